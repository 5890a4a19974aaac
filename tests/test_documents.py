"""Document masking on the ordinary zigzag layout: every block's sub-blocks against the dense mask
they stand for, the blocks some rank needs, pruned plans (valid, fewer bytes, none when no document
crosses a chunk), and mesh / a2a+mesh on virtual ranks against a float64 reference for every
factorisation of n in {2, 4, 6, 8}, MHA and GQA, causal and not; gloo runs and bad input are in
test_documents_dist.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_mesh_cp import build_plans, valid_shapes
from megatron_mesh_cp.runtime.masks import Documents, Window, documents_from_eod, intersect
from megatron_mesh_cp.runtime.kernels import TorchKernel, Varlen
from megatron_mesh_cp.runtime.layout import zigzag_positions
from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic, validate
from megatron_mesh_cp.runtime.prune import prune
from megatron_mesh_cp.runtime.topology import MeshShape
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.virtual import virtual_mesh_attention


def span_blocks(docs, n, causal, window=None):
    """The runtime's block engine of documents (a Documents or UnpaddedDocuments mask, or offsets)
    and a window on n mesh chunks."""
    docs = docs if not isinstance(docs, (list, tuple)) else Documents(tuple(docs))
    return intersect(docs, None if window is None else Window(*window)).bind(n, docs.cu[-1], causal)


def offsets(lengths):
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    return cu


def document_sets(n, rng):
    """Lengths 1, 2n-1 and 2n+1, one document spanning every rank, many tiny ones, a random mix;
    each set filled up to a multiple of 2n."""
    m = 2 * n
    sets = [[1, m - 1, m + 1, 5 * m - 1], [8 * m], [1, 2, 1, 3] * n + [2] * n, [rng.randint(1, 3 * m) for _ in range(6)]]
    out = []
    for lengths in sets:
        rest = -sum(lengths) % m
        out.append(offsets(lengths + ([rest] if rest else [])))
    return out


def dense_mask(cu, n, i, j, causal, window=None):
    """The definition: (local row, local key) of block (i, j) kept iff same document (and key <= query;
    and query - left <= key <= query + right for a window)."""
    total = cu[-1]
    doc = torch.searchsorted(torch.tensor(cu[1:]), torch.arange(total), right=True)
    qi, kj = zigzag_positions(total, n, i), zigzag_positions(total, n, j)
    keep = doc[qi][:, None] == doc[kj][None, :]
    diff = kj[None, :] - qi[:, None]
    if causal:
        keep &= diff <= 0
    if window is not None:
        left, right = window
        keep &= ((diff >= -left) | (left < 0)) & ((diff <= right) | (right < 0))
    return keep


def band(rows, keys, causal, window):
    """What a kernel call computes: bottom-right aligned window (flash-attn / TE semantics)."""
    r, c = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    left, right = window if window is not None else (-1, -1)
    if causal:
        assert rows == keys  # causal calls are square
        right = 0
    d = c - r - (keys - rows)
    return (((d >= -left) | (left < 0)) & ((d <= right) | (right < 0))).long()


def mask_of(sub_blocks, size):
    """The (row, key) pairs a block's sub-blocks compute, counting each pair's calls."""
    hits = torch.zeros(size, size, dtype=torch.int64)
    for s in sub_blocks:
        rows, cols = s.rows, s.cols
        if s.lens is None:
            hits[rows, cols] += band(rows.stop - rows.start, cols.stop - cols.start, s.causal, s.window)
            continue
        assert rows == cols  # varlen: square runs
        at = rows.start
        for x in s.lens:
            hits[at:at + x, at:at + x] += band(x, x, s.causal, s.window)
            at += x
        assert at == rows.stop
        assert s.pairs == sum(int(band(x, x, s.causal, s.window).sum()) for x in s.lens)
    return hits


WINDOWS = [None, (7, 0), (3, -1), (4, 4), (2, 9), (0, 0), (30, 5)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_sub_blocks_are_the_dense_mask(n):
    """Every block's kernel calls compute exactly the pairs of the definition, each once, with and
    without documents and windows; nonempty() says which blocks have any."""
    rng = random.Random(n)
    for cu in document_sets(n, rng) + [[0, 8 * 2 * n]]:
        for causal in (True, False):
            for window in WINDOWS + [(3 * (cu[-1] // (2 * n)), 0)]:
                if causal and window is not None and window[1] > 0:
                    continue
                mask = span_blocks(cu, n, causal, window)
                ne = mask.nonempty()
                for i in range(n):
                    for j in range(n):
                        want = dense_mask(cu, n, i, j, causal, window)
                        hits = mask_of(mask.block(i, j), want.shape[0])
                        assert hits.max() <= 1, (cu, i, j)  # no pair computed twice
                        assert torch.equal(hits.bool(), want.bool()), (cu, n, i, j, causal, window)
                        assert bool(ne[i, j]) == bool(want.any()), (cu, n, i, j, causal, window)
                        assert sum(s.pairs for s in mask.block(i, j)) == int(want.sum())
                        if causal and i != j and window is None:
                            assert len(mask.block(i, j)) <= 1  # one document at most reaches across chunks


def test_needed_blocks_are_the_union_over_ranks():
    rng = random.Random(7)
    for a, b in ((2, 3), (3, 2), (1, 6), (6, 1)):
        shape = MeshShape(a, b)
        for cu in document_sets(shape.n, rng):
            mask = span_blocks(cu, shape.n, True)
            union = {(qo, ko) for g in range(shape.n) for qo in range(a) for ko in range(b)
                     if mask.block(shape.q_chunk(g, qo), shape.kv_chunk(g, ko))}
            assert mask.needed(shape) == union


def test_documents_from_eod_follow_megatrons_masks():
    eod = 9
    tokens = torch.tensor([1, 2, 9, 3, 9, 9, 4, 5, 9])  # EOD closes its document; the last EOD ends the row
    assert documents_from_eod(tokens, eod).tolist() == [0, 3, 5, 6, 9]
    assert documents_from_eod(torch.tensor([1, 2, 3]), eod).tolist() == [0, 3]
    assert documents_from_eod(torch.tensor([9, 1]), eod).tolist() == [0, 1, 2]


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_pruned_plans_validate_and_move_less(n):
    rng = random.Random(n)
    dims = ChunkDims(1, 16 * n, 4, 2, 8, torch.float32)
    for a, b in valid_shapes(n):
        full = build_plans(a, b, chains="both-ways")
        for cu in document_sets(n, rng):
            keep = span_blocks(cu, n, True).needed(MeshShape(a, b))
            for plan in full:
                pruned = prune(plan, keep)
                validate(pruned)
                assert set(pruned.blocks) == set(keep)
                assert sum(plan_traffic(pruned, dims).values()) <= sum(plan_traffic(plan, dims).values())
        # documents that never cross a chunk (each piece its own documents): only the own block, nothing moves
        cu = offsets([2, 3, 11] * (2 * n))
        keep = span_blocks(cu, n, True).needed(MeshShape(a, b))
        assert keep == {(0, 0)}
        for plan in full:
            pruned = prune(plan, keep)
            validate(pruned)
            assert not pruned.transfers and plan_traffic(pruned, dims) == {}


SHAPES = [s for n in (2, 4, 6, 8) for s in valid_shapes(n)] + [(2, 1, 2), (2, 2, 1), (2, 1, 4), (4, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_documents_exact_against_float64_every_factorisation(shape):
    """fp32 forward (out, lse) and backward within 1e-5 of float64, MHA and GQA; causal for every
    document set, non-causal for one; bytes = plan_traffic of the pruned plans that ran."""
    n = math.prod(shape)
    u = shape[0] if len(shape) == 3 else 1
    rng = random.Random(n * 13 + len(shape))
    g = torch.Generator().manual_seed(n)
    sets = document_sets(n, rng)
    for s, cu in enumerate(sets):
        for heads, kv_heads in ((4, 2), (4, 4)) if s == 0 else ((4, 2),):  # GQA everywhere, MHA on the first set
            for causal in (True, False) if s == 0 else (True,):
                t = cu[-1]
                q, k, v, do = (torch.randn(t, x, 8, generator=g, dtype=torch.float64)
                               for x in (heads, kv_heads, kv_heads, heads))
                ref = packed_reference(q, k, v, do, cu, causal=causal)
                res = virtual_mesh_attention(*(x.float()[None] for x in (q, k, v)), shape, dout=do.float()[None],
                                             causal=causal, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                             kernel="torch")
                got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
                for name, err in relative_errors(got, ref).items():
                    assert err <= 1e-5, (shape, heads, kv_heads, cu, causal, name, err)
                if u == 1:  # the mesh's own bytes are the pruned plans' (a2a+mesh adds its all-to-all)
                    dims = ChunkDims(1, t // n, heads, kv_heads, 8, torch.float32)
                    want = {**plan_traffic(res["plans"][0], dims), **plan_traffic(res["plans"][1], dims)}
                    assert all(dict(tr.sent) == want for tr in res["traffic"]), (shape, cu)


def single_device_bf16(q, k, v, do, cu):
    """One bf16 varlen call of the torch kernel over the whole sequence (the yardstick)."""
    kern = TorchKernel()
    lens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
    vl = Varlen(torch.tensor(cu, dtype=torch.int32), lens, max(lens))
    qb, kb, vb, dob = (x.bfloat16().unsqueeze(1) for x in (q, k, v, do))  # [t, 1, h, d]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = kern.forward(qb, kb, vb, causal=True, scale=scale, varlen=vl)
    dq, dk, dv = kern.backward(dob, qb, kb, vb, out, kern.lse_for_backward(lse.permute(2, 0, 1), varlen=vl),
                               causal=True, scale=scale, varlen=vl)
    return {"out": out[:, 0], "lse": lse[0], "dq": dq[:, 0], "dk": dk[:, 0], "dv": dv[:, 0]}


def test_documents_bf16_close_to_single_device_bf16():
    """bf16 inputs: the mesh's error vs float64 stays within 1.3x the single-device bf16 error."""
    g = torch.Generator().manual_seed(3)
    cu = offsets([5, 40, 3, 80, 1, 63])
    t = cu[-1]
    q, k, v, do = (torch.randn(t, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = packed_reference(q, k, v, do, cu)
    base = relative_errors(single_device_bf16(q, k, v, do, cu), ref)
    for shape in ((2, 2), (1, 8), (2, 1, 2)):
        res = virtual_mesh_attention(*(x.bfloat16()[None] for x in (q, k, v)), shape, dout=do.bfloat16()[None],
                                     cu_seqlens=torch.tensor(cu, dtype=torch.int32), kernel="torch")
        got = relative_errors({name: res[name][0] for name in base}, ref)
        for name in base:
            assert got[name] <= 1.3 * base[name], (shape, name, got[name], base[name])
