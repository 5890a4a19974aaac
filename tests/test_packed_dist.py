"""Packed sequences (THD) on real gloo process groups: mesh 2x2, Ring 1x4 and a2a+mesh 2x1x2
against the float64 block-diagonal reference (padding, GQA); the same bytes as an unpacked call;
one agreement per new batch; bad input raises the same ValueError on every rank."""

from __future__ import annotations

import math

import pytest

from megatron_mesh_cp.spawn import RankError

CU, REAL = [0, 8, 56, 72, 80, 96], [0, 8, 51, 64, 64, 77]  # 2·CP, long, padded, all padding, padded


@pytest.mark.parametrize("shape,heads", [((2, 2), (4, 2)), ((1, 4), (4, 4)), ((2, 1, 2), (4, 2))],
                         ids=["2x2-gqa", "1x4-mha", "a2a2x1x2-gqa"])
def test_packed_exact_on_process_groups(pools, shape, heads):
    per_rank = pools.get(4).run("rank_tasks_packed:exactness", shape, CU, REAL, *heads, seed=sum(shape))
    for name in ("out", "lse", "dq", "dk", "dv"):
        num = sum(r["errors"][name][0] for r in per_rank)
        den = sum(r["errors"][name][1] for r in per_rank)
        assert math.sqrt(num / den) <= 1e-5, (shape, name, math.sqrt(num / den))
    for r in per_rank:
        assert r["same_inf"]  # padding rows: lse = -inf exactly where the reference has it
        assert r["packed_bytes"] == r["plain_bytes"] and r["packed_bytes"]  # chunk payloads unchanged
        assert r["agreed_same"] == 3  # per-batch documents: every call agrees on them ...
        assert r["agreed_batch"] == 1  # ... unless the batch was agreed once (agree_batch)


BAD = {
    "unpadded": "document 0 has padded length 6, not a multiple of 2*CP = 8; pad every document",
    "disagree": "disagree on cu_seqlens_padded",
    "kernel": ("the dense-only attention kernel cannot run document (varlen) calls; kernels that run these inputs "
               "here: torch"),
    "noncausal": "packed sequences (THD) need causal=True",
    "layout": "takes layout='thd'",
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_packed_bad_input_raises_on_every_rank(pools, what):
    with pytest.raises(RankError) as info:
        pools.get(4).run("rank_tasks_packed:bad_input", what)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert {t for t, _, _ in errors.values()} == {"ValueError"}, errors
    messages = {m for _, m, _ in errors.values()}
    assert len(messages) == 1 and BAD[what] in messages.pop(), errors
