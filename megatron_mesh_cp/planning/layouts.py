"""Choosing a micro-batch's token layout by the cost model (runtime/layouts.py builds them).

For one micro-batch's document lengths and the mesh that runs it, every candidate layout -- the
zigzag as given, the balanced document order, and the split layout cutting the 1, 2, ... longest
documents -- is priced on the calibrated cost model the way auto shape prices a tile:
:func:`~megatron_mesh_cp.planning.bounds.mesh_bound` of the layer with that layout's mask, i.e.
per phase the larger of the busiest rank's block seconds (each block as the kernel calls the mask
leaves it) and the bytes of the transfers some rank needs over its links. The fastest wins; ties go
to the earlier candidate (zigzag, then balanced, then fewer documents split), so a layout that only
matches today's is never taken over it. Deterministic: every rank chooses the same from the same
lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.layouts import Arrangement, arrange_candidates
from .bounds import mesh_bound
from .cluster import Cluster, Workload

__all__ = ["LayoutChoice", "choose_layout", "candidate_layouts", "resolve_layout", "SPLIT_CANDIDATES"]

#: the split layout is tried cutting 1 .. this many of the longest documents
SPLIT_CANDIDATES = 4


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
        return (f"layout {_label(best)} (busiest / mean chunk work {best.balance:.2f}; simulated "
                f"{self.seconds * 1e3:.2f} ms fwd+bwd per layer){'; ' + others if others else ''}")


def _label(arr: Arrangement) -> str:
    return f"split:{arr.split}" if arr.split else arr.name


def candidate_layouts(lengths: Sequence[int], chunks: int, causal: bool = True,
                      max_split: int = SPLIT_CANDIDATES) -> List[Arrangement]:
    """zigzag, balanced, and split over the 1 .. ``max_split`` longest documents longer than a piece
    (a shorter one cannot hold the busiest piece; the ones that do not fit are skipped)."""
    piece = sum(lengths) // (2 * chunks)
    long = sum(1 for x in lengths if x > piece)
    return arrange_candidates(lengths, chunks, min(max_split, long), causal=causal)


def choose_layout(lengths: Sequence[int], a: int, b: int, cluster: Cluster, w: Workload, *, stride: int = 1,
                  candidates: Optional[Sequence[Arrangement]] = None) -> LayoutChoice:
    """The fastest layout of documents ``lengths`` on the a x b mesh (its N = a * b chunks: the
    super-ranks under a2a+mesh, whose ``w`` is then the inner layer after the all-to-all).
    ``w`` is the layer without its documents (shapes, dtypes); ``stride``: GPUs between CP ranks."""
    t0 = time.perf_counter()
    n = a * b
    cands = list(candidates) if candidates is not None else candidate_layouts(lengths, n, w.causal)
    if sum(lengths) != w.seq_local * n:
        raise ValueError(f"the documents span {sum(lengths)} tokens but {n} chunks of {w.seq_local} tokens hold "
                         f"{w.seq_local * n}")
    rows = []
    for arr in cands:
        seconds = mesh_bound(a, b, cluster, replace(w, mask=arr.mask), stride)
        rows.append((_label(arr), seconds, arr.balance))
    best = int(np.argmin([r[1] for r in rows]))  # the first of equals: never a new layout for nothing
    return LayoutChoice(cands[best], rows[best][1], tuple(rows), time.perf_counter() - t0)


def resolve_layout(w: Workload, a: int, b: int, cluster: Cluster, stride: int = 1) -> Workload:
    """``w`` with an ``auto`` layout of its documents replaced by the one :func:`choose_layout` picks for
    the a x b mesh (cached); any other workload as it is."""
    docs = w.mask
    if not getattr(docs, "auto", False):
        return w
    return _resolved(w, a, b, cluster, stride)


@lru_cache(maxsize=128)
def _resolved(w: Workload, a: int, b: int, cluster: Cluster, stride: int) -> Workload:
    docs = w.mask
    choice = choose_layout(docs.lengths, a, b, cluster, replace(w, mask=None), stride=stride,
                           candidates=candidate_layouts(docs.lengths, a * b, w.causal))
    arr = choice.arrangement
    layout = f"split:{arr.split}" if arr.split else arr.name
    return replace(w, mask=docs.with_layout(layout))
