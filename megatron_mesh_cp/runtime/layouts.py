"""Token layouts: which tokens each CP rank holds, built per micro-batch from its documents.

Megatron's CP split is fixed -- the sequence is cut into 2N pieces and mesh chunk c holds pieces c
and 2N-1-c -- so a layout is a re-laying of the sequence before the split: a token order ``order``
(x' = x[order]) and the mask of x' it leaves. Under document masking every token's work is the
number of keys it sees (its document position + 1, causal; its document's length, not), so a
layout's work per chunk is exact and cheap. Four layouts:

* ``zigzag``: the sequence as given (Megatron's layout);
* ``balanced``: whole documents reordered so the zigzag chunks carry near-equal work
  (runtime/balance.py); the mask stays plain documents;
* ``tiled``: whole documents reordered so the *ranks* of the a x b mesh that runs them carry
  near-equal block cost (runtime/tile_balance.py: a rank computes a tile of blocks, and where a
  document crosses pieces decides which rank does that work); the mask stays plain documents;
* ``tiled-cut``: the tiled order with a few documents re-laid over the tokens the tiled order gives
  them (their parts reordered, rotated or interleaved), and a few of their tokens trading places
  with another document's in another chunk (runtime/tile_cut.py), moving cross-piece work from the
  busiest ranks to lighter ones without making any tile block non-empty that the tiled order
  leaves empty (same chunks sent); the mask is
  :class:`~megatron_mesh_cp.runtime.masks.arranged.Arranged`; ``restart=k`` cuts from the order of
  the rank search restarted with seed + k instead (auto tries one where the first stays unbalanced);
* ``split``: the longest documents cut the way TE's THD partition cuts every document -- 2N pieces,
  pieces g and 2N-1-g to chunk g, unpadded (uneven by a token at most) -- so each spreads its work
  evenly; piece g ends piece g of x' and piece 2N-1-g starts piece 2N-1-g, so in chunk g they are
  one run of rows. The other documents stay whole (their blocks stay prunable) and are laid back to
  back over the room left in each piece, in an order balancing the chunks' work with the split
  documents' (balance_order over those regions). The mask is
  :class:`~megatron_mesh_cp.runtime.masks.arranged.Arranged`.

Every rank computes the same layout from the same lengths (all searches are seeded). The planning
layer chooses among them by its cost model (planning/layouts.py); the launcher applies the order
to tokens, labels, loss mask, position ids and the rotary positions before the CP split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .balance import balance_order, balance_orders
from .tile_balance import PAIRS, tile_order, tile_work
from .tile_cut import cut_documents
from .masks import Documents, Mask, arranged_of

__all__ = ["TOKEN_LAYOUTS", "Arrangement", "arrange", "arrange_whole", "arrange_splits", "splits_cross_every_piece",
           "tiled_cut", "token_work", "chunk_of_piece", "half_rows", "split_label", "tile_chunks", "tile_sums"]

TOKEN_LAYOUTS = ("zigzag", "balanced", "tiled", "tiled-cut", "split")
#: the split layout's balance search (its whole documents around the split ones): at most this many
#: moves, stopping after SPLIT_PATIENCE that did not lower the busiest chunk -- a quarter of the
#: balanced layout's, so auto's split candidates cost its host time less (scripts/layout_quality.py:
#: auto's predicted seconds within 1% of the full search's on average)
SPLIT_ITERS, SPLIT_PATIENCE = 1024, 256


@dataclass(frozen=True, eq=False)
class Arrangement:
    """One micro-batch's layout: the ``mask`` of x', each chunk's attention pairs (``work``), what it
    is called (``name``, ``split``: documents cut, ``cut``: documents re-laid) and its runs (``runs``: per run of x' tokens, its
    document, first position and length, in x' order); :attr:`order` (x' = x[order]) is made from
    the runs on first use (only the layout that runs needs it)."""

    name: str
    mask: Mask
    work: np.ndarray
    runs: Tuple[np.ndarray, np.ndarray, np.ndarray] = field(repr=False)
    starts: np.ndarray = field(repr=False)  # each document's first token in x
    split: int = 0
    cut: int = 0  # tiled-cut: documents re-laid (in more than one run each)
    given: bool = False  # x' is x (the documents as given)
    shape: Tuple[int, ...] = ()  # (a, b): the mesh a tiled layout balances the ranks of
    rank_work: Optional[np.ndarray] = field(default=None, repr=False)  # tiled, split with halves: each rank's pairs
    halves: int = 0  # split: the last this many split documents cut over half of each mesh row's chunks
    # how it was chosen, for the chooser (decode does not carry them back: the runs alone are the layout)
    restart: int = 0  # tiled, tiled-cut: its rank search's seed past the balanced order's (arrange's ``restart``)
    cut_balance: float = 0.0  # tiled-cut: the busiest rank's modelled cost over the mean's (runtime/tile_cut.py)

    @cached_property
    def order(self) -> Optional[np.ndarray]:
        """The token permutation (x' = x[order], int64 [total]); None when x' is x."""
        if self.given:
            return None
        doc, pos, length = self.runs
        keep = length > 0
        first = (self.starts[doc] + pos)[keep].astype(np.int64)
        length = length[keep].astype(np.int64)
        out = np.ones(int(length.sum()), dtype=np.int64)  # +1 within a run, the jump to its first token between
        if len(out):
            out[0] = first[0]
            ends = np.cumsum(length)[:-1]
            out[ends] = first[1:] - (first[:-1] + length[:-1] - 1)
            np.cumsum(out, out=out)  # one array, filled in place (1M tokens: ~4 ms of host time less)
        return out

    @property
    def balance(self) -> float:
        """Busiest chunk's work over the mean chunk's (1.0: perfect); for a tiled layout, which balances
        the mesh's ranks instead, the busiest rank's attention pairs over the mean rank's."""
        work = self.work if self.rank_work is None else self.rank_work
        mean = float(work.mean())
        return float(work.max()) / mean if mean else 1.0

    @property
    def label(self) -> str:
        """The layout as ``--mesh-layout`` / the simulator's ``--layout`` name it: :func:`split_label` for a
        split layout, else the name."""
        return split_label(self.split, self.halves) if self.split else self.name

    def describe(self) -> str:
        cut = f", {self.split} document{'s' if self.split != 1 else ''} split" if self.split else ""
        if self.halves:
            cut += f" ({self.halves} over half of each mesh row's chunks)"
        if self.cut:
            cut = f", {self.cut} document{'s' if self.cut != 1 else ''} re-laid"
        mesh = f" (ranks of the {self.shape[0]}x{self.shape[1]} mesh balanced)" if self.shape and not self.halves else ""
        what = "chunk" if self.rank_work is None else "rank"
        return f"{self.name}{cut}{mesh}: busiest / mean {what} work {self.balance:.2f}"


def split_label(split: int, halves: int = 0) -> str:
    """A split layout's name: ``split:K`` (K documents cut), ``split:K:H`` (the last H of them over half of
    each mesh row's chunks)."""
    return f"split:{split}" + (f":{halves}" if halves else "")


def _split_mask_name(split: int, halves: int) -> str:
    """What a split layout's Arranged mask calls it (``split K``, ``split K:H``)."""
    return split_label(split, halves).replace(":", " ", 1)


def chunk_of_piece(p, chunks: int):
    """The mesh chunk holding zigzag piece ``p`` (ints or arrays) of 2 * ``chunks`` pieces."""
    return np.minimum(p, 2 * chunks - 1 - np.asarray(p))


def token_work(doc_pos: np.ndarray, doc_len: np.ndarray, causal: bool) -> np.ndarray:
    """Keys each token sees under document masking: its position + 1 (causal) or its document's length."""
    return doc_pos + 1 if causal else doc_len


def _check(lengths: Sequence[int], chunks: int) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.int64)
    if x.ndim != 1 or len(x) == 0 or (x < 1).any():
        raise ValueError("documents need positive lengths")
    if chunks < 1 or int(x.sum()) % (2 * chunks):
        raise ValueError(f"the documents span {int(x.sum())} tokens, not a multiple of 2*{chunks}: the CP split "
                         "cuts the sequence into 2 pieces per mesh chunk")
    return x


def _runs_work(doc: np.ndarray, pos: np.ndarray, length: np.ndarray, lengths: np.ndarray, chunks: int,
               causal: bool) -> Tuple[Tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """The runs cut at the piece boundaries, and the pairs per chunk: a run of ``l`` tokens from
    position ``s`` sees ``l*s + l(l+1)/2`` keys (causal) or ``l * len(doc)``."""
    total = int(length.sum())
    m = total // (2 * chunks)
    ends = np.cumsum(length)
    cuts = np.union1d(np.concatenate(([0], ends)), np.arange(0, total + 1, m))
    lo = cuts[:-1]
    k = np.searchsorted(ends, lo, side="right")  # the run holding each cut segment
    seg_len = np.diff(cuts)
    seg_pos = pos[k] + lo - (ends[k] - length[k])
    seg_doc = doc[k]
    sp, sl = seg_pos.astype(np.float64), seg_len.astype(np.float64)
    w = sl * sp + sl * (sl + 1) / 2 if causal else sl * lengths[seg_doc].astype(np.float64)
    work = np.bincount(chunk_of_piece(lo // m, chunks), weights=w, minlength=chunks)
    return (doc, pos, length), work


def _mask_of(doc: np.ndarray, pos: np.ndarray, length: np.ndarray, layout: str) -> Mask:
    """The Arranged mask of runs (consecutive runs that continue one document merged)."""
    ends = np.cumsum(length)
    starts = ends - length
    keep = np.r_[True, (doc[1:] != doc[:-1]) | (pos[1:] != pos[:-1] + length[:-1])]
    cuts = np.concatenate((starts[keep], [ends[-1]]))
    return arranged_of(cuts, doc[keep], pos[keep], layout=layout)


def _whole(lengths: np.ndarray, order_of_docs: Sequence[int], chunks: int, causal: bool, name: str) -> Arrangement:
    """Whole documents in ``order_of_docs``: x' is their concatenation."""
    idx = np.asarray(order_of_docs, dtype=np.int64)
    lens = lengths[idx]
    cu = np.concatenate(([0], np.cumsum(lens)))
    runs, work = _runs_work(idx, np.zeros(len(idx), dtype=np.int64), lens, lengths, chunks, causal)
    same = np.array_equal(idx, np.arange(len(lengths)))
    return Arrangement(name, Documents(tuple(int(c) for c in cu)), work, runs, _starts(lengths), given=same)


def _given(doc: np.ndarray, pos: np.ndarray, length: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether runs (document, first position, length) in x' order are the documents as given: x' is x."""
    return bool(np.array_equal(doc, np.arange(len(lengths))) and not pos.any() and np.array_equal(length, lengths))


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(lengths)))[:-1]


def _split_sizes(length: int, cap: np.ndarray) -> np.ndarray:
    """A document's 2N piece sizes: equal, the remainder one token each to the pieces with most room."""
    n2 = len(cap)
    base, rem = divmod(length, n2)
    sizes = np.full(n2, base, dtype=np.int64)
    if rem:
        sizes[np.argsort(-(cap - base), kind="stable")[:rem]] += 1
    return sizes


def _split(lengths: np.ndarray, chunks: int, count: int, causal: bool, seed: int,
           shape: Optional[Tuple[int, int]] = None, halves: int = 0) -> Optional[Arrangement]:
    """The ``count`` longest documents split TE-style, the others whole, laid back to back over the
    room the split pieces leave in an order balancing the chunks' work (balance_order over those
    regions); None when the split ones do not fit (their pieces must leave room in every chunk).

    In chunk c the first split document's two pieces meet at the centre (the end of x' piece c and
    the start of piece 2N-1-c); every other split document's two pieces sit side by side in one half
    (the one with more room left), so each split document is one run of rows per chunk and one
    kernel call per block. ``halves``: the last this many are cut over half of each row's chunks of the
    ``shape`` mesh (:func:`_split_plan`); a pair that fits neither half of a chunk then sits one piece
    in each (two runs there)."""
    plan = _split_plan(lengths, chunks, count, causal, shape, halves)
    if plan is None:
        return None
    problem = plan.problem(seed)
    return plan.lay(None if problem is None else balance_order(chunks=chunks, causal=causal, iters=SPLIT_ITERS,
                                                               patience=SPLIT_PATIENCE, **problem))


class _SplitPlan:
    """A split layout before its whole documents are ordered: the split documents' pieces, each
    piece's room left for the whole ones, and their work per chunk (:func:`_split_plan`); ``centre``:
    per chunk the split document at its centre, ``shape`` and ``halves`` as :func:`_split_plan` took them."""

    def __init__(self, lengths, chunks, causal, count, longest, sizes, room, side, fixed, rest, centre, shape,
                 halves) -> None:
        self.lengths, self.chunks, self.causal, self.count, self.longest = lengths, chunks, causal, count, longest
        self.sizes, self.room, self.side, self.fixed, self.rest = sizes, room, side, fixed, rest
        self.centre, self.shape, self.halves = centre, shape, halves

    def problem(self, seed: int) -> Optional[dict]:
        """balance_order's problem for the whole documents (None: at most one, nothing to order)."""
        if len(self.rest) < 2:
            return None
        return dict(lengths=self.lengths[self.rest].tolist(), regions=self.room.tolist(), fixed=self.fixed, seed=seed)

    def lay(self, order: Optional[Sequence[int]]) -> Arrangement:
        """The layout with the whole documents in ``order`` (indices into :attr:`rest`; None: as given)."""
        rest = self.rest if order is None else [self.rest[i] for i in order]
        return _split_lay(self, rest)


def half_rows(a: int, b: int) -> bool:
    """Whether an a x b mesh can take a document cut over half of each mesh row's chunks so that every
    rank meets an equal share of it (a and b even: each rank's KV column then meets it in b/2 rows)."""
    return a % 2 == 0 and b % 2 == 0


def _row_chunks(a: int, b: int, off: int) -> np.ndarray:
    """Half of each mesh row's chunks, alternating halves row by row from column ``off``: chunk a*r + s
    for s in [off + r*a/2, off + (r+1)*a/2) mod a. Rank (r, c) holds Q chunks a*r .. a*r + a-1 and KV
    chunks a*k + c, so it meets such a document in a/2 Q chunks x b/2 KV chunks: a quarter of the
    blocks every chunk would give it, each with four times the pairs (the same work)."""
    t = a // 2
    return np.array(sorted(a * r + (off + r * t + u) % a for r in range(b) for u in range(t)), dtype=np.int64)


def _split_plan(lengths: np.ndarray, chunks: int, count: int, causal: bool, shape: Optional[Tuple[int, int]] = None,
                halves: int = 0) -> Optional[_SplitPlan]:
    """The split documents' pieces and the room they leave (None: they do not fit), before balancing.
    ``halves``: the last this many of the ``count`` split documents are cut over half of each row's
    chunks of the ``shape`` (a, b) mesh (:func:`_row_chunks`) instead of over every chunk."""
    n2 = 2 * chunks
    total = int(lengths.sum())
    m = total // n2
    longest = [int(d) for d in np.argsort(-lengths, kind="stable")[:count]]
    cap = np.full(n2, m, dtype=np.int64)  # room per x' piece
    sizes = {}
    for k, d in enumerate(longest):  # piece sizes; the remainder tokens go to the chunks with most room
        if k < count - halves:
            sizes[d] = _split_sizes(int(lengths[d]), cap)
        else:  # over half of each row: the pattern leaving most room (the first of equals)
            best = None
            for off in range(shape[0]):
                c = _row_chunks(shape[0], shape[1], off)
                idx = np.sort(np.concatenate((c, n2 - 1 - c)))
                sz = np.zeros(n2, dtype=np.int64)
                sz[idx] = _split_sizes(int(lengths[d]), cap[idx])
                if best is None or (cap - sz).min() > (cap - best).min():
                    best = sz
            sizes[d] = best
        cap = cap - sizes[d]
        if (cap < 0).any() and d == longest[0]:
            return None
    # per chunk: the centre document (the longest split one there; without halves always the first)
    # spans both halves, each other one's pair sits in one half, or (halves only) apart in both
    room = np.full(n2, m, dtype=np.int64)
    side, centre = {}, {}  # (document, chunk) -> x' piece holding both its pieces (-1: one in each half)
    for c in range(chunks):
        hi = n2 - 1 - c
        here = [d for d in longest if not halves or sizes[d][c] + sizes[d][hi]]
        if not here:
            continue
        centre[c] = here[0]
        room[c] -= sizes[here[0]][c]
        room[hi] -= sizes[here[0]][hi]
        placed = _place_pairs(here[1:], sizes, c, hi, int(room[c]), int(room[hi]), bool(halves))
        if placed is None:
            return None
        for d, p in placed:
            lo_take, hi_take = _taken(sizes[d], c, hi, p)
            room[c] -= lo_take
            room[hi] -= hi_take
            side[(d, c)] = p
    if (room < 0).any():
        return None
    rest = [d for d in range(len(lengths)) if d not in sizes]
    if halves:  # balance the ranks: each rank's split-document pairs, on the chunk whose own block it runs
        a, b = shape
        fixed = tile_sums(_block_pairs(sizes, causal, chunks), a, b)
    else:  # the split documents' work per chunk: piece g of document d holds positions [first_g, first_g + s_g)
        piece_first = {d: np.concatenate(([0], np.cumsum(s)))[:-1] for d, s in sizes.items()}
        fixed = np.zeros(chunks)
        for d, s in sizes.items():
            w = s * piece_first[d] + s * (s + 1) / 2 if causal else s * float(lengths[d])
            np.add.at(fixed, chunk_of_piece(np.arange(n2), chunks), w)
    return _SplitPlan(lengths, chunks, causal, count, longest, sizes, room, side, fixed, rest, centre,
                      tuple(shape) if halves else (), halves)


#: the most split documents besides the centre one in a chunk whose placements _place_pairs searches
#: all of (3^k) where its greedy pass finds none
PLACE_SEARCH = 6


def _taken(size: np.ndarray, c: int, hi: int, p: int) -> Tuple[int, int]:
    """Tokens a split document's pieces c and hi take from x' pieces c and hi, placed at ``p`` (c or hi:
    both in that piece; -1: each in its own)."""
    s_lo, s_hi = int(size[c]), int(size[hi])
    return (s_lo + s_hi, 0) if p == c else (0, s_lo + s_hi) if p == hi else (s_lo, s_hi)


def _place_pairs(docs, sizes, c: int, hi: int, lo_room: int, hi_room: int, apart: bool):
    """Where each of ``docs`` (split documents other than the centre one) sits in chunk c: [(document,
    x' piece c or hi holding both its pieces, or -1: one piece in each)], or None where they do not fit
    the room left in pieces c and hi. Greedily each pair in the piece with more room, else the other,
    else (``apart``) apart; where that fails with ``apart``, the first placement in (c, hi, -1)^k order
    that fits, for k <= PLACE_SEARCH (a pair kept together early can leave no room for a later,
    longer-pieced one that fits only apart)."""
    out, r_lo, r_hi = [], lo_room, hi_room
    for d in docs:
        need = int(sizes[d][c] + sizes[d][hi])
        p = c if r_lo >= r_hi else hi
        if (r_lo if p == c else r_hi) < need:
            p = hi if p == c else c
            if (r_lo if p == c else r_hi) < need:
                if not apart or r_lo < sizes[d][c] or r_hi < sizes[d][hi]:
                    out = None
                    break
                p = -1
        lo_take, hi_take = _taken(sizes[d], c, hi, p)
        r_lo, r_hi = r_lo - lo_take, r_hi - hi_take
        out.append((d, p))
    if out is not None or not apart or len(docs) > PLACE_SEARCH:
        return out
    for choice in itertools.product((c, hi, -1), repeat=len(docs)):
        takes = [_taken(sizes[d], c, hi, p) for d, p in zip(docs, choice)]
        if lo_room >= sum(t[0] for t in takes) and hi_room >= sum(t[1] for t in takes):
            return list(zip(docs, choice))
    return None


def _block_pairs(sizes, causal: bool, chunks: int) -> np.ndarray:
    """[chunks, chunks] attention pairs of documents cut in x' pieces of ``sizes`` (document -> 2N piece
    sizes, positions increasing with the piece): block (Q chunk, KV chunk)."""
    n2 = 2 * chunks
    chunk = chunk_of_piece(np.arange(n2), chunks)
    out = np.zeros((chunks, chunks))
    for s in sizes.values():
        s = s.astype(np.float64)
        pairs = np.outer(s, s)
        if causal:  # query piece p sees key piece q < p whole, its own as a triangle
            pairs = np.tril(pairs, -1) + np.diag(s * (s + 1) / 2)
        np.add.at(out, (chunk[:, None], chunk[None, :]), pairs)
    return out


@lru_cache(maxsize=64)  # keyed by the mesh shape
def tile_chunks(a: int, b: int) -> Tuple[np.ndarray, np.ndarray]:
    """Every rank's tile of the a x b mesh as chunk indices, ``[rank, Q offset]`` and ``[rank, KV offset]``
    (read-only): rank g = (r, c) runs Q chunks a*r + (c - qo) % a by KV chunks a*((r - ko) % b) + c, and its
    own block (offsets 0, 0) is chunk g's."""
    g = np.arange(a * b)
    r, c = g // a, g % a
    qi = r[:, None] * a + (c[:, None] - np.arange(a)[None, :]) % a
    kj = ((r[:, None] - np.arange(b)[None, :]) % b) * a + c[:, None]
    qi.setflags(write=False)
    kj.setflags(write=False)
    return qi, kj


def tile_sums(blocks: np.ndarray, a: int, b: int) -> np.ndarray:
    """Each rank's sum of ``blocks`` (``[chunk, chunk]``) over its tile (:func:`tile_chunks`)."""
    qi, kj = tile_chunks(a, b)
    return blocks[qi[:, :, None], kj[:, None, :]].sum(axis=(1, 2))


def _split_lay(plan: _SplitPlan, rest: List[int]) -> Arrangement:
    """The runs of a split layout: per x' piece the whole documents' region (``rest`` back to back),
    the split pairs kept in that half and the centre document's piece."""
    lengths, chunks, causal, count, longest = plan.lengths, plan.chunks, plan.causal, plan.count, plan.longest
    sizes, room, side = plan.sizes, plan.room, plan.side
    n2 = 2 * chunks
    piece_first = {d: np.concatenate(([0], np.cumsum(s)))[:-1] for d, s in sizes.items()}
    # the whole documents as one stream of runs, cut into each piece's region
    rest_arr = np.asarray(rest, dtype=np.int64)
    rest_end = np.cumsum(lengths[rest_arr]) if rest else np.zeros(0, dtype=np.int64)

    def region(at: int, size: int):
        """Runs of the whole documents' stream covering stream tokens [at, at + size)."""
        if size <= 0:
            return []
        first = int(np.searchsorted(rest_end, at, side="right"))
        last = int(np.searchsorted(rest_end, at + size - 1, side="right"))
        out = []
        for q in range(first, last + 1):
            d_lo = int(rest_end[q] - lengths[rest_arr[q]])
            lo, hi = max(at, d_lo), min(at + size, int(rest_end[q]))
            out.append((int(rest_arr[q]), lo - d_lo, hi - lo))
        return out

    def piece(d, g):
        return [(d, int(piece_first[d][g]), int(sizes[d][g]))] if sizes[d][g] else []

    # x' piece p: (p < N) the whole documents' region, the pairs kept in this half, the centre document's
    # piece c; (p >= N) the centre document's piece 2N-1-c, the pairs kept here, the region
    runs, at = [], 0
    for p in range(n2):
        c = min(p, n2 - 1 - p)
        reg = region(at, int(room[p]))
        at += int(room[p])
        pairs = [r for d in longest if side.get((d, c)) == p for r in piece(d, c) + piece(d, n2 - 1 - c)]
        apart = [r for d in longest if side.get((d, c)) == -1 for r in piece(d, p)]
        pairs = pairs + apart if p < chunks else apart + pairs
        centre = piece(plan.centre[c], p) if c in plan.centre else []
        runs.extend(reg + pairs + centre if p < chunks else centre + pairs + reg)
    doc, pos, length = (np.array(col, dtype=np.int64) for col in zip(*runs))
    runs_, work = _runs_work(doc, pos, length, lengths, chunks, causal)
    label = _split_mask_name(count, plan.halves)
    rank_work = None
    if plan.halves:  # every rank's attention pairs (its tile of the x' blocks)
        rank_work = tile_sums(_run_block_pairs(doc, pos, length, chunks, causal), *plan.shape)
    return Arrangement("split", _mask_of(doc, pos, length, label), work, runs_, _starts(lengths), split=count,
                       shape=plan.shape, rank_work=rank_work, halves=plan.halves)


def _run_block_pairs(doc: np.ndarray, pos: np.ndarray, length: np.ndarray, chunks: int, causal: bool) -> np.ndarray:
    """[chunks, chunks] attention pairs of runs (document, first position, length) in x' order."""
    total = int(length.sum())
    m = total // (2 * chunks)
    ends = np.cumsum(length)
    cuts = np.union1d(np.concatenate(([0], ends)), np.arange(0, total + 1, m))
    lo = cuts[:-1]
    k = np.searchsorted(ends, lo, side="right")
    seg_len = np.diff(cuts).astype(np.float64)
    seg_lo = (pos[k] + lo - (ends[k] - length[k])).astype(np.float64)
    seg_doc, seg_chunk = doc[k], chunk_of_piece(lo // m, chunks)
    out = np.zeros((chunks, chunks))
    order = np.argsort(seg_doc, kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(seg_doc[order]) != 0, True])
    for x, y in zip(bounds[:-1], bounds[1:]):
        idx = order[x:y]
        q_lo, ln, ch = seg_lo[idx], seg_len[idx], seg_chunk[idx]
        pairs = np.outer(ln, ln)
        if causal:  # segments of one document are disjoint: keys wholly before the queries, or the same run
            pairs = np.where(q_lo[None, :] < q_lo[:, None], pairs, 0.0)
            pairs[np.arange(len(idx)), np.arange(len(idx))] = ln * (ln + 1) / 2
        np.add.at(out, (ch[:, None], ch[None, :]), pairs)
    return out


def arrange(lengths: Sequence[int], chunks: int, layout: str = "balanced", *, causal: bool = True,
            split: int = 1, seed: int = 0, shape: Optional[Tuple[int, int]] = None,
            weights: Optional[Tuple[float, float, float, float]] = None,
            start: Optional[Sequence[int]] = None, halves: int = 0, restart: int = 0) -> Arrangement:
    """The layout ``layout`` of documents of ``lengths`` (in the micro-batch's order) over ``chunks``
    mesh chunks; ``split``: how many of the longest documents the ``split`` layout cuts (``halves``: the
    last this many of them over half of each row's chunks of the ``shape`` mesh); ``shape``:
    the (a, b) mesh whose ranks the ``tiled`` layout balances (a * b = ``chunks``), ``weights`` its
    kernel-call cost model (runtime/tile_balance.py; default: pairs), ``start`` the order its search
    starts from (default: the balanced one, which it computes), ``restart`` (tiled, tiled-cut) the rank
    search's seed past ``seed`` (from the same start: another local optimum; planning/layouts.py tries
    one where the tiled-cut layout stays unbalanced). ``ValueError`` naming the fix for a layout that
    cannot be built."""
    x = _check(lengths, chunks)
    if restart and layout not in ("tiled", "tiled-cut"):  # else silently the unrestarted layout
        raise ValueError(f"restart restarts the tiled rank search: the tiled and tiled-cut layouts take it, not "
                         f"{layout!r} (pass restart=0)")
    if layout == "zigzag":
        return _whole(x, range(len(x)), chunks, causal, "zigzag")
    if layout == "balanced":
        return _whole(x, balance_order(x.tolist(), chunks, causal=causal, seed=seed), chunks, causal, "balanced")
    if layout == "tiled":
        if shape is None or len(shape) != 2 or int(shape[0]) * int(shape[1]) != chunks:
            raise ValueError(f"the tiled layout balances the ranks of an a x b mesh of {chunks} chunks: pass "
                             f"shape=(a, b) with a * b = {chunks}, not {shape!r}")
        a, b = int(shape[0]), int(shape[1])
        if isinstance(restart, bool) or not isinstance(restart, (int, np.integer)) or restart < 0:
            raise ValueError(f"restart counts the tiled search's restarts: an int >= 0, not {restart!r}")
        if restart and start is None:  # the balanced order of ``seed``, as tile_order starts from
            start = balance_order(x.tolist(), chunks, causal=causal, seed=seed)
        order = tile_order(x.tolist(), a, b, causal=causal, weights=weights, seed=seed + restart, start=start)
        return replace(_whole(x, order, chunks, causal, "tiled"), shape=(a, b),
                       rank_work=tile_work(x.tolist(), a, b, causal=causal, orders=[order])[0], restart=restart)
    if layout == "tiled-cut":
        if shape is None or len(shape) != 2 or int(shape[0]) * int(shape[1]) != chunks:
            raise ValueError(f"the tiled-cut layout balances the ranks of an a x b mesh of {chunks} chunks: pass "
                             f"shape=(a, b) with a * b = {chunks}, not {shape!r}")
        a, b = int(shape[0]), int(shape[1])
        return tiled_cut(arrange(x.tolist(), chunks, "tiled", causal=causal, seed=seed, shape=(a, b),
                                 weights=weights, start=start, restart=restart), causal=causal, weights=weights)
    if layout == "split":
        if not 1 <= split <= len(x):
            raise ValueError(f"the split layout cuts 1 .. {len(x)} documents, not {split}")
        _check_halves(split, halves, shape, chunks)
        out = _split(x, chunks, split, causal, seed, shape, halves)
        if out is None:
            raise ValueError(f"the {split} longest documents do not fit the split layout's pieces ({int(x.sum())} "
                             f"tokens over {2 * chunks} pieces); split fewer")
        return out
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(TOKEN_LAYOUTS)} (or auto, which the launcher "
                     "chooses per micro-batch)")


def _check_halves(split: int, halves: int, shape, chunks: int) -> None:
    if not halves:
        return
    if not 0 < halves <= split:
        raise ValueError(f"the split layout cuts {split} documents: 0 .. {split} of them can go over half of each "
                         f"mesh row, not {halves}")
    if shape is None or len(shape) != 2 or int(shape[0]) * int(shape[1]) != chunks or not half_rows(*shape):
        raise ValueError(f"a split layout with documents over half of each mesh row needs the a x b mesh of {chunks} "
                         f"chunks, a and b even: pass shape=(a, b), not {shape!r}")


def arrange_whole(lengths: Sequence[int], chunks: int, *, causal: bool = True, seed: int = 0,
                  shape: Optional[Tuple[int, int]] = None,
                  weights: Optional[Tuple[float, float, float, float]] = None) -> List[Arrangement]:
    """The whole-document layouts: zigzag, balanced and (with ``shape``) tiled, searched from the
    balanced order; each exactly :func:`arrange`'s."""
    x = _check(lengths, chunks)
    bal = _whole(x, balance_order(x.tolist(), chunks, causal=causal, seed=seed), chunks, causal, "balanced")
    out = [_whole(x, range(len(x)), chunks, causal, "zigzag"), bal]
    if shape is not None:
        out.append(arrange(x.tolist(), chunks, "tiled", causal=causal, seed=seed, shape=shape, weights=weights,
                           start=bal.runs[0]))
    return out


def tiled_cut(tiled: Arrangement, *, causal: bool = True,
              weights: Optional[Tuple[float, float, float, float]] = None) -> Arrangement:
    """The ``tiled-cut`` layout from a ``tiled`` one: its documents where it has them, a few re-laid inside
    their tokens and a few of those tokens traded with another document's in another chunk
    (runtime/tile_cut.py) where that lowers the busiest rank's modelled cost and every
    block it makes non-empty lies in a tile block the tiled layout keeps; ``weights``: the tiled
    search's kernel-call model (default: pairs). Without the causal mask a re-lay moves no work (a
    document's pairs per chunk pair are fixed by its footprint): the tiled order as it is, as an
    Arranged mask."""
    if tiled.name != "tiled" or not tiled.shape:
        raise ValueError("tiled_cut starts from a tiled layout (arrange(..., 'tiled', shape=(a, b)))")
    a, b = tiled.shape
    n = a * b
    order = tiled.runs[0]
    lengths = tiled.runs[2][np.argsort(order)]
    w = PAIRS if weights is None else tuple(float(v) for v in weights)
    total = int(lengths.sum())
    m = total // (2 * n)
    runs_, cut, rank_pairs = [(int(d), 0, int(lengths[d])) for d in order.tolist()], 0, tiled.rank_work
    ratio = 0.0
    if causal and n > 1:
        base = np.full(n, w[0] + (w[1] + w[2]) * 2 * m)  # each rank's own (diagonal) varlen call
        runs_, cut, cost, rank_pairs = cut_documents(lengths, order, a, b, weights=w, base=base)
        ratio = float(cost.max() / cost.mean())
    doc, pos, length = (np.asarray(v, dtype=np.int64) for v in zip(*runs_))
    runs, work = _runs_work(doc, pos, length, lengths, n, causal)
    mask = _mask_of(doc, pos, length, "tiled-cut")
    return Arrangement("tiled-cut", mask, work, runs, tiled.starts, cut=cut, given=_given(doc, pos, length, lengths),
                       shape=(a, b), rank_work=rank_pairs, restart=tiled.restart, cut_balance=ratio)


def arrange_splits(lengths: Sequence[int], chunks: int, splits: int, *, causal: bool = True,
                   seed: int = 0, shape: Optional[Tuple[int, int]] = None,
                   halves: Optional[Sequence[Tuple[int, int]]] = None) -> List[Arrangement]:
    """The split layouts over the 1 .. ``splits`` longest documents (up to the first that does not fit),
    each exactly :func:`arrange`'s; their balance searches run in lockstep
    (:func:`~megatron_mesh_cp.runtime.balance.balance_orders`: one evaluation per round for all).
    ``halves`` (with ``shape``): instead, for each (k, h) given, the layout cutting the k longest
    documents, the last h of them over half of each mesh row's chunks (those that fit; none where
    there are fewer than k documents); ``splits`` is then not read."""
    x = _check(lengths, chunks)
    plans = []
    if halves is None:
        for k in range(1, min(splits, len(x)) + 1):
            plan = _split_plan(x, chunks, k, causal)
            if plan is None:
                break
            plans.append(plan)
    else:
        for k, h in halves:
            if k > len(x):
                continue
            _check_halves(k, h, shape, chunks)
            plan = _split_plan(x, chunks, k, causal, shape, h)
            if plan is not None:
                plans.append(plan)
    problems = [p.problem(seed) for p in plans]
    found = iter(balance_orders([p for p in problems if p is not None], chunks, causal=causal, iters=SPLIT_ITERS,
                                patience=SPLIT_PATIENCE))
    return [p.lay(next(found) if q is not None else None) for p, q in zip(plans, problems)]


def splits_cross_every_piece(lengths: Sequence[int], chunks: int) -> bool:
    """Whether every split layout's first (the longest) document has tokens in all 2 * ``chunks``
    pieces, so its mask needs every block of any mesh tile (runtime/layouts.py's split)."""
    return max(lengths) >= 2 * chunks


def encode(arr: Arrangement) -> Tuple[np.ndarray, np.ndarray]:
    """``arr`` as two flat arrays a data-loader worker can hand over (the launcher chooses each
    micro-batch's layout there, ahead of its step): int64 ``[kind, split, cut, given, a, b, halves, runs,
    doc..., pos..., length...]`` and the per-rank work of a layout balancing ranks (float64, empty otherwise)."""
    doc, pos, length = arr.runs
    a, b = arr.shape if arr.shape else (0, 0)
    head = [TOKEN_LAYOUTS.index(arr.name), arr.split, arr.cut, int(arr.given), a, b, arr.halves, len(doc)]
    work = np.zeros(0) if arr.rank_work is None else np.asarray(arr.rank_work, dtype=np.float64)
    return np.concatenate((np.asarray(head, dtype=np.int64), doc, pos, length)).astype(np.int64), work


def decode(code, rank_work, lengths: Sequence[int], chunks: int, causal: bool = True) -> Arrangement:
    """The :class:`Arrangement` :func:`encode` gave, for the micro-batch of documents ``lengths``;
    ``ValueError`` when the code does not lay out exactly these documents (a stale or foreign code)."""
    x = _check(lengths, chunks)
    c = np.asarray(code, dtype=np.int64).ravel()
    if len(c) < 8 or not 0 <= c[0] < len(TOKEN_LAYOUTS) or len(c) != 8 + 3 * int(c[7]):
        raise ValueError(f"not a token layout's code ({len(c)} values)")
    kind, split, cut, given, a, b, halves, k = (int(v) for v in c[:8])
    doc, pos, length = c[8:8 + k], c[8 + k:8 + 2 * k], c[8 + 2 * k:]
    if (doc < 0).any() or (doc >= len(x)).any() or (length < 1).any() or (pos < 0).any():
        raise ValueError("a token layout's code names documents or runs this micro-batch does not have")
    seen = np.zeros(len(x), dtype=np.int64)
    np.add.at(seen, doc, length)
    if not np.array_equal(seen, x) or (pos + length > x[doc]).any():
        raise ValueError("a token layout's code does not lay out this micro-batch's documents (its lengths "
                         f"{seen.tolist()[:6]}..., the batch's {x.tolist()[:6]}...)")
    name = TOKEN_LAYOUTS[kind]
    if (bool(given) != _given(doc, pos, length, x) or (split > 0) != (name == "split") or (cut and name != "tiled-cut")
            or (a and a * b != chunks) or (bool(a) != (name in ("tiled", "tiled-cut") or halves > 0))
            or not 0 <= halves <= split or (halves and not half_rows(a, b))):
        raise ValueError(f"a token layout's code is inconsistent ({name}, split {split}, cut {cut}, given {given}, "
                         f"halves {halves}, mesh {a}x{b} for {chunks} chunks)")
    runs, work = _runs_work(doc, pos, length, x, chunks, causal)
    if split or name == "tiled-cut":  # documents in pieces: the Arranged mask its builder makes
        mask = _mask_of(doc, pos, length, _split_mask_name(split, halves) if split else name)
        mask.check(int(x.sum()), chunks, causal)  # every document's positions tiled exactly once
    else:
        if (pos != 0).any() or not np.array_equal(length, x[doc]):
            raise ValueError("a whole-document layout's code cuts a document")
        mask = Documents(tuple(int(v) for v in np.concatenate(([0], np.cumsum(length)))))
    rw = None if len(rank_work) == 0 else np.asarray(rank_work, dtype=np.float64)
    return Arrangement(name, mask, work, runs, _starts(x), split=split, cut=cut, given=bool(given),
                       shape=(a, b) if a else (), rank_work=rw, halves=halves)


def positions_of(arr: Arrangement, total: int) -> np.ndarray:
    """The original sequence position of every x' token (the rotary positions RoPE must use)."""
    return np.arange(total) if arr.order is None else arr.order


__all__ += ["positions_of", "encode", "decode"]
