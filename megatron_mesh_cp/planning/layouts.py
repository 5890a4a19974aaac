"""Choosing a micro-batch's token layout by the cost model (runtime/layouts.py builds them).

For one micro-batch's document lengths and the mesh that runs it, every candidate layout -- the
zigzag as given, the balanced document order, the tiled one (whole documents ordered so this mesh's
ranks carry near-equal block cost, searched on :func:`tile_weights`, the cost model's seconds per
kernel call), the tiled-cut one (that order with a few documents re-laid, runtime/tile_cut.py,
where the model cannot re-lay pieces not offered), and the split layout cutting the 1, 2, ... longest documents -- is priced on the
calibrated cost model the way auto shape prices a tile:
:func:`~megatron_mesh_cp.planning.bounds.mesh_bound` of the layer with that layout's mask, i.e.
per phase the larger of the busiest rank's block seconds (each block as the kernel calls the mask
leaves it) and the bytes of the transfers some rank needs over its links. The fastest wins; among
layouts priced the same (a phase bound by its transfers hides its compute), the one whose busiest
rank's block seconds are lowest, and of those the earlier candidate (zigzag, then balanced, then
tiled, then tiled-cut, then fewer documents split), so a layout priced slower, or only matching
today's in both, is never taken over it. Where the tiled-cut layout's busiest rank stays above
CUT_GOAL times the mean, it is also cut from a restarted rank search's order, and that one taken
where it is more balanced and its plans replay faster (:func:`_restarted`). Deterministic: every rank
chooses the same from the same lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.layouts import (Arrangement, arrange, arrange_splits, arrange_whole, half_rows, split_label,
                               splits_cross_every_piece, tiled_cut)
from ..runtime.tile_balance import BUDGET, search_entries
from .bounds import full_comm_bound, mesh_bound
from .cluster import Cluster, Workload
from .documents import tile_bound
from .replay import replay
from .schedule import uncached_document_plans

__all__ = ["LayoutChoice", "choose_layout", "candidate_layouts", "resolve_layout", "tile_weights", "SPLIT_CANDIDATES"]

#: the split layout is tried cutting 1 .. this many of the longest documents
SPLIT_CANDIDATES = 4
#: where the tiled-cut layout's busiest rank stays above CUT_GOAL times the mean (its modelled cost,
#: runtime/tile_cut.py; the block engine's busiest / mean came out within 0.015 above it on 4K-64K documents
#: at CP = 256), auto also cuts from the tiled orders of up to CUT_RESTARTS restarted rank searches
#: (:func:`_restarted`; one: of 4K-64K seeds 0-7, a second or third restart was taken on GQA seed 6 alone,
#: and they cost host time on every draw they did not help)
CUT_GOAL, CUT_RESTARTS = 1.12, 1
#: ... and takes one only where its modelled balance is at least CUT_MARGIN lower and its plans replay at
#: least CUT_GAIN (relative) faster: the replay here runs without the live-chunk limit the shape's plans may
#: run under (4K-64K seed 1, GQA at 2x16: a restart 0.2% faster unlimited replayed 0.7% slower at 35 live)
CUT_MARGIN, CUT_GAIN = 0.01, 0.003


@dataclass(frozen=True, eq=False)
class LayoutChoice:
    """The layout auto chose, its predicted seconds (forward + backward, simulated), and every
    candidate's (name, seconds, busiest / mean work) for the log; ``host_seconds``: the choice's cost."""

    arrangement: Arrangement
    seconds: float
    candidates: Tuple[Tuple[str, float, float], ...]
    host_seconds: float

    def describe(self) -> str:
        best = self.arrangement
        others = ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s, _ in self.candidates if n != _label(best))
        what = "chunk" if best.rank_work is None else "rank"
        return (f"layout {_label(best)} (busiest / mean {what} work {best.balance:.2f}; simulated "
                f"{self.seconds * 1e3:.2f} ms fwd+bwd per layer){'; ' + others if others else ''}")


def _label(arr: Arrangement) -> str:
    return arr.label


def tile_weights(w: Workload, cluster: Cluster) -> Tuple[float, float, float, float]:
    """The cost model's seconds (forward + backward) of one kernel call off the diagonal as (per call,
    per Q row, per key, per pair), the linear model runtime/tile_balance.py balances ranks by: the
    call overhead and output correction per row, the dK/dV accumulation per key, the kernel per pair,
    and its efficiency loss at r rows (peak * r / (r + half)), which for an r x k rectangle is ``half``
    keys' worth of pairs."""
    out = np.zeros(4)
    for bwd in (False, True):
        per_pair = w.pair_flops(1.0, bwd) / (cluster.bwd_flops if bwd else cluster.fwd_flops)
        call = w._call_cost(cluster, 0, bwd)
        out += (call, w._call_cost(cluster, 1, bwd) - call,
                w._keys_cost(cluster, 1, bwd) - w._keys_cost(cluster, 0, bwd) + per_pair * cluster.half_tokens,
                per_pair)
    return tuple(float(v) for v in out)


def candidate_layouts(lengths: Sequence[int], chunks: int, causal: bool = True,
                      max_split: int = SPLIT_CANDIDATES, shape: Optional[Tuple[int, int]] = None,
                      weights: Optional[Tuple[float, float, float, float]] = None) -> List[Arrangement]:
    """zigzag, balanced, tiled (with ``shape``, the (a, b) mesh whose ranks it balances by ``weights``,
    searched from the balanced order; only where its host budget affords at least 8 rounds of 32
    moves: not at CP = 256 chunks of 1M tokens, say) and tiled-cut (from it; with ``max_split`` >= 1,
    as it cuts documents), and split over the 1 .. ``max_split`` longest
    documents longer than a piece (a shorter one cannot hold the busiest piece; the ones that do not
    fit are skipped)."""
    return (_whole_candidates(lengths, chunks, causal, shape, weights, cut=max_split >= 1)
            + arrange_splits(lengths, chunks, _split_count(lengths, chunks, max_split), causal=causal))


def _whole_candidates(lengths, chunks, causal, shape, weights, cut: bool) -> List[Arrangement]:
    """zigzag, balanced and (where its budget allows) tiled, and with ``cut`` the tiled-cut layout
    from that tiled one (causal only: without the mask a re-lay moves no work)."""
    tiled = shape is not None and chunks > 1 and 8 * 32 * search_entries(lengths, chunks, causal) <= BUDGET
    out = arrange_whole(lengths, chunks, causal=causal, shape=shape if tiled else None, weights=weights)
    if tiled and cut and causal:
        out.append(tiled_cut(out[-1], causal=causal, weights=weights))
    return out


def _split_count(lengths: Sequence[int], chunks: int, max_split: int) -> int:
    piece = sum(lengths) // (2 * chunks)
    return min(max_split, sum(1 for x in lengths if x > piece))


def choose_layout(lengths: Sequence[int], a: int, b: int, cluster: Cluster, w: Workload, *, stride: int = 1,
                  candidates: Optional[Sequence[Arrangement]] = None,
                  max_split: int = SPLIT_CANDIDATES) -> LayoutChoice:
    """The fastest layout of documents ``lengths`` on the a x b mesh (its N = a * b chunks: the
    super-ranks under a2a+mesh, whose ``w`` is then the inner layer after the all-to-all).
    ``w`` is the layer without its documents (shapes, dtypes); ``stride``: GPUs between CP ranks.
    Without ``candidates`` (:func:`candidate_layouts`'), the split ones are built only when they can
    win: a split layout needs every block (its first document crosses every piece), so it takes at
    least :func:`~megatron_mesh_cp.planning.bounds.full_comm_bound`, and when a whole-document layout
    is priced at or below that their searches are skipped (a split layout could then at best tie,
    so it is not built). ``max_split``: the most documents a split candidate cuts (0: documents
    stay whole, where the model cannot re-lay pieces: no tiled-cut either)."""
    t0 = time.perf_counter()
    n = a * b
    if sum(lengths) != w.seq_local * n:
        raise ValueError(f"the documents span {sum(lengths)} tokens but {n} chunks of {w.seq_local} tokens hold "
                         f"{w.seq_local * n}")
    own = candidates is None
    weights = tile_weights(w, cluster)
    cands = (_whole_candidates(lengths, n, w.causal, (a, b), weights, cut=max_split >= 1) if own
             else list(candidates))
    rows = [_priced(arr, a, b, cluster, w, stride) for arr in cands]
    if own:
        skip = max_split < 1 or (splits_cross_every_piece(lengths, n)
                                 and min(r[1] for r in rows) <= full_comm_bound(a, b, cluster, w, stride))
        if not skip:
            most = _split_count(lengths, n, max_split)
            splits = arrange_splits(lengths, n, most, causal=w.causal)
            cands += splits
            rows += [_priced(arr, a, b, cluster, w, stride) for arr in splits]
            if half_rows(a, b):  # the best split count K, its last 1 .. K documents over half rows; and every
                # larger count (up to the candidates' most) all over half rows: those fit where split:K does not
                best = min(range(len(splits)), key=lambda i: rows[len(rows) - len(splits) + i][1]) if splits else None
                count = 0 if best is None else splits[best].split
                pairs = [(count, h) for h in range(1, count + 1)] + [(k, k) for k in range(count + 1, most + 1)]
                halves = arrange_splits(lengths, n, most, causal=w.causal, shape=(a, b), halves=pairs)
                cands += halves
                rows += [_priced(arr, a, b, cluster, w, stride) for arr in halves]
    if own:  # tiled-cut from a restarted search, where it is priced fastest of all and stays unbalanced
        _restarted(lengths, cands, rows, a, b, cluster, w, stride, weights)
    best = _fastest(cands, rows, a, b, cluster, w)
    if cands[best].halves:
        best = _replayed_fastest(cands, rows, a, b, cluster, w, stride)
    return LayoutChoice(cands[best], rows[best][1], tuple(rows), time.perf_counter() - t0)


def _restarted(lengths, cands: List[Arrangement], rows: list, a: int, b: int, cluster: Cluster, w: Workload,
               stride: int, weights) -> None:
    """Where the tiled-cut candidate's busiest rank stays above :data:`CUT_GOAL` times the mean (its
    cut's model), the same cut from the tiled orders of restarted rank searches (runtime/layouts.py
    ``arrange(..., restart=k)``, k = 1 .. :data:`CUT_RESTARTS`, from the same balanced start): a re-lay
    keeps its tiled order's footprint and tile blocks, which can leave no re-lay that unloads the
    busiest rank (4K-64K seed 6, MHA at 4x8: 1.25x the mean from the first order, 1.11x from the
    second). The first one modelled :data:`CUT_MARGIN` more balanced, priced no slower and whose plans
    replay :data:`CUT_GAIN` faster replaces it in ``cands`` and ``rows``; else they stay (the busiest
    rank's blocks are not all of the step: which blocks wait for which chunks moves with the order;
    4K-64K seed 5, MHA: a restart modelled 1.147 -> 1.119 replayed 8% slower). Only where tiled-cut is
    priced fastest; host time: one more tiled search and cut, and two replays (about as much again as
    the whole-document candidates). ``weights``: the tiled searches' :func:`tile_weights`."""
    i = next((k for k, arr in enumerate(cands) if arr.name == "tiled-cut"), None)
    if i is None or cands[i].cut_balance <= CUT_GOAL or rows[i][1] > min(r[1] for r in rows):
        return
    first, n = cands[i], a * b
    start = next(arr.runs[0] for arr in cands if arr.name == "balanced")  # the tiled searches' start
    base = None
    for k in range(1, CUT_RESTARTS + 1):
        arr = tiled_cut(arrange(lengths, n, "tiled", causal=w.causal, shape=(a, b), weights=weights, start=start,
                                restart=k), causal=w.causal, weights=weights)
        if arr.cut_balance > first.cut_balance - CUT_MARGIN:
            continue
        row = _priced(arr, a, b, cluster, w, stride)
        if row[1] > rows[i][1]:
            continue
        if base is None:
            base = _replay_seconds(first, a, b, cluster, w, stride)
        if _replay_seconds(arr, a, b, cluster, w, stride) <= base * (1 - CUT_GAIN):
            cands[i], rows[i] = arr, row
            return


def _replayed_fastest(cands: Sequence[Arrangement], rows, a: int, b: int, cluster: Cluster, w: Workload,
                      stride: int) -> int:
    """Among the candidates with documents over half rows priced below every other candidate, and the
    fastest other one, the one whose plans replay fastest (ties: the other one). Their bound misses
    what their uneven blocks cost: a rank meets such a document in a quarter of its tile blocks, which
    tile blocks differ from rank to rank, and the ranks of one SPMD plan then wait on each other's
    partials (heavy-tailed MHA 32/32 at 8x4x8: split:3:3 bound 20% below split:3, replayed 1.6% above)."""
    others = [i for i, arr in enumerate(cands) if not arr.halves]
    base = _fastest([cands[i] for i in others], [rows[i] for i in others], a, b, cluster, w)
    base = others[base]
    tried = [i for i, arr in enumerate(cands) if arr.halves and rows[i][1] < rows[base][1]]
    times = {i: _replay_seconds(cands[i], a, b, cluster, w, stride) for i in [base] + tried}
    return min([base] + tried, key=lambda i: (times[i], i != base))


def _replay_seconds(arr: Arrangement, a: int, b: int, cluster: Cluster, w: Workload, stride: int) -> float:
    """Forward + backward seconds of the plans the layer with ``arr``'s mask runs (planning/replay.py): those
    of schedule.document_plans, built without its cache (a candidate that does not run would evict the plans of
    layouts that do)."""
    masked = replace(w, mask=arr.mask)
    return sum(replay(p, cluster, masked, stride=stride, record=None).time
               for p in uncached_document_plans(a, b, cluster=cluster, workload=masked, stride=stride))


def _fastest(cands: Sequence[Arrangement], rows, a: int, b: int, cluster: Cluster, w: Workload) -> int:
    """The candidate priced fastest; among those priced the same (both phases bound by the same
    transfers, say), the one whose busiest rank's block seconds are lowest (its blocks' own time:
    planning/documents.py ``tile_bound``), then the earliest: never a layout priced slower, and
    never a new one for nothing."""
    price = [r[1] for r in rows]
    tied = [i for i, s in enumerate(price) if s == min(price)]
    if len(tied) == 1:
        return tied[0]
    busiest = [sum(tile_bound(replace(w, mask=cands[i].mask), cluster, a, b, bwd)[0] for bwd in (False, True))
               for i in tied]
    return tied[int(np.argmin(busiest))]  # the first of equals


def _priced(arr: Arrangement, a: int, b: int, cluster: Cluster, w: Workload, stride: int):
    """(label, mesh_bound seconds, busiest / mean chunk work) of one candidate."""
    return _label(arr), mesh_bound(a, b, cluster, replace(w, mask=arr.mask), stride), arr.balance


def resolve_layout(w: Workload, a: int, b: int, cluster: Cluster, stride: int = 1) -> Workload:
    """``w`` with an ``auto`` layout of its documents replaced by the one :func:`choose_layout` picks for
    the a x b mesh (cached), a ``tiled`` one made for that mesh; any other workload as it is."""
    docs = w.mask
    if getattr(docs, "halves", 0) and not half_rows(a, b):  # split:K:H is split:K where no half rows are
        return replace(w, mask=docs.with_layout(split_label(docs.split)))
    if getattr(docs, "tiled", False) or getattr(docs, "halves", 0):
        return replace(w, mask=docs.for_mesh(a, b, tile_weights(w, cluster)))
    if not getattr(docs, "auto", False):
        return w
    return _resolved(w, a, b, cluster, stride)


@lru_cache(maxsize=128)
def _resolved(w: Workload, a: int, b: int, cluster: Cluster, stride: int) -> Workload:
    docs = w.mask
    choice = choose_layout(docs.lengths, a, b, cluster, replace(w, mask=None), stride=stride)  # as the launcher does
    arr = choice.arrangement
    layout = arr.label
    out = replace(docs.with_layout(layout), restart=arr.restart)
    return replace(w, mask=out.for_mesh(a, b, tile_weights(w, cluster)) if out.tiled or out.halves else out)
