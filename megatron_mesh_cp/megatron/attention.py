"""``MeshCoreAttention``: a Megatron core-attention module that runs Mesh-Attention under CP.

It has Megatron's core-attention contract (constructor and forward as ``DotProductAttention`` /
``TEDotProductAttention``; [s, b, h, d] in, [s, b, h*d] out), so one layer spec serves every run:

* CP > 1 and ``cp_comm_type == "mesh"``: mesh attention on the CP group, with Megatron's
  hierarchical CP groups (sizes [a, b]) as the row and column rings;
* CP > 1 and ``cp_comm_type == "a2a+mesh"``: Ulysses x mesh (docs/hybrid.md), with the hierarchical
  CP groups for sizes [u, a, b] as the Ulysses group, the row and the column rings;
* otherwise it hands off to Transformer Engine's ``TEDotProductAttention`` when TE is installed,
  else to Megatron's local ``DotProductAttention``.

Packed sequences (``packed_seq_params`` with ``qkv_format="thd"``, documents padded to a multiple
of 2·CP and split per document as ``get_batch_on_this_cp_rank`` does) run under both, and so do
documents on the ordinary layout (``qkv_format="sbhd"`` with ``cu_seqlens_q`` = global offsets of
documents of any length, what the launcher passes for ``--reset-attention-mask``).
Attention variants under both: the layer's sliding window (``config.window_size`` where
``is_layer_window_attention`` says this layer has one, so ``window_attn_skip_freq`` alternates
window-pruned and full plans on one mesh), ``softmax_type`` off-by-one / learnable (the learnable
``softmax_offset`` held by :class:`SoftmaxOffset` as ``inner``, the name Megatron's attention gives
it under CP = 1), the max logit for ``qk_clip`` / ``log_max_attention_logit``
(``current_max_attn_logits``, as TE's wrapper keeps it) and MLA's unequal key and value head dims.
Combinations mesh CP does not support fail at construction (or, for per-call inputs such as an
attention bias, before any communication) with a message naming the fix; among them TE's FP8
attention (``fp8_dot_product_attention`` / ``fp8_multi_head_attention``): under ``--fp8-format``
the GEMMs run in FP8 and mesh attention in bf16, which it logs once (:mod:`.precision`).
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group, is_layer_window_attention, make_sharded_tensors_for_checkpoint,
)

from ..attention import mesh_attention
from ..runtime import MeshGroups
from ..runtime import check_window, packed_documents
from ..runtime import PlanOptions
from ..runtime import check_ulysses_heads
from .precision import check_fp8_attention, precision_line
from .settings import COUNTERS, options

__all__ = ["MeshCoreAttention", "SoftmaxOffset", "mesh_groups_for", "attention_traffic", "agree_batch_documents"]

_MESHES: Dict[tuple, MeshGroups] = {}
_LOGGED = set()
log = logging.getLogger("megatron_mesh_cp")
_SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.no_mask)


def _te_attention():
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention, HAVE_TE
    except ImportError:
        return None
    return TEDotProductAttention if HAVE_TE else None


def mesh_groups_for(pg_collection=None, levels: int = 2) -> MeshGroups:
    """The (cached) MeshGroups of this rank's CP group, from Megatron's hierarchical CP groups
    (``levels`` = 2: [a, b] for mesh; 3: [u, a, b] for a2a+mesh)."""
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    hcp = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if cp is None:
        cp = parallel_state.get_context_parallel_group()
    if not hcp:
        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not hcp or len(hcp) != levels:
        sizes, algo, flag = ("[a, b]", "mesh", "AxB") if levels == 2 else ("[u, a, b]", "a2a+mesh", "UxAxB")
        raise ValueError(
            f"{algo} CP needs Megatron's hierarchical CP groups for sizes {sizes} (got {len(hcp or [])} levels); "
            f"pass --context-parallel-algo {algo} --mesh-shape {flag} (or auto) through megatron_mesh_cp's "
            f"arguments, or initialize_model_parallel(..., hierarchical_context_parallel_sizes={sizes})"
        )
    key = (tuple(torch.distributed.get_process_group_ranks(cp)), levels)
    if key not in _MESHES:
        tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        opts = options()
        plan_options = PlanOptions(cluster=opts.cluster, stride=tp, max_live=opts.max_live,
                                   search=opts.plan_search)
        if levels == 3:
            mesh = MeshGroups.from_groups(cp, hcp[1], hcp[2], ulysses_group=hcp[0], plan_options=plan_options)
        else:
            mesh = MeshGroups.from_groups(cp, hcp[0], hcp[1], plan_options=plan_options)
        _MESHES[key] = mesh
    return _MESHES[key]


def agree_batch_documents(params, error: Optional[BaseException] = None) -> None:
    """The launcher's once-per-micro-batch agreement on its documents (the mask the layers will run),
    on every mesh of this rank's CP group: collective, called by every CP rank's get_batch. ``error``: why
    this rank could not lay its batch out (a damaged sample); every rank of the group then raises it."""
    from ..attention import agree_batch
    from ..runtime import documents_of

    mask = None
    if error is None:
        try:
            mask = getattr(params, "mesh_mask", None) or documents_of(params.cu_seqlens_q)
        except ValueError as exc:
            error = exc
    for mesh in _MESHES.values():
        agree_batch(mesh, mask, error)
    if error is not None:  # no mesh built yet: raised here alone
        raise error


def attention_traffic() -> Dict[str, int]:
    """Bytes this rank sent for mesh attention so far, and what Ring would have sent for the same calls."""
    sent = sum(m.traffic.total_sent() for m in _MESHES.values())
    return {"mesh_bytes": sent, "ring_bytes": COUNTERS.ring_bytes, "calls": COUNTERS.calls}


def _tp_group(pg_collection):
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return tp if tp is not None else parallel_state.get_tensor_model_parallel_group()


class SoftmaxOffset(MegatronModule):
    """The learnable sink logits of a mesh-CP layer (``softmax_type="learnable"``), made as Megatron's
    DotProductAttention makes its ``softmax_offset``: [heads / TP] in ``params_dtype``,
    ``config.init_method``, checkpoint-sharded over TP on dim 0. MeshCoreAttention holds it as
    ``inner``, so its name (``...core_attention.inner.softmax_offset``) is the one Megatron's own
    attention, ``inner`` under CP = 1, gives it: a checkpoint moves between CP algorithms and CP = 1."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config)
        self.tp_group = _tp_group(pg_collection)
        heads = config.num_attention_heads // self.tp_group.size()
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.register_parameter("softmax_offset", torch.nn.Parameter(
            torch.empty(heads, device=device, dtype=config.params_dtype)))
        if config.perform_initialization:
            self.softmax_offset = config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """``softmax_offset`` split over TP on dim 0, as DotProductAttention's."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


def _layer_comm_type(config, layer_number: int) -> Optional[str]:
    """This layer's entry of ``config.cp_comm_type`` (one algorithm, or Megatron's per-layer list)."""
    comm = getattr(config, "cp_comm_type", None)
    if isinstance(comm, (list, tuple)):
        return comm[layer_number - 1] if 1 <= layer_number <= len(comm) else None
    return comm


def _wants_max_logit(config) -> bool:
    return bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))


class MeshCoreAttention(MegatronModule):
    """Core attention with Mesh-Attention context parallelism (see module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        self.config = config
        self._max_logits = None
        cp_size = config.context_parallel_size
        if cp_comm_type is None and cp_size > 1:  # not passed (MLA's base class builds one so): the config's
            cp_comm_type = _layer_comm_type(config, layer_number)
        self.use_mesh = cp_size > 1 and cp_comm_type in ("mesh", "a2a+mesh")
        if not self.use_mesh:
            self.inner = self._fallback(
                config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                k_channels, v_channels, cp_comm_type, pg_collection,
            )
            return
        check_fp8_attention(lambda name, default=None: getattr(config, name, default))
        line = precision_line(lambda name, default=None: getattr(config, name, default))
        if line and line not in _LOGGED:  # --fp8-format / --fp4-format: what runs in low precision, once
            _LOGGED.add(line)
            log.info(line)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            raise ValueError(
                f"mesh CP does not support attention dropout ({dropout}); set --attention-dropout 0"
            )
        if attn_mask_type not in _SUPPORTED_MASKS:
            raise ValueError(
                f"mesh CP supports causal and no-mask attention, not {attn_mask_type.name}; "
                "use a causal (GPT) or unmasked model, or another --context-parallel-algo"
            )
        self.window = None  # Megatron's rule for which layers have the window (window_attn_skip_freq)
        if is_layer_window_attention(getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
            self.window = tuple(config.window_size)
            try:
                check_window(self.window, attn_mask_type == AttnMaskType.causal)
            except ValueError as exc:
                raise ValueError(f"--window-size {','.join(map(str, self.window))} (layer {layer_number}): {exc}") from None
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type must be vanilla, off-by-one or learnable, got {self.softmax_type!r}")
        # learnable sinks: the parameter in a module named as Megatron's own attention is under CP = 1
        self.inner = SoftmaxOffset(config, pg_collection) if self.softmax_type == "learnable" else None
        self.max_logit = _wants_max_logit(config)
        kv = config.kv_channels
        self.k_channels, self.v_channels = k_channels or kv, v_channels or kv  # MLA: they differ
        self.attn_mask_type = attn_mask_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.mesh = mesh_groups_for(pg_collection, levels=3 if cp_comm_type == "a2a+mesh" else 2)
        if self.mesh.size != cp_size:
            raise ValueError(
                f"the CP group has {self.mesh.size} ranks but context_parallel_size is {cp_size}"
            )
        if self.mesh.ulysses > 1:  # u must divide this rank's heads (no message sent yet)
            tp = config.tensor_model_parallel_size
            heads = config.num_attention_heads
            check_ulysses_heads(heads // tp, (config.num_query_groups or heads) // tp, self.mesh.ulysses, cp_size)

    @property
    def current_max_attn_logits(self) -> Optional[torch.Tensor]:
        """The running max (detached, fp32 [heads / TP]) of scale * q.k since Megatron's clip_qk last
        reset it, the same on every CP rank; under CP = 1 the wrapped attention's (TE keeps one)."""
        if self.use_mesh:
            return self._max_logits
        return getattr(self.inner, "current_max_attn_logits", None)

    @current_max_attn_logits.setter
    def current_max_attn_logits(self, value) -> None:
        if self.use_mesh:
            self._max_logits = value
        elif hasattr(self.inner, "current_max_attn_logits"):
            self.inner.current_max_attn_logits = value

    @property
    def softmax_offset(self) -> Optional[torch.Tensor]:
        """The learnable sink logits where there are some (Megatron's inference path reads
        ``core_attention.softmax_offset``; off-by-one: None, which it takes as zeros)."""
        return getattr(self.inner, "softmax_offset", None)

    def _sink(self, query: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 [local heads] sink logits of ``softmax_type`` (off-by-one: 0 for every head)."""
        if self.softmax_type == "learnable":
            return self.inner.softmax_offset.float()
        if self.softmax_type == "off-by-one":
            return torch.zeros(query.shape[-2], dtype=torch.float32, device=query.device)
        return None

    @staticmethod
    def _fallback(config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                  k_channels, v_channels, cp_comm_type, pg_collection):
        te = _te_attention()
        if te is not None:
            return te(
                config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                attention_type=attention_type, attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                k_channels=k_channels, v_channels=v_channels, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
            )
        if config.context_parallel_size > 1:
            raise ValueError(
                f"context parallelism with cp_comm_type={cp_comm_type!r} needs Transformer Engine, which is not "
                "installed; use --context-parallel-algo mesh (runs without TE) or install TE"
            )
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if _wants_max_logit(config):
            raise ValueError("qk_clip / log_max_attention_logit read the max logit, which Megatron's local "
                             "DotProductAttention (CP = 1 without Transformer Engine) does not return; install TE "
                             "(>= 2.9) or run mesh CP (CP > 1)")
        if v_channels is not None and v_channels != config.kv_channels:
            # its output is [s, b, heads * kv_channels]; the key head dim only enters q.k (any width)
            raise ValueError(
                f"Megatron's local DotProductAttention (CP = 1 without Transformer Engine) gives every head "
                f"kv_channels = {config.kv_channels} output values, but the value head dim is {v_channels} (MLA); "
                f"pass --kv-channels {v_channels}, or install TE")
        return DotProductAttention(
            config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type=attention_type, attention_dropout=attention_dropout, softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type, pg_collection=pg_collection,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        if not self.use_mesh:
            if getattr(packed_seq_params, "qkv_format", None) == "sbhd":
                raise ValueError("documents in qkv_format 'sbhd' (the launcher's --reset-attention-mask) are read only "
                                 "by mesh CP; use --context-parallel-algo mesh or a2a+mesh")
            return self.inner(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs,
            )
        packed = self._packed(packed_seq_params) if packed_seq_params is not None else {}
        thd = packed.pop("thd", False)
        if attention_bias is not None:
            raise ValueError("mesh CP does not support an attention bias; drop it or use another --context-parallel-algo")
        mask = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask not in _SUPPORTED_MASKS:
            raise ValueError(f"mesh CP supports causal and no-mask attention, not {mask.name}")
        # the attention_mask tensor of a causal model is the standard causal mask; like TE, it is
        # implied by the mask type and not read
        opts = options()
        out = mesh_attention(
            query, key, value, self.mesh, causal=mask == AttnMaskType.causal, softmax_scale=self.softmax_scale,
            layout="thd" if thd else "sbhd", kernel=opts.kernel, partial_dtype=opts.partial_dtype,
            planner=opts.planner, deterministic=opts.deterministic, check_finite=opts.check_finite,
            window=self.window, sink=self._sink(query), return_max_logit=self.max_logit, **packed,
        )
        if self.max_logit:  # a running max, detached, as TE's wrapper keeps it (Megatron's clip_qk resets it)
            out, top = out
            top = top.detach()
            self._max_logits = top if self._max_logits is None else torch.maximum(self._max_logits, top)
        if thd:  # [t, h, d] -> [t, h*d], as TE returns for thd
            COUNTERS.count_call(query.unsqueeze(1), key.unsqueeze(1), self.mesh.size, training=torch.is_grad_enabled(),
                                documents=True, v_head_dim=value.shape[-1])
            return out.reshape(out.shape[0], -1)
        COUNTERS.count_call(query, key, self.mesh.size, training=torch.is_grad_enabled(), documents=bool(packed),
                            v_head_dim=value.shape[-1])
        s, b = out.shape[0], out.shape[1]
        return out.reshape(s, b, -1)

    def _packed(self, params) -> dict:
        """mesh_attention's document arguments from Megatron's PackedSeqParams (self-attention: q and
        kv must list the same documents; a per-sample CP group is hybrid CP, which mesh is not).
        ``thd``: packed, padded per 2·CP; ``sbhd``: documents of any length on the ordinary layout."""
        fmt = getattr(params, "qkv_format", None)
        laid = getattr(params, "mesh_mask", None)
        if fmt == "sbhd" and laid is not None:  # documents a layout cut into pieces (megatron/layout.py)
            return {"mask": laid}
        if fmt == "sbhd":
            cu = params.cu_seqlens_q
            if cu is None or params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
                raise ValueError("documents in qkv_format 'sbhd' take cu_seqlens_q (global offsets) and no padded "
                                 "offsets; padded documents go in qkv_format 'thd'")
            kv = params.cu_seqlens_kv
            if kv is not None and kv is not cu and packed_documents(kv) != packed_documents(cu):
                raise ValueError("mesh CP documents are self-attention: cu_seqlens_kv must equal cu_seqlens_q")
            return {"cu_seqlens": cu}
        if fmt != "thd":
            raise ValueError(f"mesh CP takes documents in qkv_format 'thd' (padded) or 'sbhd', not {fmt!r}")
        group = getattr(params, "cp_group", None)
        if group is not None and torch.distributed.get_process_group_ranks(group) != self.mesh.cp_ranks:
            raise ValueError("packed_seq_params.cp_group differs from the mesh's CP group (hybrid CP); mesh CP needs "
                             "one fixed CP group; drop --hybrid-context-parallel")
        q = (params.cu_seqlens_q, params.cu_seqlens_q_padded)
        kv = (params.cu_seqlens_kv, params.cu_seqlens_kv_padded)
        same = all(a is b for a, b in zip(q, kv)) or all(x is None for x in kv)
        if not same and packed_documents(*kv) != packed_documents(*q):  # host copies, read once per tensor
            raise ValueError("mesh CP packed sequences are self-attention: cu_seqlens_kv(_padded) must equal "
                             "cu_seqlens_q(_padded)")
        return {"cu_seqlens": q[0], "cu_seqlens_padded": q[1], "thd": True}
