"""Document masking on real gloo process groups: mesh 2x2, Ring 1x4 and a2a+mesh 2x1x2 against
the float64 reference; every rank sends exactly its pruned plans' bytes and its pool holds their
peak; documents agreed every call, or once per batch after agree_batch; bad input raises the same
ValueError on every rank, also when one rank's documents change on a warm cache."""

from __future__ import annotations

import math

import pytest

from megatron_mesh_cp.spawn import RankError

CU = [0, 1, 8, 17, 18, 19, 20, 21, 30, 42, 54, 66, 78, 90, 96]  # 1 token, 2*CP-1, 2*CP+1, tiny, 12s; S = 96


@pytest.mark.parametrize("shape,heads", [((2, 2), (4, 2)), ((1, 4), (4, 4)), ((2, 1, 2), (4, 2))],
                         ids=["2x2-gqa", "1x4-mha", "a2a2x1x2-gqa"])
def test_documents_exact_on_process_groups(pools, shape, heads):
    per_rank = pools.get(4).run("rank_tasks_documents:exactness", shape, CU, *heads, seed=sum(shape))
    for name in ("out", "lse", "dq", "dk", "dv"):
        num = sum(r["errors"][name][0] for r in per_rank)
        den = sum(r["errors"][name][1] for r in per_rank)
        assert math.sqrt(num / den) <= 1e-5, (shape, name, math.sqrt(num / den))
    for r in per_rank:
        assert r["sent"] == r["want"] and r["sent"], (r["sent"], r["want"])  # bytes = the pruned plans'
        assert r["pool"] == r["peak"]
        assert r["kept"] < r["tile"] or len(shape) == 3  # something was pruned (2x1x2's 1x2 keeps both)
        assert r["agreed"] == 3  # documents change per batch: every call agrees on them ...
        assert r["agreed_batch"] == 1  # ... unless the batch was agreed once (agree_batch)


BAD = {
    "start": "cu_seqlens must start at 0",
    "end": "cu_seqlens ends at 30 but the sequence has 32 tokens",
    "order": "cu_seqlens must be strictly increasing; document 1 has length -15",
    "disagree": "disagree on documents",
    "warm": "disagree on documents",  # one rank's new documents on a warm cache: no hang, the same error
    "batch": "takes one sequence per call, got batch 2",
    "unread": "CP rank 2 (global rank 2) rejected its inputs: a token layout's code is inconsistent",  # agree_batch
    "kernel": ("the dense-only attention kernel cannot run document (varlen) calls; kernels that run these inputs "
               "here: torch"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_documents_bad_input_raises_on_every_rank(pools, what):
    with pytest.raises(RankError) as info:
        pools.get(4).run("rank_tasks_documents:bad_input", what)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert {t for t, _, _ in errors.values()} == {"ValueError"}, errors
    messages = {m for _, m, _ in errors.values()}
    assert len(messages) == 1 and BAD[what] in messages.pop(), errors
