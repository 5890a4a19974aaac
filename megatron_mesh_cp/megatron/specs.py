"""GPT layer specs with :class:`MeshCoreAttention` as the core attention.

* :func:`with_mesh_attention` takes any stock GPT layer (or block) spec, TE or local, and returns a
  copy whose self-attention uses ``MeshCoreAttention`` (which hands off to TE / local attention
  whenever mesh CP is not in use, so the spec serves every run).
* ``gpt_mesh_spec`` -- a callable for ``--spec megatron_mesh_cp.megatron.specs gpt_mesh_spec``
  (Megatron's GPT builder calls it with the model config; the launcher's default): the spec Megatron
  itself would build for that config (``megatron.training.models.gpt.default_layer_spec``: TE or
  local, MoE block specs with ``num_experts`` / grouped GEMM / ``moe_layer_freq``, MLA,
  heterogeneous layers), with mesh attention. Given a bare ``TransformerConfig`` (a directly built
  ``GPTModel``, megatron-core 0.16), the TE or local layer spec, or the MoE decoder block spec when
  ``num_moe_experts`` is set.
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


def _check_te(te: bool) -> None:
    if not te:
        return
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # missing, or its CUDA libraries are
        raise ValueError(f"--transformer-impl transformer_engine needs Transformer Engine ({type(exc).__name__}: {exc}); "
                         "install it or pass --transformer-impl local") from None


def gpt_mesh_spec(config, vp_stage=None) -> ModuleSpec:
    """The GPT layer (or block) spec Megatron would use for ``config``, with mesh attention."""
    cfg = _transformer_config(config)
    te = getattr(cfg, "transformer_impl", "local") == "transformer_engine"
    _check_te(te)
    if cfg is not config:  # a GPTModelConfig: Megatron's own choice, so MoE, MLA, ... are what it builds
        from megatron.training.models.gpt import default_layer_spec

        return with_mesh_attention(default_layer_spec(config, vp_stage))
    normalization = getattr(cfg, "normalization", "LayerNorm")
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    if getattr(cfg, "num_moe_experts", None):  # MoE: Megatron's decoder block spec (moe_layer_freq, grouped GEMM)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return with_mesh_attention(get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=te, normalization=normalization,
            qk_l2_norm=bool(getattr(cfg, "qk_l2_norm", False)), vp_stage=vp_stage))
    qk_layernorm = bool(getattr(cfg, "qk_layernorm", False))
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return with_mesh_attention(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm,
                                                                              multi_latent_attention=mla))
    return with_mesh_attention(get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization,
                                                        multi_latent_attention=mla))


gpt_local_mesh_spec: ModuleSpec = with_mesh_attention(get_gpt_layer_local_spec())
