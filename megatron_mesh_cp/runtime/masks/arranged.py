"""Documents in a layout of their own: the mask of a sequence whose documents were re-laid in pieces.

A layout (runtime/layouts.py) decides which tokens each CP rank holds by re-laying the sequence
before Megatron's zigzag split: the split then cuts the re-laid sequence x' into 2N pieces and
mesh chunk c holds pieces c and 2N-1-c as always. A long document may be cut into pieces that
land far apart in x' (TE's per-document split: pieces g and 2N-1-g of the document to chunk g), so
a document is no longer one run of x': x' is a sequence of *segments*, each a run of one document's
tokens in increasing position. :class:`Arranged` holds them (segment cuts over x', each segment's
document and the document position of its first token); query i sees key j iff both lie in one
document and, when causal, j's position is not after i's.

:class:`SegmentBlocks` is its block engine. A chunk's rows are its segments in row order; consecutive
segments of one document with increasing positions form a *run*, inside which row order is position
order, so a causal square over a run is exact. The own block is one varlen call over the runs plus,
for a document with several runs in the chunk, a dense rectangle per pair of them; a block of two
chunks keeps, per pair of runs of one document, the rectangles where keys precede queries (for each
query segment the keys before it are a prefix of the key run, and query segments with the same
prefix share one call). On documents laid whole (the zigzag layout) this is call for call what
:class:`~megatron_mesh_cp.runtime.masks.spans.SpanBlocks` runs (tested). Windows are not taken: a layout
that cuts documents runs with documents (and chunks) only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from ..kernels.base import Varlen
from ..topology import MeshShape
from .base import Mask
from .spans import SubBlock, needed_blocks

__all__ = ["Arranged", "SegmentBlocks", "arranged_of"]


@dataclass(frozen=True)
class Arranged(Mask):
    """A re-laid sequence's documents: segment ``k`` is ``x'[cuts[k]:cuts[k+1]]``, tokens of document
    ``docs[k]`` from its position ``starts[k]`` on. ``layout`` names the layout that made it."""

    cuts: Tuple[int, ...]
    docs: Tuple[int, ...]
    starts: Tuple[int, ...]
    layout: str = ""

    name = "documents (re-laid)"
    per_batch = True
    cuts_documents = True
    span_error = ("a layout that cuts documents into pieces runs documents (and chunks) only, not a sliding window; "
                  "use the zigzag layout (--mesh-layout zigzag) with windows")

    def check(self, total: int, cp: int, causal: bool = True, batch: int = 1) -> None:
        cuts, k = self.cuts, len(self.docs)
        if len(cuts) != k + 1 or len(self.starts) != k or k < 1 or cuts[0] != 0 or cuts[-1] != total:
            raise ValueError(f"a re-laid sequence needs segment cuts 0 .. {total} and one document and start per "
                             f"segment; got {len(cuts)} cuts, {k} documents, {len(self.starts)} starts")
        if any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise ValueError("the segments of a re-laid sequence must not be empty (cuts strictly increasing)")
        covered: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
        for d, s, a, b in zip(self.docs, self.starts, cuts, cuts[1:]):
            covered[d].append((s, s + b - a))
        for d, spans in covered.items():
            spans.sort()
            if spans[0][0] != 0 or any(x[1] != y[0] for x, y in zip(spans, spans[1:])):
                raise ValueError(f"document {d}'s segments do not tile its positions 0 .. {spans[-1][1]} exactly once")
        if batch != 1:
            raise ValueError(f"document masking takes one sequence per call, got batch {batch}; run one sequence per "
                             "micro-batch (Megatron: --micro-batch-size 1)")

    def check_batch(self, batch: int) -> None:
        if batch != 1:
            raise ValueError(f"document masking takes one sequence per call, got batch {batch}")

    def agreement(self) -> dict:
        return {"documents (re-laid)": (self.layout, self.cuts, self.docs, self.starts)}

    def bind(self, chunks: int, total: int, causal: bool) -> "SegmentBlocks":
        return SegmentBlocks(self, chunks, causal)


def arranged_of(cuts, docs, starts, layout: str = "") -> Arranged:
    """An :class:`Arranged` from sequences of ints (numpy arrays welcome)."""
    return Arranged(tuple(int(x) for x in cuts), tuple(int(x) for x in docs), tuple(int(x) for x in starts), layout)


class _Seg(NamedTuple):
    doc: int
    lo: int  # document positions [lo, hi)
    hi: int
    row: int  # first local row


class SegmentBlocks:
    """The blocks a re-laid sequence's documents leave on ``chunks`` mesh chunks (module docstring)."""

    pruned = True
    window = None

    def __init__(self, mask: Arranged, chunks: int, causal: bool) -> None:
        total = mask.cuts[-1]
        if total % (2 * chunks):
            raise ValueError(f"sequence length {total} is not divisible by 2*CP = {2 * chunks}")
        self.mask, self.n, self.causal = mask, chunks, bool(causal)
        self.m = total // (2 * chunks)
        self._cuts = np.asarray(mask.cuts, dtype=np.int64)
        self._chunk_segs: Dict[int, List[_Seg]] = {}
        self._blocks: Dict[Tuple[int, int], Tuple[SubBlock, ...]] = {}
        self._nonempty: Optional[np.ndarray] = None

    # --- a chunk's segments and runs ------------------------------------------------------------
    def _piece(self, start: int, base: int) -> List[_Seg]:
        """Segments of x'[start, start + m), rows from ``base``."""
        m, cuts, mask = self.m, self._cuts, self.mask
        k = int(np.searchsorted(cuts, start, side="right")) - 1
        out, pos = [], start
        while pos < start + m:
            stop = min(int(cuts[k + 1]), start + m)
            lo = mask.starts[k] + pos - int(cuts[k])
            out.append(_Seg(mask.docs[k], lo, lo + stop - pos, base + pos - start))
            pos, k = stop, k + 1
        return out

    def segments(self, c: int) -> List[_Seg]:
        """Chunk c's segments in row order (pieces c and 2N-1-c)."""
        hit = self._chunk_segs.get(c)
        if hit is None:
            m = self.m
            hit = self._chunk_segs[c] = self._piece(c * m, 0) + self._piece((2 * self.n - 1 - c) * m, m)
        return hit

    def runs(self, c: int) -> List[List[_Seg]]:
        """Chunk c's runs: consecutive segments of one document with increasing positions."""
        runs: List[List[_Seg]] = []
        for s in self.segments(c):
            if runs and runs[-1][-1].doc == s.doc and runs[-1][-1].hi <= s.lo:
                runs[-1].append(s)
            else:
                runs.append([s])
        return runs

    # --- one block ------------------------------------------------------------------------------
    def block(self, i: int, j: int) -> Tuple[SubBlock, ...]:
        """The kernel calls of block (Q chunk i, KV chunk j); empty: nothing to compute."""
        key = (i, j)
        hit = self._blocks.get(key)
        if hit is None:
            hit = self._blocks[key] = self._describe(i, j)
        return hit

    def _describe(self, i: int, j: int) -> Tuple[SubBlock, ...]:
        out: List[SubBlock] = []
        qruns = self.runs(i)
        if i == j:  # one varlen call over the runs, square and causal each
            lens = tuple(_rows(r) for r in qruns)
            whole = slice(0, 2 * self.m)
            out.append(SubBlock(whole, whole, self.causal, None if len(lens) == 1 else lens))
            kruns = qruns
        else:
            kruns = self.runs(j)
        by_doc: Dict[int, List[List[_Seg]]] = defaultdict(list)
        for r in kruns:
            by_doc[r[0].doc].append(r)
        for qr in qruns:
            for kr in by_doc.get(qr[0].doc, ()):
                if kr is qr:
                    continue
                out.extend(self._pair(qr, kr))
        return tuple(out)

    def _pair(self, qr: List[_Seg], kr: List[_Seg]) -> List[SubBlock]:
        """The rectangles of two runs of one document (disjoint positions): without the causal mask the
        whole rectangle; with it, per query segment the prefix of key segments before it, consecutive
        query segments with the same prefix in one call."""
        k0 = kr[0].row
        if not self.causal:
            return [SubBlock(slice(qr[0].row, qr[-1].row + _len(qr[-1])), slice(k0, kr[-1].row + _len(kr[-1])), False)]
        out, group, last = [], None, 0
        for s in qr:
            f = 0
            while f < len(kr) and kr[f].hi <= s.lo:
                f += 1
            if group is not None and f == last:
                group[1] = s.row + _len(s)
                continue
            if group is not None and last:
                out.append(SubBlock(slice(*group), slice(k0, kr[last - 1].row + _len(kr[last - 1])), False))
            group, last = [s.row, s.row + _len(s)], f
        if group is not None and last:
            out.append(SubBlock(slice(*group), slice(k0, kr[last - 1].row + _len(kr[last - 1])), False))
        return out

    # --- every block ----------------------------------------------------------------------------
    def nonempty(self) -> np.ndarray:
        """Bool ``[chunks, chunks]``: which blocks keep any (query, key) pair: the own blocks, and two
        chunks holding segments of one document, a key segment before a query segment (causal)."""
        if self._nonempty is not None:
            return self._nonempty
        n, m, mask = self.n, self.m, self.mask
        cuts = self._cuts
        # every segment cut at the piece boundaries: piece p of x' belongs to chunk min(p, 2N-1-p)
        bounds = np.union1d(cuts, np.arange(0, cuts[-1] + 1, m, dtype=np.int64))
        lo = bounds[:-1]
        k = np.searchsorted(cuts, lo, side="right") - 1
        piece = lo // m
        chunk = np.where(piece < n, piece, 2 * n - 1 - piece)
        doc = np.asarray(mask.docs, dtype=np.int64)[k]
        plo = np.asarray(mask.starts, dtype=np.int64)[k] + lo - cuts[k]
        phi = plo + np.diff(bounds)
        out = np.zeros((n, n), dtype=bool)
        out[np.arange(n), np.arange(n)] = True
        order = np.lexsort((plo, doc))
        doc, chunk, plo, phi = doc[order], chunk[order], plo[order], phi[order]
        starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
        ends = np.r_[starts[1:], len(doc)]
        for a, b in zip(starts, ends):
            if b - a < 2 or np.all(chunk[a:b] == chunk[a]):
                continue
            c, lo_, hi_ = chunk[a:b], plo[a:b], phi[a:b]
            pair = c[:, None] != c[None, :]
            if self.causal:  # query segment s (rows) sees key segment t (cols) before it
                pair &= hi_[None, :] <= lo_[:, None]
            qi, kj = np.nonzero(pair)
            out[c[qi], c[kj]] = True
        self._nonempty = out
        return out

    def needed(self, shape: MeshShape) -> FrozenSet[Tuple[int, int]]:
        """Tile blocks (Q offset, KV offset) that some rank of ``shape`` must compute."""
        if shape.n != self.n:
            raise ValueError(f"the mask is for {self.n} mesh chunks, the mesh {shape} has {shape.n}")
        return needed_blocks(self.nonempty(), shape)

    def rank_parts(self, shape: MeshShape, position: int, device) -> Dict[Tuple[int, int], tuple]:
        """Rank ``position``'s kernel calls per tile block, varlen offsets on ``device`` (made once)."""
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
                    parts.append((s.rows, s.cols, s.causal, vl, None))
                out[(qo, ko)] = tuple(parts)
        return out


def _len(s: _Seg) -> int:
    return s.hi - s.lo


def _rows(run: List[_Seg]) -> int:
    return sum(_len(s) for s in run)
