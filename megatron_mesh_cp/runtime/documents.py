"""Document masking on Megatron's ordinary zigzag layout: which part of each block a document keeps.

A batch's documents are global offsets ``cu`` (0 = cu[0] < cu[1] < ... < cu[-1] = S), of any
length, over one sequence in the usual CP layout (mesh chunk c = pieces c and 2N-1-c of S/2N
tokens; N = mesh chunks, the super-ranks under ``a2a+mesh``). Query i sees key j iff both lie in
one document (and j <= i when causal). Because a chunk's tokens are in global order, every
document's tokens in a chunk are one contiguous run of rows, so a block (Q chunk i, KV chunk j) is:

* **empty** when no document spans both chunks: not computed, and pruned from the plan
  (:mod:`~megatron_mesh_cp.runtime.prune`) together with every transfer nobody then needs;
* i != j: at most one rectangle per shared document (causal: exactly one document can reach
  from one piece into another, so at most one), no mask -- a dense kernel call on a row range and
  a key range;
* i == j (the rank's own block): one varlen call whose documents are the chunk's runs (square per
  document, causal inside each), or a plain call when one document covers the chunk.

:class:`DocumentMask` describes every block on the host from the offsets alone (made once per
batch); :meth:`DocumentMask.needed` is the set of tile blocks some rank must compute (the pruned
plan keeps exactly those); :meth:`DocumentMask.rank_parts` gives one rank's kernel calls with the
varlen offsets on the device (one small copy per batch, none per call).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from .kernels.base import Varlen
from .topology import MeshShape

__all__ = ["Documents", "documents_of", "SubBlock", "DocumentMask", "documents_from_eod", "check_window"]


@dataclass(frozen=True)
class Documents:
    """One batch's document offsets as host ints (validated by :meth:`check`)."""

    cu: Tuple[int, ...]

    def check(self, total: int) -> None:
        """``ValueError`` naming the fix unless ``cu`` splits a sequence of ``total`` tokens."""
        cu = self.cu
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold documents + 1 offsets, got {list(cu)[:8]}")
        if cu[-1] != total:
            raise ValueError(f"cu_seqlens ends at {cu[-1]} but the sequence has {total} tokens (CP x local); "
                             f"its last offset must be {total}")
        for i in range(len(cu) - 1):
            if cu[i + 1] <= cu[i]:
                raise ValueError(f"cu_seqlens must be strictly increasing; document {i} has length "
                                 f"{cu[i + 1] - cu[i]} (drop empty documents)")

    @property
    def count(self) -> int:
        return len(self.cu) - 1


def documents_of(cu_seqlens) -> Documents:
    """:class:`Documents` from a 1-D int tensor (read to the host once per tensor) or a sequence."""
    from .packed import _host

    return Documents(_host(cu_seqlens, "cu_seqlens"))


def documents_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Megatron's document boundaries of a ``[s]`` token row: a document ends with (and includes)
    each EOD token, as ``GPTDataset``'s ``reset_attention_mask`` masks (``_get_ltor_masks_and_position_ids``);
    returns int32 offsets ``[documents + 1]`` on the tokens' device."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one [s] row, got shape {tuple(tokens.shape)}")
    s = tokens.numel()
    ends = torch.nonzero(tokens[:-1] == eod).flatten() + 1
    edge = torch.tensor([0, s], dtype=ends.dtype, device=tokens.device)
    return torch.cat([edge[:1], ends, edge[1:]]).to(torch.int32)


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
        return sum(_band_pairs(x, y, self.causal, self.window) for x, y in spans)


def _band_pairs(rows: int, keys: int, causal: bool, window) -> int:
    """(row, key) pairs of a rows x keys call with ``key - row`` in the call's band."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    shift = keys - rows  # bottom-right alignment
    r = np.arange(rows)
    lo = np.zeros(rows, dtype=np.int64) if left < 0 else np.maximum(r + shift - left, 0)
    hi = np.full(rows, keys - 1, dtype=np.int64) if right < 0 else np.minimum(r + shift + right, keys - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def check_window(window, causal: bool) -> Optional[Tuple[int, int]]:
    """``window`` as (left, right) ints >= -1 (-1: unbounded), None for none; ``ValueError`` otherwise.
    Causal attention sees no key to the right: ``right`` must be 0 or -1 and becomes 0."""
    if window is None:
        return None
    try:
        left, right = window
        ok = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= -1 for x in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window!r}")
    left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(f"window={window!r} with causal=True: a causal query sees no key to its right; pass "
                             f"window=({left}, 0), or causal=False for keys on both sides")
        right = 0
    if left == -1 and right == -1 or (causal and left == -1):
        return None  # no window beyond what the mask already is
    return left, right


class DocumentMask:
    """The blocks a document mask (and, optionally, a sliding window) leaves on a mesh of ``chunks``
    chunks (see the module docstring). ``docs`` None: one document; ``window``: (left, right) as
    :func:`check_window` returns it -- query i sees key j iff i - left <= j <= i + right."""

    def __init__(self, docs: Optional[Documents], chunks: int, causal: bool, window=None, total: int = None) -> None:
        total = docs.cu[-1] if docs is not None else total
        if total is None or total % (2 * chunks):
            raise ValueError(f"sequence length {total} is not divisible by 2*CP = {2 * chunks}")
        docs = docs if docs is not None else Documents((0, total))
        self.docs, self.n, self.causal = docs, chunks, bool(causal)
        self.window = check_window(window, causal)
        self.m = total // (2 * chunks)
        self._cu = docs.cu
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
                        sub = _band_rectangle(r0, r1, *keys[d], lo, hi, big)
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
        ne = self.nonempty()
        a, b = shape.a, shape.b
        g = np.arange(shape.n)
        r, c = g // a, g % a
        keep = set()
        for qo in range(a):
            qi = r * a + (c - qo) % a
            for ko in range(b):
                kj = ((r - ko) % b) * a + c
                if ne[qi, kj].any():
                    keep.add((qo, ko))
        return frozenset(keep)

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


def _band_rectangle(r0, r1, c0, c1, lo, hi, big):
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
