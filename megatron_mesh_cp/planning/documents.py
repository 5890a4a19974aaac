"""Unpadded documents in the cost model: every block's kernel calls as the document mask leaves them.

``mesh_attention(..., cu_seqlens=cu)`` (runtime/masks/) runs documents of any length on
Megatron's ordinary zigzag layout: nothing is padded, a block (Q chunk i, KV chunk j) runs as the
sub-blocks its documents leave (an empty block: no kernel call at all), and the plan is the cached
full plan pruned to the tile blocks some rank needs (runtime/prune.py;
:func:`~megatron_mesh_cp.planning.schedule.call_plans`). This module prices that:
:class:`UnpaddedDocuments` is the hashable document mask a :class:`~megatron_mesh_cp.planning.cluster.Workload`
carries, :func:`block_calls` lists every kernel call of every block of a span (documents, chunks)
at once with numpy (the calls of ``SpanBlocks.block``, tested call for call: one per block under
the causal mask off the diagonal, one per shared document without it, one varlen call on the
diagonal) and :func:`price_calls` turns them into seconds (windows: planning/windows.py). TE's algorithms cannot run documents this way (THD
pads every document to 2*CP and sends every chunk): they are priced with a
:class:`~megatron_mesh_cp.planning.packing.Packing` of the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, NamedTuple, Tuple

import numpy as np

from ..runtime.balance import balance_order
from ..runtime.layouts import arrange, split_label, tile_sums
from ..runtime.masks import Span, SpanMask, check_offsets, check_one_sequence
from .packing import DISTRIBUTIONS, _fill, _read_lengths, _rect, _tri, length_draws

__all__ = ["UnpaddedDocuments", "BlockCalls", "block_calls", "arranged_block_calls", "span_sequence_work",
           "price_calls", "call_seconds", "CallSeconds", "tile_bound",
           "sample_documents", "read_documents"]


@dataclass(frozen=True)
class UnpaddedDocuments(SpanMask):
    """Documents of any length, back to back over one sequence of ``total`` tokens, unpadded: the
    runtime's documents mask (``mesh_attention(cu_seqlens=...)``) as the cost model draws them.

    ``tile`` counts a call's work as :class:`~megatron_mesh_cp.planning.packing.Packing` does
    (0: exact unmasked pairs; t: whole t x t tiles per document segment). Hashable: workloads
    carrying it are cache keys of the planner, the replay and auto shape.
    """

    lengths: Tuple[int, ...]
    tile: int = 0
    label: str = field(default="", compare=False)
    #: run in the order runtime/balance.py gives each chunk count (the ``balanced`` layout, as the
    #: launcher runs it per batch) instead of as given
    balanced: bool = False
    #: run in the ``split`` layout cutting this many of the longest documents (runtime/layouts.py)
    split: int = 0
    #: the layout is chosen per mesh by the cost model (planning/layouts.py: ``resolve_layout``), as
    #: the launcher's ``--mesh-layout auto`` chooses it per micro-batch
    auto: bool = False
    #: run in the ``tiled`` layout: whole documents ordered so the ranks of the mesh that runs them
    #: carry near-equal block cost (runtime/tile_balance.py); ``mesh`` (a, b) and ``weights`` (its
    #: kernel-call cost model) are set per mesh by ``resolve_layout``
    tiled: bool = False
    #: with ``tiled``: the ``tiled-cut`` layout, a few documents of the tiled order re-laid
    #: (runtime/tile_cut.py), run as its re-laid (``Arranged``) mask
    cut: bool = False
    #: with ``split``: the last this many split documents cut over half of each mesh row's chunks
    #: (runtime/layouts.py), laid out per mesh like ``tiled``
    halves: int = 0
    #: with ``tiled`` and ``cut`` (tiled-cut): the rank search's restart its order comes from
    #: (runtime/layouts.py ``arrange``);
    #: auto sets it where it took a restarted tiled-cut layout (planning/layouts.py)
    restart: int = 0
    mesh: Tuple[int, ...] = ()
    weights: Tuple[float, ...] = ()

    name = "documents"
    per_batch = True
    order = 10
    cuts_documents = True

    def __post_init__(self) -> None:
        if not self.lengths or any(int(x) != x or x < 1 for x in self.lengths):
            raise ValueError(f"documents need positive whole lengths, got {list(self.lengths)[:8]}; "
                             "drop empty documents")
        if self.tile < 0:
            raise ValueError(f"kernel tile {self.tile} must be >= 0 (0: count exact pairs)")
        if (self.split or self.cut) and self.tile:
            raise ValueError("a layout cutting documents (split, tiled-cut) has its blocks priced by their exact "
                             "pairs; give the documents kernel tile 0")
        if self.restart and not (self.tiled and self.cut):  # else silently the unrestarted layout
            raise ValueError(f"restart (the tiled rank search's) applies to the tiled-cut layout, not {self.layout!r}")
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))

    @property
    def cu(self) -> Tuple[int, ...]:
        """Global document offsets, as ``mesh_attention(cu_seqlens=...)`` takes them."""
        return (0,) + tuple(int(x) for x in np.cumsum(self.lengths))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def refine(self, span: Span, causal: bool) -> Span:
        check_offsets(self.cu, span.total)
        cuts = self.cu if span.cu is None else tuple(sorted(set(span.cu) | set(self.cu)))
        return Span(span.total, cuts, span.window, max(span.tile, self.tile))

    def span(self, total: int = None, causal: bool = True) -> Span:
        """The canonical form over ``total`` tokens (default: the documents' own)."""
        return self.refine(Span(self.total if total is None else total), causal)

    def check_batch(self, batch: int) -> None:
        check_one_sequence(batch)

    def agreement(self) -> dict:
        return {"documents": self.cu}

    def with_tile(self, tile: int) -> "UnpaddedDocuments":
        return replace(self, tile=tile)

    def with_balance(self, balanced: bool) -> "UnpaddedDocuments":
        return replace(self, balanced=bool(balanced), split=0, auto=False, tiled=False, cut=False, halves=0, mesh=(),
                       weights=(), restart=0)

    def with_layout(self, layout: str) -> "UnpaddedDocuments":
        """The same documents run in ``layout``: ``zigzag``, ``balanced``, ``tiled`` (the mesh's ranks
        balanced), ``tiled-cut`` (tiled, a few documents re-laid), ``split:K`` (the K longest
        cut), ``split:K:H`` (the last H of them over half of each mesh row's chunks) or ``auto``
        (chosen per mesh by the cost model)."""
        name, _, spec = layout.partition(":")
        k, colon, h = spec.partition(":")
        if layout in ("split", "split-half"):  # the launcher's --mesh-layout spellings, which choose K per batch
            raise ValueError(f"unknown layout {layout!r} here: the launcher's --mesh-layout {layout} chooses per "
                             "micro-batch how many of the longest documents to cut (every one longer than a chunk); "
                             "the simulator prices a fixed count: split:K (e.g. split:2)"
                             + (", or split:K:K for all K over half of each mesh row's chunks (e.g. split:2:2)"
                                if layout == "split-half" else "") + ", or auto, which tries them")
        if name == "split" and k.isdigit() and int(k) == 0 and not colon:
            raise ValueError(f"unknown layout {layout!r}: split:K cuts the K >= 1 longest documents (split:1 for one); "
                             "for none, keep them whole: zigzag, balanced or tiled")
        if name == "split" and k.isdigit() and int(k) >= 1 and h.isdigit() and not 1 <= int(h) <= int(k):
            raise ValueError(f"layout {layout!r}: H = {h} of split:K:H must be 1 .. K = {k} (the last H of the {k} "
                             f"split documents go over half of each mesh row's chunks): split:{k}:{k} for all of "
                             f"them, split:{k} for none")
        if name not in ("zigzag", "balanced", "tiled", "tiled-cut", "split", "auto") or (
                (name == "split") != bool(k)) or (k and (not k.isdigit() or int(k) < 1)) or (
                colon and not (h.isdigit() and k.isdigit())):  # an H out of 1 .. K was refused above
            raise ValueError(f"unknown layout {layout!r}; choose zigzag, balanced, tiled, tiled-cut, split:K (K "
                             "documents cut), split:K:H (the last H of them over half of each mesh row's chunks, "
                             "1 <= H <= K) or auto")
        return replace(self, balanced=name == "balanced", split=int(k) if k else 0, auto=name == "auto",
                       tiled=name in ("tiled", "tiled-cut"), cut=name == "tiled-cut", halves=int(h) if h else 0,
                       mesh=(), weights=(), restart=0)

    def for_mesh(self, a: int, b: int, weights) -> "UnpaddedDocuments":
        """The tiled layout (or a split one with halves) made concrete for the a x b mesh and its
        kernel-call cost ``weights``."""
        if not (self.tiled or self.halves):
            raise ValueError("only the tiled layouts and split:K:H are laid out per mesh this way")
        return replace(self, mesh=(int(a), int(b)), weights=tuple(float(v) for v in weights))

    @property
    def layout(self) -> str:
        if self.auto:
            return "auto"
        if self.tiled:
            return "tiled-cut" if self.cut else "tiled"
        if self.split:
            return split_label(self.split, self.halves)
        return "balanced" if self.balanced else "zigzag"

    def arranged(self, chunks: int, causal: bool = True):
        """The documents as they run on ``chunks`` chunks: balanced
        (:func:`~megatron_mesh_cp.runtime.balance.balance_order`, cached), re-laid by the split layout
        (an ``Arranged`` mask, cached) or as given; ``auto`` must be resolved for a mesh first."""
        if self.auto:
            raise ValueError("the auto layout is chosen per mesh: resolve it first (planning.layouts.resolve_layout)")
        if self.tiled:
            if not self.mesh or self.mesh[0] * self.mesh[1] != chunks:
                mesh = "x".join(map(str, self.mesh)) or "none"
                raise ValueError(f"the tiled layout balances one mesh's ranks ({mesh} set, {chunks} chunks asked): "
                                 "resolve it for the mesh first (planning.layouts.resolve_layout)")
            return _tiled_cut(self, bool(causal)) if self.cut else _tiled(self, bool(causal))
        if self.split:
            if self.halves and (not self.mesh or self.mesh[0] * self.mesh[1] != chunks):
                raise ValueError(f"split:{self.split}:{self.halves} cuts documents over one mesh's rows ({chunks} "
                                 "chunks asked): resolve it for the mesh first (planning.layouts.resolve_layout)")
            return _split(self, chunks, bool(causal))
        return _balanced(self, chunks, bool(causal)) if self.balanced else self

    for_chunks = arranged

    def sequence_work(self, causal: bool = True) -> int:
        """Work of one call over the whole sequence (Ulysses' view): each document's own triangle."""
        x = np.array(self.lengths, dtype=np.int64)
        return int(_tri(x, self.tile).sum() if causal else _rect(x, x, self.tile).sum())

    def work_fraction(self, causal: bool = True) -> float:
        s = self.total
        return self.sequence_work(causal) / (s * (s + 1) // 2 if causal else s * s)

    def describe(self) -> str:
        x = np.array(self.lengths)
        text = (f"{len(x)} documents{f' ({self.label})' if self.label else ''}: lengths {x.min()}-{x.max()}, "
                f"mean {x.mean():.0f}, median {np.median(x):.0f}, {(x < 4096).mean():.0%} under 4K, "
                f"{int((x > 256 * 1024).sum())} over 256K; {self.total} tokens, unpadded; causal attention work "
                f"{self.work_fraction():.2%} of one unmasked sequence")
        text += f" (counted in {self.tile}x{self.tile} tiles)" if self.tile else ""
        if self.auto:
            return text + "; laid out per mesh by the cost model (auto)"
        if self.split:
            half = f", the last {self.halves} over half of each mesh row's chunks" if self.halves else ""
            return text + f"; run in the split layout ({self.split} longest split{half})"
        if self.tiled:
            mesh = f" of the {self.mesh[0]}x{self.mesh[1]} mesh" if self.mesh else " of each mesh"
            if self.cut:
                return text + f"; run in the order balancing the ranks{mesh}, a few documents re-laid " \
                              "(tiled-cut)"
            return text + f"; run in the order balancing the ranks{mesh} (tiled)"
        return text + ("; run in the order balancing each mesh's zigzag chunks" if self.balanced else "")


@lru_cache(maxsize=64)
def _split(docs: UnpaddedDocuments, chunks: int, causal: bool):
    return arrange(docs.lengths, chunks, "split", split=docs.split, causal=causal, shape=docs.mesh or None,
                   halves=docs.halves).mask


@lru_cache(maxsize=64)
def _tiled(docs: UnpaddedDocuments, causal: bool) -> UnpaddedDocuments:
    a, b = docs.mesh
    arr = arrange(docs.lengths, a * b, "tiled", causal=causal, shape=(a, b), weights=docs.weights or None)
    return UnpaddedDocuments(tuple(docs.lengths[i] for i in arr.runs[0]), docs.tile,
                             (docs.label + ", " if docs.label else "") + f"tiled for the {a}x{b} mesh")


@lru_cache(maxsize=64)
def _tiled_cut(docs: UnpaddedDocuments, causal: bool):
    a, b = docs.mesh
    return arrange(docs.lengths, a * b, "tiled-cut", causal=causal, shape=(a, b), weights=docs.weights or None,
                   restart=docs.restart).mask


@lru_cache(maxsize=64)
def _balanced(docs: UnpaddedDocuments, chunks: int, causal: bool) -> UnpaddedDocuments:
    order = balance_order(docs.lengths, chunks, causal=causal)
    return UnpaddedDocuments(tuple(docs.lengths[i] for i in order), docs.tile,
                             (docs.label + ", " if docs.label else "") + f"balanced for {chunks} chunks")


class BlockCalls(NamedTuple):
    """One entry per kernel call: its block (i, j), Q rows, keys and work (pairs or tile area)."""

    i: np.ndarray
    j: np.ndarray
    rows: np.ndarray
    keys: np.ndarray
    work: np.ndarray


def block_calls(span: Span, chunks: int, causal: bool) -> BlockCalls:
    """Every kernel call of every block of a span without a window on ``chunks`` mesh chunks (the
    calls of ``SpanBlocks.block``; read-only arrays, cached)."""
    return _block_calls(span, chunks, bool(causal))


@lru_cache(maxsize=64)
def _block_calls(span: Span, n: int, causal: bool) -> BlockCalls:
    cu = np.array(span.offsets, dtype=np.int64)
    total = int(cu[-1])
    if total % (2 * n):
        raise ValueError(f"the documents span {total} tokens, not a multiple of 2*CP = {2 * n}; "
                         "the sequence must split into 2*CP equal pieces")
    m, t = total // (2 * n), span.tile
    sq = (lambda x: _tri(x, t)) if causal else (lambda x: _rect(x, x, t))  # noqa: E731
    doc = lambda pos: np.searchsorted(cu, pos, side="right") - 1  # noqa: E731
    c = np.arange(n, dtype=np.int64)
    # the diagonal: one call over the chunk, square per document run (runs cut by the document ends)
    bounds = np.union1d(cu, np.arange(0, total + 1, m, dtype=np.int64))
    lo, seg = bounds[:-1], np.diff(bounds)
    piece = lo // m
    diag = np.zeros(n, dtype=np.int64)
    np.add.at(diag, np.where(piece < n, piece, 2 * n - 1 - piece), sq(seg))
    # a document across the chunk's two pieces is one run: its two segments are one square
    d_end, d_start = doc((c + 1) * m - 1), doc((2 * n - 1 - c) * m)
    x = (c + 1) * m - np.maximum(cu[d_end], c * m)
    y = np.minimum(cu[d_start + 1], (2 * n - c) * m) - (2 * n - 1 - c) * m
    diag += np.where(d_end == d_start, sq(x + y) - sq(x) - sq(y), 0)
    full = np.full(n, 2 * m, dtype=np.int64)
    parts = [(c, c, full, full, diag)]
    if causal:
        i, j = c[:, None], c[None, :]
        # j < i: the document holding KV piece j's last token, x every Q row it reaches
        end, start = cu[d_end + 1][None, :], np.maximum(cu[d_end], c * m)[None, :]
        rows_l = np.clip(end - i * m, 0, m) + np.clip(end - (2 * n - 1 - i) * m, 0, m)
        keys_l = np.broadcast_to((j + 1) * m - start, (n, n))
        # j > i: the document holding Q piece 2n-1-i's first token, x every key from its start
        s2 = cu[d_start][:, None]
        rows_u = np.broadcast_to(np.minimum(cu[d_start + 1], (2 * n - c) * m)[:, None] - (2 * n - 1 - i) * m, (n, n))
        keys_u = (np.clip((j + 1) * m - np.maximum(s2, j * m), 0, m)
                  + np.clip((2 * n - j) * m - np.maximum(s2, (2 * n - 1 - j) * m), 0, m))
        rows = np.where(j < i, rows_l, np.where(j > i, rows_u, 0))
        keys = np.where(j < i, keys_l, np.where(j > i, keys_u, 0))
        ii, jj = np.nonzero((rows > 0) & (keys > 0))
        r, k = rows[ii, jj], keys[ii, jj]
        parts.append((ii, jj, r, k, _rect(r, k, t)))
    else:
        parts.append(_shared_documents(lo, seg, piece, doc(lo), n, t))
    out = BlockCalls(*(np.ascontiguousarray(np.concatenate(col), dtype=np.int64) for col in zip(*parts)))
    for arr in out:
        arr.setflags(write=False)
    return out


def _shared_documents(lo, seg, piece, doc, n, tile):
    """Without the causal mask, block (i, j) runs one call per shared document: its run in chunk i
    (both pieces) x its run in chunk j."""
    chunk = np.where(piece < n, piece, 2 * n - 1 - piece)
    keys, inv = np.unique(doc * n + chunk, return_inverse=True)
    count = np.zeros(len(keys), dtype=np.int64)
    np.add.at(count, np.asarray(inv).reshape(-1), seg)
    d, ch = keys // n, keys % n
    cuts = np.flatnonzero(np.diff(d)) + 1
    out = [[], [], [], []]
    for grp in np.split(np.arange(len(d)), cuts):
        if len(grp) < 2:
            continue
        gi, gj = np.meshgrid(grp, grp, indexing="ij")
        off = gi != gj
        for col, v in zip(out, (ch[gi[off]], ch[gj[off]], count[gi[off]], count[gj[off]])):
            col.append(v)
    i, j, r, k = (np.concatenate(col) if col else np.zeros(0, dtype=np.int64) for col in out)
    return i, j, r, k, _rect(r, k, tile)


def arranged_block_calls(mask, n: int, causal: bool) -> BlockCalls:
    """Every kernel call of every block of documents re-laid in pieces (``runtime.masks.Arranged``) on
    ``n`` mesh chunks: call for call what ``SegmentBlocks.block`` runs (tested), vectorised per
    document over its segments (read-only arrays, cached)."""
    return _arranged_calls(mask, n, bool(causal))


@lru_cache(maxsize=64)
def _arranged_calls(mask, n: int, causal: bool) -> BlockCalls:
    cuts = np.asarray(mask.cuts, dtype=np.int64)
    total = int(cuts[-1])
    m = total // (2 * n)
    # segments cut at the piece boundaries, with their chunk, first local row, document and positions
    bounds = np.union1d(cuts, np.arange(0, total + 1, m, dtype=np.int64))
    lo, seg = bounds[:-1], np.diff(bounds)
    k = np.searchsorted(cuts, lo, side="right") - 1
    piece = lo // m
    chunk = np.where(piece < n, piece, 2 * n - 1 - piece)
    row = np.where(piece < n, lo - piece * m, m + lo - piece * m)
    doc = np.asarray(mask.docs, dtype=np.int64)[k]
    pos = np.asarray(mask.starts, dtype=np.int64)[k] + lo - cuts[k]
    # per chunk in row order; a run = consecutive segments of one document with increasing positions
    order = np.lexsort((row, chunk))
    chunk, row, doc, pos, seg = chunk[order], row[order], doc[order], pos[order], seg[order]
    new_run = np.r_[True, (chunk[1:] != chunk[:-1]) | (doc[1:] != doc[:-1]) | (pos[1:] < pos[:-1] + seg[:-1])]
    run = np.cumsum(new_run) - 1
    run_len = np.bincount(run, weights=seg).astype(np.int64)
    run_first = np.flatnonzero(new_run)
    run_chunk = chunk[run_first]
    tri = (lambda x: x * (x + 1) // 2) if causal else (lambda x: x * x)  # noqa: E731
    diag_work = np.bincount(run_chunk, weights=tri(run_len), minlength=n).astype(np.int64)
    full = np.full(n, 2 * m, dtype=np.int64)
    parts = [(np.arange(n), np.arange(n), full, full, diag_work)]
    # documents with several runs: their run pairs' rectangles
    if causal:
        parts.append(_causal_run_calls(chunk, doc, pos, seg, run, run_first))
    else:
        parts.extend(_run_pair_calls(chunk, doc, pos, seg, run))
    out = BlockCalls(*(np.ascontiguousarray(np.concatenate(c), dtype=np.int64) for c in zip(*parts)))
    for arr in out:
        arr.setflags(write=False)
    return out


def _causal_run_calls(chunk, doc, pos, seg, run, run_first):
    """Under the causal mask, the calls between the runs of documents with several runs, in the order
    (document, key run, query segment) and each as one document's loop makes it: query segment s
    sees the f keys of run V that end by its start (V's first segments, in position order);
    consecutive segments of one run with the same f share a call. Arrays over (segment, run) pairs
    of the same document; segments in (chunk, row) order, ``run`` their run there, ``run_first``
    each run's first segment."""
    run_doc = doc[run_first]
    nruns = np.bincount(run_doc)
    multi = nruns >= 2
    segs = np.flatnonzero(multi[doc])
    segs = segs[np.argsort(doc[segs], kind="stable")]  # by document, then (chunk, row)
    if not len(segs):
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(5))
    _, seg_first, seg_count = np.unique(doc[segs], return_index=True, return_counts=True)
    runs = np.flatnonzero(multi[run_doc])
    runs = runs[np.argsort(run_doc[runs], kind="stable")]  # by document, then run
    blk_doc = np.repeat(np.arange(len(seg_first)), nruns[multi])  # one block per (document, key run)
    blk_len = seg_count[blk_doc]
    pair_blk = np.repeat(np.arange(len(runs)), blk_len)
    k = np.arange(int(blk_len.sum())) - np.repeat(np.cumsum(blk_len) - blk_len, blk_len)
    at = seg_first[blk_doc][pair_blk] + k  # the query segment's place in segs
    q, v = segs[at], runs[pair_blk]
    # f and the keys: V's segments are consecutive and in position order; count those ending by p_s
    big = int((pos + seg).max()) + 1
    ends = run * big + pos + seg
    idx = np.searchsorted(ends, v * big + pos[q], side="right")
    lens = np.concatenate(([0], np.cumsum(seg)))
    f = idx - run_first[v]
    keys = lens[idx] - lens[run_first[v]]
    same_run = np.r_[False, run[segs[1:]] == run[segs[:-1]]][at]
    start = ~(same_run & (f == np.r_[-1, f[:-1]]))
    kept = (run[q] != v) & (f > 0)
    first = np.flatnonzero(kept & start)
    call = np.cumsum(kept & start) - 1
    rows = np.bincount(call[kept], weights=seg[q][kept]).astype(np.int64)
    kk = keys[first]
    return chunk[q[first]], chunk[run_first[v[first]]], rows, kk, rows * kk


def _run_pair_calls(chunk, doc, pos, seg, run):
    """Without the causal mask, every pair of a document's runs: one call, its rectangle."""
    parts = []
    by_doc = np.lexsort((pos, doc))
    d_sorted = doc[by_doc]
    starts_ = np.flatnonzero(np.r_[True, d_sorted[1:] != d_sorted[:-1]])
    ends_ = np.r_[starts_[1:], len(d_sorted)]
    for a, b in zip(starts_, ends_):
        idx = by_doc[a:b]
        if len(np.unique(run[idx])) < 2:
            continue
        segs = np.sort(idx)  # this document's segments in (chunk, row) order: runs are contiguous in it
        r_of, l_of, c_of = run[segs], seg[segs], chunk[segs]
        uniq, first = np.unique(r_of, return_index=True)
        col = np.searchsorted(uniq, r_of)  # run column of each segment
        rl = np.bincount(col, weights=l_of).astype(np.int64)
        rc = c_of[first]
        qa, kb = np.nonzero(~np.eye(len(uniq), dtype=bool))
        parts.append((rc[qa], rc[kb], rl[qa], rl[kb], rl[qa] * rl[kb]))
    return parts


def span_sequence_work(span: Span, causal: bool) -> int:
    """Work of one call over the whole sequence of a span without a window (Ulysses' view): each
    document's own triangle (square without the causal mask), counted in the span's tiles."""
    x = np.diff(np.array(span.offsets, dtype=np.int64))
    return int(_tri(x, span.tile).sum() if causal else _rect(x, x, span.tile).sum())


class CallSeconds(NamedTuple):
    """Per kernel call of a :class:`BlockCalls`, the parts of its seconds: ``peak`` its work at the
    kernel's peak rate, ``kernel`` that work at the throughput of its rows (small calls run slower),
    ``call`` the call overhead and the correction over its rows, ``keys`` the backward's dK/dV over its keys
    (the last two are paid whatever the call's work)."""

    peak: np.ndarray
    kernel: np.ndarray
    call: np.ndarray
    keys: np.ndarray


def call_seconds(w, cluster, backward: bool, calls: BlockCalls) -> CallSeconds:
    """Every call's seconds, in parts (:class:`CallSeconds`): what :func:`price_calls` sums per block."""
    rows = calls.rows.astype(float)
    flops = w.pair_flops(calls.work.astype(float), backward)
    peak = flops / (cluster.bwd_flops if backward else cluster.fwd_flops)
    keys = np.broadcast_to(w._keys_cost(cluster, calls.keys.astype(float), backward), rows.shape)
    return CallSeconds(peak, cluster.attention_time(flops, rows, backward), w._call_cost(cluster, rows, backward), keys)


def price_calls(w, cluster, backward: bool, ranks: int, calls: BlockCalls) -> np.ndarray:
    """[ranks, ranks] seconds: every block's calls, each its kernel and its fixed costs."""
    sec = call_seconds(w, cluster, backward, calls)
    out = np.bincount(calls.i * ranks + calls.j, weights=sec.kernel + sec.call + sec.keys, minlength=ranks * ranks)
    return out.reshape(ranks, ranks)


def tile_bound(w, cluster, a: int, b: int, backward: bool) -> Tuple[float, Dict[str, int]]:
    """What any pruned plan of the a x b mesh must do for ``w``'s documents in one phase: the busiest
    rank's block seconds (its tile's blocks, empty ones 0), and per kind the fewest transfers (each
    foreign Q or KV offset some rank needs arrives once; each such offset's partial leaves it once)."""
    compute = float(tile_sums(w.block_times(cluster, backward, a * b), a, b).max())
    keep = w.needed(a, b)
    q, kv = len({qo for qo, _ in keep if qo}), len({ko for _, ko in keep if ko})
    return compute, {"q": q, "o": q, "dq": q, "kv": kv, "dkv": kv}


def sample_documents(total: int, lo: int, hi: int, *, dist: str = "loguniform", seed: int = 0,
                     tile: int = 0) -> UnpaddedDocuments:
    """The draws of :func:`~megatron_mesh_cp.planning.packing.sample_packing` (same ``dist`` and
    ``seed``: the same documents in the same order), filling ``total`` tokens unpadded; the last one
    is cut to the space left."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown document length distribution {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    lengths = _fill(length_draws(lo, hi, dist, seed), total, 1, "the documents")
    return UnpaddedDocuments(lengths, tile, f"{dist} {lo}-{hi} tokens, seed {seed}")


def read_documents(path, total: int, *, tile: int = 0) -> UnpaddedDocuments:
    """Document lengths from a text file (as :func:`~megatron_mesh_cp.planning.packing.read_packing`),
    back to back in file order until ``total`` tokens are full, unpadded."""
    lengths, name = _read_lengths(path)
    used = _fill(lengths, total, 1, f"the {len(lengths)} documents of {str(path)!r}")
    return UnpaddedDocuments(used, tile, name + (f", first {len(used)} of {len(lengths)}" if len(used) < len(lengths)
                                                 else ""))
