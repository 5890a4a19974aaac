"""Packed sequences (THD, document masking): the per-document partition index for index against
its definition, and mesh / a2a+mesh on virtual ranks against a float64 block-diagonal reference
for every factorisation of n in {2, 4, 6, 8}, MHA and GQA, forward and backward; multi-rank gloo
runs, byte counts and bad input are in test_packed_dist.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_mesh_cp import valid_shapes
from megatron_mesh_cp.runtime.layout import BlockCase
from megatron_mesh_cp.runtime.masks import packed_documents
from megatron_mesh_cp.runtime.packed import (
    PackedLayout, packed_slices, padding_rows, thd_gather, thd_partition_indices, thd_shard,
)
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.virtual import virtual_mesh_attention


def definition(cu, n, g):
    """The partition as words say it: each document's 2n pieces, rank g keeps pieces g and 2n-1-g."""
    out = []
    for start, stop in zip(cu[:-1], cu[1:]):
        p = (stop - start) // (2 * n)
        for piece in (g, 2 * n - 1 - g):
            out += range(start + piece * p, start + (piece + 1) * p)
    return out


def offsets(lengths):
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    return cu


def documents(n, rng, count=5):
    """Padded lengths (multiples of 2n: one of exactly 2n, one long) and real lengths (one document
    all padding, one with a single real token, one unpadded)."""
    m = 2 * n
    padded = [m, 6 * m] + [m * rng.randint(1, 3) for _ in range(count - 2)]
    real = [m, 6 * m - rng.randint(1, m - 1), 0, 1] + [x - rng.randint(0, m - 1) for x in padded[4:]]
    return offsets(padded), offsets(real)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_partition_indices_match_the_definition(n):
    rng = random.Random(n)
    for trial in range(5):
        cu = offsets([2 * n * rng.randint(0 if trial else 1, 4) for _ in range(rng.randint(1, 6))])
        if cu[-1] == 0:
            continue
        total = cu[-1]
        seen = []
        for g in range(n):
            got = thd_partition_indices(torch.tensor(cu, dtype=torch.int32), total, n, g)
            assert got.tolist() == definition(cu, n, g), (cu, n, g)
            seen += got.tolist()
        assert sorted(seen) == list(range(total))  # every token on exactly one rank
        x = torch.randn(total, 3)
        assert torch.equal(thd_gather([thd_shard(x, cu, n, g) for g in range(n)], cu), x)


def test_partition_refuses_documents_not_split_evenly():
    with pytest.raises(ValueError, match=r"document 1 has padded length 6, not a multiple of 2\*CP = 4; pad every"):
        thd_partition_indices([0, 4, 10, 12], 12, 2, 0)
    with pytest.raises(ValueError, match="ends at 12 but the packed sequence has 16 tokens"):
        thd_partition_indices([0, 4, 12], 16, 2, 0)
    with pytest.raises(ValueError, match="real length 5 but padded length 4"):
        packed_documents(torch.tensor([0, 5, 8]), torch.tensor([0, 4, 8])).check(8, 2)


def test_padding_rows_and_half_major_order():
    n, cu, real = 2, [0, 8, 16], [0, 5, 13]  # document 0: 5 real tokens, 3 padding
    spec = packed_documents(torch.tensor(real), torch.tensor(cu))
    # rank 0 holds pieces 0 and 3 of each document: positions 0,1 and 6,7 of document 0 -> 6,7 pad
    assert padding_rows(spec, n, 0).tolist() == [False, False, True, True] + [False] * 4
    assert padding_rows(spec, n, 1).tolist() == [False] * 3 + [True] + [False] * 4  # positions 2, 3, 4, 5
    lay = PackedLayout(spec, n, 1, "cpu")
    # local rows [d0 first, d0 second, d1 first, d1 second] (2 each) -> firsts, then seconds
    assert lay.to_mesh.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert lay.varlen.lens == (2, 2) and lay.varlen.cu.tolist() == [0, 2, 4]
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop, s.causal) for s in packed_slices(BlockCase.DIAG, 8)] == [
        (0, 4, 0, 4, True), (4, 8, 0, 4, False), (4, 8, 4, 8, True)]


SHAPES = [s for n in (2, 4, 6, 8) for s in valid_shapes(n)] + [(2, 1, 2), (2, 2, 1), (2, 1, 4), (4, 1, 2), (2, 3, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_packed_exact_against_float64_every_factorisation(shape):
    """Random documents (one of length 2·CP, one long, one all padding), MHA and GQA, fp32 forward
    and backward within 1e-5 of float64; padding rows give exactly 0 / -inf / zero gradients."""
    n = math.prod(shape)
    rng = random.Random(n * 31 + len(shape))
    g = torch.Generator().manual_seed(n)
    for heads, kv_heads in ((4, 4), (4, 2)):
        for cu, real in (documents(n, rng), (offsets([8 * n]), offsets([8 * n - 3]))):  # + one long document
            t = cu[-1]
            q, k, v, do = (torch.randn(t, x, 8, generator=g, dtype=torch.float64) for x in (heads, kv_heads, kv_heads, heads))
            ref = packed_reference(q, k, v, do, cu, real)
            res = virtual_mesh_attention(q.float(), k.float(), v.float(), shape, dout=do.float(), layout="thd",
                                         cu_seqlens=torch.tensor(real), cu_seqlens_padded=torch.tensor(cu), kernel="torch")
            finite = torch.isfinite(ref["lse"])
            assert torch.equal(torch.isfinite(res["lse"]), finite)
            for name, err in relative_errors(res, ref).items():
                assert err <= 1e-5, (shape, heads, kv_heads, cu, real, name, err)
            pad = ~finite.any(0)
            assert pad.any() and not res["out"][pad].any() and not res["dq"][pad].any()
