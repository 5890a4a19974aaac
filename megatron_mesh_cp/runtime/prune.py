"""Pruned plans: the plan that computes only the tile blocks a mask keeps and sends nothing else.

A document mask (documents.py) leaves many blocks of the tile empty on every rank. Rather than
replanning, :func:`prune` derives a plan from the cached full plan in one backward and one forward
pass over its ops: computes keep only the kept blocks; a gathered chunk's transfer stays iff a
kept compute, or a later kept transfer forwarding it, reads it; a reduction transfer stays iff the
partial it carries has content (a kept block feeds its offset, or a kept partial arrived there
first); frees follow their chunks and KV slabs shrink to the runs of offsets still received.
Everything keeps its plan order, so the result is SPMD like its source, passes
:func:`~megatron_mesh_cp.runtime.plan.validate`, and :func:`~megatron_mesh_cp.runtime.plan.plan_traffic`
of it is what every rank sends.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Optional, Set, Tuple

from .plan import GATHER_KINDS, REDUCE_KINDS, Compute, Free, Plan, Transfer, partial_offset

__all__ = ["prune"]


def prune(plan: Plan, keep: AbstractSet[Tuple[int, int]]) -> Plan:
    """The plan computing exactly the blocks of ``plan`` in ``keep`` (tile offsets (q, kv))."""
    tile = frozenset(blk for blk in plan.tile_blocks if blk in keep)
    if tile == plan.tile_blocks:
        return plan
    ops: List[Optional[object]] = []
    for op in plan.ops:
        if isinstance(op, Compute):
            kvs = tuple(kv for kv in op.kvs if (op.q, kv) in tile)
            op = Compute(op.q, kvs) if kvs else None
        ops.append(op)
    # gathers, backwards: a chunk is needed where a kept compute or a kept forward reads it
    needed: Dict[str, Set[int]] = {kind: set() for kind in GATHER_KINDS}
    for q, kv in tile:
        needed["q"].add(q)
        needed["kv"].add(kv)
    received: Dict[str, Set[int]] = {kind: set() for kind in GATHER_KINDS}
    for idx in range(len(ops) - 1, -1, -1):
        op = ops[idx]
        if isinstance(op, Transfer) and op.kind in GATHER_KINDS:
            dst = plan.dst(op)
            if dst in needed[op.kind]:
                needed[op.kind].add(op.src)
                received[op.kind].add(dst)
            else:
                ops[idx] = None
    # reductions, forwards: a partial travels iff something fed its offset or arrived there
    fed = {kind: {partial_offset(kind, q, kv) for q, kv in tile} for kind in REDUCE_KINDS[plan.phase]}
    arrived: Dict[str, Set[int]] = {kind: set() for kind in fed}
    for idx, op in enumerate(ops):
        if isinstance(op, Transfer) and op.kind in fed:
            if op.src in fed[op.kind] or op.src in arrived[op.kind]:
                arrived[op.kind].add(plan.dst(op))
            else:
                ops[idx] = None
        elif isinstance(op, Free) and op.offset not in received[op.kind]:
            ops[idx] = None
    slabs = tuple(run for slab in plan.slabs for run in _runs(slab, received["kv"]))
    return Plan(plan.phase, plan.a, plan.b, tuple(op for op in ops if op is not None), name=f"{plan.name}+pruned",
                meta=plan.meta, slabs=slabs, tile=tile)


def without_slabs(plan: Plan) -> Plan:
    """The same plan with every foreign KV chunk in its own buffer (no slab): for masks whose lower
    blocks can need a KV chunk's second piece, which a slab keeps apart from its first (plan.py)."""
    if not plan.slabs:
        return plan
    return Plan(plan.phase, plan.a, plan.b, plan.ops, name=plan.name, meta=plan.meta, slabs=(), tile=plan.tile)


def _runs(slab: Tuple[int, int], received: Set[int]) -> List[Tuple[int, int]]:
    """The maximal runs of consecutive offsets of ``slab`` that are still received."""
    runs: List[Tuple[int, int]] = []
    for off in range(slab[0], slab[1] + 1):
        if off not in received:
            continue
        if runs and runs[-1][1] == off - 1:
            runs[-1] = (runs[-1][0], off)
        else:
            runs.append((off, off))
    return runs
