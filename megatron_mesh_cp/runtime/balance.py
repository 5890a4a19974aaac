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

from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["chunk_work", "balance_order", "balance_orders", "token_order", "balance_documents"]


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
    return balance_orders([dict(lengths=lengths, regions=regions, fixed=fixed, seed=seed)], chunks, causal=causal,
                          iters=iters, patience=patience, batch=batch)[0]


def balance_orders(problems: Sequence[dict], chunks: int, *, causal: bool = True, iters: int = 4096,
                   patience: int = 1024, batch: int = 32) -> List[Tuple[int, ...]]:
    """:func:`balance_order` of several document sets over the same ``chunks`` (each problem a dict of
    its ``lengths`` and optional ``regions``, ``fixed``, ``seed``), each exactly its own search's result:
    the searches run in lockstep, every round's moves of all of them scored in one evaluation (the
    layouts auto prices search once per candidate: one evaluation per round instead of one per
    candidate and round)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    out: List[Optional[Tuple[int, ...]]] = [None] * len(problems)
    live = []
    for idx, prob in enumerate(problems):
        regions = prob.get("regions")
        x = (_check(prob["lengths"], chunks) if regions is None else _check(prob["lengths"])).astype(np.float64)
        if len(x) < 2 or chunks < 2:
            out[idx] = tuple(range(len(x)))
            continue
        if regions is None:
            piece = x.sum() / (2 * chunks)
            bounds = np.arange(2 * chunks + 1) * piece
        else:
            if len(regions) != 2 * chunks or sum(regions) != x.sum():
                raise ValueError(f"regions must be 2*chunks sizes summing to the documents' {int(x.sum())} tokens")
            bounds = np.concatenate(([0.0], np.cumsum(np.asarray(regions, dtype=np.float64))))
        fixed = prob.get("fixed")
        live.append(_Search(idx, x, bounds, None if fixed is None else np.asarray(fixed, dtype=np.float64),
                            int(prob.get("seed", 0))))
    if live:
        _run(live, chunks, causal, iters, patience, batch)
        for srch in live:
            out[srch.idx] = srch.result()
    return out


class _Search:
    """One problem's state in :func:`balance_orders`: its documents (x, their global ids in the
    lockstep's tables from ``base``), bounds, fixed work, generator and the search's counters."""

    def __init__(self, idx: int, x: np.ndarray, bounds: np.ndarray, extra: Optional[np.ndarray], seed: int) -> None:
        self.idx, self.x, self.bounds, self.extra = idx, x, bounds, extra
        self.m = len(x)
        self.rng = np.random.default_rng(seed)
        self.stale = self.tried = 0
        self.slot = self.base = 0  # its row and first document id in the lockstep's tables
        self.order: np.ndarray = None  # global ids, padded to the lockstep's width
        self.best = self.best_sq = 0.0
        self.busiest = 0
        self.cu: np.ndarray = None
        self.touch: Optional[np.ndarray] = None

    def result(self) -> Tuple[int, ...]:
        return tuple(int(i) for i in self.order[:self.m] - self.base)


def _run(searches: List[_Search], chunks: int, causal: bool, iters: int, patience: int, batch: int) -> None:
    """The searches of :func:`balance_orders`, round by round: each draws its moves from its own
    generator in balance_order's sequence; the candidates of all are scored together (documents
    padded with empty ones after each set's last, which no move touches and no bound reaches)."""
    width = max(s.m for s in searches)
    nb = 2 * chunks + 1
    pad = sum(s.m for s in searches)  # the empty document
    xs = np.concatenate([s.x for s in searches] + [np.zeros(1)])
    whole_all = xs * (xs + 1) / 2 if causal else xs * xs
    at = 0
    for slot, s in enumerate(searches):
        s.slot, s.base = slot, at
        s.order = np.full(width, pad, dtype=np.int64)
        s.order[:s.m] = np.arange(at, at + s.m)
        at += s.m
    bounds_all = np.stack([s.bounds for s in searches])
    extra_all = np.stack([np.zeros(chunks) if s.extra is None else s.extra for s in searches])
    cap_all = np.array([s.m - 1 for s in searches], dtype=np.int64)
    cols = np.arange(width)

    def score(orders: np.ndarray, prob: np.ndarray):
        """Busiest chunk work, sum of squares and busiest chunk of each order [R, width] of problem
        ``prob`` [R] (balance_order's arithmetic, row for row), and the rows' prefix lengths: one
        running sum over all rows (exact: whole numbers far below 2**53), each row's its own minus
        its start."""
        rows = len(orders)
        start = np.arange(rows) * (width + 1)
        lens = np.zeros((rows, width + 1))
        lens[:, 1:] = xs[orders]
        cu = np.cumsum(lens.ravel())
        acc = np.zeros((rows, width + 1))
        acc[:, 1:] = whole_all[orders]
        acc = np.cumsum(acc.ravel())
        base, acc_base = cu[start][:, None], acc[start][:, None]
        bounds = bounds_all[prob]
        # d[r, p]: the document holding bound p (the last prefix <= it), at most the set's last
        at = np.searchsorted(cu, (bounds + base).ravel(), side="right").reshape(rows, nb) - 1
        d = np.minimum(at - start[:, None], cap_all[prob][:, None]) + start[:, None]
        k = bounds - (cu[d] - base)
        acc_d = acc[d] - acc_base
        at_ = acc_d + (k * (k + 1) / 2 if causal else k * lens.ravel()[d + 1])
        pw = np.diff(at_, axis=1)
        w = pw[:, :chunks] + pw[:, ::-1][:, :chunks]
        w = w + extra_all[prob]
        return w.max(axis=1), np.einsum("ij,ij->i", w, w), np.argmax(w, axis=1), (cu, start)

    def prefix(cus, row: int, m: int) -> np.ndarray:
        cu, start = cus
        return cu[start[row]:start[row] + m + 1] - cu[start[row]]

    every = np.arange(len(searches))
    mx, sq, top, cus = score(np.stack([s.order for s in searches]), every)
    for r, s in enumerate(searches):
        s.best, s.best_sq, s.busiest, s.cu = float(mx[r]), float(sq[r]), int(top[r]), prefix(cus, r, s.m)
    while True:
        active = [s for s in searches if s.tried < iters and s.stale < patience]
        if not active:
            return
        draws = []
        for s in active:  # balance_order's draws, in its order
            if s.touch is None:
                b, cu = s.busiest, s.cu
                lo, hi = s.bounds[b], s.bounds[b + 1]
                lo2, hi2 = s.bounds[2 * chunks - 1 - b], s.bounds[2 * chunks - b]
                s.touch = np.flatnonzero(((cu[:-1] < hi) & (cu[1:] > lo)) | ((cu[:-1] < hi2) & (cu[1:] > lo2)))
            rng, m = s.rng, s.m
            i = np.where(rng.random(batch) < 0.5, s.touch[rng.integers(len(s.touch), size=batch)],
                         rng.integers(m, size=batch))
            j = rng.integers(m, size=batch)
            swap = rng.random(batch) < 0.5
            draws.append((i, j, swap))
            s.tried += batch
        i = np.concatenate([d[0] for d in draws])
        j = np.concatenate([d[1] for d in draws])
        swap = np.concatenate([d[2] for d in draws])
        rows = len(i)
        lane = np.arange(rows)
        # a move of i to j: positions between them shift by one towards i, position j takes i; a swap
        lo, hi = np.minimum(i, j)[:, None], np.maximum(i, j)[:, None]
        step = np.where(swap, 0, np.where(i < j, 1, -1))[:, None]
        src = cols + ((cols >= lo) & (cols <= hi)) * step
        src[lane[swap], i[swap]] = j[swap]
        src[lane, j] = i
        prob = np.repeat(np.array([s_.slot for s_ in active]), batch)
        orders = np.stack([s_.order for s_ in active]).ravel()
        cand = orders[src + (np.repeat(np.arange(len(active)), batch) * width)[:, None]]
        mx, sq, top, cus = score(cand, prob)
        mx = np.where(i != j, mx, np.inf).reshape(len(active), batch)
        sq = sq.reshape(len(active), batch)
        # per search the first of its moves with the lowest (busiest, sum of squares): lexsort's pick
        low = mx.min(axis=1)
        tie = mx == low[:, None]
        low_sq = np.where(tie, sq, np.inf).min(axis=1)
        pick = np.argmax(tie & (sq == low_sq[:, None]), axis=1)
        for r, s in enumerate(active):
            if low[r] == np.inf:  # every move was i = j: nothing scored
                continue
            row = r * batch + int(pick[r])
            if (float(low[r]), float(low_sq[r])) < (s.best, s.best_sq):
                s.stale = 0 if float(low[r]) < s.best else s.stale + batch  # only a lower busiest chunk resets patience
                s.order, s.best, s.best_sq, s.busiest = cand[row], float(low[r]), float(low_sq[r]), int(top[row])
                s.cu, s.touch = prefix(cus, row, s.m), None
            else:
                s.stale += batch


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
