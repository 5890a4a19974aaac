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


def balance_order(lengths: Sequence[int], chunks: int, *, causal: bool = True, iters: int = 2000,
                  patience: int = 400, seed: int = 0, regions: Optional[Sequence[int]] = None,
                  fixed: Optional[Sequence[float]] = None) -> Tuple[int, ...]:
    """An order of the documents (indices into ``lengths``) whose zigzag chunks carry near-equal work:
    a local search (swap two documents or move one, half the time one touching the busiest chunk)
    that keeps a move when it lowers the busiest chunk's work (ties: the sum of squares). Seeded and
    deterministic: every rank computes the same order from the same lengths. Never worse than the
    given order, which it starts from.

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

    def score(o: np.ndarray):
        lens = x[o]
        cu = np.concatenate(([0.0], np.cumsum(lens)))
        acc = np.concatenate(([0.0], np.cumsum(whole[o])))
        d = np.minimum(np.searchsorted(cu, bounds, side="right") - 1, m - 1)
        k = bounds - cu[d]
        pw = np.diff(acc[d] + (k * (k + 1) / 2 if causal else k * lens[d]))
        w = pw[:chunks] + pw[::-1][:chunks]
        if extra is not None:
            w = w + extra
        return float(w.max()), float(w @ w), int(np.argmax(w)), cu

    best, best_sq, busiest, cu = score(order)
    rng = np.random.default_rng(seed)
    stale = 0
    for _ in range(iters):
        if rng.random() < 0.5:  # a document touching the busiest chunk's pieces
            c = busiest
            lo, hi = bounds[c], bounds[c + 1]
            lo2, hi2 = bounds[2 * chunks - 1 - c], bounds[2 * chunks - c]
            touch = np.flatnonzero(((cu[:-1] < hi) & (cu[1:] > lo)) | ((cu[:-1] < hi2) & (cu[1:] > lo2)))
            i = int(touch[rng.integers(len(touch))])
        else:
            i = int(rng.integers(m))
        j = int(rng.integers(m))
        if i == j:
            continue
        cand = order.copy()
        if rng.random() < 0.5:
            cand[i], cand[j] = cand[j], cand[i]
        else:
            cand = np.insert(np.delete(cand, i), j, order[i])
        mx, sq, top, ccu = score(cand)
        if (mx, sq) < (best, best_sq):
            order, best, best_sq, busiest, cu, stale = cand, mx, sq, top, ccu, 0
        else:
            stale += 1
            if stale >= patience:
                break
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
