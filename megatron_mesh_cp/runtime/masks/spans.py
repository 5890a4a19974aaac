"""The block engine of span masks (documents, windows, chunks) on Megatron's zigzag layout.

Chunk c of N mesh chunks holds pieces c and 2N-1-c of m = S/2N tokens (the super-ranks under
``a2a+mesh``). Query i sees key j iff both lie in one document of the span (and j <= i when causal,
and within the window). Because a chunk's tokens are in global order, every document's tokens in a
chunk are one contiguous run of rows, so a block (Q chunk i, KV chunk j) is:

* **empty** when no document spans both chunks: not computed, and pruned from the plan
  (:mod:`~megatron_mesh_cp.runtime.prune`) together with every transfer nobody then needs;
* i != j: at most one rectangle per shared document (causal: exactly one document can reach
  from one piece into another, so at most one), no mask -- a dense kernel call on a row range and
  a key range;
* i == j (the rank's own block): one varlen call whose documents are the chunk's runs (square per
  document, causal inside each), or a plain call when one document covers the chunk.

With a window a block is described piece pair by piece pair (the two pieces of a chunk lie far apart):
a pair of one piece is one varlen call over the piece's documents with the window; a pair of two
pieces keeps, per shared document, the tight rectangle of the band inside the document's rectangle.

:class:`SpanBlocks` describes every block on the host from the offsets alone (made once per batch);
:meth:`SpanBlocks.needed` is the set of tile blocks some rank must compute (the pruned plan keeps
exactly those); :meth:`SpanBlocks.rank_parts` gives one rank's kernel calls with the varlen offsets
on the device (one small copy per batch, none per call).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from ..kernels.base import Varlen
from ..topology import MeshShape
from .base import Mask, Span, tighter

__all__ = ["SubBlock", "SpanBlocks", "FullBlocks", "needed_blocks", "SpanMask", "Full", "FULL", "Intersection", "intersect", "as_mask",
           "band_pairs", "band_rectangle"]


def band_pairs(rows: int, keys: int, causal: bool, window) -> int:
    """(row, key) pairs of a rows x keys call with ``key - row`` in the call's band (bottom-right aligned)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    shift = keys - rows  # bottom-right alignment
    r = np.arange(rows)
    lo = np.zeros(rows, dtype=np.int64) if left < 0 else np.maximum(r + shift - left, 0)
    hi = np.full(rows, keys - 1, dtype=np.int64) if right < 0 else np.minimum(r + shift + right, keys - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def band_rectangle(r0, r1, c0, c1, lo, hi, big):
    """The tight rows x keys of rectangle [r0, r1) x [c0, c1) within the band lo <= c - r <= hi, and
    its kernel window (bottom-right aligned; None when the band covers it); None when empty."""
    a, b = max(r0, c0 - hi), min(r1, c1 - lo)
    c, e = max(c0, r0 + lo), min(c1, r1 - 1 + hi + 1)
    if a >= b or c >= e:
        return None
    rows, keys = b - a, e - c
    shift = keys - rows
    lo_loc, hi_loc = lo - (c - a), hi - (c - a)
    left = -1 if lo <= -big // 2 or lo_loc <= -(rows - 1) else shift - lo_loc
    right = -1 if hi >= big // 2 or hi_loc >= keys - 1 else hi_loc - shift
    return (a, b), (c, e), None if left == -1 and right == -1 else (left, right)


def needed_blocks(nonempty: np.ndarray, shape: MeshShape) -> FrozenSet[Tuple[int, int]]:
    """Tile blocks (Q offset, KV offset) of ``shape`` with a nonempty block on some rank."""
    a, b = shape.a, shape.b
    g = np.arange(shape.n)
    r, c = g // a, g % a
    keep = set()
    for qo in range(a):
        qi = r * a + (c - qo) % a
        for ko in range(b):
            kj = ((r - ko) % b) * a + c
            if nonempty[qi, kj].any():
                keep.add((qo, ko))
    return frozenset(keep)


class SubBlock(NamedTuple):
    """One kernel call of a block: local Q rows x local KV rows; ``lens``: the documents of a square
    varlen call (q and kv share them), None for a dense call; ``window``: (left, right) keys a query
    sees around the bottom-right diagonal of the call (flash-attn's and TE's ``window_size``; -1 =
    unbounded), None for none beyond ``causal``."""

    rows: slice
    cols: slice
    causal: bool
    lens: Optional[Tuple[int, ...]] = None
    window: Optional[Tuple[int, int]] = None

    @property
    def pairs(self) -> int:
        """Unmasked (query, key) pairs of this call."""
        r, c = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        spans = [(r, c)] if self.lens is None else [(x, x) for x in self.lens]
        if self.window is None:  # squares (causal: triangles) and rectangles
            return sum(x * (x + 1) // 2 if self.causal else x * y for x, y in spans)
        return sum(band_pairs(x, y, self.causal, self.window) for x, y in spans)


class SpanBlocks:
    """The blocks a span mask leaves on a mesh of ``chunks`` chunks (see the module docstring)."""

    pruned = True

    def __init__(self, span: Span, chunks: int, causal: bool) -> None:
        total = span.total
        if total % (2 * chunks):
            raise ValueError(f"sequence length {total} is not divisible by 2*CP = {2 * chunks}")
        self.span, self.n, self.causal = span, chunks, bool(causal)
        self.window = span.window
        self.m = total // (2 * chunks)
        self._cu = span.offsets
        self._blocks: Dict[Tuple[int, int], Tuple[SubBlock, ...]] = {}
        self._nonempty: Optional[np.ndarray] = None

    # --- one block ------------------------------------------------------------------------------
    def _piece_runs(self, start: int) -> List[Tuple[int, int, int]]:
        """(document, first, end) of the piece starting at global ``start``, offsets in the piece."""
        m, cu = self.m, self._cu
        runs, pos = [], start
        while pos < start + m:
            d = bisect_right(cu, pos) - 1
            stop = min(cu[d + 1], start + m)
            runs.append((d, pos - start, stop - start))
            pos = stop
        return runs

    def _runs(self, c: int) -> List[Tuple[int, int, int]]:
        """(document, first local row, end local row) of chunk c's tokens, in local order."""
        m = self.m
        runs: List[Tuple[int, int, int]] = []
        for base, start in ((0, c * m), (m, (2 * self.n - 1 - c) * m)):
            for d, lo, hi in self._piece_runs(start):
                if runs and runs[-1][0] == d and runs[-1][2] == base + lo:  # one document across both pieces
                    runs[-1] = (d, runs[-1][1], base + hi)
                else:
                    runs.append((d, base + lo, base + hi))
        return runs

    def block(self, i: int, j: int) -> Tuple[SubBlock, ...]:
        """The kernel calls of block (Q chunk i, KV chunk j); empty: nothing to compute."""
        key = (i, j)
        hit = self._blocks.get(key)
        if hit is None:
            hit = self._blocks[key] = self._describe(i, j) if self.window is None else self._windowed(i, j)
        return hit

    def _describe(self, i: int, j: int) -> Tuple[SubBlock, ...]:
        m = self.m
        if i == j:  # the own block: every run is square, causal inside when causal
            lens = tuple(hi - lo for _, lo, hi in self._runs(i))
            whole = slice(0, 2 * m)
            return (SubBlock(whole, whole, self.causal, None if len(lens) == 1 else lens),)
        rows, cols = (0, 2 * m), (0, 2 * m)
        if self.causal:  # j < i: every query x the first KV piece; j > i: the second Q piece x every key
            rows, cols = ((0, 2 * m), (0, m)) if j < i else ((m, 2 * m), (0, 2 * m))
        keys = {d: (lo, hi) for d, lo, hi in self._runs(j)}
        out = []
        for d, qlo, qhi in self._runs(i):
            if d not in keys:
                continue
            klo, khi = keys[d]
            r0, r1 = max(qlo, rows[0]), min(qhi, rows[1])
            k0, k1 = max(klo, cols[0]), min(khi, cols[1])
            if r0 < r1 and k0 < k1:
                out.append(SubBlock(slice(r0, r1), slice(k0, k1), False))
        return tuple(out)

    def _windowed(self, i: int, j: int) -> Tuple[SubBlock, ...]:
        """With a window, piece by piece: the distance between the two pieces of a chunk matters."""
        n, m = self.n, self.m
        left, right = self.window
        big = 4 * n * m  # "unbounded"
        out = []
        for qp, rbase in ((i, 0), (2 * n - 1 - i, m)):
            for kp, cbase in ((j, 0), (2 * n - 1 - j, m)):
                delta = (qp - kp) * m  # key - query offset = (c - r) - delta in piece-local rows r, keys c
                lo = delta - left if left >= 0 else -big
                hi = min(delta + right if right >= 0 else big, delta if self.causal else big)
                if qp == kp:  # square per document: one varlen call over the piece's documents
                    lens = tuple(b - a for _, a, b in self._piece_runs(qp * m))
                    win = (left, 0 if self.causal else right)
                    rows = slice(rbase, rbase + m)
                    out.append(SubBlock(rows, slice(cbase, cbase + m), self.causal, None if len(lens) == 1 else lens,
                                        win))
                    continue
                keys = {d: (a, b) for d, a, b in self._piece_runs(kp * m)}
                for d, r0, r1 in self._piece_runs(qp * m):
                    if d in keys:
                        sub = band_rectangle(r0, r1, *keys[d], lo, hi, big)
                        if sub is not None:
                            (a, b), (c, e), win = sub
                            out.append(SubBlock(slice(rbase + a, rbase + b), slice(cbase + c, cbase + e), False,
                                                None, win))
        return tuple(out)

    # --- every block, vectorised ----------------------------------------------------------------
    def nonempty(self) -> np.ndarray:
        """Bool ``[chunks, chunks]``: which blocks (i, j) keep any (query, key) pair."""
        if self._nonempty is not None:
            return self._nonempty
        n, m = self.n, self.m
        cu = np.asarray(self._cu, dtype=np.int64)
        left, right = self.window if self.window is not None else (-1, -1)
        p = np.arange(2 * n)
        reach = cu[np.searchsorted(cu, (p + 1) * m - 1, side="right")]  # end of the document holding a piece's last token
        qp, kp = p[:, None], p[None, :]
        gap = (np.abs(qp - kp) - 1) * m + 1  # the closest (query, key) of two different pieces
        # keys before the queries: the document of the key piece's last token reaches the query piece
        before = (kp < qp) & (reach[None, :] > qp * m) & ((left < 0) | (gap <= left))
        after = (kp > qp) & (reach[:, None] > kp * m) & ((right < 0) | (gap <= right)) & (not self.causal)
        pieces = before | after | (qp == kp)
        c = np.arange(n)
        halves = (c, 2 * n - 1 - c)
        out = np.zeros((n, n), dtype=bool)
        for qh in halves:
            for kh in halves:
                out |= pieces[np.ix_(qh, kh)]
        self._nonempty = out
        return out

    def needed(self, shape: MeshShape) -> FrozenSet[Tuple[int, int]]:
        """Tile blocks (Q offset, KV offset) that some rank of ``shape`` must compute (SPMD: the
        pruned plan computes them everywhere; a rank whose own block is empty runs no kernel)."""
        if shape.n != self.n:
            raise ValueError(f"the mask is for {self.n} mesh chunks, the mesh {shape} has {shape.n}")
        return needed_blocks(self.nonempty(), shape)

    def rank_parts(self, shape: MeshShape, position: int, device) -> Dict[Tuple[int, int], tuple]:
        """Rank ``position``'s kernel calls per tile block (Q offset, KV offset): tuples of
        ``(rows, cols, causal, varlen, window)``, the varlen offsets copied to ``device`` once."""
        out = {}
        for qo in range(shape.a):
            i = shape.q_chunk(position, qo)
            for ko in range(shape.b):
                parts = []
                for s in self.block(i, shape.kv_chunk(position, ko)):
                    vl = None
                    if s.lens is not None:
                        offs = np.concatenate(([0], np.cumsum(s.lens)))
                        vl = Varlen(torch.tensor(offs, dtype=torch.int32, device=device), s.lens, max(s.lens))
                    parts.append((s.rows, s.cols, s.causal, vl, s.window))
                out[(qo, ko)] = tuple(parts)
        return out


class SpanMask(Mask):
    """A mask of documents and a band: it refines a :class:`Span`, composes with the other span
    masks (``a & b``) and binds to the span engine (FullBlocks when it masks nothing)."""

    def refine(self, span: Span, causal: bool) -> Span:
        raise NotImplementedError

    def bind(self, chunks: int, total: int, causal: bool):
        span = self.span(total, causal)
        return FullBlocks(chunks, total, causal) if span.unmasked else SpanBlocks(span, chunks, causal)

    def __and__(self, other: Mask) -> Mask:
        return intersect(self, other)


@dataclass(frozen=True)
class Full(SpanMask):
    """No mask beyond the causal flag."""

    name = "full"
    order = 0

    def refine(self, span: Span, causal: bool) -> Span:
        return span

    def agreement(self) -> dict:
        return {"mask": "full"}


FULL = Full()


class FullBlocks:
    """The engine of an unmasked layer: every block runs its whole zigzag case (DESIGN.md section 3)."""

    pruned = False

    def __init__(self, chunks: int, total: int, causal: bool) -> None:
        self.n, self.total, self.causal = chunks, total, causal

    def needed(self, shape):
        return None  # every block: the full plans as they are

    def rank_parts(self, shape, position: int, device):
        return None  # the executor's unmasked path (prepared calls, grouped computes)


@dataclass(frozen=True)
class Intersection(SpanMask):
    """Several span masks at once: a query sees a key iff every one of them lets it."""

    parts: Tuple[Mask, ...]

    @property
    def name(self) -> str:  # type: ignore[override]
        return " & ".join(p.name for p in self.parts)

    @property
    def per_batch(self) -> bool:  # type: ignore[override]
        return any(p.per_batch for p in self.parts)

    def refine(self, span: Span, causal: bool) -> Span:
        for p in self.parts:
            span = p.refine(span, causal)
        return span

    @property
    def cuts_documents(self) -> bool:  # type: ignore[override]
        return any(p.cuts_documents for p in self.parts)

    @property
    def has_window(self) -> bool:  # type: ignore[override]
        return any(p.has_window for p in self.parts)

    def check(self, total, chunks, causal, batch) -> None:
        for p in self.parts:
            p.check(total, chunks, causal, batch)

    def check_batch(self, batch: int) -> None:
        for p in self.parts:
            p.check_batch(batch)

    def agreement(self) -> dict:
        out: dict = {}
        for p in self.parts:
            out.update(p.agreement())
        return out

    def arranged(self, chunks: int, causal: bool) -> Mask:
        return Intersection(tuple(p.arranged(chunks, causal) for p in self.parts))

    def band(self, causal: bool) -> Optional[Tuple[int, int]]:
        out = None
        for p in self.parts:
            w = p.band(causal)
            if w is not None:
                out = w if out is None else (tighter(out[0], w[0]), tighter(out[1], w[1]))
        return out

    def simplified(self, causal: bool) -> Mask:
        return intersect(*(p.simplified(causal) for p in self.parts))


def intersect(*masks: Optional[Mask]) -> Mask:
    """The mask that lets a query see a key iff every given mask does (None and FULL drop out).
    Span masks apply in their ``order`` (documents first, then what refines them); a mask that is not
    a span (packed documents) stands alone."""
    parts = []
    for m in masks:
        if m is None or isinstance(m, Full):
            continue
        parts.extend(m.parts if isinstance(m, Intersection) else (m,))
    if not parts:
        return FULL
    if len(parts) == 1:
        return parts[0]
    for p in parts:
        if p.span_error:  # not a span: it cannot be intersected
            raise ValueError(p.span_error)
    return Intersection(tuple(sorted(parts, key=lambda p: p.order)))


def as_mask(mask) -> Mask:
    """``mask`` as a :class:`Mask` (None: :data:`FULL`); ``ValueError`` for anything else."""
    if mask is None:
        return FULL
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be a megatron_mesh_cp mask (Documents, Window, Chunked, ... or their '&'), "
                         f"got {type(mask).__name__}")
    return mask
