"""Sliding windows in the cost model: every block's kernel calls as the runtime's windowed mask makes them.

``mesh_attention(..., window=(left, right))`` (runtime/masks/spans.py, ``SpanBlocks._windowed``)
describes a block piece pair by piece pair, since the two pieces of a chunk lie far apart: a pair of
one piece is one call over the piece's documents with the window (square per document); a pair of
two pieces keeps, per shared document, the tight rectangle of the band inside the document's
rectangle, one dense call. :func:`window_block_calls` lists those calls for every block at once with
numpy (rows, keys and exact pairs of each, tested call for call against ``SpanBlocks.block``), and
the documents' pricing (``documents.span_block_times``) prices them (each call its kernel and fixed
costs; an empty block 0). A window alone is one document over the whole sequence with a window.
:func:`row_pairs` and :func:`sequence_pairs` count what one call over the whole sequence (Ulysses)
or over a rank's rows (all-gather) computes under the window.
"""

from __future__ import annotations

from functools import lru_cache
import numpy as np

from ..runtime.masks import Span
from .documents import BlockCalls, block_calls

__all__ = ["band_pairs", "window_block_calls", "row_pairs", "sequence_pairs"]


def band_pairs(rows, keys, lo, hi):
    """(r, c) pairs of a rows x keys rectangle with ``lo <= c - r <= hi`` (int64 arrays broadcast)."""
    rows, keys = np.asarray(rows, dtype=np.int64), np.asarray(keys, dtype=np.int64)
    lo, hi = np.maximum(lo, -rows), np.minimum(hi, keys)  # c - r lies in [-(rows - 1), keys - 1]
    return np.maximum(_below(rows, keys, hi) - _below(rows, keys, lo - 1), 0)


def _below(rows, keys, t):
    """#{(r, c) in [0, rows) x [0, keys): c - r <= t} = sum over r of clip(r + t + 1, 0, keys)."""
    return _ramp(t + 1 + rows, keys) - _ramp(t + 1, keys)


def _ramp(x, keys):
    """sum_{v < x} clip(v, 0, keys): 0 for x <= 0."""
    x = np.maximum(x, 0)
    low = np.minimum(x, keys + 1)
    return low * (low - 1) // 2 + np.maximum(x - keys - 1, 0) * keys


def _square_band(left: int, right: int, causal: bool, size):
    """(lo, hi) of c - r on a square call (bottom-right = the diagonal) with the window."""
    big = np.asarray(size, dtype=np.int64)
    return (-big if left < 0 else -left), (0 if causal else (big if right < 0 else right))


def window_block_calls(span: Span, n: int, causal: bool) -> BlockCalls:
    """Every kernel call of every block of a windowed span on ``n`` mesh chunks (read-only, cached)."""
    if span.window is None:
        raise ValueError("window_block_calls prices a sliding window; the span has none")
    return _calls(span, n, bool(causal))


@lru_cache(maxsize=64)
def _calls(span: Span, n: int, causal: bool) -> BlockCalls:
    left, right = span.window
    cu = np.array(span.offsets, dtype=np.int64)
    total = int(cu[-1])
    if total % (2 * n):
        raise ValueError(f"the sequence spans {total} tokens, not a multiple of 2*CP = {2 * n}")
    m, big = total // (2 * n), 4 * total + 4
    # segments: one document inside one piece, in global order (a document's are consecutive pieces)
    bounds = np.union1d(cu, np.arange(0, total + 1, m, dtype=np.int64))
    start, seg = bounds[:-1], np.diff(bounds)
    piece = start // m
    doc = np.searchsorted(cu, start, side="right") - 1
    s0 = start - piece * m
    chunk = np.where(piece < n, piece, 2 * n - 1 - piece)
    # one piece against itself: one call over the piece's documents (rows = keys = m)
    lo, hi = _square_band(left, right, causal, seg)
    own = np.zeros(2 * n, dtype=np.int64)
    np.add.at(own, piece, band_pairs(seg, seg, lo, hi))
    p = np.arange(2 * n)
    pc = np.where(p < n, p, 2 * n - 1 - p)
    full = np.full(2 * n, m, dtype=np.int64)
    parts = [(pc, pc, full, full, own)]
    # two pieces d apart: the segment pairs of one document whose closest pair, (d-1)m + 1 apart, is in the window
    reach = lambda side: 2 * n - 1 if side < 0 else min(2 * n - 1, (side - 1) // m + 1) if side > 0 else 0  # noqa: E731
    idx = np.arange(len(seg))
    qs, ks = [], []
    for d in list(range(1, reach(left) + 1)) + ([] if causal else [-x for x in range(1, reach(right) + 1)]):
        k = idx - d
        ok = (k >= 0) & (k < len(seg))
        ok[ok] &= doc[k[ok]] == doc[ok]
        qs.append(idx[ok])
        ks.append(k[ok])
    if qs:
        q, k = np.concatenate(qs), np.concatenate(ks)
        delta = (piece[q] - piece[k]) * m  # key - query = (c - r) - delta in piece-local rows r, keys c
        lo = delta - left if left >= 0 else np.full_like(delta, -big)
        hi = np.minimum(delta + right if right >= 0 else big, delta if causal else big) + 0 * delta
        r0, r1, c0, c1 = s0[q], s0[q] + seg[q], s0[k], s0[k] + seg[k]
        a, b = np.maximum(r0, c0 - hi), np.minimum(r1, c1 - lo)  # the band's tight rectangle (_band_rectangle)
        c, e = np.maximum(c0, r0 + lo), np.minimum(c1, r1 - 1 + hi + 1)
        keep = (a < b) & (c < e)
        a, b, c, e, lo, hi = (x[keep] for x in (a, b, c, e, lo, hi))
        rows, keys = b - a, e - c
        parts.append((chunk[q[keep]], chunk[k[keep]], rows, keys, band_pairs(rows, keys, lo - (c - a), hi - (c - a))))
    out = BlockCalls(*(np.ascontiguousarray(np.concatenate(col), dtype=np.int64) for col in zip(*parts)))
    for arr in out:
        arr.setflags(write=False)
    return out


def row_pairs(span: Span, n: int, causal: bool) -> np.ndarray:
    """Per rank of ``n`` (zigzag pieces g and 2n-1-g), the pairs its rows compute against the whole
    sequence under the mask: what an all-gather rank runs."""
    calls = block_calls(span, n, causal) if span.window is None else window_block_calls(span, n, causal)
    return np.bincount(calls.i, weights=calls.work, minlength=n)


def sequence_pairs(span: Span, causal: bool) -> int:
    """Pairs of one call over the whole sequence (each document's square, causal and windowed)."""
    x = np.diff(np.array(span.offsets, dtype=np.int64))
    left, right = (-1, -1) if span.window is None else span.window
    lo, hi = _square_band(left, right, causal, x)
    return int(band_pairs(x, x, lo, hi).sum())
