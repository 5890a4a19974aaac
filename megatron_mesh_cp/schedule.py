"""Planners: functions that build a :class:`~megatron_mesh_cp.plan.Plan` for a tile shape.

``in_order_plan`` is the straightforward overlapped schedule: gather Q and KV hop by hop around
their rings (one transfer in flight per ring), compute each block as soon as both of its chunks
are present, then compute the remaining rows in the order their partials leave and reduce them
around the ring. It is always valid and is the baseline the greedy planner is measured against.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List

from .plan import BACKWARD, FORWARD, Compute, Op, Plan, Transfer, validate

__all__ = ["in_order_plan", "build_plans"]


@lru_cache(maxsize=None)
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


def build_plans(a: int, b: int, planner: str = "in-order"):
    """(forward plan, backward plan) for a shape with the named planner."""
    if planner != "in-order":
        raise ValueError(f"unknown planner {planner!r}; available: in-order")
    return in_order_plan(a, b, FORWARD), in_order_plan(a, b, BACKWARD)
