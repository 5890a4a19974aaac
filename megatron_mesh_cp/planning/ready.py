"""Ready order: re-order a pruned plan's ops by when their chunks arrive (list scheduling).

Pruning (runtime/prune.py) keeps the full plan's op order, so a kept compute whose chunk arrives
late sits where it was, and a reduction partial whose blocks sat late in the full plan leaves late
and its neighbour waits for it. :func:`ready_order` list-schedules the pruned plan's ops on one
representative rank (a scalar model of the replay's semantics: one compute stream; one channel per
ring, both directions and gathers and reductions alike in issue order; the network transfers of
both rings queue on the NIC): each resource takes, among its ops whose inputs are there when it is
free, the one with the longest tail (or plan order, gathers breadth first), each reduction partial
as soon as every compute feeding it is done and the partial it forwards has arrived, each ``Free``
right after the chunk's last use. The set of transfers is the pruned plan's, so its bytes are
unchanged; only the order moves.

The representative rank is a statistic over the ranks of each compute's seconds (mean, max, or the
slowest rank's own), so a few candidate orders come out (:data:`VARIANTS`); :func:`reorder` (called
by planning/schedule.py's ``call_plans``, which the executor and the simulator share) keeps the one
the full replay (planning/replay.py) scores fastest, or the pruned order if none beats it, within
the live-chunk limit and the full plan's pool bytes. Plans over :data:`MAX_RANK_OPS` rank x ops keep
the pruned order (the host cost cap). Everything is a deterministic function of the plan, the
masked workload and the cluster, so every rank derives the same plan (and the call's agreement
compares plan digests).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .replay import per_rank
from ..runtime.plan import (GATHER_KINDS, REDUCE_KINDS, RING_OF, Compute, Free, Plan, PlanError, Transfer,
                            partial_offset, payload, validate)

__all__ = ["ready_order", "ready_orders", "reorder", "scored_reorder", "link_costs", "TIES", "STATS", "MAX_RANK_OPS",
           "VARIANTS"]

#: how a resource chooses among ops ready at once: the longest tail (chain of ops waiting on it) first, or
#: plan order (gathers: breadth first, the nearer hop of either chain before the farther one)
TIES = ("tail", "plan")
#: the statistic over ranks that gives a compute its scalar seconds
STATS = ("mean", "max", "critical")


def ready_order(plan: Plan, seconds: Sequence[float], transfer_s: Dict[str, float], inter: Dict[str, bool],
                fold_s: Dict[str, float], tie: str = "tail") -> Plan:
    """``plan``'s ops list-scheduled on one rank: ``seconds`` per compute (in plan order), ``transfer_s``
    per transfer kind (bytes / bandwidth + latency), ``inter`` per ring (its hops cross the NIC both
    rings share), ``fold_s`` per reduction kind (folding one arrived partial). Same ops, new order.

    Each resource (the compute stream, each ring's channel) takes, among its ops whose inputs are
    there when it is free, the one with the longest *tail* (its seconds plus the longest chain of
    ops waiting on it: a compute feeding a travelling partial carries that partial's trip and fold;
    a gather carries the computes and forwards that read its chunk); if none is there yet, the one
    there first. ``tie="plan"``: plan order instead of the tail (the pure ready order; gathers breadth
    first, by hops from the owner, so no chain's far hop holds up the other's near one). Ops are
    handled by index (hashing the op dataclasses is what would cost)."""
    if tie not in TIES:
        raise ValueError(f"tie must be one of {', '.join(TIES)}, got {tie!r}")
    reduce_kinds = REDUCE_KINDS[plan.phase]
    ops = plan.ops
    comp_idx = [k for k, op in enumerate(ops) if isinstance(op, Compute)]
    xfer_idx = [k for k, op in enumerate(ops) if isinstance(op, Transfer)]
    free_of = {(op.kind, op.offset): k for k, op in enumerate(ops) if isinstance(op, Free)}
    dst = {k: plan.dst(ops[k]) for k in xfer_idx}
    is_gather = {k: ops[k].kind in GATHER_KINDS for k in xfer_idx}
    ring_of = {k: ops[k].ring for k in xfer_idx}
    chunks = {k: [("q", ops[k].q)] + [("kv", kv) for kv in ops[k].kvs] for k in comp_idx}
    partials = {k: {(kind, partial_offset(kind, q, kv)) for kind in reduce_kinds for q, kv in ops[k].blocks}
                for k in comp_idx}
    sec = dict(zip(comp_idx, seconds))
    sender = {(ops[k].kind, ops[k].src): k for k in xfer_idx if not is_gather[k]}
    feeding: Dict[Tuple[str, int], int] = {}
    for k in comp_idx:
        for key in partials[k]:
            feeding[key] = feeding.get(key, 0) + 1
    upstream = {(ops[k].kind, dst[k]) for k in sender.values()}  # offsets a partial is forwarded into
    readers: Dict[Tuple[str, int], List[int]] = {}  # chunk -> computes and forwards reading it
    for k in comp_idx:
        for key in chunks[k]:
            readers.setdefault(key, []).append(k)
    for k in xfer_idx:
        if is_gather[k]:
            readers.setdefault((ops[k].kind, ops[k].src), []).append(k)
    uses = {key: len(v) for key, v in readers.items()}

    # tails, from the end backwards: a partial's trip to its owner, computes, gathers (deepest first)
    tail: Dict[int, float] = {}

    def reduction_tail(k: int) -> float:
        if k not in tail:
            nxt = sender.get((ops[k].kind, dst[k]))
            tail[k] = transfer_s[ops[k].kind] + (reduction_tail(nxt) if nxt is not None else fold_s[ops[k].kind])
        return tail[k]

    for k in comp_idx:
        tail[k] = sec[k] + max([reduction_tail(sender[key]) for key in partials[k] if key in sender] or [0.0])

    def gather_tail(k: int) -> float:
        if k not in tail:
            got = readers.get((ops[k].kind, dst[k]), [])
            tail[k] = transfer_s[ops[k].kind] + max([gather_tail(x) if x in is_gather else tail[x] for x in got]
                                                    or [0.0])
        return tail[k]

    for k in xfer_idx:
        if is_gather[k]:
            gather_tail(k)
    prio = {k: ((-tail[k] if tie == "tail" else 0.0), k) for k in tail}
    if tie == "plan":  # gathers breadth first: the nearer hop of either chain before the farther one
        for k in xfer_idx:
            if is_gather[k]:
                prio[k] = (float(dst[k] if ops[k].direction > 0 else plan.ring_size(ring_of[k]) - dst[k]), k)

    arrival: Dict[Tuple[str, int], float] = {("q", 0): 0.0, ("kv", 0): 0.0}
    partial_in: Dict[Tuple[str, int], float] = {}  # (kind, offset) -> when the partial forwarded into it arrived
    fed_done: Dict[Tuple[str, int], int] = {}
    chan = {"row": 0.0, "col": 0.0}
    nic = 0.0
    comp = 0.0
    out: List[int] = []
    pending = set(comp_idx)
    missing = {k: sum(key not in arrival for key in chunks[k]) for k in comp_idx}  # chunks not there yet
    avail = {k: max(arrival.get(key, 0.0) for key in chunks[k]) for k in comp_idx if not missing[k]}
    waiting = {"row": [k for k in xfer_idx if ring_of[k] == "row"], "col": [k for k in xfer_idx if ring_of[k] == "col"]}

    def use(key) -> None:
        uses[key] -= 1
        if not uses[key] and key in free_of:
            out.append(free_of.pop(key))

    def pick(cands, free_at: float):
        """(ready, op) of the op a resource free at ``free_at`` takes among (ready, op) pairs."""
        there = [(prio[k], ready, k) for ready, k in cands if ready <= free_at]
        if there:
            _, ready, k = min(there)
            return ready, k
        ready, _, k = min((ready, prio[k], k) for ready, k in cands)
        return ready, k

    while pending or waiting["row"] or waiting["col"]:
        best = None  # (time, class, index, start): transfers before computes at one instant
        for ring in ("row", "col"):
            cands = []
            for k in waiting[ring]:
                key = (ops[k].kind, ops[k].src)
                if is_gather[k]:
                    if key in arrival:
                        cands.append((arrival[key], k))
                elif fed_done.get(key, 0) == feeding.get(key, 0):
                    if key not in upstream:
                        cands.append((comp, k))
                    elif key in partial_in:  # the fold runs on the compute stream first
                        cands.append((max(comp, partial_in[key]) + fold_s[ops[k].kind], k))
            if cands:
                free_at = max(chan[ring], nic) if inter[ring] else chan[ring]
                ready, k = pick(cands, free_at)  # issued once its payload is ready: the channel keeps its order
                best = min(best or (np.inf,), (ready, 0, k, max(ready, free_at)))
        cands = [(ready, k) for k, ready in avail.items()]
        if cands:
            ready, k = pick(cands, comp)
            start = max(ready, comp)
            best = min(best or (np.inf,), (start, 1, k, start))
        if best is None:  # pragma: no cover - a valid plan always has a next op
            raise PlanError(f"{plan.name}: ready order stalled with {len(pending)} computes left")
        _, cls, k, start = best
        op = ops[k]
        out.append(k)
        if cls == 0:
            key = (op.kind, op.src)
            if not is_gather[k] and key in upstream:
                comp = max(comp, partial_in[key]) + fold_s[op.kind]
            fin = start + transfer_s[op.kind]
            if inter[op.ring]:
                nic = fin
            chan[op.ring] = fin
            waiting[op.ring].remove(k)
            if is_gather[k]:
                arrival[(op.kind, dst[k])] = fin
                for x in readers.get((op.kind, dst[k]), ()):
                    if x in missing:  # a compute (forwards are gathers, tracked by arrival)
                        missing[x] -= 1
                        if not missing[x]:
                            avail[x] = max(arrival[c] for c in chunks[x])
                use(key)
            else:
                partial_in[(op.kind, dst[k])] = fin
        else:
            comp = start + sec[k]
            pending.discard(k)
            del avail[k]
            for key in partials[k]:
                fed_done[key] = fed_done.get(key, 0) + 1
            for key in chunks[k]:
                use(key)
    out.extend(free_of.values())  # chunks never read (none in a valid pruned plan)
    if sorted(out) != list(range(len(ops))):  # pragma: no cover - a bug, not an input
        raise PlanError(f"{plan.name}: ready order changed the ops")
    return Plan(plan.phase, plan.a, plan.b, tuple(ops[k] for k in out), name=f"{plan.name}+ready", meta=plan.meta,
                slabs=plan.slabs, tile=plan.tile)


def ready_orders(plan: Plan, durations: Sequence[np.ndarray], critical: int, transfer_s: Dict[str, float],
                 inter: Dict[str, bool], fold_s: Dict[str, float], max_live: Optional[int] = None,
                 variants: Sequence[Tuple[str, str]] = (), check: bool = True) -> List[Plan]:
    """The distinct ready orders of ``plan`` for each (stat, tie) of ``variants`` (default: all of
    :data:`STATS` x :data:`TIES`), valid within ``max_live`` (``check=False``: unchecked, the caller
    validates the one it keeps); ``durations``: each compute's seconds on every rank, in plan order;
    ``critical``: the slowest rank of the pruned order (the ``critical`` stat's rank)."""
    out: List[Plan] = []
    seen = {plan.ops}
    d = np.array([per_rank(x, plan.a * plan.b) for x in durations]).reshape(len(durations), -1)
    stats = {"mean": d.mean(axis=1), "max": d.max(axis=1), "critical": d[:, critical]} if len(d) else {}
    for stat, tie in variants or [(s, t) for s in STATS for t in TIES]:
        cand = ready_order(plan, stats[stat].tolist() if stats else [], transfer_s, inter, fold_s, tie)
        if cand.ops in seen:
            continue
        seen.add(cand.ops)
        if check and not _valid(cand, max_live):
            continue
        out.append(cand)
    return out


def _valid(plan: Plan, max_live: Optional[int]) -> bool:
    """Whether ``plan`` passes validate within ``max_live`` live chunks (a ready order can exceed the
    budget where a chunk's last use moved later)."""
    try:
        validate(plan, max_live=max_live)
    except PlanError:
        return False
    return True


def link_costs(plan: Plan, dims, bw: Dict[Tuple[str, int], np.ndarray], lat: Dict[Tuple[str, int], np.ndarray],
               inter: Dict[Tuple[str, int], np.ndarray], hbm_bw: float):
    """Scalar transfer seconds per kind (the slowest hop of its ring), whether each ring's hops cross
    the NIC on any rank, and the fold seconds per reduction kind: what :func:`ready_order` takes."""
    transfer_s, folds = {}, {}
    kinds = GATHER_KINDS + REDUCE_KINDS[plan.phase]
    for kind in kinds:
        nbytes = sum(s.nbytes for s in payload(plan.phase, kind, dims))
        ring = RING_OF[kind]
        transfer_s[kind] = max(float(np.max(nbytes / bw[(ring, d)] + lat[(ring, d)])) for d in (1, -1))
        if kind not in GATHER_KINDS:
            folds[kind] = 3 * nbytes / hbm_bw
    crosses = {ring: bool(any(np.any(inter[(ring, d)]) for d in (1, -1))) for ring in ("row", "col")}
    return transfer_s, crosses, folds



#: The cap on host cost: a plan is re-ordered only while ranks x ops stays within this (each candidate is
#: scored by a full replay, whose cost grows as ranks x ops: about 1 ms per phase at 32 ranks x 25 ops
#: on one CPU thread). Larger plans (e.g. Ring 1 x 256, 256 ranks x ~170 ops) keep the pruned order.
MAX_RANK_OPS = 4096

#: The (stat, tie) candidates :func:`reorder` scores per phase: the single forward one and the backward
#: pair with the least total time over 8 draws of 1M tokens of 4K-64K documents (a2a+mesh 8x2x16 GQA
#: and 8x4x8 MHA; within 1-2% of the best of all six); with the pruned order's, 2 replays forward
#: and 3 backward, which keeps the host cost near 5 ms.
VARIANTS = {"forward": (("max", "tail"),), "backward": (("mean", "plan"), ("critical", "tail"))}


def reorder(plan: Plan, cluster, w, *, stride: int = 1, max_live: Optional[int] = None,
            room: Optional[int] = None, force: bool = False) -> Plan:
    """The fastest of ``plan`` (pruned) and its ready orders (:data:`VARIANTS`) by the full replay of
    the masked layer ``w`` on ``cluster`` (CP ranks ``stride`` GPUs apart); ``plan`` itself where it is
    larger than :data:`MAX_RANK_OPS` or has nothing to re-order. A ready order keeps within ``max_live``
    live chunks and never needs a larger buffer pool (peak live bytes) than ``room`` (the full plan's,
    which the memory budget was sized by) or the pruned order's, whichever is larger. ``force``:
    the fastest ready order even where the pruned order replays faster (tests run re-ordered plans on
    small meshes this way)."""
    return scored_reorder(plan, cluster, w, stride=stride, max_live=max_live, room=room, force=force)[1]


def scored_reorder(plan: Plan, cluster, w, *, stride: int = 1, max_live: Optional[int] = None,
                   room: Optional[int] = None, force: bool = False, variants=None,
                   beat: Optional[float] = None, costs: Optional[tuple] = None,
                   floor: Optional[float] = None) -> Tuple[float, Plan]:
    """:func:`reorder` with its replayed seconds: ``(seconds, plan)``. ``variants``: the (stat, tie)
    candidates (default :data:`VARIANTS` of the phase); ``beat``: the seconds to beat instead of the
    pruned order's (which is then not replayed, and not returned: ``(inf, plan)`` when nothing beats it);
    ``costs``: replay_costs of a plan with these computes (and more), computed once by the caller.
    ``floor``: the seconds of another plan the caller takes over this search's unless it is beaten
    (strictly): an order that replays slower than ``floor`` is stopped as soon as it surely does (replay's
    ``bound`` and ``floor``), so it comes back as infinite -- the pruned order's too, except where a
    variant is picked by the slowest rank of its replay (``critical``) -- which changes no result the
    caller keeps: what replays at or under ``floor`` is scored as without it."""
    from ..runtime.memory import peak_live_bytes
    from .replay import replay, replay_costs

    n = plan.a * plan.b
    own = np.inf if beat is not None else np.nan  # the pruned order's seconds, where replayed
    if not plan.computes or (n * len(plan.ops) > MAX_RANK_OPS and not force):
        return own, plan
    costs = costs or replay_costs(plan, cluster, w, stride)
    _, inter, bw, lat, _, dims, blocks, _, _ = costs
    transfer_s, crosses, folds = link_costs(plan, dims, bw, lat, inter, cluster.hbm_bw)
    variants = variants or VARIANTS[plan.phase]
    if beat is None:
        # the slowest rank of the pruned order's replay picks the critical variant: that replay runs to its end
        stop = None if force or any(stat == "critical" for stat, _ in variants) else floor
        base = replay(plan, cluster, w, stride=stride, record=None, costs=costs, bound=stop, floor=stop)
        beat = own = base.time
        critical = base.critical
    else:  # the rank with the most block seconds stands for the slowest
        critical = int(np.argmax(sum(per_rank(blocks[op], n) for op in plan.computes)))
    cands = ready_orders(plan, [blocks[op] for op in plan.computes], critical, transfer_s, crosses, folds,
                         max_live=max_live, variants=variants, check=False)
    scored, best_t = [], None if force else beat
    if floor is not None and not force:
        best_t = min(best_t, floor)
    for k, p in enumerate(cands):  # a candidate is dropped as soon as it cannot beat the best so far
        t = replay(p, cluster, w, stride=stride, record=None, costs=costs, bound=best_t,
                   floor=None if force else floor).time
        scored.append((t, k, p))
        best_t = t if best_t is None else min(best_t, t)
    scored.sort()
    room = max(room or 0, peak_live_bytes(plan, dims))  # a re-order never needs a larger pool than this
    for t, _, best in scored:
        if not (force or t < beat):
            break
        if _valid(best, max_live) and peak_live_bytes(best, dims) <= room:
            return t, best
    return own, plan
