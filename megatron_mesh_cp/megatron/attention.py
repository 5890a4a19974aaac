"""``MeshCoreAttention``: a Megatron core-attention module that runs Mesh-Attention under CP.

It has Megatron's core-attention contract (constructor and forward as ``DotProductAttention`` /
``TEDotProductAttention``; [s, b, h, d] in, [s, b, h*d] out), so one layer spec serves every run:

* CP > 1 and ``cp_comm_type == "mesh"``: mesh attention on the CP group, with Megatron's
  hierarchical CP groups (sizes [a, b]) as the row and column rings;
* CP > 1 and ``cp_comm_type == "a2a+mesh"``: Ulysses x mesh (docs/HYBRID.md), with the hierarchical
  CP groups for sizes [u, a, b] as the Ulysses group, the row and the column rings;
* otherwise it hands off to Transformer Engine's ``TEDotProductAttention`` when TE is installed,
  else to Megatron's local ``DotProductAttention``.

Packed sequences (``packed_seq_params`` with ``qkv_format="thd"``, documents padded to a multiple
of 2·CP and split per document as ``get_batch_on_this_cp_rank`` does) run under both, and so do
documents on the ordinary layout (``qkv_format="sbhd"`` with ``cu_seqlens_q`` = global offsets of
documents of any length, what the launcher passes for ``--reset-attention-mask``).
Combinations mesh CP does not support fail at construction (or, for per-call inputs such as an
attention bias, before any communication) with a message naming the fix.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..attention import mesh_attention
from ..runtime.groups import MeshGroups
from ..runtime.packed import packed_spec
from ..runtime.ulysses import check_ulysses_heads
from .settings import SETTINGS

__all__ = ["MeshCoreAttention", "mesh_groups_for", "attention_traffic"]

_MESHES: Dict[tuple, MeshGroups] = {}
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
        if levels == 3:
            mesh = MeshGroups.from_groups(cp, hcp[1], hcp[2], ulysses_group=hcp[0])
        else:
            mesh = MeshGroups.from_groups(cp, hcp[0], hcp[1])
        mesh.cluster = SETTINGS.cluster
        mesh.max_live = SETTINGS.max_live
        mesh.stride = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        _MESHES[key] = mesh
    return _MESHES[key]


def attention_traffic() -> Dict[str, int]:
    """Bytes this rank sent for mesh attention so far, and what Ring would have sent for the same calls."""
    sent = sum(m.traffic.total_sent() for m in _MESHES.values())
    return {"mesh_bytes": sent, "ring_bytes": SETTINGS.ring_bytes, "calls": SETTINGS.calls}


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
        cp_size = config.context_parallel_size
        self.use_mesh = cp_size > 1 and cp_comm_type in ("mesh", "a2a+mesh")
        if not self.use_mesh:
            self.inner = self._fallback(
                config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                k_channels, v_channels, cp_comm_type, pg_collection,
            )
            return
        self.inner = None
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
        if getattr(config, "window_size", None) is not None:
            raise ValueError("mesh CP does not support sliding-window attention yet; drop --window-size")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"mesh CP supports the vanilla softmax only, not {config.softmax_type!r}")
        kv = config.kv_channels
        k_ch, v_ch = k_channels or kv, v_channels or kv
        if k_ch != v_ch:
            raise ValueError(f"mesh CP needs equal key and value head dims, got {k_ch} and {v_ch}")
        self.attn_mask_type = attn_mask_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_ch)
        self.mesh = mesh_groups_for(pg_collection, levels=3 if cp_comm_type == "a2a+mesh" else 2)
        if self.mesh.size != cp_size:
            raise ValueError(
                f"the CP group has {self.mesh.size} ranks but context_parallel_size is {cp_size}"
            )
        if self.mesh.ulysses > 1:  # u must divide this rank's heads (no message sent yet)
            tp = config.tensor_model_parallel_size
            heads = config.num_attention_heads
            check_ulysses_heads(heads // tp, (config.num_query_groups or heads) // tp, self.mesh.ulysses, cp_size)

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
        out = mesh_attention(
            query, key, value, self.mesh, causal=mask == AttnMaskType.causal, softmax_scale=self.softmax_scale,
            layout="thd" if thd else "sbhd", kernel=SETTINGS.kernel, partial_dtype=SETTINGS.partial_dtype,
            planner=SETTINGS.planner, deterministic=SETTINGS.deterministic, check_finite=SETTINGS.check_finite,
            **packed,
        )
        if thd:  # [t, h, d] -> [t, h*d], as TE returns for thd
            SETTINGS.count_call(query.unsqueeze(1), key.unsqueeze(1), self.mesh.size, training=torch.is_grad_enabled(),
                                packed=True)
            return out.reshape(out.shape[0], -1)
        SETTINGS.count_call(query, key, self.mesh.size, training=torch.is_grad_enabled(), packed=bool(packed))
        s, b = out.shape[0], out.shape[1]
        return out.reshape(s, b, -1)

    def _packed(self, params) -> dict:
        """mesh_attention's document arguments from Megatron's PackedSeqParams (self-attention: q and
        kv must list the same documents; a per-sample CP group is hybrid CP, which mesh is not).
        ``thd``: packed, padded per 2·CP; ``sbhd``: documents of any length on the ordinary layout."""
        fmt = getattr(params, "qkv_format", None)
        if fmt == "sbhd":
            cu = params.cu_seqlens_q
            if cu is None or params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
                raise ValueError("documents in qkv_format 'sbhd' take cu_seqlens_q (global offsets) and no padded "
                                 "offsets; padded documents go in qkv_format 'thd'")
            kv = params.cu_seqlens_kv
            if kv is not None and kv is not cu and packed_spec(kv) != packed_spec(cu):
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
        if not same and packed_spec(*kv) != packed_spec(*q):  # host copies, read once per tensor
            raise ValueError("mesh CP packed sequences are self-attention: cu_seqlens_kv(_padded) must equal "
                             "cu_seqlens_q(_padded)")
        return {"cu_seqlens": q[0], "cu_seqlens_padded": q[1], "thd": True}
