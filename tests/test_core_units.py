"""Single-process tests: topology, layout, merge, the torch kernel, plans, and virtual-rank runs."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from megatron_mesh_cp import ChunkDims, MeshShape, build_plans, plan_traffic, valid_shapes, validate
from megatron_mesh_cp.runtime.execute import delta_stand_in
from megatron_mesh_cp.virtual import virtual_mesh_attention
from megatron_mesh_cp.runtime.kernels import TorchKernel, get_kernel
from megatron_mesh_cp.runtime.layout import BlockCase, BlockSlices, block_case, zigzag_gather, zigzag_positions, zigzag_shard
from megatron_mesh_cp.runtime.merge import empty_partial, merge_into
from megatron_mesh_cp.runtime.plan import Compute, Free, Plan, PlanError, Transfer
from megatron_mesh_cp.reference import reference_attention
from megatron_mesh_cp.runtime.topology import parse_shape

# --- topology ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 8, 9, 12, 16])
def test_topology_tiles_cover_the_matrix_once(n):
    for a, b in valid_shapes(n):
        m = MeshShape(a, b)
        am = m.assignment_matrix()
        for g in range(n):
            assert am[g][g] == g  # local Q-KV: own Q meets own KV in own tile
            tile = m.tile(g)
            assert len(tile) == n and all(am[i][j] == g for i, j in tile)
            r, c = m.coords(g)
            assert m.q_chunk(g, 0) == g == m.kv_chunk(g, 0)
            assert m.q_chunk(g, 1) == r * a + (c - 1) % a  # offset 1 = previous rank on the row ring
            assert m.kv_chunk(g, 1) == ((r - 1) % b) * a + c  # ... and on the column ring
            assert sorted(m.q_chunk(g, o) for o in range(a)) == m.row_ring(g)
            assert sorted(m.kv_chunk(g, o) for o in range(b)) == m.col_ring(g)
        counts = [sum(row.count(g) for row in am) for g in range(n)]
        assert counts == [n] * n


def test_topology_ring_and_pass_q_and_groups():
    ring, passq = MeshShape(1, 4), MeshShape(4, 1)
    assert ring.assignment_matrix() == [[i] * 4 for i in range(4)]  # Ring: each rank owns its Q row
    assert passq.assignment_matrix() == [list(range(4)) for _ in range(4)]  # pass-Q: KV column
    m = MeshShape(2, 4)
    assert m.row_rings() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.col_rings() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert valid_shapes(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert parse_shape("4x2") == (4, 2) and parse_shape("3×3") == (3, 3)
    with pytest.raises(ValueError, match="choose one of 1x4, 2x2, 4x1"):
        MeshShape.for_size((3, 2), 4)
    with pytest.raises(ValueError, match="AxB"):
        parse_shape("4by4")


# --- layout ------------------------------------------------------------------------------------


def test_zigzag_round_trip_and_positions():
    x = torch.arange(2 * 24).view(2, 24)
    for n in (1, 2, 3, 4, 6):
        shards = [zigzag_shard(x, n, g, dim=1) for g in range(n)]
        assert torch.equal(zigzag_gather(shards, dim=1), x)
        for g in range(n):
            assert torch.equal(shards[g][0], zigzag_positions(24, n, g))
    with pytest.raises(ValueError, match="divisible by 2\\*CP"):
        zigzag_shard(x, 5, 0, dim=1)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_block_cases_match_the_causal_mask(n):
    """The three cases of DESIGN.md section 3 are exactly what the global causal mask leaves."""
    seq = 4 * n
    chunk = seq // n
    for i, j in itertools.product(range(n), repeat=2):
        pi, pj = zigzag_positions(seq, n, i), zigzag_positions(seq, n, j)
        mask = pj[None, :] <= pi[:, None]
        sl = BlockSlices.of(block_case(i, j, True), chunk)
        want = torch.zeros_like(mask)
        sub = want[sl.q_rows, sl.kv_cols]
        sub[:] = torch.ones_like(sub).tril() if sl.causal else True
        assert torch.equal(mask, want), (i, j)
    assert block_case(1, 2, False) is BlockCase.FULL


# --- merge -------------------------------------------------------------------------------------


def test_merge_is_exact_and_handles_untouched_rows():
    torch.manual_seed(0)
    scores = torch.randn(2, 6, 3, 10, dtype=torch.float64) * 30  # large: overflow-prone
    values = torch.randn(2, 6, 3, 10, 5, dtype=torch.float64)
    full_lse = torch.logsumexp(scores, -1)
    full_out = (torch.softmax(scores, -1).unsqueeze(-1) * values).sum(-2)
    acc_out, acc_lse = empty_partial(full_out, torch.float64)
    for part in (slice(0, 3), slice(3, 7), slice(7, 10)):
        s = scores[..., part]
        lse = torch.logsumexp(s, -1)
        out = (torch.softmax(s, -1).unsqueeze(-1) * values[..., part, :]).sum(-2)
        merge_into(acc_out, acc_lse, out, lse)
    assert torch.allclose(acc_out, full_out, atol=1e-12) and torch.allclose(acc_lse, full_lse, atol=1e-12)
    # untouched rows (lse = -inf) merged with untouched rows stay untouched, never NaN
    o1, l1 = empty_partial(full_out, torch.float32)
    o2, l2 = empty_partial(full_out, torch.float32)
    merge_into(o1, l1, o2, l2)
    assert not torch.isnan(o1).any() and torch.isneginf(l1).all() and (o1 == 0).all()


# --- kernel ------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_kernel_matches_reference(heads, causal):
    h, hk = heads
    torch.manual_seed(1)
    q = torch.randn(2, 12, h, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 12, hk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 12, hk, 8, dtype=torch.float64, requires_grad=True)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref_out)
    ref_out.backward(do)
    kern = get_kernel("auto")
    assert isinstance(kern, TorchKernel)
    sm = lambda x: x.detach().transpose(0, 1)  # noqa: E731  (kernels take sequence-major views)
    out, lse = kern.forward(sm(q), sm(k), sm(v), causal=causal, scale=1 / math.sqrt(8))
    dq, dk, dv = kern.backward(sm(do), sm(q), sm(k), sm(v), out, kern.lse_for_backward(lse.permute(2, 0, 1)),
                               causal=causal, scale=1 / math.sqrt(8))
    out, dq, dk, dv = (x.transpose(0, 1) for x in (out, dq, dk, dv))
    for x, r in ((out, ref_out), (lse, ref_lse), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(x, r, atol=1e-10), (x - r).abs().max()
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'; choose one of auto, te, flash, torch"):
        get_kernel("nope")


def test_delta_stand_in_reproduces_row_sums():
    torch.manual_seed(2)
    dout = torch.randn(2, 6, 4, 16)
    dout[0, 0, 0] = 0  # a zero row
    dout[1, 1, 1] *= 1e-30  # a tiny row
    out = torch.randn_like(dout)
    delta = (dout * out).sum(-1)
    x = delta_stand_in(dout, delta)
    assert torch.isfinite(x).all()
    assert torch.allclose((dout * x).sum(-1), delta, rtol=1e-5, atol=1e-36)


# --- plans -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", list(range(1, 33)))
def test_in_order_plans_are_valid_for_every_shape(n):
    for a, b in valid_shapes(n):
        fwd, bwd = build_plans(a, b)
        assert validate(fwd) >= 2 and validate(bwd) >= 2
        assert sorted(fwd.blocks) == sorted(itertools.product(range(a), range(b)))


def _bad(ops, a=2, b=2, phase="forward"):
    with pytest.raises(PlanError):
        validate(Plan(phase, a, b, tuple(ops)))


def test_validate_rejects_broken_plans():
    blocks = [Compute(i, j) for i in range(2) for j in range(2)]
    gathers = [Transfer("q", 1, 0), Transfer("kv", 1, 0)]
    good = gathers + blocks[:1] + [Compute(1, 0), Compute(1, 1), Transfer("o", 1, 1), Compute(0, 1)]
    validate(Plan("forward", 2, 2, tuple(good)))
    _bad(blocks + gathers)  # block used before its chunk arrived
    _bad(gathers + blocks + blocks[:1])  # block twice
    _bad(gathers + blocks[:3])  # block missing (and partial never sent)
    _bad(gathers + [Compute(1, 0), Transfer("o", 1, 1), Compute(1, 1), Compute(0, 0), Compute(0, 1)])  # early send
    _bad(gathers + blocks)  # partial never reduced
    _bad(gathers + [Free("q", 1)] + blocks)  # used after free
    _bad([Transfer("q", 1, 1)] + gathers)  # forwarding a chunk that never arrived
    _bad(gathers + blocks + [Transfer("dq", 1, 1)])  # backward kind in a forward plan
    _bad([Transfer("q", 1, 0)], a=1, b=4)  # transfer on a ring of one
    # a chain that turns around never reaches the owner
    ops = [Transfer("q", 1, 0), Transfer("q", 1, 1)] + [Compute(i, 0) for i in range(3)]
    _bad(ops + [Transfer("o", 1, 1), Transfer("o", -1, 2)], a=3, b=1)
    with pytest.raises(PlanError, match="budget"):
        validate(build_plans(4, 4)[0], max_live=3)


def test_plan_traffic_matches_design_formulas():
    """Ring moves 2*gamma*u*(n-1) forward and 4*gamma*u*(n-1) backward (bf16 partials)."""
    n, h, hk, d, s = 16, 8, 2, 16, 8
    dims = ChunkDims(1, s, h, hk, d, torch.bfloat16, partial_dtype=torch.bfloat16)
    u = s * h * d * 2
    gamma = hk / h
    fwd, bwd = build_plans(1, n)
    assert sum(plan_traffic(fwd, dims).values()) == 2 * gamma * u * (n - 1)
    assert sum(plan_traffic(bwd, dims).values()) == 4 * gamma * u * (n - 1)
    fwd, bwd = build_plans(4, 4)
    lse = s * h * 4
    t = plan_traffic(fwd, dims)
    assert t[("forward", "Q")] == 3 * u and t[("forward", "KV")] == 3 * 2 * gamma * u
    assert t[("forward", "O")] == 3 * (u + lse)
    t = plan_traffic(bwd, dims)
    assert t[("backward", "dO")] == 3 * (u + 2 * lse) and t[("backward", "dKV")] == 3 * 2 * gamma * u


# --- virtual ranks: the executor with many ranks in one process --------------------------------


def _virtual_case(shape, causal, h, hk, dtype=torch.float32, seed=0, s_local=8, d=8, batch=2):
    n = shape.n
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(batch, s_local * n, heads, d, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=causal)
    ro.backward(do)
    res = virtual_mesh_attention(q.to(dtype), k.to(dtype), v.to(dtype), shape, dout=do.to(dtype), causal=causal)
    got = [res[name] for name in ("out", "lse", "dq", "dk", "dv")]
    refs = [ro.detach(), rl.detach(), qr.grad, kr.grad, vr.grad]
    return [float((x.double() - r).norm() / r.norm()) for x, r in zip(got, refs)], res["traffic"]


@pytest.mark.parametrize("n", [5, 10, 12, 15])
def test_virtual_ranks_match_reference_beyond_the_process_matrix(n):
    rnd = random.Random(n)
    for a, b in valid_shapes(n):
        causal = rnd.choice([True, False])
        h, hk = rnd.choice([(4, 4), (4, 2), (6, 1)])
        errs, traffic = _virtual_case(MeshShape(a, b), causal, h, hk, seed=n * 100 + a)
        assert max(errs) < 1e-5, ((a, b), causal, h, hk, errs)
        assert len({t.total_sent() for t in traffic}) == 1  # SPMD: every rank moves the same bytes


def test_virtual_fp64_is_exact_to_rounding():
    errs, _ = _virtual_case(MeshShape(2, 3), True, 4, 2, dtype=torch.float64)
    assert max(errs) < 1e-12, errs
