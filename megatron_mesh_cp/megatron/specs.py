"""GPT layer specs with :class:`MeshCoreAttention` as the core attention.

* :func:`with_mesh_attention` takes any stock GPT layer (or block) spec, TE or local, and returns a
  copy whose self-attention uses ``MeshCoreAttention`` (which hands off to TE / local attention
  whenever mesh CP is not in use, so the spec serves every run).
* ``gpt_mesh_spec`` -- a callable for ``--spec megatron_mesh_cp.megatron.specs gpt_mesh_spec``
  (Megatron's GPT builder calls it with the model config): the stock TE spec when
  ``--transformer-impl transformer_engine`` and TE is installed, the local spec otherwise; with
  ``--multi-latent-attention`` Megatron's MLA layer spec (MLASelfAttention, whose core attention
  gets the key and value head dims as ``k_channels`` / ``v_channels``).
* ``gpt_local_mesh_spec`` -- a ``ModuleSpec`` object (local modules, LayerNorm) for
  ``--spec megatron_mesh_cp.megatron.specs gpt_local_mesh_spec``.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import MeshCoreAttention

__all__ = ["with_mesh_attention", "gpt_mesh_spec", "gpt_local_mesh_spec"]


def _swap(layer_spec) -> None:
    attn = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sub = getattr(attn, "submodules", None)
    if sub is None or not hasattr(sub, "core_attention"):
        raise ValueError(
            f"cannot find self_attention.submodules.core_attention in {type(layer_spec).__name__}; "
            "mesh CP needs a standard GPT layer spec (get_gpt_layer_local_spec / ..._with_transformer_engine_spec)"
        )
    sub.core_attention = MeshCoreAttention


def with_mesh_attention(spec):
    """A deep copy of a GPT layer or block spec with MeshCoreAttention as its core attention."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None)
    if layers is None and hasattr(spec, "submodules") and hasattr(spec.submodules, "layer_specs"):
        layers = spec.submodules.layer_specs
    for layer in layers if layers is not None else [spec]:
        _swap(layer)
    return spec


def _transformer_config(config):
    return getattr(config, "transformer", config)  # GPTModelConfig (0.19 builder) or TransformerConfig


def gpt_mesh_spec(config, vp_stage=None) -> ModuleSpec:
    """Stock GPT layer spec for ``config`` (TE or local, its normalisation, QK-norm and MLA) with mesh attention."""
    cfg = _transformer_config(config)
    qk_layernorm = bool(getattr(cfg, "qk_layernorm", False))
    normalization = getattr(cfg, "normalization", "LayerNorm")
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    if getattr(cfg, "transformer_impl", "local") == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        try:
            base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, multi_latent_attention=mla)
        except Exception as exc:  # TE missing or too old
            raise ValueError(
                f"--transformer-impl transformer_engine needs Transformer Engine ({exc}); "
                "install it or pass --transformer-impl local"
            ) from None
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization,
                                        multi_latent_attention=mla)
    return with_mesh_attention(base)


gpt_local_mesh_spec: ModuleSpec = with_mesh_attention(get_gpt_layer_local_spec())
