"""Process-wide mesh-CP settings chosen from the command line, read by every MeshCoreAttention."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

__all__ = ["MeshSettings", "SETTINGS"]


@dataclass
class MeshSettings:
    kernel: str = "auto"
    deterministic: bool = False  # Megatron's --deterministic-mode: ask the kernel for a deterministic backward
    partial_dtype: Optional[torch.dtype] = None  # None: fp32 partials (exact)
    planner: str = "greedy"
    check_finite: bool = False  # --mesh-check-finite: NaN/Inf in attention inputs raise on every CP rank
    cluster: object = None  # a megatron_mesh_cp.planning.cluster.Cluster, or None for the default
    shape_explanation: str = ""
    max_live: Optional[int] = None  # live-chunk limit of the plans mesh_shape=auto chose to fit its memory budget
    documents: str = ""  # "eod": --reset-attention-mask under mesh CP, boundaries from each micro-batch's EOD tokens
    document_order: str = "given"  # "balanced": each micro-batch's documents reordered (runtime/balance.py)
    reordered: int = 0  # micro-batches whose documents were reordered so far
    # what Ring would have sent for the calls made so far (like-for-like partial dtype)
    ring_bytes: int = 0
    calls: int = 0
    packed_calls: int = 0  # of which on packed sequences (THD)

    def count_call(self, query: torch.Tensor, key: torch.Tensor, n: int, training: bool, packed: bool = False,
                   v_head_dim: Optional[int] = None) -> None:
        from ..runtime.kernels import lse_dtype
        from ..runtime.plan import ChunkDims

        s, b, h, d = query.shape
        dv = v_head_dim if v_head_dim is not None and v_head_dim != d else None  # MLA
        dims = ChunkDims(b, s, h, key.shape[2], d, query.dtype, lse_dtype(query.dtype), self.partial_dtype, dv)
        self.ring_bytes += _ring_bytes(dims, n, training)
        self.calls += 1
        self.packed_calls += int(packed)


@lru_cache(maxsize=64)
def _ring_bytes(dims, n: int, training: bool) -> int:
    """Bytes a 1 x n Ring sends for one call with these dims (computed once per layer shape)."""
    from ..runtime.plan import plan_traffic
    from ..planning.schedule import in_order_plan

    phases = ("forward", "backward") if training else ("forward",)
    return sum(sum(plan_traffic(in_order_plan(1, n, ph), dims).values()) for ph in phases)


SETTINGS = MeshSettings()
