"""A Megatron run's mesh-CP settings: the options its command line resolves to, and its counters.

:class:`MeshOptions` is frozen and made once per argument resolution (``arguments.apply_mesh_args``
calls :func:`configure` with everything it resolved); the attention layers and the launcher read it
through :func:`options`. :data:`COUNTERS` is what they count while the run trains (bytes Ring would
have sent, calls, layouts), reported in the summary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch

__all__ = ["MeshOptions", "MeshCounters", "options", "configure", "COUNTERS"]


@dataclass(frozen=True)
class MeshOptions:
    """What the command line resolved to, for every MeshCoreAttention and the launcher's get_batch."""

    kernel: str = "auto"
    deterministic: bool = False  # Megatron's --deterministic-mode: ask the kernel for a deterministic backward
    partial_dtype: Optional[torch.dtype] = None  # None: fp32 partials (exact)
    planner: str = "greedy"
    check_finite: bool = False  # --mesh-check-finite: NaN/Inf in attention inputs raise on every CP rank
    cluster: object = None  # a megatron_mesh_cp.planning.Cluster, or None for the default
    shape_explanation: str = ""
    max_live: Optional[int] = None  # live-chunk limit of the plans mesh_shape=auto chose to fit its memory budget
    documents: str = ""  # "eod": --reset-attention-mask under mesh CP, boundaries from each micro-batch's EOD tokens
    layout: str = "auto"  # --mesh-layout: each micro-batch's token layout (megatron/layout.py)
    layout_note: str = ""  # why auto was narrowed to whole documents (the model cannot re-lay pieces)
    whole_documents: bool = False  # auto chooses among the layouts keeping documents whole (zigzag, balanced, tiled)
    plan_search: int = 0  # --mesh-plan-search: replays per phase the order search spends on each micro-batch's plans


@dataclass
class MeshCounters:
    """What happened while the run trained (this process)."""

    ring_bytes: int = 0  # what Ring would have sent for the calls made so far (like-for-like partial dtype)
    calls: int = 0
    document_calls: int = 0  # of which masked documents (packed THD, or unpadded documents from EOD)
    relaid: int = 0  # micro-batches whose tokens a layout re-laid
    layouts: Counter = field(default_factory=Counter)  # layout name -> micro-batches
    balance_sum: float = 0.0  # busiest / mean chunk work, summed over the micro-batches laid out
    balance_max: float = 0.0
    host_sum: float = 0.0  # seconds the launcher spent laying micro-batches out (choice + re-laying)
    host_max: float = 0.0
    ahead: int = 0  # micro-batches whose layout the data loader chose (off the step's critical path)
    ahead_sum: float = 0.0  # seconds those choices took there
    over_every_chunk: int = 0  # --mesh-layout split-half: micro-batches whose documents fit no half rows (run as split would)

    def count_call(self, query: torch.Tensor, key: torch.Tensor, n: int, training: bool, documents: bool = False,
                   v_head_dim: Optional[int] = None) -> None:
        from ..runtime import ChunkDims
        from ..runtime import lse_dtype

        s, b, h, d = query.shape
        dv = v_head_dim if v_head_dim is not None and v_head_dim != d else None  # MLA
        dims = ChunkDims(b, s, h, key.shape[2], d, query.dtype, lse_dtype(query.dtype), options().partial_dtype, dv)
        self.ring_bytes += _ring_bytes(dims, n, training)
        self.calls += 1
        self.document_calls += int(documents)

    def note_layout(self, arrangement, choice=None, seconds: float = 0.0, ahead: Optional[float] = None) -> bool:
        """One micro-batch laid out (runtime.layouts.Arrangement; ``choice``: auto's report) in
        ``seconds`` of host time; ``ahead``: the seconds the data loader took to choose its layout
        (None: chosen here, inside ``seconds``); True for the run's first."""
        if ahead is not None:
            self.ahead += 1
            self.ahead_sum += ahead
        name = arrangement.label
        first = not self.layouts
        self.layouts[name] += 1
        self.host_sum += seconds
        self.host_max = max(self.host_max, seconds)
        self.relaid += int(arrangement.order is not None)
        self.balance_sum += arrangement.balance
        self.balance_max = max(self.balance_max, arrangement.balance)
        return first

    def layout_summary(self) -> Optional[dict]:
        total = sum(self.layouts.values())
        if not total:
            return None
        return {"micro_batches": dict(self.layouts), "busiest_over_mean_mean": round(self.balance_sum / total, 4),
                "busiest_over_mean_max": round(self.balance_max, 4), "relaid": self.relaid,
                "host_ms_mean": round(1e3 * self.host_sum / total, 3), "host_ms_max": round(1e3 * self.host_max, 3),
                "chosen_ahead": self.ahead,
                "ahead_choice_ms_mean": round(1e3 * self.ahead_sum / self.ahead, 3) if self.ahead else None,
                **({"split_half_over_every_chunk": self.over_every_chunk} if self.over_every_chunk else {})}


@lru_cache(maxsize=64)
def _ring_bytes(dims, n: int, training: bool) -> int:
    """Bytes a 1 x n Ring sends for one call with these dims (computed once per layer shape)."""
    from ..planning import in_order_plan
    from ..runtime import plan_traffic

    phases = ("forward", "backward") if training else ("forward",)
    return sum(sum(plan_traffic(in_order_plan(1, n, ph), dims).values()) for ph in phases)


_STATE = {"options": MeshOptions()}
COUNTERS = MeshCounters()


def options() -> MeshOptions:
    """The options of this process's run (defaults until arguments.apply_mesh_args configured them)."""
    return _STATE["options"]


def configure(opts: MeshOptions) -> MeshOptions:
    """Set this process's options (arguments.apply_mesh_args does, once per resolution)."""
    if not isinstance(opts, MeshOptions):
        raise TypeError(f"configure takes a MeshOptions, got {type(opts).__name__}")
    _STATE["options"] = opts
    return opts
