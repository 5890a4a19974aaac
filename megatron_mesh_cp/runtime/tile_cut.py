"""Re-laying a few documents of a tiled order, so the mesh's ranks carry nearer-equal block cost.

The tiled layout (runtime/tile_balance.py) orders whole documents; its busiest rank stays about
1.2x the mean on a few dozen 4K-64K documents, because a whole document's cross-piece work comes in
lumps (a 16K x 16K rectangle is half a rank's work). This search keeps every document's *footprint*
(the x' tokens the tiled order gives it, so every chunk holds the same tokens of the same documents)
and only changes which of the document's positions sit where inside it. Of a document with t_i
tokens in chunk i and t_j in chunk j, the t_i * t_j cross pairs fall to block (i, j) or (j, i) by
which of them holds the earlier positions, so a re-lay moves work between the owners of those two
blocks (inside a row group: rank i and rank j). The re-lays tried (:func:`_candidates`):

* every order of the document's piece-aligned parts (each part one run of positions: no new
  segment inside a piece; over more than MAX_PARTS pieces the identity and every swap of two
  parts, over more than MAX_SWAPS the identity alone), each also
* rotated in position space by ``L * k / ROTATIONS`` (one part cut in two), or
* interleaved: in position order part p's last ``t`` positions moved behind the next part q
  (positions p1 | q | p2), ``t = size(p) * k / INTERLEAVES``: t * size(q) of their pairs turn from
  block (q, p) to (p, q), every other part sees them as before (documents over at most
  MAX_INTERLEAVE_PARTS pieces: the pricing grows as the parts cubed).

A re-lay (or exchange) is only taken when every block it makes non-empty lies in a tile block the
tiled order already keeps (no chunk sent that the tiled layout does not send: the same bytes). A
re-lay's cost per rank is the linear kernel-call model of runtime/tile_balance.py (per call, Q row,
key and pair) per pair of parts -- an approximation of the calls the block engine makes; the planner
prices the result exactly and auto takes it only when that is no slower. A greedy descent: each
round scores every re-lay of every document giving the busiest rank over MIN_SHARE of a mean rank's
work (where none helps, the next busiest's, up to the TOP-th; vectorised, each document's re-lays
priced once on first use) by the sum of (rank cost / mean) ** 32, a smooth stand-in for the busiest
rank, takes the best, and stops when none lowers it; it keeps the state whose busiest rank was lowest.

A footprint alone cannot always balance the ranks (two long documents in one row group load all its
ranks, whatever their re-lays), so then up to EXCHANGES greedy *exchanges* move tokens between
chunks (:func:`_exchange`): the document D giving the busiest rank most work (where none helps, the
next busiest's, up to the SWAP_TOP-th) trades the x'-first or x'-last t tokens of one of its parts
(t consecutive positions) with as many of another document E's, the x'-first or x'-last of one of
E's parts in another chunk, t the smaller part's size (SWAP_SIZES): each one's tokens now sit in the
other's chunk, and their cross-piece work falls to the blocks between that chunk and their others
(only chunks whose blocks with D's lie in kept tile blocks are tried). Scored by the same smooth
objective over every (D's part, side, E's part, side) at once; a document in MAX_RUNS runs takes no
further trade; it keeps the state whose busiest rank was lowest.

The grids are sized for host time (on one core at 45 documents over 32 chunks about 8 ms per
micro-batch for the re-lays, 5-20 ms for the exchanges). Deterministic: every rank computes the same re-lays
from the same lengths.
"""

from __future__ import annotations

from itertools import permutations
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["cut_documents", "ROTATIONS", "INTERLEAVES", "MAX_PARTS", "MAX_SWAPS", "TOP", "MIN_SHARE", "ROUNDS",
           "EXCHANGES", "SWAP_SIZES", "MAX_RUNS", "SWAP_DOCS", "SWAP_TOP", "MAX_INTERLEAVE_PARTS"]

#: rotations tried per order of parts: r = L * k / ROTATIONS for k < ROTATIONS
ROTATIONS = 4
#: documents over at most this many pieces are tried in every order of their pieces
MAX_PARTS = 3
#: ... over at most this many in the identity order and every swap of two parts (more: the identity)
MAX_SWAPS = 6
#: interleaves of two parts tried at size * k / INTERLEAVES for 0 < k < INTERLEAVES
INTERLEAVES = 4
#: ... for documents over at most this many pieces: pricing a document's re-lays costs (re-lays) x parts^2,
#: and a document over every piece has ~3 interleaves per part (review h48: one 1M-token document at 2x128
#: took 33 s and 21 GB; over more pieces it is tried in its rotations alone)
MAX_INTERLEAVE_PARTS = 64
#: the smooth objective's power is 2 ** POWER (:func:`_smooth`)
POWER = 5
#: each round tries the documents giving the busiest rank work, or where none lowers the objective the
#: next busiest's, up to the TOP-th
TOP = 4
#: ... and of those only the ones giving it more than this share of the mean rank's cost
MIN_SHARE = 0.1
#: at most this many greedy rounds (one re-lay taken per round)
ROUNDS = 96
#: then at most this many exchanges (one taken per round; 0: none)
EXCHANGES = 8
#: an exchange trades t tokens, t = the smaller of the two parts' sizes times each of these
SWAP_SIZES = (1.0,)
#: a document in this many runs or more takes no further exchange
MAX_RUNS = 8
#: an exchange's D: of the SWAP_DOCS documents giving the busy rank most work
SWAP_DOCS = 1
#: ... of the busiest rank, or where none lowers the objective the next busiest's, up to the SWAP_TOP-th
SWAP_TOP = 2


def _edges(start: int, length: int, m: int) -> np.ndarray:
    """The footprint's offsets 0, the piece boundaries inside it, and ``length``."""
    inner = np.arange((start // m + 1) * m, start + length, m, dtype=np.int64) - start
    return np.concatenate(([0], inner, [length]))


def _swaps(k: int) -> List[Tuple[int, ...]]:
    """The identity order of k parts and every order with two of its parts swapped."""
    out = [tuple(range(k))]
    for i in range(k):
        for j in range(i + 1, k):
            p = list(range(k))
            p[i], p[j] = j, i
            out.append(tuple(p))
    return out


def _candidates(start: int, length: int, m: int, rotations: int):
    """A document's re-lays over its footprint x'[start, start + length) as parts ([R, P] each: x'
    offset, size, first position; zero-size parts pad): every order of its piece-aligned parts (each
    part one run of positions; over more than MAX_PARTS parts :func:`_swaps`, over more than
    MAX_SWAPS the identity), each rotated in
    position space by ``length * k / rotations`` (position p to (p + r) mod L: the part holding
    position L - r is cut in two) or interleaved with the part after one of its parts (module
    docstring). Row 0 is the document whole."""
    edges = _edges(start, length, m)
    k = len(edges) - 1
    sizes = np.diff(edges)
    perms = np.array(list(permutations(range(k))) if k <= MAX_PARTS else _swaps(k) if k <= MAX_SWAPS
                     else [tuple(range(k))], dtype=np.int64)
    rank = np.argsort(perms, axis=1)  # where each part comes in the position order
    p_pos = ((rank[:, None, :] < rank[:, :, None]) * sizes[None, None, :]).sum(axis=2)  # [perm, part]
    rot = np.unique(np.concatenate(([0], (length * np.arange(1, rotations) / rotations).astype(np.int64))))
    P, Q = len(perms), len(rot)
    pos = np.broadcast_to(p_pos[:, None, :], (P, Q, k)).reshape(-1, k)
    r = np.broadcast_to(rot[None, :, None], (P, Q, 1)).reshape(-1, 1)
    lo = np.broadcast_to(edges[:-1], pos.shape)
    size = np.broadcast_to(sizes, pos.shape)
    w = length - r  # positions from w on wrap to the front
    cut = (pos < w) & (pos + size > w)  # the part cut by the wrap (at most one per row)
    head = np.where(cut, w - pos, size)  # its first sub-part: positions [pos, w)
    tail = np.where(cut, size - head, 0)
    new_pos = np.where(pos >= w, pos - w, pos + r)
    tail_lo = (lo + head) * cut
    lo = np.concatenate((lo, tail_lo.sum(1, keepdims=True)), axis=1)
    size = np.concatenate((head, tail.sum(1, keepdims=True)), axis=1)
    pos = np.concatenate((new_pos, np.zeros_like(r)), axis=1)  # the tail starts at position 0
    # interleaves: in each order, part p's last t positions moved behind the part q after it in
    # position order (positions p1 | q | p2), t = size(p) * f for f on the grid: of the pairs of p
    # and q, t * size(q) turn from block (q, p) to block (p, q); the other parts see p and q as before
    f = np.arange(1, INTERLEAVES) / INTERLEAVES
    if 2 <= k <= MAX_INTERLEAVE_PARTS and len(f):
        order = perms  # order[j]: the part j-th in position order
        jj = np.arange(k - 1)
        pp, qq = order[:, jj], order[:, jj + 1]  # [perm, j]
        sp, sq = sizes[pp], sizes[qq]
        t = np.maximum(1, (sp[:, :, None] * f[None, None, :]).astype(np.int64))  # [perm, j, f]
        t = np.minimum(t, sp[:, :, None] - 1)
        E = t.size
        base_pos = np.broadcast_to(p_pos[:, None, None, :], t.shape + (k,)).reshape(E, k).copy()
        pe, qe = np.broadcast_to(pp[:, :, None], t.shape).ravel(), np.broadcast_to(qq[:, :, None], t.shape).ravel()
        te = t.ravel()
        rows = np.arange(E)
        P0 = base_pos[rows, pe]
        base_pos[rows, qe] = P0 + sizes[pe] - te
        i_lo = np.broadcast_to(edges[:-1], (E, k)).copy()
        i_size = np.broadcast_to(sizes, (E, k)).copy()
        i_size[rows, pe] = sizes[pe] - te
        ok = te > 0
        lo = np.concatenate((lo, np.concatenate((i_lo, (edges[pe] + sizes[pe] - te)[:, None]), axis=1)[ok]))
        size = np.concatenate((size, np.concatenate((i_size, te[:, None]), axis=1)[ok]))
        pos = np.concatenate((pos, np.concatenate((base_pos, (P0 + sizes[pe] - te + sizes[qe])[:, None]),
                                                  axis=1)[ok]))
    return lo, size, pos


def _costs(start, lo, size, pos, m, n, a, weights, kept):
    """Per candidate re-lay of one document at x' offset ``start`` (rows of the parts; ``start`` may
    be one per row): every rank's modelled cost [R, n],
    its attention pairs [R, n] (exact), and whether its non-empty cross-chunk blocks all lie in
    ``kept`` tile blocks ([a, b] bool) -- or, with ``kept`` None, the tile blocks they lie in [R, a, b]."""
    call, row, key, pair = weights
    n2, b = 2 * n, n // a
    s = size.astype(np.float64)
    R = len(s)
    piece = np.minimum((np.reshape(start, (-1, 1)) + lo) // m, n2 - 1)  # (a zero-size pad may sit at the end)
    chunk = np.minimum(piece, n2 - 1 - piece)
    qk = pos[:, :, None] >= pos[:, None, :] + size[:, None, :]  # [R, query part, key part]: key before query
    qk &= (size[:, :, None] > 0) & (size[:, None, :] > 0)
    ci, cj = chunk[:, :, None], chunk[:, None, :]
    same = ci == cj
    in_run = same & (lo[:, None, :] < lo[:, :, None])  # same chunk, rows in position order: the varlen call
    own = qk & ~in_run  # a call of its own: off the diagonal, or a dense rectangle in the own block
    cross = s[:, :, None] * s[:, None, :] * qk
    calls = own * (call + row * s[:, :, None] + key * s[:, None, :])
    at = (((ci // a) * a + cj % a) + (np.arange(R) * n)[:, None, None]).ravel()  # the owner of each pair
    diag = (chunk + (np.arange(R) * n)[:, None]).ravel()
    pairs = np.bincount(at, weights=cross.ravel(), minlength=R * n)
    pairs += np.bincount(diag, weights=(s * (s + 1) / 2).ravel(), minlength=R * n)
    cost = pair * pairs + np.bincount(at, weights=calls.ravel(), minlength=R * n)
    qo, ko = (cj % a - ci % a) % a, (ci // a - cj // a) % b
    hit = qk & ~same
    if kept is None:
        used = np.zeros((R, a, b), dtype=bool)
        r = np.broadcast_to(np.arange(R)[:, None, None], hit.shape)
        used[r[hit], qo[hit], ko[hit]] = True
        return cost.reshape(R, n), pairs.reshape(R, n), used
    ok = ~(hit & ~kept[qo, ko]).reshape(R, -1).any(axis=1)
    return cost.reshape(R, n), pairs.reshape(R, n), ok


def _smooth(t: np.ndarray) -> np.ndarray:
    """A smooth stand-in for the busiest rank (rows of ranks' costs over the mean): the sum of
    t ** (2 ** POWER), which a move lowers by taking work off the busy ranks even where the busiest
    rank's stays."""
    for _ in range(POWER):
        t = t * t
    return t.sum(axis=-1)


def cut_documents(lengths: Sequence[int], order: Sequence[int], a: int, b: int, *, weights,
                  rounds: int = ROUNDS, rotations: int = ROTATIONS, base: Optional[np.ndarray] = None,
                  exchanges: int = EXCHANGES) -> Tuple[List[Tuple[int, int, int]], int, np.ndarray, np.ndarray]:
    """The runs (document, first position, length) in x' order of documents laid whole in ``order``
    on the a x b mesh (causal) with a few re-laid and exchanged (module docstring), how many
    documents it cuts (more than one run), every rank's modelled cost and its attention pairs
    (exact). A re-lay or exchange may make non-empty only blocks in the tile blocks the whole
    documents keep; ``base`` ([a*b]): each rank's cost outside the documents (default: none);
    ``exchanges``: at most this many exchanges after the re-lays."""
    x = np.asarray(lengths, dtype=np.int64)
    n = a * b
    m = int(x.sum()) // (2 * n)
    o = np.asarray(order, dtype=np.int64)
    starts = np.empty(len(x), dtype=np.int64)
    starts[o] = np.concatenate(([0], np.cumsum(x[o])))[:-1]
    kept = np.zeros((a, b), dtype=bool)
    kept[0, 0] = True
    # every document whole, one row each: one part per piece it crosses (zero-size parts pad)
    edges = [_edges(int(starts[d]), int(x[d]), m) for d in range(len(x))]
    width = max(len(e) for e in edges)
    ends = np.array([np.pad(e, (0, width - len(e)), constant_values=e[-1]) for e in edges])
    lo = ends[:, :-1]
    cost, pairs, used = _costs(starts, lo, np.diff(ends, axis=1), lo, m, n, a, weights, None)
    whole = cost.copy(), pairs.copy()
    kept |= used.any(axis=0)
    cuts = [d for d in range(len(x)) if starts[d] // m != (starts[d] + x[d] - 1) // m]  # over 2+ pieces
    cand: dict = {}

    def candidates(d: int):
        """Document d's re-lays that keep to the kept tile blocks, and their costs (made on first use)."""
        if d not in cand:
            lo, size, pos = _candidates(int(starts[d]), int(x[d]), m, rotations)
            c, p, ok = _costs(int(starts[d]), lo, size, pos, m, n, a, weights, kept)
            cand[d] = (lo[ok], size[ok], pos[ok], c[ok], p[ok])
        return cand[d]

    total = cost.sum(0) + (0.0 if base is None else np.asarray(base, dtype=np.float64))
    scale = float(total.mean())
    pick: dict = {}
    best_max, best_pick, best_total, best_pairs = float(total.max()), {}, total, pairs.sum(0)
    f = _smooth(total / scale)
    for _ in range(rounds):
        move = None
        for g in np.argsort(-total, kind="stable")[:TOP]:  # the busiest rank first, the next where it is stuck
            for d in cuts:
                if cost[d, g] <= MIN_SHARE * scale:  # only a document giving this rank work
                    continue
                c = candidates(d)[3]
                fd = _smooth((total[None, :] - cost[d][None, :] + c) / scale)
                k = int(np.argmin(fd))
                if fd[k] < f * (1 - 1e-9) and (move is None or fd[k] < move[2]):
                    move = (d, k, float(fd[k]))
            if move is not None:
                break
        if move is None:
            break
        d, k, f = move
        total = total - cost[d] + cand[d][3][k]
        cost[d] = cand[d][3][k]
        pick[d] = k
        pairs[d] = cand[d][4][k]
        if float(total.max()) < best_max:
            best_max, best_pick, best_total, best_pairs = float(total.max()), dict(pick), total, pairs.sum(0)
    pick, total = best_pick, best_total
    # every document's parts in the best state: (x' offset from its start, size, first position)
    state = {}
    cost, pairs = whole[0].copy(), whole[1].copy()
    for d in range(len(x)):
        if d in pick:
            k = pick[d]
            state[d] = (cand[d][0][k].copy(), cand[d][1][k].copy(), cand[d][2][k].copy())
            cost[d], pairs[d] = cand[d][3][k], cand[d][4][k]
        else:
            state[d] = (edges[d][:-1].copy(), np.diff(edges[d]), edges[d][:-1].copy())
    _exchange(x, starts, state, cost, pairs, total, m, n, a, weights, kept, scale, exchanges)
    total = cost.sum(0) + (0.0 if base is None else np.asarray(base, dtype=np.float64))
    out = []  # (x' offset, document, first position, length)
    for d in range(len(x)):
        lo_, size_, pos_ = state[d]
        for i in np.flatnonzero(size_ > 0):
            out.append((int(starts[d] + lo_[i]), d, int(pos_[i]), int(size_[i])))
    out.sort()
    runs: List[Tuple[int, int, int]] = []
    for _, d, p, l in out:
        if runs and runs[-1][0] == d and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (d, runs[-1][1], runs[-1][2] + l)
        else:
            runs.append((d, p, l))
    cut = int((np.bincount([r[0] for r in runs], minlength=len(x)) > 1).sum())
    return runs, cut, total, pairs.sum(0)


def _exchange(x, starts, state, cost, pairs, total, m, n, a, weights, kept, scale, rounds):
    """Greedy exchanges (module docstring): t consecutive tokens of a document D giving a busy rank
    work (the x'-first or x'-last t of one of its parts) trade places with t consecutive tokens of
    another document E in another chunk (the x'-first or x'-last t of one of its parts; t = the
    smaller part's size times each of SWAP_SIZES), so each document's tokens move to the other's
    chunk; scored by the smooth objective over every (D's part, side, E's part, side, t) at once
    (each D's trades priced once, again only where D or E has traded since). Updates ``state``,
    ``cost``, ``pairs`` in place."""
    total = total.copy()
    f = _smooth(total / scale)
    frac = np.asarray(SWAP_SIZES, dtype=np.float64)
    # near[c1, c2]: a tile block the whole documents keep holds block (c1, c2) or (c2, c1) (or c1 = c2)
    c = np.arange(n)
    hold = kept[(c[None, :] % a - c[:, None] % a) % a, (c[:, None] // a - c[None, :] // a) % (n // a)]
    near = hold | hold.T
    # every document's parts as rows of one table (zero-size pads; the last column always a pad)
    width = max(max(len(v[0]) for v in state.values()), MAX_RUNS) + 2
    table = np.zeros((3, len(x), width), dtype=np.int64)

    def put(d: int) -> None:
        table[:, d] = 0
        for i in range(3):
            table[i, d, :len(state[d][i])] = state[d][i]

    for d in range(len(x)):
        put(d)

    def chunks() -> np.ndarray:
        p = np.minimum((starts[:, None] + table[0]) // m, 2 * n - 1)
        return np.minimum(p, 2 * n - 1 - p)

    part_chunk = chunks()

    def trades(d: int, others: np.ndarray) -> dict:
        """D = d's trades with the live parts of the documents ``others`` (bool), priced (rows)."""
        lo, size, pos = state[d]
        di = np.flatnonzero(size > 0)
        c_d = part_chunk[d, :len(lo)]
        reach = near[:, np.unique(c_d[di])].all(axis=1)  # chunks whose blocks with D's are kept
        pe, pj = np.nonzero((table[1] > 0) & others[:, None] & reach[part_chunk])
        if not len(pe) or not len(di):
            return {"E": np.zeros(0, dtype=np.int64)}
        I, SD, K, SE, F = (v.ravel() for v in np.meshgrid(di, [0, 1], np.arange(len(pe)), [0, 1],
                                                             np.arange(len(frac)), indexing="ij"))
        E, j = pe[K], pj[K]
        keep = c_d[I] != part_chunk[E, j]  # a trade inside one chunk moves no work
        I, SD, SE, F, E, j = (v[keep] for v in (I, SD, SE, F, E, j))
        if not len(E):  # every candidate inside D's own chunks
            return {"E": np.zeros(0, dtype=np.int64)}
        e_lo0, e_sz, e_pos0 = table[0, E, j], table[1, E, j], table[2, E, j]
        t = np.maximum(1, (np.minimum(size[I], e_sz) * frac[F]).astype(np.int64))
        R = len(t)
        r = np.arange(R)
        d_lo = np.where(SD == 0, lo[I], lo[I] + size[I] - t)  # D's traded tokens (x' from D's start)
        d_pos = np.where(SD == 0, pos[I], pos[I] + size[I] - t)
        e_lo = np.where(SE == 0, e_lo0, e_lo0 + e_sz - t)  # E's (x' from E's start)
        e_pos = np.where(SE == 0, e_pos0, e_pos0 + e_sz - t)
        k = len(lo)
        DL, DZ, DP = (np.broadcast_to(v, (R, k)).copy() for v in (lo, size, pos))
        step = np.where(SD == 0, t, 0)
        DZ[r, I] -= t
        DL[r, I] += step
        DP[r, I] += step
        DL = np.concatenate((DL, (starts[E] + e_lo - starts[d])[:, None]), axis=1)
        DZ = np.concatenate((DZ, t[:, None]), axis=1)
        DP = np.concatenate((DP, d_pos[:, None]), axis=1)
        w = max(len(state[e][0]) for e in np.unique(E).tolist()) + 1  # the last column a pad in every row
        XL, XZ, XP = table[0, E, :w], table[1, E, :w], table[2, E, :w]
        step = np.where(SE == 0, t, 0)
        XZ[r, j] -= t
        XL[r, j] += step
        XP[r, j] += step
        XL[:, -1], XZ[:, -1], XP[:, -1] = starts[d] + d_lo - starts[E], t, e_pos
        cD, pD, okD = _costs(int(starts[d]), DL, DZ, DP, m, n, a, weights, kept)
        cE, pE, okE = _costs(starts[E], XL, XZ, XP, m, n, a, weights, kept)
        ok = okD & okE
        return {"E": E[ok], "D": (DL[ok], DZ[ok], DP[ok]), "X": (XL[ok], XZ[ok], XP[ok]), "cD": cD[ok],
                "pD": pD[ok], "cE": cE[ok], "pE": pE[ok]}

    def merge(old: dict, new: dict, drop) -> dict:
        """``old``'s rows whose E is not in ``drop``, then ``new``'s."""
        if not len(old["E"]):
            return new
        keep = ~np.isin(old["E"], list(drop))
        out = {k: tuple(u[keep] for u in v) if k in ("D", "X") else v[keep] for k, v in old.items()}
        if not len(new["E"]):
            return out
        return {k: tuple(_cat_rows(u, w) for u, w in zip(v, new[k])) if k in ("D", "X") else np.concatenate((v, new[k]))
                for k, v in out.items()}

    cache: dict = {}
    best = (float(total.max()), dict(state), cost.copy(), pairs.copy())  # the state with the lowest busiest rank
    for _ in range(rounds):
        runs = (table[1] > 0).sum(axis=1)
        free = runs < MAX_RUNS
        docs = np.flatnonzero(free).tolist()
        move = None
        for g in np.argsort(-total, kind="stable")[:SWAP_TOP]:
            heavy = sorted(docs, key=lambda d: (-cost[d, g], d))[:SWAP_DOCS]
            for d in heavy:
                if cost[d, g] <= MIN_SHARE * scale:
                    continue
                if d not in cache:
                    others = free.copy()
                    others[d] = False
                    cache[d] = trades(d, others)
                rows = cache[d]
                if not len(rows["E"]):
                    continue
                busy = ~free[rows["E"]]
                new = total[None, :] - cost[d][None, :] - cost[rows["E"]] + rows["cD"] + rows["cE"]
                fd = np.where(busy, np.inf, _smooth(new / scale))
                i = int(np.argmin(fd))
                if fd[i] < f * (1 - 1e-9) and (move is None or fd[i] < move[0]):
                    move = (float(fd[i]), int(d), int(rows["E"][i]), i)
            if move is not None:
                break
        if move is None:
            break
        f, d, e, i = move
        rows = cache[d]
        sd_, se_ = tuple(v[i] for v in rows["D"]), tuple(v[i] for v in rows["X"])
        cD, pD, cE, pE = rows["cD"][i], rows["pD"][i], rows["cE"][i], rows["pE"][i]
        total += cD + cE - cost[d] - cost[e]
        state[d] = tuple(v[sd_[1] > 0] for v in sd_)
        state[e] = tuple(v[se_[1] > 0] for v in se_)
        cost[d], pairs[d], cost[e], pairs[e] = cD, pD, cE, pE
        if float(total.max()) < best[0]:
            best = (float(total.max()), dict(state), cost.copy(), pairs.copy())
        put(d)
        put(e)
        part_chunk = chunks()
        pair = np.zeros(len(x), dtype=bool)
        pair[[d, e]] = True
        for k in list(cache):  # re-price what d and e take part in
            if k in (d, e):
                del cache[k]
            else:
                cache[k] = merge(cache[k], trades(k, pair), {d, e})
    _, kept_state, cost[:], pairs[:] = best
    state.update(kept_state)


def _cat_rows(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Rows of two [R, k] arrays stacked, the narrower padded with zero-size columns at the end."""
    k = max(u.shape[1], w.shape[1])
    pad = lambda v: np.pad(v, ((0, 0), (0, k - v.shape[1])))  # noqa: E731
    return np.concatenate((pad(u), pad(w)))
