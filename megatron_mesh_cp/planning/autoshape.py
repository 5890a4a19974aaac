"""``mesh_shape="auto"``: pick the tile shape (a, b) -- or (u, a, b) for a2a+mesh -- the simulator says is fastest.

Every candidate is planned with the greedy planner and replayed (forward + backward) on the
cluster, so sequence length, heads, kv heads, head dim, TP placement and the network all move
the answer: few kv heads make KV cheap and favour wide tiles; a slow NIC favours square ones; a
Ulysses degree u keeps part of the traffic on NVLink. Candidates are scored in the order of a
cheap lower bound (busiest link or compute stream), and the search stops once the bound of the
next candidate cannot beat the best simulated time, so the answer is the same as scoring all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, List, Optional, Tuple

from ..runtime.plan import validate
from ..runtime.topology import MeshShape, valid_shapes
from .bounds import mesh_bound
from .cluster import Cluster, Workload
from .costs import plan_peak_bytes, te_ring_peak_bytes, ulysses_a2a_steps, ulysses_buffer_bytes, ulysses_inner
from .layouts import resolve_layout
from .replay import replay
from .schedule import build_plans, document_plans

__all__ = ["ShapeChoice", "HybridChoice", "choose_shape", "choose_hybrid_shape", "ulysses_degrees", "shape_bound",
           "default_budget", "BUDGET_X_RING"]

log = logging.getLogger("megatron_mesh_cp")


@dataclass(frozen=True)
class ShapeChoice:
    shape: MeshShape
    seconds: float  # simulated forward + backward of one attention layer
    table: Tuple[Tuple[Tuple[int, int], Optional[float], str], ...]  # (shape, seconds or None, note)
    explanation: str
    peak_bytes: int = 0  # the chosen plans' attention memory per rank (pool arena)
    budget: float = 0.0  # the memory budget the search honoured
    max_live: Optional[int] = None  # the live-chunk limit the chosen plans need to fit it (None: none)


@dataclass(frozen=True)
class HybridChoice:
    """The a2a+mesh choice: Ulysses degree u and the a x b mesh over the n/u Ulysses groups."""

    u: int
    shape: MeshShape
    seconds: float
    table: Tuple[Tuple[Tuple[int, int, int], Optional[float], str], ...]
    explanation: str
    peak_bytes: int = 0
    budget: float = 0.0
    max_live: Optional[int] = None  # as ShapeChoice.max_live, for the inner mesh


def shape_bound(a: int, b: int, cluster: Cluster, w: Workload, stride: int = 1) -> float:
    """A lower bound on the a x b mesh's simulated time (planning/bounds.py), its documents laid out as
    auto lays them out for this mesh."""
    return mesh_bound(a, b, cluster, resolve_layout(w, a, b, cluster, stride), stride)


#: auto's default memory budget, in multiples of what TE's p2p Ring holds for the same layer.
BUDGET_X_RING = 4.0
#: Planning rounds spent looking for the live-chunk limit that fits a shape into the budget.
PROBES = 5


def default_budget(w: Workload) -> float:
    """``BUDGET_X_RING`` times TE Ring's peak attention memory per rank for this layer."""

    return BUDGET_X_RING * te_ring_peak_bytes(w)


def _search(cands: List[Tuple[tuple, float, Callable[[], Tuple[float, int]]]]):
    """Score candidates (key, bound, simulate) in bound order, skipping those that cannot win;
    returns rows (key, seconds or None, note) and (peak bytes, live-chunk limit) of each scored one."""
    rows, peaks, best = [], {}, float("inf")
    for key, bound, run in sorted(cands, key=lambda c: c[1]):
        if bound >= best:
            rows.append((key, None, f"skipped: lower bound {bound * 1e3:.2f} ms >= best {best * 1e3:.2f} ms"))
            continue
        try:
            t, peak, live = run()
            peaks[key] = (peak, live)
        except ValueError as exc:  # the memory budget is too small for this tile
            rows.append((key, None, str(exc)))
            log.info("mesh_shape=auto skips %s: %s", "x".join(map(str, key)), exc)
            continue
        rows.append((key, t, ""))
        best = min(best, t)
    return rows, peaks


def _full_plans(a, b, cluster, w, stride, max_live, chains="auto"):
    """The plans a shape is sized by: for unpadded documents the full plans their pruned ones come
    from (the pool must fit every batch's documents); for a window or chunks alone its pruned plans
    (the mask is the same for every batch)."""
    if w.pruned and not w.mask.per_batch:  # a window or chunks alone: the same mask every batch
        return document_plans(a, b, cluster=cluster, workload=w, stride=stride, max_live=max_live)
    if w.pruned:
        return build_plans(a, b, cluster=cluster, workload=w.unmasked, stride=stride,
                           max_live=max_live, chains="both-ways")
    return build_plans(a, b, cluster=cluster, workload=w, stride=stride, max_live=max_live, chains=chains)


def _mesh_time(a, b, cluster, w, stride, max_live, chains="auto") -> float:
    """Simulated forward + backward of the plans that run ``w`` (documents: the pruned plans)."""
    w = resolve_layout(w, a, b, cluster, stride)
    fwd, bwd = (document_plans(a, b, cluster=cluster, workload=w, stride=stride, max_live=max_live)
                if w.pruned else
                build_plans(a, b, cluster=cluster, workload=w, stride=stride, max_live=max_live, chains=chains))
    return (replay(fwd, cluster, w, stride=stride, record=None).time
            + replay(bwd, cluster, w, stride=stride, record=None).time)


def _within_budget(a, b, cluster, w, stride, max_live, budget, extra=0) -> Tuple[float, int, Optional[int]]:
    """(simulated seconds, peak bytes, live-chunk limit used) of the a x b mesh planned to fit ``budget`` bytes per rank
    (``extra``: bytes held beside the pool, e.g. the all-to-all's); ValueError when it cannot."""

    fwd, bwd = _full_plans(a, b, cluster, w, stride, max_live)
    peak = plan_peak_bytes(fwd, bwd, w) + extra
    if peak > budget:  # the largest live-chunk budget whose plans fit (bisection, a few probes)

        lo, hi, fit = 2, max(validate(fwd), validate(bwd)) - 1, None
        for _ in range(PROBES):
            if lo > hi:
                break
            mid = (lo + hi + 1) // 2
            try:
                f, b_ = _full_plans(a, b, cluster, w, stride, mid)
                p = plan_peak_bytes(f, b_, w) + extra
            except ValueError:
                p = None
            if p is not None and p <= budget:
                lo, fit = mid + 1, (mid, p)
            elif p is None:
                lo = mid + 1
            else:
                hi = mid - 1
        if fit is None:
            raise ValueError(f"its plans need {peak / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB) and no "
                             f"live-chunk limit tried brings them under it")
        max_live, peak = fit
    return _mesh_time(a, b, cluster, w, stride, max_live), peak, max_live


def _shapes(n: int, even: bool) -> List[Tuple[int, int]]:
    """The a x b shapes auto chooses among for ``n`` ranks; ``even``: only those with a and b both even (the
    split-half layout cuts documents over half of each mesh row's chunks, which needs them)."""
    return [(a, b) for a, b in valid_shapes(n) if not even or (a % 2 == 0 and b % 2 == 0)]


_EVEN_NOTE = " among meshes with both sides even (--mesh-layout split-half)"


def _vs(ring: float, best: float, even: bool, otherwise: str) -> str:
    """How Ring's time compares with the choice's: slower, or faster but left out -- its 1 x n sides are not both
    even (``even``), or ``otherwise`` why (its plans are over the memory budget; TE's one-way Ring is no layout
    auto runs)."""
    if ring >= best:
        return f"{ring / best:.2f}x slower"
    return f"{best / ring:.2f}x faster, but " + ("its sides are not both even" if even else otherwise)


@lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    """Log ``message`` once per process (the launcher, the dry run's estimate and its documents' workloads each ask
    for a shape)."""
    log.warning(message)


@lru_cache(maxsize=128)
def choose_shape(
    n: int, cluster: Cluster, workload: Workload, *, stride: int = 1, max_live: Optional[int] = None,
    memory_budget: Optional[float] = None, even: bool = False,
) -> ShapeChoice:
    """The fastest valid shape for CP size ``n`` whose plans fit ``memory_budget`` bytes of attention
    memory per rank (default: :func:`default_budget`, 4x TE Ring's); ``explanation`` is the logged reason.
    ``even``: only shapes a x b with a and b both even (``--mesh-layout split-half``); ValueError if none."""
    budget = default_budget(workload) if memory_budget is None else memory_budget
    cands = [((a, b), shape_bound(a, b, cluster, workload, stride),
              lambda a=a, b=b: _within_budget(a, b, cluster, workload, stride, max_live, budget))
             for a, b in _shapes(n, even)]
    if not cands:
        raise ValueError(f"no mesh shape a x b = {n} has a and b both even (split-half needs them)")
    rows, peaks = _search(cands)
    timed = sorted((t, s) for s, t, _ in rows if t is not None)
    if not timed:
        if memory_budget is None:  # the default budget is ours, not the user's: say so and go without
            _warn_once(f"mesh_shape=auto: no mesh shape for CP={n} fits the default budget of {budget / 2**20:.0f} "
                       f"MiB per rank ({BUDGET_X_RING:g}x TE Ring's); choosing without a budget")
            return choose_shape(n, cluster, workload, stride=stride, max_live=max_live, memory_budget=float("inf"),
                                even=even)
        raise ValueError(f"no mesh shape for CP={n} fits the memory budget ({budget / 2**20:.0f} MiB per rank, "
                         f"max_live={max_live}); raise memory_budget")
    best_t, best = timed[0]
    ring = next((t for s, t, _ in rows if s == (1, n)), None)
    if ring is None and best != (1, n):
        ring = _mesh_time(1, n, cluster, workload, stride, max_live)
    runner = f", next {timed[1][1][0]}x{timed[1][1][1]} {timed[1][0] * 1e3:.2f} ms" if len(timed) > 1 else ""
    vs_ring = (f", 1x{n} (Ring layout) {ring * 1e3:.2f} ms ({_vs(ring, best_t, even, 'over the memory budget')})"
               if ring and best != (1, n) else "")
    text = (
        f"mesh_shape=auto -> {best[0]}x{best[1]} for CP={n}{_EVEN_NOTE if even else ''} "
        f"(S/rank={workload.seq_local}, heads "
        f"{workload.heads}/{workload.kv_heads} kv, d={workload.head_dim}, {cluster.name}, stride {stride}): "
        f"simulated {best_t * 1e3:.2f} ms/layer fwd+bwd, peak attention memory {peaks[best][0] / 2**20:.0f} MiB/rank "
        f"(budget {budget / 2**20:.0f} MiB){runner}{vs_ring}"
    )
    log.info(text)
    return ShapeChoice(MeshShape(*best), best_t, tuple(sorted(rows)), text, peaks[best][0], budget, peaks[best][1])


def ulysses_degrees(n: int, cluster: Cluster, heads: int, kv_heads: int, stride: int = 1) -> List[int]:
    """Ulysses degrees u a2a+mesh may use: u | n and u | heads (K/V heads are replicated until u divides
    them, as the runtime does), and a Ulysses group of u ranks (u * TP GPUs) inside one node."""
    return [u for u in range(1, n + 1) if n % u == 0 and heads % u == 0 and u * stride <= cluster.gpus_per_node]


@lru_cache(maxsize=64)
def choose_hybrid_shape(
    n: int, cluster: Cluster, workload: Workload, *, stride: int = 1, max_live: Optional[int] = None,
    memory_budget: Optional[float] = None, even: bool = False,
) -> HybridChoice:
    """The fastest (u, a, b) with u * a * b = n for a2a+mesh (u = 1 is pure mesh) within the memory
    budget (as :func:`choose_shape`); logged like choose_shape. ``even``: only meshes a x b with a and b
    both even (``--mesh-layout split-half``)."""

    budget = default_budget(workload) if memory_budget is None else memory_budget
    cands = []
    for u in ulysses_degrees(n, cluster, workload.heads, workload.kv_heads, stride):
        inner = ulysses_inner(u, workload)
        a2a = sum(step[2] for part in ulysses_a2a_steps(u, cluster, workload, stride)[:4] for step in part)
        for a, b in _shapes(n // u, even):
            def run(a=a, b=b, inner=inner, u=u, a2a=a2a):
                t, peak, live = _within_budget(a, b, cluster, inner, stride * u, max_live, budget,
                                               ulysses_buffer_bytes(u, workload))
                return a2a + t, peak, live

            cands.append(((u, a, b), a2a + shape_bound(a, b, cluster, inner, stride * u), run))
    if not cands:
        raise ValueError(f"no Ulysses degree divides CP={n}, heads={workload.heads} and kv heads="
                         f"{workload.kv_heads} within a node of {cluster.gpus_per_node} GPUs (TP {stride})"
                         + (" leaving a mesh a x b with a and b both even (split-half needs them)" if even else ""))
    rows, peaks = _search(cands)
    timed = sorted((t, s) for s, t, _ in rows if t is not None)
    if not timed:
        if memory_budget is None:
            _warn_once(f"mesh_shape=auto (a2a+mesh): no shape for CP={n} fits the default budget of "
                       f"{budget / 2**20:.0f} MiB per rank ({BUDGET_X_RING:g}x TE Ring's); choosing without a budget")
            return choose_hybrid_shape(n, cluster, workload, stride=stride, max_live=max_live,
                                       memory_budget=float("inf"), even=even)
        raise ValueError(f"no a2a+mesh shape for CP={n} fits the memory budget ({budget / 2**20:.0f} MiB per rank, "
                         f"max_live={max_live}); raise memory_budget")
    best_t, (u, a, b) = timed[0]
    ring = _mesh_time(1, n, cluster, workload, stride, None, chains="one-way")  # TE's p2p Ring (documents: pruned)
    runner = (f", next {'x'.join(map(str, timed[1][1]))} {timed[1][0] * 1e3:.2f} ms" if len(timed) > 1 else "")
    vs_ring = _vs(ring, best_t, even, "not a layout auto runs")  # TE's one-way Ring: not a candidate of auto's
    text = (
        f"mesh_shape=auto (a2a+mesh) -> {u}x{a}x{b} for CP={n}{_EVEN_NOTE if even else ''} "
        f"(S/rank={workload.seq_local}, heads "
        f"{workload.heads}/{workload.kv_heads} kv, d={workload.head_dim}, {cluster.name}, stride {stride}): "
        f"simulated {best_t * 1e3:.2f} ms/layer fwd+bwd, peak attention memory {peaks[(u, a, b)][0] / 2**20:.0f} "
        f"MiB/rank (budget {budget / 2**20:.0f} MiB){runner}, {'pruned ' if workload.pruned else ''}Ring 1x1x{n} "
        f"{ring * 1e3:.2f} ms "
        f"({vs_ring})"
    )
    log.info(text)
    return HybridChoice(u, MeshShape(a, b), best_t, tuple(sorted(rows)), text, peaks[(u, a, b)][0], budget,
                        peaks[(u, a, b)][1])
