"""Planners: functions that build a :class:`~megatron_mesh_cp.runtime.plan.Plan` for a tile shape.

``build_plans`` is the entry point: ``greedy`` (default, :mod:`megatron_mesh_cp.planning.greedy`, scored on a
cluster by the simulator) or ``in-order``. Plans are pure functions of their inputs and cached.

``call_plans`` is the one entry point for the plans a call runs: the full plans of the layer, and for a
mask that may leave blocks empty (documents, chunks, a sliding window) the full plans with chains
split both ways, pruned to the blocks some rank needs and re-ordered by when their chunks are ready
(planning/ready.py). The runtime asks it for every mesh attention
call, and ``document_plans`` for a masked workload of the simulator.

``in_order_plan`` is the straightforward overlapped schedule: gather Q and KV hop by hop around
their rings (one transfer in flight per ring), compute each block as soon as both of its chunks
are present, then compute the remaining rows in the order their partials leave and reduce them
around the ring. It is always valid and is the baseline the greedy planner is measured against.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from functools import lru_cache
from typing import List, Optional, Tuple

from ..runtime.plan import BACKWARD, FORWARD, Compute, Op, Plan, PlanError, Transfer, validate
from ..runtime.prune import prune, without_slabs
from ..runtime.memory import peak_live_bytes
from .cluster import Cluster, Workload, load_cluster, workload_dims
from .costs import plan_peak_bytes
from .greedy import CONFIGS, PlanCost, greedy_plan, grouping_pays
from .ready import VARIANTS, scored_reorder
from .replay import replay, replay_costs
from . import search as order_search
from .search import budget_error, searched

__all__ = ["in_order_plan", "build_plans", "call_plans", "document_plans", "plan_scale", "masked_pool_bytes", "PLANNERS", "default_cluster",
           "DEFAULT_WORKLOAD", "clear_plan_cache", "uncached_document_plans"]

PLANNERS = ("greedy", "in-order")
#: how ``build_plans`` may direct the gather and reduction chains
CHAINS = ("auto", "one-way", "both-ways")
#: Used when a caller plans without saying what it runs (e.g. validating shapes).
DEFAULT_WORKLOAD = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128)


def default_cluster() -> Cluster:
    """The cluster plans are tuned for unless told otherwise: ``$MESH_CP_CLUSTER`` or h100-ib400."""
    return _cluster_named(os.environ.get("MESH_CP_CLUSTER", "h100-ib400"))


@lru_cache(maxsize=8)
def _cluster_named(name: str) -> Cluster:
    return load_cluster(name)  # read once: plans are looked up on every attention call


@lru_cache(maxsize=256)  # keyed by mesh shape and phase, not per batch; bounded all the same
def in_order_plan(a: int, b: int, phase: str = FORWARD) -> Plan:
    """The naive overlapped plan: pipelined ring gathers, then in-order reductions."""
    ops: List[Op] = []
    done = set()

    def compute(i: int, j: int) -> None:
        if (i, j) not in done:
            done.add((i, j))
            ops.append(Compute(i, j))

    for t in range(1, max(a, b)):
        if t < a:
            ops.append(Transfer("q", +1, t - 1))
        if t < b:
            ops.append(Transfer("kv", +1, t - 1))
        # overlap the hop in flight with the blocks whose chunks arrived at the previous hop
        for i in range(min(t, a)):
            for j in range(min(t, b)):
                compute(i, j)
    row_kind = "o" if phase == FORWARD else "dq"
    # partials leave in the order of the +1 reduce-scatter chain: offsets 1, 2, ..., a-1, then own
    for i in list(range(1, a)) + [0]:
        for j in range(b):
            compute(i, j)
        if i:
            ops.append(Transfer(row_kind, +1, i))
    if phase == BACKWARD:
        for j in range(1, b):
            ops.append(Transfer("dkv", +1, j))
    plan = Plan(phase, a, b, tuple(ops), name="in-order")
    validate(plan)
    return plan


def build_plans(
    a: int,
    b: int,
    planner: str = "greedy",
    *,
    cluster: Optional[Cluster] = None,
    workload: Optional[Workload] = None,
    stride: int = 1,
    max_live: Optional[int] = None,
    max_inflight: int = 2,
    chains: str = "auto",
) -> Tuple[Plan, Plan]:
    """(forward plan, backward plan) for an a x b mesh.

    ``greedy`` plans for ``workload`` on ``cluster`` (CP ranks ``stride`` GPUs apart, i.e. the TP
    size) within ``max_live`` live chunks; ``chains="one-way"`` keeps every ring one-directional
    (how Ring-Attention is usually run), ``"auto"`` also tries splitting chains both ways, and
    ``"both-ways"`` only splits them (every offset within half a ring of its owner: what plans
    pruned for documents want, as a document reaches its neighbours on both sides).
    ``in-order`` is the naive baseline.
    """
    if chains not in CHAINS:
        raise ValueError(f"chains must be one of {', '.join(CHAINS)}, got {chains!r}")
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")
    if planner == "in-order":
        plans = in_order_plan(a, b, FORWARD), in_order_plan(a, b, BACKWARD)
        if max_live is not None:
            for p in plans:
                validate(p, max_live=max_live)
        return plans
    cluster = cluster or default_cluster()
    workload = workload or DEFAULT_WORKLOAD
    return _greedy_plans(a, b, cluster, workload, stride, max_live, max_inflight, chains)


def call_plans(a: int, b: int, planner: str = "greedy", *, workload: Workload, cluster: Optional[Cluster] = None,
               stride: int = 1, max_live: Optional[int] = None, keep=None, masked: bool = False,
               slabs: bool = True, scale: Optional[float] = None, layer: Optional[Workload] = None,
               reorder: Optional[bool] = None, search: int = 0) -> Tuple[Plan, Plan]:
    """(forward, backward) plans of one call on an a x b mesh for the unmasked layer ``workload``.

    ``masked``: the call's mask may leave blocks empty (documents, chunks, a window), so the full plans
    split their chains both ways (a document or a window reaches its neighbours on both sides) and are
    pruned to ``keep``, the tile blocks some rank needs (None: every block); where the mask keeps every
    tile block (documents cut over every chunk, say), so the plan runs as planned, it is planned for
    ``scale`` (default :func:`plan_scale` of ``layer``: the kept blocks' time against an unmasked
    block's; transfers then hide behind shorter blocks), each phase within its unscaled plan's live
    chunks (:func:`masked_pool_bytes`: the most memory any batch can need). A pruned plan keeps the
    unscaled order (measured: planning it for the scale is slower there), except where the mask keeps
    more than half of the tile blocks: there the scaled full plan pruned alike is taken where it replays
    faster (:func:`_scaled_pruned`). ``slabs=False``: the mask's
    lower blocks can need a KV chunk's second piece (its engine's ``zigzag_keys``), so no KV chunk is
    kept in a slab. ``layer``: the masked layer (``workload`` with the call's mask); with it a pruned
    plan is re-ordered by when its chunks are ready (planning/ready.py: ``reorder=None`` where the
    replay says that is faster, ``True`` always, ``False`` never) and then, with ``search`` > 0, searched
    for a faster order by at most that many replays per phase (planning/search.py; ``PlanOptions.search``)."""
    why = budget_error(search)
    if why:
        raise ValueError(f"search (replays per phase of the order search): {why}")
    if search and reorder is False:
        raise ValueError("search re-orders pruned plans, which reorder=False forbids: set search=0 or reorder=None")
    every = keep is None or len(keep) == a * b
    if scale is None:
        scale = plan_scale(layer, cluster or default_cluster(), a * b) if masked and every and layer is not None else 1.0
    if masked and scale != 1.0 and planner == "greedy" and every:
        full = _scaled_plans(a, b, cluster or default_cluster(), workload, stride, max_live, float(scale), slabs)
    else:
        full = build_plans(a, b, planner, cluster=cluster, workload=workload, stride=stride, max_live=max_live,
                           chains="both-ways" if masked else "auto")
    unpruned = full
    if keep is not None:
        full = prune(full[0], keep), prune(full[1], keep)
    if not slabs:
        full = without_slabs(full[0]), without_slabs(full[1])
    if keep is not None and layer is not None and layer.pruned and reorder is not False:
        cl = cluster or default_cluster()
        # a live-chunk limit shapes the full plans for the worst batch; this batch's pruned plans may
        # fit the same pool from the unlimited full plans, whose ready order can be faster
        free = (build_plans(a, b, planner, cluster=cluster, workload=workload, stride=stride, max_live=None,
                            chains="both-ways") if max_live is not None and planner == "greedy" else unpruned)
        scaled = None
        if planner == "greedy" and not every and 2 * len(keep) > a * b and reorder is None:
            scaled = _scaled_pruned(full, a, b, keep, slabs, cl, workload, layer, stride, max_live)
        ready = [_ready(p, u, f, keep, slabs, cl, layer, stride, max_live, bool(reorder),
                        *((None, None) if scaled is None or scaled[k] is None else (scaled[k][0], scaled[k][2])))
                 for k, (p, u, f) in enumerate(zip(full, unpruned, free))]
        full = tuple(p for _, p in ready)
        if scaled is not None:
            full = tuple(_faster(plan, t, alt, cl, layer, stride) for (t, plan), alt in zip(ready, scaled))
        if search:
            full = tuple(_searched(p, u, slabs, cl, layer, stride, max_live, search) for p, u in zip(full, unpruned))
    return full


def _searched(plan: Plan, full: Plan, slabs: bool, cluster: Cluster, layer: Workload, stride: int,
              max_live: Optional[int], budget: int) -> Plan:
    """``plan`` after the order search (planning/search.py) within ``full``'s pool bytes (in the form that
    runs) and ``max_live``, as :func:`_ready` keeps a ready order."""
    room = peak_live_bytes(full if slabs else without_slabs(full), workload_dims(layer))
    return searched(plan, cluster, layer, budget=budget, stride=stride, max_live=max_live, room=room)


def _scaled_pruned(plans, a, b, keep, slabs: bool, cluster: Cluster, workload: Workload, layer: Workload,
                   stride: int, max_live: Optional[int]) -> Optional[list]:
    """Where a mask keeps most tile blocks but not all, each phase's plan (its ready order, :func:`_ready`)
    or the full plan planned for the layer's :func:`plan_scale` pruned alike, whichever replays faster
    (ties: the former; :func:`_faster`). Measured on docs/packing.md's heavy-tailed draw with documents over
    half of each mesh row (23 and 29 of 32 tile blocks kept): 79.4 -> 75.9 ms GQA 8x2x16, 93.2 -> 86.1 ms MHA
    8x4x8; where few blocks are kept (the 4K-64K draws, 9-12 of 32) the scaled order is slower in three of
    four, so it is not tried there. Its pool is within :func:`masked_pool_bytes`, which holds every scale's
    full plans.

    Per phase of the pruned ``plans``, ``(replayed seconds, plan, costs)`` of the scaled one, replayed first
    so its seconds are the ``floor`` of the phase's ready-order search (an order that surely replays slower
    is stopped early: it loses to this plan anyway), with the pruned plan's replay_costs (the search's; the
    scaled plan's replay shares them where its computes are among the pruned plan's); None where it is the
    pruned plan itself (its scaled plan fell back to the unscaled one), or for both where the scale is 1."""
    scale = plan_scale(layer, cluster, a * b)
    if scale == 1.0:
        return None
    out = []
    for plan, full in zip(plans, _scaled_plans(a, b, cluster, workload, stride, max_live, float(scale), slabs)):
        alt = prune(full, keep)
        alt = alt if slabs else without_slabs(alt)
        if alt.ops == plan.ops and alt.slabs == plan.slabs:
            out.append(None)
            continue
        costs = replay_costs(plan, cluster, layer, stride) if plan.computes else None
        shared = costs if costs is not None and set(alt.computes) <= set(plan.computes) else None
        out.append((replay(alt, cluster, layer, stride=stride, record=None, costs=shared).time, alt, costs))
    return out


def _faster(plan: Plan, t: float, scaled, cluster: Cluster, layer: Workload, stride: int) -> Plan:
    """``plan`` (its ready-order search's seconds ``t``: infinite where that search stopped it as slower than
    the scaled plan's; nan where not replayed) or ``scaled`` (:func:`_scaled_pruned`), where that replays faster."""
    if scaled is None:  # the pruned plan itself: never faster than the ready-order search's pick
        return plan
    t_alt, alt, _ = scaled
    if t != t:  # not replayed (too large to re-order): price it now
        t = replay(plan, cluster, layer, stride=stride, record=None, bound=t_alt, floor=t_alt).time
    return alt if t_alt < t else plan


def _ready(pruned: Plan, full: Plan, free: Plan, keep, slabs: bool, cluster: Cluster, layer: Workload, stride: int,
           max_live: Optional[int], force: bool, floor: Optional[float] = None,
           costs: Optional[tuple] = None) -> Tuple[float, Plan]:
    """(replayed seconds or nan, plan): the ready order of one phase's pruned plan (planning/ready.py), within ``full``'s pool bytes (in
    the form that runs: without KV slabs where ``slabs`` is False) and ``max_live``; backward, where the limit made ``full`` differ from the unlimited ``free`` plan, also
    the first ready order of ``free`` pruned alike, kept if it replays faster still and fits the same
    pool and limit (``force`` applies to the first). Over 8 draws of 4K-64K documents on a2a+mesh 8x2x16
    this takes the backward 1% lower (0.33 ms on the issue's draw); forward it never won, so it is
    not tried there (each try is a replay and more: ~1.5 ms of host time). ``floor``: the seconds of the plan
    the caller takes unless this one is faster (scored_reorder's: the seconds come back infinite where
    this phase's orders surely replay slower); ``costs``: ``pruned``'s replay_costs where the caller has them."""
    if pruned.tile is None:
        return float("nan"), pruned
    room = peak_live_bytes(full if slabs else without_slabs(full), workload_dims(layer))  # the form that runs
    second = free.ops != full.ops and pruned.phase == BACKWARD  # forward: never faster over 8 draws
    if costs is None and second:  # shared when the computes are
        costs = replay_costs(pruned, cluster, layer, stride)
    t, plan = scored_reorder(pruned, cluster, layer, stride=stride, max_live=max_live, room=room, force=force,
                             costs=costs, floor=floor)
    if not second or t != t:  # nan: too large to re-order
        return t, plan
    alt = prune(free, keep)
    alt = alt if slabs else without_slabs(alt)
    if alt.tile is None:
        return t, plan
    if not set(alt.computes) <= set(pruned.computes):  # other computes (grouped otherwise): price them anew
        costs = None
    t2, alt = scored_reorder(alt, cluster, layer, stride=stride, max_live=max_live, room=room,
                             variants=VARIANTS[alt.phase][:1], beat=t, costs=costs, floor=floor)
    return (t2, alt) if t2 < t else (t, plan)


#: the smallest :func:`plan_scale` (a layer whose kept blocks are lighter still plans as at this one)
MIN_PLAN_SCALE = 1.0 / 16


def plan_scale(masked: Workload, cluster: Cluster, chunks: int) -> float:
    """The mean time (forward + backward) of the blocks a masked layer keeps on ``chunks`` chunks over
    an unmasked block's, rounded to a power of two in [:data:`MIN_PLAN_SCALE`, 1]: what its full plans
    are planned for (:func:`call_plans`). Rounded so a run's changing batches share a few plans (the
    cache stays bounded) and every rank gets the same from the same (agreed) mask."""
    if not masked.pruned:
        return 1.0
    fwd, bwd = (masked.block_times(cluster, backward, chunks) for backward in (False, True))
    kept = (fwd + bwd) > 0
    if not kept.any():
        return 1.0
    plain = masked.unmasked
    base = plain.mean_block_time(cluster, False, chunks) + plain.mean_block_time(cluster, True, chunks)
    ratio = float((fwd + bwd)[kept].mean()) / base
    return float(min(1.0, max(MIN_PLAN_SCALE, 2.0 ** round(math.log2(ratio)))))


@lru_cache(maxsize=64)  # a few scales per layer and shape
def _scaled_plans(a, b, cluster, workload, stride, max_live, scale, slabs: bool = True) -> Tuple[Plan, Plan]:
    """The full masked-layer plans planned for blocks ``scale`` times an unmasked one, each phase within
    the live chunks of its unscaled plan (that plan where the scaled one needs more). Their arena can
    still be larger (measured: heavy-tailed split:3 at n = 256, MHA 1443 -> 1571 MiB, within auto
    shape's budget of 4x TE Ring's); :func:`masked_pool_bytes` is what the dry run reports."""
    full = build_plans(a, b, cluster=cluster, workload=workload, stride=stride, max_live=max_live,
                       chains="both-ways")
    peaks = tuple(_live_chunks(p) for p in full)
    try:
        tuned = build_plans(a, b, cluster=cluster, workload=replace(workload, plan_scale=scale), stride=stride,
                            max_live=max(peaks), chains="both-ways")
    except ValueError:  # no scaled plan within the unscaled ones' live chunks: keep them
        return full
    if not slabs:  # compared as they run: every KV chunk in its own buffer
        peaks = tuple(_live_chunks(without_slabs(p)) for p in full)
    return tuple(t if validate(t if slabs else without_slabs(t)) <= peak else f for t, f, peak in zip(tuned, full, peaks))


@lru_cache(maxsize=64)  # the unscaled full plans of a few layers and shapes, each scale's build reads them
def _live_chunks(plan: Plan) -> int:
    """validate's peak live chunks of a full plan (read again for every scale: :func:`_scaled_plans`)."""
    return validate(plan)


def masked_pool_bytes(a: int, b: int, cluster: Cluster, workload: Workload, stride: int = 1,
                      max_live: Optional[int] = None) -> int:
    """The pool a masked layer's plans can need on the a x b mesh, whatever its batches: the larger arena
    of its full plans, unscaled and at every :func:`plan_scale` (pruning only frees chunks)."""
    scales, s = [1.0], 0.5
    while s >= MIN_PLAN_SCALE:
        scales.append(s)
        s /= 2
    out = 0
    for scale in scales:
        for slabs in (True, False):  # masks whose lower blocks need a KV chunk's second piece run without slabs
            plans = (build_plans(a, b, cluster=cluster, workload=workload, stride=stride, max_live=max_live,
                                 chains="both-ways") if scale == 1.0
                     else _scaled_plans(a, b, cluster, workload, stride, max_live, scale, slabs))
            out = max(out, plan_peak_bytes(*(p if slabs else without_slabs(p) for p in plans), workload))
    return out


@lru_cache(maxsize=256)
def document_plans(a: int, b: int, planner: str = "greedy", *, cluster: Optional[Cluster] = None,
                   workload: Workload, stride: int = 1, max_live: Optional[int] = None,
                   reorder: Optional[bool] = None, search: int = 0) -> Tuple[Plan, Plan]:
    """(forward, backward) plans for a masked ``workload`` (documents, chunks, a window), as
    ``mesh_attention`` runs them (:func:`call_plans`, planned for its :func:`plan_scale`; ``reorder`` and
    ``search`` as ``PlanOptions``'); cached (:func:`uncached_document_plans` builds them)."""
    return uncached_document_plans(a, b, planner, cluster=cluster, workload=workload, stride=stride,
                                   max_live=max_live, reorder=reorder, search=search)


def uncached_document_plans(a: int, b: int, planner: str = "greedy", *, cluster: Optional[Cluster] = None,
                            workload: Workload, stride: int = 1, max_live: Optional[int] = None,
                            reorder: Optional[bool] = None, search: int = 0) -> Tuple[Plan, Plan]:
    """:func:`document_plans` without its cache: for plans of masks that may never run (auto's layout
    candidates, planning/layouts.py), which would otherwise evict the plans of the layouts that do."""
    return call_plans(a, b, planner, workload=workload.unmasked, cluster=cluster, stride=stride, max_live=max_live,
                      keep=workload.needed(a, b), masked=True, slabs=workload.blocks(a * b).zigzag_keys,
                      layer=workload, reorder=reorder, search=search)


def clear_plan_cache() -> None:
    """Forget every plan built so far (benchmarks time planning from scratch)."""
    _greedy_plans.cache_clear()
    _scaled_plans.cache_clear()
    _live_chunks.cache_clear()
    document_plans.cache_clear()


@lru_cache(maxsize=256)
def _greedy_plans(a, b, cluster, workload, stride, max_live, max_inflight, chains) -> Tuple[Plan, Plan]:
    t0 = time.perf_counter()
    best = []
    for phase in (FORWARD, BACKWARD):
        cost = PlanCost.of(a, b, phase, cluster, workload, stride)
        scored = []
        errors = []
        grouped = grouping_pays(workload, cluster, phase == BACKWARD)
        for cfg in _chain_configs(chains):
            if cfg.group and not grouped:
                continue
            cfg = replace(cfg, max_inflight=max_inflight, max_live=max_live)
            try:
                plan = greedy_plan(a, b, phase, cost, cfg)
            except PlanError as exc:
                errors.append(str(exc))
                continue
            t = replay(plan, cluster, workload, stride=stride, record=None).time
            scored.append((t, len(scored), plan))
        if not scored:
            need = _minimum_budget(a, b, phase, cost, max_inflight)
            raise ValueError(
                f"memory budget of {max_live} live chunks is below what any {phase} plan for {a}x{b} needs "
                f"(minimum {need}); raise the budget or pick a shape with a smaller tile"
            )
        best.append(min(scored)[2])
    elapsed = time.perf_counter() - t0
    fwd, bwd = best
    meta = (("planning_seconds", elapsed),)
    return (
        Plan(fwd.phase, a, b, fwd.ops, name=fwd.name, meta=fwd.meta + meta, slabs=fwd.slabs),
        Plan(bwd.phase, a, b, bwd.ops, name=bwd.name, meta=bwd.meta + meta, slabs=bwd.slabs),
    )


def _chain_configs(chains: str):
    if chains == "auto":
        return CONFIGS
    if chains == "one-way":  # how Ring-Attention is run (TE's p2p): one direction, ungrouped
        return CONFIGS[:1]
    return tuple(c for c in CONFIGS if c.split_gathers and c.split_reductions)


def _minimum_budget(a, b, phase, cost, max_inflight) -> int:
    """Smallest live-chunk budget the greedy planner can honour (binary search; feasibility is monotone)."""

    def feasible(budget: int) -> bool:
        for cfg in CONFIGS:
            try:
                greedy_plan(a, b, phase, cost, replace(cfg, max_inflight=max_inflight, max_live=budget))
                return True
            except PlanError:
                pass
        return False

    lo, hi = 2, max(validate(in_order_plan(a, b, phase)), 2)
    while not feasible(hi):  # pragma: no cover - the in-order peak always suffices in practice
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def orders_ahead(a: int, b: int, planner: str, *, workload, mask, cluster=None, stride: int = 1,
                 max_live: Optional[int] = None, budget: int) -> np.ndarray:
    """The searched orders of the plans ``call_plans`` makes for ``mask`` on an a x b mesh (the layer
    ``workload`` unmasked, as the attention call builds it), ``search.encode_orders``-ed: what the launcher's
    data loader workers compute for a micro-batch, so that its step takes them (``search.remember_encoded``)
    instead of searching. Empty where the mask leaves no pruned plans or ``budget`` is 0."""
    from ..runtime.topology import MeshShape

    if not budget:
        return order_search.encode_orders(())
    blocks = mask.bind(a * b, workload.seq_local * a * b, workload.causal)
    if not blocks.pruned:
        return order_search.encode_orders(())
    kw = dict(workload=workload, cluster=cluster, stride=stride, max_live=max_live,
              keep=blocks.needed(MeshShape(a, b)), masked=True, slabs=blocks.zigzag_keys,
              layer=replace(workload, mask=mask))
    with order_search.recording() as found:  # each search's digest (its every input) and order, as searched
        call_plans(a, b, planner, search=budget, **kw)
    return order_search.encode_orders(found)
