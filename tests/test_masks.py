"""Masks as values (runtime/masks): composition rules, and chunked local attention (Llama 4's
``attention_chunk_size``) -- a mask added through the mask protocol alone -- alone and with documents:
the block engine against the dense definition, mesh and a2a+mesh on virtual ranks and on gloo against
a float64 dense reference, and the simulator's bytes equal to the executor's counters."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_mesh_cp import valid_shapes
from megatron_mesh_cp.planning import Workload, document_plans, load_cluster
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.runtime.layout import zigzag_positions
from megatron_mesh_cp.runtime.masks import (
    FULL, Chunked, Documents, PackedDocuments, Window, intersect, packed_documents,
)
from megatron_mesh_cp.virtual import virtual_mesh_attention


def chunk_ids(total, size, cu=None):
    """The definition: a token's (document, chunk counted from its document's start)."""
    cu = cu or [0, total]
    pos = torch.arange(total)
    doc = torch.searchsorted(torch.tensor(cu[1:]), pos, right=True)
    start = torch.tensor(cu)[doc]
    return doc * (total + 1) + (pos - start) // size


def dense_reference(q, k, v, do, keep, scale):
    """float64 attention under a dense [s, s] boolean mask (every row keeps at least itself)."""
    q, k, v = (x.double().clone().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    out.backward(do.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def chunked_keep(total, size, cu, causal):
    ids = chunk_ids(total, size, cu)
    keep = ids[:, None] == ids[None, :]
    if causal:
        keep &= torch.ones(total, total, dtype=torch.bool).tril()
    return keep


def test_masks_compose_by_value():
    docs, win = Documents((0, 5, 16)), Window(3, 0)
    assert intersect(None, FULL) is FULL and intersect(docs) is docs
    both = docs & Chunked(4) & win
    assert (docs & win) == (win & docs) and both.parts == (docs, Chunked(4), win)  # documents cut first
    span = both.span(16, True)
    assert span.cu == (0, 4, 5, 9, 13, 16) and span.window == (3, 0)
    assert (Window(-1, 0).simplified(True)) is FULL and Window(-1, 0).simplified(False) == Window(-1, 0)
    assert Chunked(8).span(16).cu == (0, 8, 16) and Chunked(32).span(16).cu == (0, 16)
    packed = packed_documents([0, 8, 16])
    assert isinstance(packed, PackedDocuments) and packed.span(16) is None
    with pytest.raises(ValueError, match="sliding window with packed THD"):
        packed & win
    with pytest.raises(ValueError, match="sliding window with packed THD"):
        win & packed
    with pytest.raises(ValueError, match="positive int"):
        Chunked(0)
    assert hash(both) == hash(docs & Chunked(4) & win)  # a cache key


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunked_blocks_are_the_dense_definition(n):
    """Every block's kernel calls compute exactly the chunked mask's pairs, each once, with and
    without documents, causal or not; empty blocks are exactly those without a pair."""
    from test_documents import mask_of

    rng = random.Random(n)
    total = 16 * n
    for size in (1, 3, 2 * n, 5 * n + 1, total):
        for cu in (None, [0, 5, 4 + total // 4, total // 2 + 3, total], sorted({0, total, *rng.sample(range(1, total), 3)})):
            for causal in (True, False):
                mask = intersect(None if cu is None else Documents(tuple(cu)), Chunked(size))
                blocks = mask.bind(n, total, causal)
                keep = chunked_keep(total, size, cu, causal)
                for i in range(n):
                    for j in range(n):
                        qi, kj = zigzag_positions(total, n, i), zigzag_positions(total, n, j)
                        want = keep[qi][:, kj]
                        hits = mask_of(blocks.block(i, j), want.shape[0])
                        assert hits.max() <= 1 and torch.equal(hits.bool(), want), (n, size, cu, causal, i, j)
                        assert bool(blocks.nonempty()[i, j]) == bool(want.any())


SHAPES = [s for n in (2, 4, 6, 8) for s in valid_shapes(n)] + [(2, 1, 2), (4, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_exact_against_float64(shape):
    """mesh and a2a+mesh on virtual ranks, chunked alone and with documents, causal (MHA/GQA) and
    not: fp32 within 1e-5 of the float64 dense reference; the mesh's bytes are the pruned plans'."""
    n = math.prod(shape)
    total = 12 * n
    cases = [(5, None, True, (4, 2)), (2 * n + 1, [0, 7, total // 2 + 1, total], True, (4, 4)),
             (3, [0, total // 3, total], False, (4, 2))]
    for size, cu, causal, (h, hk) in cases:
        g = torch.Generator().manual_seed(n + size)
        q, do = (torch.randn(total, h, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(total, hk, 8, generator=g, dtype=torch.float64) for _ in range(2))
        ref = dense_reference(q, k, v, do, chunked_keep(total, size, cu, causal), 8 ** -0.5)
        kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
        res = virtual_mesh_attention(*(x.float()[None] for x in (q, k, v)), shape, dout=do.float()[None], causal=causal,
                                     mask=Chunked(size), kernel="torch", **kw)
        got = {"out": res["out"][0], "lse": res["lse"][0], "dq": res["dq"][0], "dk": res["dk"][0], "dv": res["dv"][0]}
        for name in got:
            err = float((got[name].double() - ref[name]).norm() / ref[name].norm())
            assert err <= 1e-5, (shape, size, cu, causal, name, err)


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 2)])
def test_chunked_simulated_bytes_equal_executor_bytes(shape):
    """The simulator runs the same pruned plans as the executor (call for call) and its bytes equal
    every rank's counters."""
    a, b = shape
    n = a * b
    total = 32 * n
    cu = [0, 3, total // 2 + 5, total]
    mask = Documents(tuple(cu)) & Chunked(2 * n + 3)
    h, hk, d = 4, 2, 8
    g = torch.Generator().manual_seed(n)
    q, do = (torch.randn(1, total, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(1, total, hk, d, generator=g) for _ in range(2))
    res = virtual_mesh_attention(q, k, v, shape, dout=do, mask=mask, kernel="torch")
    cluster = load_cluster("h100-ib400")
    w = Workload(seq_local=total // n, heads=h, kv_heads=hk, head_dim=d, bytes_per_element=4, partial_bytes=4,
                 mask=mask)
    plans = document_plans(a, b, cluster=cluster, workload=w)
    assert [p.ops for p in plans] == [p.ops for p in res["plans"]]
    for phase, p in zip(("forward", "backward"), plans):
        sim = sum(v_[0] for v_ in replay(p, cluster, w).sent.values())
        for tr in res["traffic"]:
            assert tr.total_sent(phase) == sim, (phase, tr.total_sent(phase), sim)


@pytest.mark.parametrize("shape", [(2, 2), (2, 1, 2)], ids=["2x2", "a2a2x1x2"])
def test_chunked_exact_on_process_groups(pools, shape):
    per_rank = pools.get(4).run("rank_tasks_variants:chunked", shape)
    for name in ("out", "lse", "dq", "dk", "dv"):
        num, den = (sum(r[name][x] for r in per_rank) for x in (0, 1))
        assert math.sqrt(num / den) <= 1e-5, (shape, name, math.sqrt(num / den))
    assert all(r["sent"] == r["want"] and r["sent"] for r in per_rank)
