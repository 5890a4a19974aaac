"""Order search: improve a pruned plan's op order by moving one op at a time, each move scored by the replay.

The ready orders (planning/ready.py) are list schedules of one representative rank; the replay of all
ranks can still find a faster order nearby -- an own-chunk block pulled ahead of a gather it waited
behind, a partial's feeding blocks moved before the blocks of the owner's row, a gather moved ahead of
another on the NIC they share. :func:`search_order` hill-climbs: each try moves one compute or transfer
to another place (drawn by a seeded generator, so every rank makes the same tries and gets the same
plan), re-places every ``Free`` right after its chunk's last use, and keeps the move where the plan
stays valid within the live-chunk limit and the pool bytes and replays strictly faster. The ops
themselves never change, so the transfers and their bytes are the plan's.

Each try that passes :func:`~megatron_mesh_cp.runtime.plan.validate` costs one replay (about 1 ms
at 32 ranks x 55 ops on one CPU thread), so the search is bounded by a count of replays (``budget``),
not by time: the result is a deterministic function of the plan, the masked layer and the cluster.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Optional, Tuple

from ..runtime.memory import peak_live_bytes
from ..runtime.plan import GATHER_KINDS, Compute, Free, Plan, PlanError, validate
from .cluster import workload_dims

__all__ = ["search_order", "ATTEMPTS_PER_REPLAY", "SEED"]

#: tries drawn per replay of the budget at most (most tries break a dependency and cost no replay)
ATTEMPTS_PER_REPLAY = 20
#: the generator's seed: the same on every rank
SEED = 0
#: a move is kept only where it replays faster by more than this share (rounding never decides)
MARGIN = 1e-9


def _frees_placed(ops, frees) -> Tuple:
    """``ops`` (no Free) with each of ``frees`` right after the last op that reads its chunk (a compute on
    it, a gather forwarding it) or, if none does, right after the transfer that delivered it."""
    last = {}
    for k, op in enumerate(ops):
        if isinstance(op, Compute):
            last[("q", op.q)] = k
            for kv in op.kvs:
                last[("kv", kv)] = k
        elif op.kind in GATHER_KINDS:
            last[(op.kind, op.src)] = k
    after = {}
    for f in frees:
        after.setdefault(last.get((f.kind, f.offset), -1), []).append(f)
    out = list(after.get(-1, ()))
    for k, op in enumerate(ops):
        out.append(op)
        out.extend(after.get(k, ()))
    return tuple(out)


def _delivered(plan: Plan):
    """Whether every freed chunk is delivered by a transfer (so its Free can follow it)."""
    got = {(t.kind, plan.dst(t)) for t in plan.transfers if t.kind in GATHER_KINDS}
    return all((op.kind, op.offset) in got for op in plan.ops if isinstance(op, Free))


def search_order(plan: Plan, cluster, w, *, budget: int, stride: int = 1, max_live: Optional[int] = None,
                 room: Optional[int] = None, costs: Optional[tuple] = None,
                 seconds: Optional[float] = None) -> Tuple[float, Plan]:
    """``(seconds, plan)``: ``plan`` re-ordered by at most ``budget`` scored moves (see the module), or
    ``plan`` itself where no move replays faster. ``w``: the masked layer the plan runs; ``max_live``: its
    live-chunk limit; ``room``: the pool bytes it may need (at least its own peak); ``costs``: its
    replay_costs, where the caller has them; ``seconds``: its replayed time, where known."""
    from .replay import replay, replay_costs  # replay imports the planners, which import this

    if budget < 0:
        raise ValueError(f"the order search's budget is a count of replays >= 0, got {budget!r}")
    movable = [op for op in plan.ops if not isinstance(op, Free)]
    frees = [op for op in plan.ops if isinstance(op, Free)]
    if not budget or len(movable) < 2 or not plan.computes or not _delivered(plan):
        return (float("nan") if seconds is None else seconds), plan
    costs = costs or replay_costs(plan, cluster, w, stride)
    dims = workload_dims(w)
    room = max(room or 0, peak_live_bytes(plan, dims))
    best = replay(plan, cluster, w, stride=stride, record=None, costs=costs).time if seconds is None else seconds
    rng = random.Random(SEED)
    kept, replays, tries = plan, 0, 0
    while replays < budget and tries < budget * ATTEMPTS_PER_REPLAY:
        tries += 1
        i, j = rng.randrange(len(movable)), rng.randrange(len(movable))
        if i == j:
            continue
        order = list(movable)
        order.insert(j, order.pop(i))
        cand = replace(plan, ops=_frees_placed(order, frees))
        try:
            validate(cand, max_live=max_live)
        except PlanError:
            continue
        replays += 1
        t = replay(cand, cluster, w, stride=stride, record=None, costs=costs, bound=best).time
        if t < best * (1 - MARGIN) and peak_live_bytes(cand, dims) <= room:
            best, kept, movable = t, cand, order
    return best, (kept if kept is plan else replace(kept, name=plan.name + "+search"))
