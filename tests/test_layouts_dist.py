"""Token layouts on real gloo process groups: a long document split over every chunk among short ones
(split:1; split:2:1, the second over half of each mesh row's chunks), whole documents reordered (balanced, and tiled for the mesh's ranks) and tiled-cut (on 2x2
one document re-laid), on mesh 2x2 and
a2a+mesh 2x1x2, against the float64 reference of the documents in their own order; every rank sends
exactly its plans' bytes."""

from __future__ import annotations

import math

import pytest

LENGTHS = [61, 3, 9, 1, 14, 5, 2, 9]  # S = 104 on 4 ranks: a document over half the sequence among short ones


@pytest.mark.parametrize("shape,heads", [((2, 2), (4, 2)), ((2, 1, 2), (4, 2))], ids=["2x2-gqa", "a2a2x1x2-gqa"])
@pytest.mark.parametrize("layout,split", [("split", 1), ("balanced", 0), ("tiled", 0), ("tiled-cut", 0)])
def test_relaid_documents_exact_on_process_groups(pools, shape, heads, layout, split):
    _check(pools.get(4).run("rank_tasks_layouts:relaid_exactness", shape, LENGTHS, layout, split, *heads,
                            seed=len(shape)), shape, layout, split)


def test_documents_over_half_rows_exact_on_process_groups(pools):
    """split:2:1 on mesh 2x2: the long document over every chunk, the second over half of each mesh row's
    (one chunk per row, so two of the four ranks' Q chunks hold none of it)."""
    _check(pools.get(4).run("rank_tasks_layouts:relaid_exactness", (2, 2), LENGTHS, "split", 2, 4, 2, seed=3,
                            halves=1), (2, 2), "split", 2)


def _check(per_rank, shape, layout, split):
    for name in ("out", "lse", "dq", "dk", "dv"):
        num = sum(r["errors"][name][0] for r in per_rank)
        den = sum(r["errors"][name][1] for r in per_rank)
        assert math.sqrt(num / den) <= 1e-5, (shape, layout, name, math.sqrt(num / den))
    for r in per_rank:
        assert r["name"] == layout and r["split"] == split
        assert r["sent"] == r["want"] and r["sent"], (r["sent"], r["want"])  # bytes = the plans'
