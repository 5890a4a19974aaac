"""A plan's ops worked out once per plan, rank and chunk length: the executor's prepared steps.

What an op does on one rank -- a transfer's destination offset, the pool roles it receives into,
whether a KV chunk travels whole or as pieces and where they land in a slab; a compute's kernel
calls, their query rows and keys, and where each call's dK/dV rows go -- depends on the plan, the
rank's mesh position, the causal flag and the chunk length, never on the tensors.
:func:`prepared` works it out once and caches it by the plan's identity (plans are immutable; an
entry holds its plan, so an id is never reused while cached). Masked blocks (documents, windows,
packed THD) change with every batch: their calls come from the mask's per-rank parts
(masks/: ``rank_parts``) through :func:`compute_calls` per call. A range covering the whole chunk is
``None``, so the executor takes no view for it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .layout import BlockSlices, Slab, block_case, kernel_calls, slab_piece
from .plan import GATHER_KINDS, ChunkDims, Compute, Plan, Transfer, payload
from .topology import MeshShape

__all__ = ["Part", "Call", "Move", "Prepared", "compute_calls", "prepared"]

Rows = Optional[slice]  # None: every row


class Part(NamedTuple):
    """One kernel call: the Q chunk's ``rows``, the ``cols`` of the call's k / v, its mask, and
    ``grads``: (KV offset, rows of that offset's dK/dV partial, rows of the call's dk) per target."""

    rows: Rows
    cols: Rows
    causal: bool
    varlen: object
    window: Optional[Tuple[int, int]]
    grads: Tuple[Tuple[int, Rows, Rows], ...]


class Call(NamedTuple):
    """Kernel calls over one set of keys: the KV offsets they read (waited for) and where the keys
    lie (``slab`` None: offset ``kvs[0]``'s own buffer; else rows ``keys`` of the slab's K and V)."""

    kvs: Tuple[int, ...]
    slab: Optional[Slab]
    keys: Rows
    parts: Tuple[Part, ...]


def _whole(sl: slice, seq: int) -> Rows:
    return None if (sl.start or 0) == 0 and sl.stop == seq else sl


def compute_calls(op: Compute, shape: MeshShape, position: int, causal: bool, seq: int,
                  slab_of: Callable[[int], Optional[Slab]], parts=None) -> Tuple[Call, ...]:
    """The kernel calls of ``op`` on the rank at ``position`` (chunks of ``seq`` rows): one per
    contiguous run of keys per case (layout.kernel_calls); masked (``parts``: (q, kv) offsets ->
    the rank's calls, a mask engine's ``rank_parts``) one per block, each as its sub-block calls,
    none for an empty block."""
    i = shape.q_chunk(position, op.q)
    split = shape.coords(position)[0] if causal else 0  # foreign KV offsets <= the rank's row: lower blocks
    cases = {ko: block_case(i, shape.kv_chunk(position, ko), causal) for ko in op.kvs}
    masked = parts is not None
    if not masked:
        kcalls = kernel_calls(op.kvs, cases, slab_of, split)
    else:
        kvs = [ko for ko in op.kvs if parts[(op.q, ko)]]
        kcalls = [c for ko in kvs for c in kernel_calls((ko,), cases, slab_of, split)]
    m = seq // 2
    out = []
    for call in kcalls:
        keys = None if call.slab is None else slice(call.start * m, (call.start + len(call.pieces)) * m)
        if masked:  # one block: its cols are its chunk's rows (in a slab, k starts at the chunk's first piece)
            ko = call.kvs[0]
            block = tuple(Part(rows, cols, c, vl, w, ((ko, cols, None),)) for rows, cols, c, vl, w in parts[(op.q, ko)])
        else:
            sl = BlockSlices.of(call.case, seq)
            if call.slab is None:
                cols = _whole(sl.kv_cols, seq)
                grads = ((call.kvs[0], cols, None),)
            else:  # the keys are the call's pieces side by side: each piece's gradient into its chunk's partial
                cols = None
                grads = tuple((ko, slice(p * m, (p + 1) * m), slice(at * m, (at + 1) * m))
                              for at, (ko, p) in enumerate(call.pieces))
            block = (Part(_whole(sl.q_rows, seq), cols, sl.causal, None, None, grads),)
        out.append(Call(call.kvs, call.slab, keys, block))
    return tuple(out)


class Move(NamedTuple):
    """One transfer on one rank: the offset it delivers (``dst``), the pool roles it receives into,
    the byte category of each tensor on the wire, and for a KV chunk whether it travels whole (as
    k, v: neither side keeps it in a slab) and, landing in a slab, the rows of its two pieces."""

    dst: int
    roles: Tuple[tuple, ...]
    categories: Tuple[str, ...]
    whole: bool
    at: Optional[Tuple[int, int]]


class Prepared(NamedTuple):
    """A plan on one rank: every transfer's :class:`Move`; every compute's calls (unmasked plans)."""

    moves: Dict[Transfer, Move]
    calls: Dict[Compute, Tuple[Call, ...]]


#: payload() needs sizes only for the tensors' shapes; the count and categories do not depend on them
_ANY = ChunkDims(1, 2, 1, 1, 1, torch.float32)


def _move(plan: Plan, op: Transfer, split: int, seq: int) -> Move:
    dst = plan.dst(op)
    cats = tuple(s.category for s in payload(plan.phase, op.kind, _ANY))
    if op.kind not in GATHER_KINDS:  # a partial: an offset receives at most one per direction
        return Move(dst, tuple(("in", op.kind, dst, op.direction, i) for i in range(len(cats))), cats, False, None)
    roles = tuple(("recv", op.kind, dst, i) for i in range(len(cats)))
    if op.kind == "q":
        return Move(dst, roles, cats, False, None)
    slab = plan.slab_of(dst)
    if slab is None and plan.slab_of(op.src) is None:  # a fact of the plan, so the same on every rank
        return Move(dst, roles, cats, True, None)
    cats = tuple(c for c in cats for _ in range(2))  # the wire carries pieces: each lands where the rank keeps it
    if slab is None:
        return Move(dst, roles, cats, False, None)
    m = seq // 2
    at = tuple(slab_piece(slab, dst, p, split) * m for p in (0, 1))
    return Move(dst, tuple(("slab", "kv", slab[0], i) for i in range(len(roles))), cats, False, at)


_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 256


def prepared(plan: Plan, position: int, causal: bool, seq: int, masked: bool = False) -> Prepared:
    """``plan``'s ops on the rank at ``position`` with chunks of ``seq`` rows, made once per (plan,
    position, causal, seq, masked) and kept (the last 256); ``masked``: no calls (made per batch)."""
    key = (id(plan), position, causal, seq, masked)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is plan:
        _CACHE.move_to_end(key)
        return hit[1]
    shape = MeshShape(plan.a, plan.b)
    split = shape.coords(position)[0] if causal else 0
    moves = {op: _move(plan, op, split, seq) for op in plan.ops if isinstance(op, Transfer)}
    calls = {} if masked else {op: compute_calls(op, shape, position, causal, seq, plan.slab_of)
                               for op in plan.ops if isinstance(op, Compute)}
    out = _CACHE[key] = (plan, Prepared(moves, calls))
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return out[1]
