"""Document order that balances the zigzag layout's attention work across CP chunks.

Under document masking the documents of a packed sequence are independent (each attends only to
itself, positions restart per document), so their order is free. Megatron's zigzag layout gives
chunk c the sequence pieces c and 2n-1-c, which balances one causal sequence but not documents: a
piece holding the tail of a long document attends to all of it, one holding document starts to
little, and the busiest chunk does about twice the mean work (docs/packing.md). :func:`balance_order`
searches for an order of the documents whose zigzag chunks carry near-equal work (a seeded local
search, the same on every rank); :func:`token_order` is the token permutation that applies it.
The busiest single piece bounds what any order can reach.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["chunk_work", "balance_order", "token_order", "balance_documents"]


def _prefix_work(lengths: np.ndarray, causal: bool) -> Tuple[np.ndarray, np.ndarray]:
    cu = np.concatenate([[0.0], np.cumsum(lengths)])
    whole = lengths * (lengths + 1) / 2 if causal else lengths * lengths
    return cu, np.concatenate([[0.0], np.cumsum(whole)])


def _piece_work(lengths: np.ndarray, chunks: int, causal: bool) -> np.ndarray:
    """Attention pairs of each of the 2*chunks equal pieces (query rows in the piece)."""
    cu, acc = _prefix_work(lengths, causal)
    total = cu[-1]
    bounds = np.arange(2 * chunks + 1) * (total / (2 * chunks))
    d = np.minimum(np.searchsorted(cu, bounds, side="right") - 1, len(lengths) - 1)
    k = bounds - cu[d]
    f = acc[d] + (k * (k + 1) / 2 if causal else k * lengths[d])
    return np.diff(f)


def chunk_work(lengths: Sequence[int], chunks: int, causal: bool = True) -> np.ndarray:
    """Attention pairs each of ``chunks`` zigzag chunks computes for documents of ``lengths`` back to
    back (chunk c: pieces c and 2*chunks-1-c)."""
    pw = _piece_work(_check(lengths, chunks).astype(np.float64), chunks, causal)
    return pw[:chunks] + pw[::-1][:chunks]


def _check(lengths: Sequence[int], chunks: int = 0) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.int64)
    if x.ndim != 1 or len(x) == 0 or (x < 1).any():
        raise ValueError("documents need positive lengths")
    if chunks and int(x.sum()) % (2 * chunks) or chunks < 0:
        raise ValueError(f"the documents span {int(x.sum())} tokens, not a multiple of 2*{chunks}: the zigzag "
                         "layout splits the sequence into 2 pieces per CP chunk")
    return x


def balance_order(lengths: Sequence[int], chunks: int, *, causal: bool = True, iters: int = 4096,
                  patience: int = 1024, seed: int = 0, regions: Optional[Sequence[int]] = None,
                  fixed: Optional[Sequence[float]] = None, batch: int = 32) -> Tuple[int, ...]:
    """An order of the documents (indices into ``lengths``) whose zigzag chunks carry near-equal work:
    a local search (swap two documents or move one, half the time one touching the busiest chunk)
    that keeps a move when it lowers the busiest chunk's work (ties: the sum of squares). Each round
    scores ``batch`` random moves at once (one vectorised evaluation: host time per micro-batch is
    the budget) and keeps the best of them if it improves; at most ``iters`` moves, stopping after
    ``patience`` that did not lower the busiest chunk's work. Seeded and deterministic: every rank computes the same order
    from the same lengths. Never worse than the given order, which it starts from.

    ``regions`` (a layout's, runtime/layouts.py): the documents are laid back to back over 2 *
    ``chunks`` regions of these sizes (region p belongs to chunk min(p, 2*chunks-1-p), as zigzag
    pieces do) instead of equal pieces; ``fixed``: work each chunk carries besides them."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    x = (_check(lengths, chunks) if regions is None else _check(lengths)).astype(np.float64)
    m = len(x)
    order = np.arange(m)
    if m < 2 or chunks < 2:
        return tuple(int(i) for i in order)
    if regions is None:
        piece = x.sum() / (2 * chunks)
        bounds = np.arange(2 * chunks + 1) * piece
    else:
        if len(regions) != 2 * chunks or sum(regions) != x.sum():
            raise ValueError(f"regions must be 2*chunks sizes summing to the documents' {int(x.sum())} tokens")
        bounds = np.concatenate(([0.0], np.cumsum(np.asarray(regions, dtype=np.float64))))
    extra = None if fixed is None else np.asarray(fixed, dtype=np.float64)
    whole = x * (x + 1) / 2 if causal else x * x
    nb = len(bounds)

    def score(orders: np.ndarray):
        """Busiest chunk work, sum of squares, busiest chunk and prefix lengths of each order [B, m]."""
        rows = len(orders)
        lens = x[orders]
        cu = np.zeros((rows, m + 1))
        np.cumsum(lens, axis=1, out=cu[:, 1:])
        acc = np.zeros((rows, m + 1))
        np.cumsum(whole[orders], axis=1, out=acc[:, 1:])
        # d[r, p]: the document holding bound p (the last prefix <= it), counted from the prefixes' side
        first = np.searchsorted(bounds, cu, side="left") + (np.arange(rows) * nb)[:, None]
        d = np.cumsum(np.bincount(first.ravel(), minlength=rows * nb)[:rows * nb].reshape(rows, nb), axis=1)
        d = np.minimum(d - 1, m - 1)
        k = bounds[None, :] - np.take_along_axis(cu, d, axis=1)
        at = np.take_along_axis(acc, d, axis=1) + (k * (k + 1) / 2 if causal else k * np.take_along_axis(lens, d, 1))
        pw = np.diff(at, axis=1)
        w = pw[:, :chunks] + pw[:, ::-1][:, :chunks]
        if extra is not None:
            w = w + extra
        return w.max(axis=1), np.einsum("ij,ij->i", w, w), np.argmax(w, axis=1), cu

    mx, sq, top, cus = score(order[None, :])
    best, best_sq, busiest, cu = float(mx[0]), float(sq[0]), int(top[0]), cus[0]
    rng = np.random.default_rng(seed)
    lanes = np.arange(batch)[:, None]
    cols = np.arange(m)[None, :]
    stale = tried = 0
    while tried < iters and stale < patience:
        lo, hi = bounds[busiest], bounds[busiest + 1]
        lo2, hi2 = bounds[2 * chunks - 1 - busiest], bounds[2 * chunks - busiest]
        touch = np.flatnonzero(((cu[:-1] < hi) & (cu[1:] > lo)) | ((cu[:-1] < hi2) & (cu[1:] > lo2)))
        i = np.where(rng.random(batch) < 0.5, touch[rng.integers(len(touch), size=batch)], rng.integers(m, size=batch))
        j = rng.integers(m, size=batch)
        swap = rng.random(batch) < 0.5
        # a move of i to j: positions between them shift by one towards i, position j takes i
        ahead = ((cols >= i[:, None]) & (cols < j[:, None])).astype(np.int64)
        behind = ((cols > j[:, None]) & (cols <= i[:, None])).astype(np.int64)
        src = cols + np.where(i[:, None] < j[:, None], ahead, -behind)
        src[lanes[:, 0], j] = i
        swapped = np.broadcast_to(cols, (batch, m)).copy()
        swapped[lanes[:, 0], i], swapped[lanes[:, 0], j] = j, i
        src = np.where(swap[:, None], swapped, src)
        keep = i != j
        cand = order[src[keep]]
        tried += batch
        if not len(cand):
            continue
        mx, sq, top, cus = score(cand)
        pick = int(np.lexsort((sq, mx))[0])
        if (float(mx[pick]), float(sq[pick])) < (best, best_sq):
            stale = 0 if float(mx[pick]) < best else stale + batch  # only a lower busiest chunk resets patience
            order, best, best_sq, busiest, cu = cand[pick], float(mx[pick]), float(sq[pick]), int(top[pick]), cus[pick]
        else:
            stale += batch
    return tuple(int(i) for i in order)


def token_order(lengths: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """Token permutation applying a document ``order``: position p of the reordered sequence holds
    token ``idx[p]`` of the original (int64 [total])."""
    x = _check(lengths)
    o = np.asarray(order, dtype=np.int64)
    if sorted(o.tolist()) != list(range(len(x))):
        raise ValueError(f"order must be a permutation of the {len(x)} documents")
    starts = np.concatenate([[0], np.cumsum(x)])[:-1]
    lens = x[o]
    first = np.repeat(starts[o], lens)
    within = np.arange(int(lens.sum())) - np.repeat(np.concatenate([[0], np.cumsum(lens)])[:-1], lens)
    return first + within


def balance_documents(cu, chunks: int, causal: bool = True):
    """A micro-batch's documents (global offsets ``cu``, a tensor) reordered by :func:`balance_order`
    for ``chunks`` zigzag chunks: ``(new offsets, token index)`` to apply with
    ``x.index_select(seq_dim, index)``, or ``(cu, None)`` when the given order is kept."""
    import torch

    lengths = (cu[1:] - cu[:-1]).tolist()
    order = balance_order(lengths, chunks, causal=causal)
    if list(order) == list(range(len(lengths))):
        return cu, None
    new = torch.tensor([0] + np.cumsum([lengths[i] for i in order]).tolist(), dtype=cu.dtype, device=cu.device)
    return new, torch.from_numpy(token_order(lengths, order)).to(cu.device)
