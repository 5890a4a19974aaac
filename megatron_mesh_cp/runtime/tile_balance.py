"""Document order that balances each mesh RANK's tile work, not each chunk's.

Rank g = (r, c) of the a x b mesh computes the blocks (Q chunk i, KV chunk j) of its tile: i in its
row group (chunks r*a .. r*a + a - 1), j in its column group (chunks c, c + a, ...), the diagonal
block (g, g) among them (runtime/topology.py). Under document masking a block off the diagonal has
work only where a document crosses from one piece into another, so which rank does that work is
fixed by where the documents' pieces fall, and a balanced chunk (runtime/balance.py: its Q rows'
keys) is not a balanced rank. :func:`tile_work` is every rank's block cost for a batch of document
orders at once -- its blocks' kernel calls priced by a linear model (per call, Q row, key and pair:
``weights``, default pairs alone), exactly the calls ``SpanBlocks.block`` runs (tested) -- and
:func:`tile_order` a seeded local search for an order whose busiest rank is lowest.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from .balance import balance_order

__all__ = ["tile_work", "tile_order", "search_entries", "BUDGET"]

#: (per call, per Q row, per key, per pair): the cost of one kernel call of r rows, k keys, p pairs
Weights = Tuple[float, float, float, float]
PAIRS: Weights = (0.0, 0.0, 0.0, 1.0)
#: a search scores at most this many (piece pair, order) entries: on one core about 20 ms at 32 chunks of
#: 1M tokens (the iteration cap binds first), under 100 ms at 256
BUDGET = 1 << 21


def _check(lengths: Sequence[int], a: int, b: int) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.int64)
    if x.ndim != 1 or len(x) == 0 or (x < 1).any():
        raise ValueError("documents need positive lengths")
    if not (isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer))) or a < 1 or b < 1:
        raise ValueError(f"the mesh shape must be two positive ints (a, b), got {a!r} x {b!r}")
    if int(x.sum()) % (2 * a * b):
        raise ValueError(f"the documents span {int(x.sum())} tokens, not a multiple of 2*{a * b}: the CP split "
                         "cuts the sequence into 2 pieces per mesh chunk")
    return x


def _docs_at(cu: np.ndarray, t: np.ndarray) -> np.ndarray:
    """d[r, p]: the document (its place in order r) holding token t[p], i.e. cu[r, d] <= t[p] < cu[r, d + 1]."""
    rows, width = cu.shape
    off = (np.arange(rows, dtype=np.int64) * (int(cu[0, -1]) + 1))[:, None]
    d = np.searchsorted((cu + off).ravel(), (t[None, :] + off).ravel(), side="right").reshape(rows, -1)
    return d - 1 - (np.arange(rows) * width)[:, None]


class _Tiles:
    """The fixed part of :func:`tile_work` for one mesh and sequence: pieces, the band of piece pairs
    a document can reach, and which rank owns each pair and which of the block's call costs it carries."""

    def __init__(self, x: np.ndarray, a: int, b: int, causal: bool, weights: Weights):
        self.x, self.a, self.b, self.causal = x, a, b, causal
        self.w = tuple(float(v) for v in weights)
        n = a * b
        self.n, self.n2 = n, 2 * n
        self.M = int(x.sum()) // self.n2
        chunk = lambda p: np.minimum(p, self.n2 - 1 - p)  # noqa: E731
        owner = lambda i, j: (i // a) * a + j % a  # noqa: E731
        # the diagonal call of every chunk: 2M rows, 2M keys (its pairs are added per order)
        call, row, key, _ = self.w
        self.diag_call = call + (row + key) * 2 * self.M
        if not causal:
            return
        # band entry (q, k): queries in piece P = q + k against the keys in piece q of the document
        # holding q's last token; k <= ceil(longest / M) covers every document
        self.width = max(1, -(-int(x.max()) // self.M))
        q = np.arange(self.n2)[:, None]
        P = q + np.arange(1, self.width + 1)[None, :]
        self.valid = P < self.n2
        self.P = np.where(self.valid, P, 0)
        i, j = chunk(self.P), chunk(q + 0 * P)
        lower, upper = i > j, i < j
        # a block's call rows, keys and fixed cost are counted once: a lower block (i > j) is one KV
        # piece j against Q pieces i (always reached first) and 2n-1-i; an upper one is Q piece 2n-1-i
        # against KV pieces j and 2n-1-j (the later one always reached)
        self.f_row = (lower | (upper & (q >= n))) & self.valid
        self.f_key = ((lower & (self.P < n)) | upper) & self.valid
        self.f_call = ((lower & (self.P < n)) | (upper & (q >= n))) & self.valid
        self.owner = owner(i, j)

    def touching(self, order: np.ndarray, g: int) -> np.ndarray:
        """Places in ``order`` of the documents that give rank ``g`` block work (causal: the documents
        of its off-diagonal blocks and of its own pieces; else those in its row or column group)."""
        n, n2, M = self.n, self.n2, self.M
        cu = np.concatenate(([0], np.cumsum(self.x[order])))
        first, last = cu[:-1] // M, (cu[1:] - 1) // M
        own = np.array([g, n2 - 1 - g])
        if self.causal:
            dl = np.searchsorted(cu, np.arange(1, n2 + 1) * M - 1, side="right") - 1
            R = (cu[dl + 1][:, None] > self.P * M) & self.valid & (self.owner == g)
            mine = np.zeros(len(order), dtype=bool)
            mine[dl[R.any(axis=1)]] = True
        else:
            chunk = np.minimum(np.arange(n2), n2 - 1 - np.arange(n2))
            own = np.flatnonzero((chunk // self.a == g // self.a) | (chunk % self.a == g % self.a))
            mine = np.zeros(len(order), dtype=bool)
        mine |= ((first[:, None] <= own[None, :]) & (last[:, None] >= own[None, :])).any(axis=1)
        return np.flatnonzero(mine)

    def cost(self, orders: np.ndarray) -> np.ndarray:
        """[rows, n]: every rank's block cost for each document order (rows of ``orders``)."""
        lens = self.x[orders]
        rows, m = lens.shape
        cu = np.zeros((rows, m + 1), dtype=np.int64)
        np.cumsum(lens, axis=1, out=cu[:, 1:])
        if self.causal:
            return self._causal(lens, cu)
        return self._full(cu)

    def _causal(self, lens: np.ndarray, cu: np.ndarray) -> np.ndarray:
        rows, n, n2, M = len(lens), self.n, self.n2, self.M
        call, row, key, pair = self.w
        starts = np.arange(n2, dtype=np.int64) * M
        dl = _docs_at(cu, starts + M - 1)  # the document holding each piece's last token
        df = _docs_at(cu, starts)  # ... and its first
        s_l, e_l = np.take_along_axis(cu, dl, 1), np.take_along_axis(cu, dl + 1, 1)
        e_f = np.take_along_axis(cu, df + 1, 1)
        K = (starts + M - np.maximum(s_l, starts)).astype(np.float64)  # keys of that document in the piece
        R = np.clip(e_l[:, :, None] - self.P[None] * M, 0, M).astype(np.float64) * self.valid  # its rows in P
        hit = R > 0
        Kb = np.broadcast_to(K[:, :, None], R.shape)
        c = pair * R * Kb + hit * (row * R * self.f_row + key * Kb * self.f_key + call * self.f_call)
        out = np.bincount((self.owner[None] + (np.arange(rows) * n)[:, None, None]).ravel(), weights=c.ravel(),
                          minlength=rows * n).reshape(rows, n)
        # pairs inside each piece: the first and last documents' segments and the whole ones between
        tri = lambda v: v * (v + 1.0) / 2  # noqa: E731
        acc = np.zeros((rows, lens.shape[1] + 1))
        np.cumsum(tri(lens.astype(np.float64)), axis=1, out=acc[:, 1:])
        inner = (tri((e_f - starts).astype(np.float64)) + tri((starts + M - s_l).astype(np.float64))
                 + np.take_along_axis(acc, dl, 1) - np.take_along_axis(acc, df + 1, 1))
        inside = np.where(dl == df, tri(float(M)), inner)
        return out + pair * (inside[:, :n] + inside[:, ::-1][:, :n]) + self.diag_call

    def _full(self, cu: np.ndarray) -> np.ndarray:
        """Without the causal mask a block runs one call per shared document (its run in chunk i x its
        run in chunk j), so a rank's cost separates into its row group's and column group's sums."""
        rows, a, b, n2, M = len(cu), self.a, self.b, self.n2, self.M
        call, row, key, pair = self.w
        lo = np.arange(n2, dtype=np.int64) * M
        t = np.clip(np.minimum(cu[:, 1:, None], lo + M) - np.maximum(cu[:, :-1, None], lo), 0, None)
        t = (t[:, :, :self.n] + t[:, :, ::-1][:, :, :self.n]).astype(np.float64)  # [rows, docs, chunk]
        g = t.reshape(rows, -1, b, a)  # chunk r * a + c
        on = g > 0
        sr, nr = g.sum(3)[:, :, :, None], on.sum(3)[:, :, :, None]  # row group r
        sc, nc = g.sum(2)[:, :, None, :], on.sum(2)[:, :, None, :]  # column group c
        off = call * (nr * nc - on) + row * (sr * nc - g) + key * (nr * sc - g) + pair * (sr * sc - g * g)
        return (off + pair * g * g).sum(1).reshape(rows, -1) + self.diag_call


def search_entries(lengths: Sequence[int], chunks: int, causal: bool = True) -> int:
    """Entries :func:`tile_work` scores per order on ``chunks`` chunks (causal: the pieces times the
    band of pieces the longest document reaches; else documents times chunks): what a search's host
    time scales with (:data:`BUDGET`)."""
    x = np.asarray(lengths, dtype=np.int64)
    piece = max(1, int(x.sum()) // (2 * chunks))
    return 2 * chunks * max(1, -(-int(x.max()) // piece)) if causal else len(x) * chunks


def tile_work(lengths: Sequence[int], a: int, b: int, *, causal: bool = True,
              weights: Optional[Weights] = None, orders=None) -> np.ndarray:
    """Every rank's block cost on the a x b mesh for documents of ``lengths`` back to back: [a*b], or
    [len(orders), a*b] for ``orders`` (rows of document indices). A kernel call of r Q rows, k keys
    and p pairs costs ``weights`` = (per call, per row, per key, per pair) . (1, r, k, p); the
    default counts pairs alone (a rank's attention work)."""
    x = _check(lengths, a, b)
    tiles = _Tiles(x, a, b, bool(causal), PAIRS if weights is None else weights)
    if orders is None:
        return tiles.cost(np.arange(len(x))[None, :])[0]
    o = np.atleast_2d(np.asarray(orders, dtype=np.int64))
    if o.shape[1] != len(x) or (np.sort(o, axis=1) != np.arange(len(x))).any():
        raise ValueError(f"each order must be a permutation of the {len(x)} documents")
    return tiles.cost(o)


def _moves(order: np.ndarray, x: np.ndarray, rng, batch: int, touch: np.ndarray) -> np.ndarray:
    """``batch`` neighbours of ``order``: two disjoint runs of documents swapped -- a run of 1-3 (mostly
    starting at a document in ``touch``) and, mostly, the run after a random start whose tokens come
    closest to its own, so the documents between keep (nearly) their places; else one document.
    Covers swapping two documents and moving one (two adjacent runs)."""
    m = len(order)
    cu = np.concatenate(([0], np.cumsum(x[order])))
    i1 = np.where(rng.random(batch) < 0.9, touch[rng.integers(len(touch), size=batch)], rng.integers(m, size=batch))
    i2 = np.minimum(m, i1 + rng.integers(1, 4, size=batch))
    j1 = rng.integers(m, size=batch)
    ends = np.arange(m + 1)[None, :]
    # j1 before the run: ends up to its start; after it: any end
    ok = (ends > j1[:, None]) & np.where((j1 < i1)[:, None], ends <= i1[:, None], True)
    gap = np.abs(cu[None, :] - cu[j1][:, None] - (cu[i2] - cu[i1])[:, None])
    matched = np.argmin(np.where(ok, gap, np.inf), axis=1)
    j2 = np.where(rng.random(batch) < 0.75, matched, j1 + 1)
    good = (j1 < i1) | (j1 >= i2)
    p1, p2 = np.where(j1 < i1, j1, i1), np.where(j1 < i1, j2, i2)  # the earlier run
    q1, q2 = np.where(j1 < i1, i1, j1), np.where(j1 < i1, i2, j2)  # the later one
    t = np.arange(m)[None, :]
    seg = (t >= p1[:, None]).astype(np.int64) + (t >= p2[:, None]) + (t >= q1[:, None]) + (t >= q2[:, None])
    key = np.array([0, 3, 2, 1, 4])[seg] * m + t  # before, later run, between, earlier run, after
    return order[np.argsort(key[good], axis=1, kind="stable")]


def tile_order(lengths: Sequence[int], a: int, b: int, *, causal: bool = True, weights: Optional[Weights] = None,
               iters: int = 1024, patience: int = 256, seed: int = 0, batch: int = 32,
               start: Optional[Sequence[int]] = None, budget: int = BUDGET) -> Tuple[int, ...]:
    """An order of the documents (indices into ``lengths``) whose busiest rank on the a x b mesh
    carries the least block cost (:func:`tile_work`; ties: the sum of squares): a seeded local search
    (:func:`_moves`: two runs of documents swapped, one of them giving the busiest rank work half
    the time; ``batch`` moves scored at once, at most ``iters``, stopping after ``patience`` that did
    not lower the busiest rank, and at most ``budget`` scored entries: :func:`search_entries`) started
    from ``start`` (default: the chunk-balanced order, runtime/balance.py), so never worse than it.
    Deterministic: every rank computes the same order from the same lengths."""
    x = _check(lengths, a, b)
    m, n = len(x), a * b
    order = (np.asarray(balance_order(x.tolist(), n, causal=causal, seed=seed), dtype=np.int64) if start is None
             else np.asarray(start, dtype=np.int64))
    if sorted(order.tolist()) != list(range(m)):
        raise ValueError(f"start must be a permutation of the {m} documents")
    if m < 2 or n < 2:
        return tuple(int(i) for i in order)
    tiles = _Tiles(x, a, b, bool(causal), PAIRS if weights is None else weights)
    per = search_entries(x, n, causal)
    batch = max(1, min(batch, budget // per))  # a round of at least one move, within the budget where it can be
    iters = min(iters, max(batch, budget // per))

    def score(orders):
        w = tiles.cost(orders)
        return w.max(axis=1), np.einsum("ij,ij->i", w, w), np.argmax(w, axis=1)

    mx, sq, top = score(order[None, :])
    best, best_sq, busiest = float(mx[0]), float(sq[0]), int(top[0])
    rng = np.random.default_rng(seed)
    stale = tried = 0
    while tried < iters and stale < patience:
        cand = _moves(order, x, rng, batch, tiles.touching(order, busiest))
        tried += batch
        if not len(cand):
            continue
        mx, sq, top = score(cand)
        pick = int(np.lexsort((sq, mx))[0])
        if (float(mx[pick]), float(sq[pick])) < (best, best_sq):
            stale = 0 if float(mx[pick]) < best else stale + batch  # only a lower busiest rank resets patience
            order, best, best_sq, busiest = cand[pick], float(mx[pick]), float(sq[pick]), int(top[pick])
        else:
            stale += batch
    return tuple(int(i) for i in order)
