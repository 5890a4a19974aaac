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

Since it is, it can run ahead, where the micro-batch is loaded (the launcher's data loader workers):
:func:`found_order` gives a searched plan as its search's :func:`digest` (the base plan, mask, budget and
every other input: :func:`search_inputs`) and the order of its ops, :func:`recording` collects those of a
planning pass (``schedule.orders_ahead``), and :func:`remember` hands them to the process that trains,
whose ``call_plans`` then takes the order
for the plan with that digest (checked valid) instead of searching again; a plan nobody searched
ahead is searched where it is made. Either way the plan is the same; :data:`SEARCHES` counts where.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Optional, Sequence, Tuple

import numpy as np

from ..runtime.memory import peak_live_bytes
from ..runtime.plan import GATHER_KINDS, Compute, Free, Plan, PlanError, Transfer, validate
from ..runtime.mesh import MAX_SEARCH_BUDGET as MAX_BUDGET, search_budget_error as budget_error
from .cluster import workload_dims

__all__ = ["search_order", "searched", "search_inputs", "digest", "found_order", "recording", "remember", "forget", "encode_orders", "remember_encoded", "SEARCHES", "ATTEMPTS_PER_REPLAY", "SEED", "MAX_BUDGET",
           "budget_error"]  # the last two: runtime.mesh's cap on PlanOptions.search, under the search's names

#: tries drawn per replay of the budget at most (most tries break a dependency and cost no replay)
ATTEMPTS_PER_REPLAY = 20
#: the generator's seed: the same on every rank
SEED = 0
#: a move is kept only where it replays faster by more than this share (rounding never decides)
MARGIN = 1e-9


def _frees_placed(ops, frees, dst) -> Tuple:
    """``ops`` (no Free) with each of ``frees`` right after the last op that reads its chunk (a compute on
    it, a gather forwarding it) or, if none does, right after the transfer that delivered it (``dst``: a
    transfer's destination offset)."""
    last = {}
    for k, op in enumerate(ops):
        if isinstance(op, Transfer) and op.kind in GATHER_KINDS:
            last.setdefault((op.kind, dst(op)), k)  # delivered here; a later read moves it on
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


def _searchable(plan: Plan, budget: int) -> bool:
    """Whether :func:`search_order` moves anything: a budget, two ops to move, computes, every chunk delivered, and
    the plan within the ready order's host-cost cap (``ready.MAX_RANK_OPS`` ranks x ops, e.g. Ring 1 x 256)."""
    from .ready import MAX_RANK_OPS

    movable = sum(not isinstance(op, Free) for op in plan.ops)
    return bool(budget and movable >= 2 and plan.computes and _delivered(plan)
                and plan.a * plan.b * len(plan.ops) <= MAX_RANK_OPS)


def search_order(plan: Plan, cluster, w, *, budget: int, stride: int = 1, max_live: Optional[int] = None,
                 room: Optional[int] = None, costs: Optional[tuple] = None,
                 seconds: Optional[float] = None) -> Tuple[float, Plan]:
    """``(seconds, plan)``: ``plan`` re-ordered by at most ``budget`` scored moves (see the module), or
    ``plan`` itself where no move replays faster or the plan is over the ready order's host-cost cap
    (``ready.MAX_RANK_OPS`` ranks x ops, e.g. Ring 1 x 256). ``w``: the masked layer the plan runs; ``max_live``: its
    live-chunk limit; ``room``: the pool bytes it may need (at least its own peak); ``costs``: its
    replay_costs, where the caller has them; ``seconds``: its replayed time, where known."""
    from .replay import replay, replay_costs  # replay imports the planners, which import this

    why = budget_error(budget)
    if why:
        raise ValueError(f"the order search's budget (replays per phase): {why}")
    movable = [op for op in plan.ops if not isinstance(op, Free)]
    frees = [op for op in plan.ops if isinstance(op, Free)]
    if not _searchable(plan, budget):
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
        cand = replace(plan, ops=_frees_placed(order, frees, plan.dst))
        try:
            validate(cand, max_live=max_live)
        except PlanError:
            continue
        replays += 1
        t = replay(cand, cluster, w, stride=stride, record=None, costs=costs, bound=best).time
        if t < best * (1 - MARGIN) and peak_live_bytes(cand, dims) <= room:
            best, kept, movable = t, cand, order
    return best, (kept if kept is plan else replace(kept, name=plan.name + "+search"))


#: where the searches of this process's plans ran: "ahead" (an order remembered from the data loader) or "here"
SEARCHES: Counter = Counter()
#: orders found ahead, by the digest of the plan they re-order (bounded: one micro-batch's phases, a few ahead)
_AHEAD: "OrderedDict[int, Tuple[int, ...]]" = OrderedDict()
_AHEAD_SIZE = 16
_FOUND: list = [None]  # the searches being recorded (recording()): orders_ahead's, not the step's


def search_inputs(cluster, w, stride: int = 1, max_live: Optional[int] = None) -> str:
    """What a search's result depends on besides the plan, its mask and its budget: the cost model (cluster),
    the layer's dims and dtypes (``w`` without its mask), the stride and the live-chunk limit, as one string
    for :func:`digest` -- so an order found for other inputs is a miss (searched again, and counted), never
    taken for a plan it was not scored for."""
    return repr((cluster, replace(w, mask=None), int(stride), max_live))


def digest(plan: Plan, mask=None, budget: int = 0, inputs: str = "") -> int:
    """A 60-bit digest of a search: everything that makes ``plan`` what it is (phase, mesh, ops, slabs, tile),
    the mask it is searched for, the budget and the other inputs (:func:`search_inputs`) -- the same in every
    process (unlike ``hash``, which Python salts per process); it fits an int64 tensor."""
    tile = sorted(plan.tile) if plan.tile is not None else None
    text = repr((plan.phase, plan.a, plan.b, plan.ops, plan.slabs, tile, mask, int(budget), inputs))
    return int(hashlib.sha1(text.encode()).hexdigest()[:15], 16)


def found_order(base: Plan, found: Plan, key: int) -> Tuple[int, Tuple[int, ...]]:
    """``found`` (``base`` searched, its search's :func:`digest` ``key``) as ``(key, the index in base.ops of
    each of its ops)``."""
    at = {op: k for k, op in enumerate(base.ops)}
    order = tuple(at[op] for op in found.ops)
    if len(order) != len(base.ops) or len(set(order)) != len(order):
        raise ValueError("found_order: the plans do not hold the same ops")
    return int(key), order


def recording() -> "_Recording":
    """``with recording() as found:`` the searches :func:`searched` makes inside (or takes from :func:`remember`)
    are appended to ``found`` as :func:`found_order` pairs and not counted as the step's: what
    ``schedule.orders_ahead`` hands from the data loader to the step."""
    return _Recording()


class _Recording:
    def __enter__(self) -> list:
        if _FOUND[0] is not None:
            raise RuntimeError("order search: recording() does not nest")
        _FOUND[0] = []
        return _FOUND[0]

    def __exit__(self, *exc) -> None:
        _FOUND[0] = None


def forget() -> None:
    """Drop every order found ahead (tests)."""
    _AHEAD.clear()


def remember(key: int, order: Sequence[int]) -> None:
    """Keep an order found ahead for the plan with digest ``key`` (the last few kept)."""
    _AHEAD[int(key)] = tuple(int(k) for k in order)
    _AHEAD.move_to_end(key)
    while len(_AHEAD) > _AHEAD_SIZE:
        _AHEAD.popitem(last=False)


def searched(plan: Plan, cluster, w, *, budget: int, stride: int = 1, max_live: Optional[int] = None,
             room: Optional[int] = None) -> Plan:
    """:func:`search_order`'s plan, or the order remembered for ``plan`` (:func:`remember`), which is that
    same plan found ahead: checked valid within ``max_live`` and ``room`` before it is taken."""
    key = digest(plan, w.mask, budget, search_inputs(cluster, w, stride, max_live)) if budget else None
    order = _AHEAD.get(key)  # None without a budget (no key) or where nobody searched ahead
    if order is None:
        found = search_order(plan, cluster, w, budget=budget, stride=stride, max_live=max_live, room=room)[1]
        if _FOUND[0] is not None:  # the search ahead (orders_ahead): recorded, not the step's
            if _searchable(plan, budget):  # a plan it could not move: nothing to hand on (nor to count there)
                _FOUND[0].append(found_order(plan, found, key))
        else:
            SEARCHES["here"] += int(_searchable(plan, budget))  # a plan it could not move: not searched
        return found
    if sorted(order) != list(range(len(plan.ops))):
        raise PlanError(f"the order found ahead for {plan.name} does not re-order its {len(plan.ops)} ops")
    cand = plan if order == tuple(range(len(plan.ops))) else replace(
        plan, ops=tuple(plan.ops[k] for k in order), name=plan.name + "+search")
    validate(cand, max_live=max_live)
    if peak_live_bytes(cand, workload_dims(w)) > max(room or 0, peak_live_bytes(plan, workload_dims(w))):
        raise PlanError(f"the order found ahead for {plan.name} needs a larger buffer pool than its plan may")
    if _FOUND[0] is not None:
        _FOUND[0].append((int(key), tuple(order)))
    else:
        SEARCHES["ahead"] += 1
    return cand


def encode_orders(pairs) -> np.ndarray:
    """``(digest, order)`` pairs (:func:`found_order`) as one int64 array: per pair its digest, its length,
    its order."""
    out = []
    for key, order in pairs:
        out += [int(key), len(order), *order]
    return np.asarray(out, dtype=np.int64)


def remember_encoded(codes) -> int:
    """:func:`remember` every pair of an :func:`encode_orders` array; the number of pairs."""
    codes = [int(x) for x in codes]
    k = count = 0
    while k < len(codes):
        key, length = codes[k], (codes[k + 1] if k + 1 < len(codes) else -1)
        if length < 0 or k + 2 + length > len(codes):
            raise ValueError("a plan order found ahead is cut short: the sample's mesh_plan_orders is damaged")
        remember(key, codes[k + 2:k + 2 + length])
        k, count = k + 2 + length, count + 1
    return count

