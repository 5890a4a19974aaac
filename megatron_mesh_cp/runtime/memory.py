"""Buffers laid out by the plan's liveness: what one rank's pool holds for one layer shape.

A plan says when every buffer the executor needs comes to life and when it dies: a gathered chunk
lives from the transfer that receives it to the ``Free`` that drops it; a partial accumulator from
the first block that feeds it to the transfer that sends it; a received partial until it is folded
(the transfer that forwards its offset, or the end of the run); a KV slab (plan.py) from the first
chunk it receives to the ``Free`` of its last one. :func:`buffer_lives` lists them;
:func:`layout` places each tensor at a byte offset of one arena, reusing the bytes of tensors that
died before it is born, as a register allocator reuses registers. The arena's size is the pool's
footprint; ``Layout.peak`` (:func:`peak_live_bytes`) is the largest sum of live bytes at any op,
the floor any placement needs (first fit reaches it on every plan tried). Offsets are aligned to
:data:`ALIGN` bytes (sizes are rounded up to it in both).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, NamedTuple, Tuple

import numpy as np

from .plan import BACKWARD, FORWARD, GATHER_KINDS, REDUCE_KINDS, ChunkDims, Compute, Free, Plan, TensorSpec, Transfer
from .plan import partial_offset, payload

__all__ = ["ALIGN", "Life", "Layout", "buffer_lives", "layout", "peak_live_bytes", "slab_specs"]

#: Every pool tensor starts at a multiple of this many bytes (what CUDA kernels' vector loads want).
ALIGN = 256


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Life(NamedTuple):
    """One pool tensor: its role (the executor's key), spec, and the ops it is live at (inclusive)."""

    role: tuple
    spec: TensorSpec
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return _aligned(self.spec.nbytes)


class Layout(NamedTuple):
    """Byte offset of every role in one arena of ``nbytes``."""

    offsets: Dict[tuple, int]
    specs: Dict[tuple, TensorSpec]
    nbytes: int
    peak: int


def _acc_specs(phase: str, kind: str, dims: ChunkDims) -> List[TensorSpec]:
    return [TensorSpec(s.category, s.shape, dims.acc_dtype) for s in payload(phase, kind, dims)]


def slab_specs(slab: Tuple[int, int], dims: ChunkDims) -> List[TensorSpec]:
    """The K and V tensors of a KV slab: the chunks of offsets lo..hi, sequence-major, piece-major
    (layout.slab_piece), the same bytes as that many received chunks."""
    chunks = slab[1] - slab[0] + 1
    return [TensorSpec(s.category, (chunks * s.shape[0],) + tuple(s.shape[1:]), s.dtype)
            for s in payload(FORWARD, "kv", dims)]


def buffer_lives(plan: Plan, dims: ChunkDims) -> List[Life]:
    """Every tensor the executor takes from the pool when it runs ``plan`` on chunks of ``dims``.

    Roles: ``("recv", kind, offset, i)`` gathered chunks, ``("slab", "kv", lo, i)`` the K (i = 0) and
    V (i = 1) slab of the plan's slab starting at offset lo, ``("stand_in", offset)`` the backward's
    stand-in for a foreign chunk's output, ``("acc", kind, offset, i)`` partial accumulators,
    ``("in", kind, offset, direction, i)`` received partials, ``("scratch", dim)`` merge scratch.
    A tensor alive "to the end" ends at ``len(plan.ops)`` (the executor's ``finish``).
    """
    end = len(plan.ops)
    fwd = plan.phase == FORWARD
    born: Dict[tuple, Tuple[int, TensorSpec]] = {}
    lives: List[Life] = []

    def birth(role, spec, i):
        born[role] = (i, spec)

    def death(prefix, i):
        for role in [r for r in born if r[: len(prefix)] == prefix]:
            start, spec = born.pop(role)
            lives.append(Life(role, spec, start, i))

    slab_left = {sl: sl[1] - sl[0] + 1 for sl in plan.slabs}
    for i, op in enumerate(plan.ops):
        if isinstance(op, Transfer):
            dst = plan.dst(op)
            slab = plan.slab_of(dst) if op.kind == "kv" else None
            if slab is not None:
                if ("slab", "kv", slab[0], 0) not in born:
                    for j, spec in enumerate(slab_specs(slab, dims)):
                        birth(("slab", "kv", slab[0], j), spec, i)
            elif op.kind in GATHER_KINDS:
                for j, spec in enumerate(payload(plan.phase, op.kind, dims)):
                    birth(("recv", op.kind, dst, j), spec, i)
            else:
                if ("acc", op.kind, op.src, 0) not in born:  # a pruned plan's relay: no block fed it here
                    for j, spec in enumerate(_acc_specs(plan.phase, op.kind, dims)):
                        birth(("acc", op.kind, op.src, j), spec, i)
                death(("acc", op.kind, op.src), i)
                death(("in", op.kind, op.src), i)
                for j, spec in enumerate(payload(plan.phase, op.kind, dims)):
                    birth(("in", op.kind, dst, op.direction, j), spec, i)
        elif isinstance(op, Compute):
            for q_off, kv_off in op.blocks:
                for kind in REDUCE_KINDS[plan.phase]:
                    off = partial_offset(kind, q_off, kv_off)
                    if ("acc", kind, off, 0) not in born:
                        for j, spec in enumerate(_acc_specs(plan.phase, kind, dims)):
                            birth(("acc", kind, off, j), spec, i)
            if not fwd and op.q and ("stand_in", op.q) not in born:
                birth(("stand_in", op.q), TensorSpec("", (dims.seq, dims.batch, dims.heads, dims.dv), dims.dtype), i)
        elif isinstance(op, Free):
            slab = plan.slab_of(op.offset) if op.kind == "kv" else None
            if slab is not None:
                slab_left[slab] -= 1
                if not slab_left[slab]:
                    death(("slab", "kv", slab[0]), i)
            death(("recv", op.kind, op.offset), i)
            if op.kind == "q":
                death(("stand_in", op.offset), i)
    if fwd:  # merges of the output partials: one scratch per rank of tensor, for the whole run
        b, s, h = dims[:3]
        for dim, shape in ((4, (s, b, h, dims.dv)), (3, (s, b, h))):
            lives.append(Life(("scratch", dim), TensorSpec("", shape, dims.acc_dtype), 0, end))
    lives += [Life(role, spec, start, end) for role, (start, spec) in born.items()]
    return lives


def _peak(lives: List[Life], n_ops: int) -> int:
    delta = [0] * (n_ops + 2)
    for x in lives:
        delta[x.start] += x.nbytes
        delta[x.end + 1] -= x.nbytes
    peak = cur = 0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return peak


#: placement orders tried in turn (the first reaching the live-bytes floor wins): largest first
#: reaches it on 365 of 372 greedy plans (n <= 64, fp32 and bf16), one of these on all of them
_ORDERS = (
    lambda x: (-x.nbytes, x.start, x.role),
    lambda x: (x.start, -x.nbytes, x.role),
    lambda x: (-x.nbytes, x.start - x.end, x.start, x.role),
    lambda x: (-x.nbytes * (x.end - x.start + 1), x.start, x.role),
    lambda x: (x.start - x.end, -x.nbytes, x.start, x.role),
)


def _first_fit(order: List[Life]) -> Tuple[Dict[tuple, int], int]:
    """Place each tensor at the lowest offset whose bytes are free for its whole life."""
    k = len(order)
    off, size, start, end = (np.zeros(k, dtype=np.int64) for _ in range(4))
    offsets: Dict[tuple, int] = {}
    for n, x in enumerate(order):
        live = (end[:n] >= x.start) & (start[:n] <= x.end)  # placed tensors whose lives overlap
        lo, hi = off[:n][live], off[:n][live] + size[:n][live]
        pos = 0
        if lo.size:
            by = np.argsort(lo, kind="stable")
            lo, hi = lo[by], hi[by]
            before = np.concatenate(([0], np.maximum.accumulate(hi)))  # highest end below each one
            fits = np.nonzero(lo - before[:-1] >= x.nbytes)[0]
            pos = int(before[fits[0]]) if fits.size else int(before[-1])
        off[n], size[n], start[n], end[n] = pos, x.nbytes, x.start, x.end
        offsets[x.role] = pos
    return offsets, int((off + size).max()) if k else 0


@lru_cache(maxsize=256)
def layout(plan: Plan, dims: ChunkDims) -> Layout:
    """Place every pool tensor of ``plan`` in one arena, reusing bytes of dead tensors (first fit,
    trying a few placement orders until one reaches the live-bytes floor; else the smallest)."""
    lives = buffer_lives(plan, dims)
    peak = _peak(lives, len(plan.ops))
    best = None
    for key in _ORDERS:
        offsets, top = _first_fit(sorted(lives, key=key))
        if best is None or top < best[1]:
            best = (offsets, top)
        if top == peak:
            break
    return Layout(best[0], {x.role: x.spec for x in lives}, best[1], peak)


def peak_live_bytes(plan: Plan, dims: ChunkDims) -> int:
    """The most bytes one rank's buffer pool holds at once while it runs ``plan`` on chunks of
    ``dims``: received chunks, backward output stand-ins, partial accumulators, received partials
    and merge scratch, each live from the op that creates it to the op that frees, sends or folds
    it (this module). A pure function of the plan; the executor's pool holds exactly this for one
    layer shape and phase (the larger of the two phases once both ran). Not counted: the rank's
    own q, k, v (and out, dout in backward), the results, and kernel workspaces.
    """
    return layout(plan, dims).nbytes  # the arena: equal to the live-bytes floor on every plan tried
