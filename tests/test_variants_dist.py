"""Attention variants on real gloo process groups: a sliding window, a learnable sink and the max
logit together (with documents, and MLA head dims on one shape), mesh 2x2, Ring 1x4 and a2a+mesh
2x1x2, against float64; bytes = the pruned plans' (+ the all-to-all); bad input raises the same
ValueError on every rank before any transfer."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh_cp.spawn import RankError

RUNS = [((2, 2), True, (7, 0), 4, 2, 8, 8), ((1, 4), False, (4, 4), 4, 4, 8, 8), ((2, 1, 2), True, (3, 0), 4, 2, 40, 24)]


@pytest.mark.parametrize("shape,causal,window,heads,kv_heads,d,dv", RUNS, ids=["2x2-window-sink", "1x4-noncausal",
                                                                          "a2a2x1x2-mla"])
def test_variants_exact_on_process_groups(pools, shape, causal, window, heads, kv_heads, d, dv):
    per_rank = pools.get(4).run("rank_tasks_variants:exactness", shape, causal, window, heads, kv_heads, d, dv,
                                seed=sum(shape))
    for name in ("out", "lse", "dq", "dk", "dv"):
        num = sum(r["errors"][name][0] for r in per_rank)
        den = sum(r["errors"][name][1] for r in per_rank)
        assert math.sqrt(num / den) <= 1e-5, (shape, name, math.sqrt(num / den))
    dsink = sum(r["dsink"] for r in per_rank)  # each rank's rows; a parameter's gradient is reduced over CP
    ref = per_rank[0]["dsink_ref"]
    assert float((dsink - ref).norm() / ref.norm()) <= 1e-5
    for r in per_rank:
        assert torch.allclose(r["max_logit"], r["max_logit_ref"], rtol=1e-5, atol=1e-6)  # the same on every rank
        assert r["sent"] == r["want"] and r["sent"]


BAD = {
    "window": "window must be a pair of ints >= -1",
    "window-type": "window must be a pair of ints >= -1",
    "causal-right": "a causal query sees no key to its right",
    "sink-shape": "sink must be an fp32 tensor [4]",
    "sink-dtype": "sink must be an fp32 tensor [4]",
    "kernel": "the no-window attention kernel has no sliding window",
    "max-logit-kernel": "the no-window attention kernel cannot return the max logit",
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_variants_bad_input_raises_on_every_rank(pools, what):
    with pytest.raises(RankError) as info:
        pools.get(4).run("rank_tasks_variants:bad_input", what)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert {t for t, _, _ in errors.values()} == {"ValueError"}, errors
    messages = {m for _, m, _ in errors.values()}
    assert len(messages) == 1 and BAD[what] in messages.pop(), errors
