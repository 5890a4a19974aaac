"""Token layouts: which tokens each CP rank holds, built per micro-batch from its documents.

Megatron's CP split is fixed -- the sequence is cut into 2N pieces and mesh chunk c holds pieces c
and 2N-1-c -- so a layout is a re-laying of the sequence before the split: a token order ``order``
(x' = x[order]) and the mask of x' it leaves. Under document masking every token's work is the
number of keys it sees (its document position + 1, causal; its document's length, not), so a
layout's work per chunk is exact and cheap. Three layouts:

* ``zigzag``: the sequence as given (Megatron's layout);
* ``balanced``: whole documents reordered so the zigzag chunks carry near-equal work
  (runtime/balance.py); the mask stays plain documents;
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

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .balance import balance_order
from .masks import Documents, Mask, arranged_of

__all__ = ["LAYOUTS", "Arrangement", "arrange", "token_work", "chunk_of_piece"]

LAYOUTS = ("zigzag", "balanced", "split")


@dataclass(frozen=True, eq=False)
class Arrangement:
    """One micro-batch's layout: ``order`` (x' = x[order]; None: as given), the ``mask`` of x',
    each chunk's attention pairs (``work``) and what it is called (``name``, ``split``: documents cut)."""

    name: str
    order: Optional[np.ndarray]
    mask: Mask
    work: np.ndarray
    split: int = 0

    @property
    def balance(self) -> float:
        """Busiest chunk's work over the mean chunk's (1.0: perfect)."""
        mean = float(self.work.mean())
        return float(self.work.max()) / mean if mean else 1.0

    def describe(self) -> str:
        cut = f", {self.split} document{'s' if self.split != 1 else ''} split" if self.split else ""
        return f"{self.name}{cut}: busiest / mean chunk work {self.balance:.2f}"


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


def _chunk_work(order: np.ndarray, docs: np.ndarray, pos: np.ndarray, lengths: np.ndarray, chunks: int,
                causal: bool) -> np.ndarray:
    """Pairs per chunk of x' given, per x' token, its document and position."""
    m = len(order) // (2 * chunks)
    chunk = chunk_of_piece(np.arange(len(order)) // m, chunks)
    w = token_work(pos.astype(np.float64), lengths[docs].astype(np.float64), causal)
    return np.bincount(chunk, weights=w, minlength=chunks)


def _whole(lengths: np.ndarray, order_of_docs: Sequence[int], chunks: int, causal: bool, name: str) -> Arrangement:
    """Whole documents in ``order_of_docs``: x' is their concatenation."""
    idx = np.asarray(order_of_docs, dtype=np.int64)
    lens = lengths[idx]
    starts = np.concatenate(([0], np.cumsum(lengths)))[:-1]
    order = np.repeat(starts[idx], lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
    docs = np.repeat(idx, lens)
    pos = order - starts[docs]
    cu = np.concatenate(([0], np.cumsum(lens)))
    same = np.array_equal(idx, np.arange(len(lengths)))
    return Arrangement(name, None if same else order, Documents(tuple(int(c) for c in cu)),
                       _chunk_work(order, docs, pos, lengths, chunks, causal))


def _split_sizes(length: int, cap: np.ndarray) -> np.ndarray:
    """A document's 2N piece sizes: equal, the remainder one token each to the pieces with most room."""
    n2 = len(cap)
    base, rem = divmod(length, n2)
    sizes = np.full(n2, base, dtype=np.int64)
    if rem:
        sizes[np.argsort(-(cap - base), kind="stable")[:rem]] += 1
    return sizes


def _split(lengths: np.ndarray, chunks: int, count: int, causal: bool, seed: int) -> Optional[Arrangement]:
    """The ``count`` longest documents split TE-style, the others whole, laid back to back over the
    room the split pieces leave in an order balancing the chunks' work (balance_order over those
    regions); None when the split ones do not fit (their pieces must leave room in every chunk).

    In chunk c the first split document's two pieces meet at the centre (the end of x' piece c and
    the start of piece 2N-1-c); every other split document's two pieces sit side by side in one half
    (the one with more room left), so each split document is one run of rows per chunk and one
    kernel call per block."""
    n2 = 2 * chunks
    total = int(lengths.sum())
    m = total // n2
    longest = [int(d) for d in np.argsort(-lengths, kind="stable")[:count]]
    cap = np.full(n2, m, dtype=np.int64)  # room per x' piece
    sizes = {}
    for d in longest:  # piece sizes; the remainder tokens go to the chunks with most room
        sizes[d] = _split_sizes(int(lengths[d]), cap)
        cap = cap - sizes[d]
        if (cap < 0).any() and d == longest[0]:
            return None
    # per chunk: which half holds each non-centre split document's pair (the centre one spans both)
    room = np.full(n2, m, dtype=np.int64)
    side = {}  # (document, chunk) -> x' piece holding both its pieces
    for c in range(chunks):
        hi = n2 - 1 - c
        if longest:
            room[c] -= sizes[longest[0]][c]
            room[hi] -= sizes[longest[0]][hi]
        for d in longest[1:]:
            need = int(sizes[d][c] + sizes[d][hi])
            p = c if room[c] >= room[hi] else hi
            if room[p] < need:
                p = hi if p == c else c
                if room[p] < need:
                    return None
            room[p] -= need
            side[(d, c)] = p
    if (room < 0).any():
        return None
    piece_first = {d: np.concatenate(([0], np.cumsum(s)))[:-1] for d, s in sizes.items()}
    # the split documents' work per chunk: piece g of document d holds positions [first_g, first_g + s_g)
    fixed = np.zeros(chunks)
    for d, s in sizes.items():
        w = s * piece_first[d] + s * (s + 1) / 2 if causal else s * float(lengths[d])
        np.add.at(fixed, chunk_of_piece(np.arange(n2), chunks), w)
    rest = [d for d in range(len(lengths)) if d not in sizes]
    if len(rest) > 1:
        rest = [rest[i] for i in balance_order(lengths[rest].tolist(), chunks, causal=causal, regions=room.tolist(),
                                                fixed=fixed, seed=seed)]
    rl = lengths[rest] if rest else np.zeros(0, dtype=np.int64)
    stream_docs = np.repeat(np.asarray(rest, dtype=np.int64), rl)
    stream_pos = np.arange(int(rl.sum())) - np.repeat(np.cumsum(rl) - rl, rl)

    def piece(d, g):
        return np.full(int(sizes[d][g]), d, dtype=np.int64), piece_first[d][g] + np.arange(int(sizes[d][g]))

    # x' piece p: (p < N) the whole documents' region, the pairs kept in this half, the centre document's
    # piece c; (p >= N) the centre document's piece 2N-1-c, the pairs kept here, the region
    docs_out, pos_out, at = [], [], 0
    for p in range(n2):
        c = min(p, n2 - 1 - p)
        region = (stream_docs[at:at + room[p]], stream_pos[at:at + room[p]])
        at += int(room[p])
        pairs = [part for d in longest[1:] if side[(d, c)] == p for part in (piece(d, c), piece(d, n2 - 1 - c))]
        centre = [piece(longest[0], p)] if longest else []
        parts = [region] + pairs + centre if p < chunks else centre + pairs + [region]
        docs_out.extend(x for x, _ in parts)
        pos_out.extend(y for _, y in parts)
    docs = np.concatenate(docs_out)
    pos = np.concatenate(pos_out)
    starts = np.concatenate(([0], np.cumsum(lengths)))[:-1]
    order = starts[docs] + pos
    change = np.flatnonzero((docs[1:] != docs[:-1]) | (pos[1:] != pos[:-1] + 1)) + 1
    cuts = np.concatenate(([0], change, [total]))
    mask = arranged_of(cuts, docs[cuts[:-1]], pos[cuts[:-1]], layout=f"split {count}")
    return Arrangement("split", order, mask, _chunk_work(order, docs, pos, lengths, chunks, causal), split=count)


def arrange(lengths: Sequence[int], chunks: int, layout: str = "balanced", *, causal: bool = True,
            split: int = 1, seed: int = 0) -> Arrangement:
    """The layout ``layout`` of documents of ``lengths`` (in the micro-batch's order) over ``chunks``
    mesh chunks; ``split``: how many of the longest documents the ``split`` layout cuts. ``ValueError``
    naming the fix for a layout that cannot be built."""
    x = _check(lengths, chunks)
    if layout == "zigzag":
        return _whole(x, range(len(x)), chunks, causal, "zigzag")
    if layout == "balanced":
        return _whole(x, balance_order(x.tolist(), chunks, causal=causal, seed=seed), chunks, causal, "balanced")
    if layout == "split":
        if not 1 <= split <= len(x):
            raise ValueError(f"the split layout cuts 1 .. {len(x)} documents, not {split}")
        out = _split(x, chunks, split, causal, seed)
        if out is None:
            raise ValueError(f"the {split} longest documents do not fit the split layout's pieces ({int(x.sum())} "
                             f"tokens over {2 * chunks} pieces); split fewer")
        return out
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)} (or auto, which the launcher "
                     "chooses per micro-batch)")


def positions_of(arr: Arrangement, total: int) -> np.ndarray:
    """The original sequence position of every x' token (the rotary positions RoPE must use)."""
    return np.arange(total) if arr.order is None else arr.order


__all__ += ["positions_of"]
