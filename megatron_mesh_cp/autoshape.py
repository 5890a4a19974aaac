"""``mesh_shape="auto"``: pick the tile shape (a, b) that the simulator says is fastest.

Every factorisation of n is planned with the greedy planner and replayed (forward + backward) on
the cluster, so sequence length, heads, kv heads, head dim, TP placement and the network all move
the answer: few kv heads make KV cheap and favour wide tiles; a slow NIC favours square ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

from .cluster import Cluster, Workload
from .topology import MeshShape, valid_shapes

__all__ = ["ShapeChoice", "choose_shape"]

log = logging.getLogger("megatron_mesh_cp")


@dataclass(frozen=True)
class ShapeChoice:
    shape: MeshShape
    seconds: float  # simulated forward + backward of one attention layer
    table: Tuple[Tuple[Tuple[int, int], Optional[float], str], ...]  # (shape, seconds or None, note)
    explanation: str


@lru_cache(maxsize=128)
def choose_shape(
    n: int, cluster: Cluster, workload: Workload, *, stride: int = 1, max_live: Optional[int] = None
) -> ShapeChoice:
    """The fastest valid shape for CP size ``n``; ``explanation`` is the one-line reason (also logged)."""
    from .schedule import build_plans
    from .simulate import replay

    rows: List[Tuple[Tuple[int, int], Optional[float], str]] = []
    for a, b in valid_shapes(n):
        try:
            fwd, bwd = build_plans(a, b, cluster=cluster, workload=workload, stride=stride, max_live=max_live)
        except ValueError as exc:  # memory budget too small for this tile
            rows.append(((a, b), None, str(exc)))
            continue
        t = replay(fwd, cluster, workload, stride=stride, record=None).time
        t += replay(bwd, cluster, workload, stride=stride, record=None).time
        rows.append(((a, b), t, ""))
    timed = sorted((t, s) for s, t, _ in rows if t is not None)
    if not timed:
        raise ValueError(f"no mesh shape for CP={n} fits the memory budget of {max_live} live chunks; raise it")
    best_t, best = timed[0]
    ring = next((t for s, t, _ in rows if s == (1, n)), None)
    runner = f", next {timed[1][1][0]}x{timed[1][1][1]} {timed[1][0] * 1e3:.2f} ms" if len(timed) > 1 else ""
    vs_ring = (f", 1x{n} (Ring layout) {ring * 1e3:.2f} ms ({ring / best_t:.2f}x slower)"
               if ring and best != (1, n) else "")
    text = (
        f"mesh_shape=auto -> {best[0]}x{best[1]} for CP={n} (S/rank={workload.seq_local}, heads "
        f"{workload.heads}/{workload.kv_heads} kv, d={workload.head_dim}, {cluster.name}, stride {stride}): "
        f"simulated {best_t * 1e3:.2f} ms/layer fwd+bwd{runner}{vs_ring}"
    )
    log.info(text)
    return ShapeChoice(MeshShape(*best), best_t, tuple(rows), text)
