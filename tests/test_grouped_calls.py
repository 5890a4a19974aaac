"""Grouped computes: one Compute op covers several blocks of a Q chunk whose KV
chunks sit in a slab, and the executor runs them as one kernel call per contiguous run of keys.

Checked here: the slab layout gives each case group one run on every rank; grouped plans are exact
(float64, every rank against a single-device reference) and bitwise repeatable; the validator
counts a slab's memory and rejects malformed groups; the pool holds the plan's peak live bytes;
the simulator prices exactly the kernel calls the executor makes and counts its bytes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_mesh_cp import MeshShape
from megatron_mesh_cp.planning.cluster import Workload, load_cluster
from megatron_mesh_cp.planning.costs import ulysses_inner
from megatron_mesh_cp.planning.greedy import GROUP_WIDTH, ChainConfig, PlanCost, greedy_plan, grouping_pays
from megatron_mesh_cp.planning.replay import _block_durations, replay
from megatron_mesh_cp.planning.schedule import build_plans
from megatron_mesh_cp.reference import packed_reference, reference_attention, relative_errors
from megatron_mesh_cp.runtime.comm import VirtualHub
from megatron_mesh_cp.runtime.execute import run_virtual
from megatron_mesh_cp.runtime.kernels import TorchKernel
from megatron_mesh_cp.runtime.layout import BlockCase, block_case, kernel_calls, slab_piece, zigzag_shard
from megatron_mesh_cp.runtime.memory import peak_live_bytes
from megatron_mesh_cp.runtime.plan import ChunkDims, Compute, Free, Plan, PlanError, Transfer, validate
from megatron_mesh_cp.virtual import virtual_mesh_attention

H100 = load_cluster("h100-ib400")
S_LOCAL, D = 8, 8


def _grouped_plans(a, b, causal, h, hk, split_gathers=False, split_reductions=False, width=GROUP_WIDTH):
    """Greedy plans of the grouped variant for a tiny layer (there the per-call cost dominates, so
    chunks arrive faster than blocks finish and groups form); they must contain grouped ops."""
    w = Workload(seq_local=S_LOCAL, heads=h, kv_heads=hk, head_dim=D, causal=causal, bytes_per_element=8)
    cfg = ChainConfig(split_gathers, split_reductions, group=width)
    plans = tuple(greedy_plan(a, b, ph, PlanCost.of(a, b, ph, H100, w), cfg) for ph in ("forward", "backward"))
    assert all(p.slabs for p in plans) and any(len(op.kvs) > 1 for p in plans for op in p.computes)
    return plans, w


def test_each_case_group_of_a_slab_is_one_run_on_every_rank():
    """All foreign KV offsets in one slab: per Q chunk, the own chunk's block plus at most one call
    for the lower blocks and one for the upper ones, on every rank of several meshes; each call's
    keys are one range of the rank's slab layout, every piece its blocks read once."""
    for a, b in ((1, 9), (2, 6), (3, 4), (4, 5)):
        shape = MeshShape(a, b)
        slab = (1, b - 1)
        for g in range(shape.n):
            for causal in (True, False):
                split = shape.coords(g)[0] if causal else 0
                spots = sorted(slab_piece(slab, ko, p, split) for ko in range(1, b) for p in (0, 1))
                assert spots == list(range(2 * (b - 1)))  # the layout is a permutation of the slab
                for qo in range(a):
                    i = shape.q_chunk(g, qo)
                    kvs = list(range(b))
                    cases = {ko: block_case(i, shape.kv_chunk(g, ko), causal) for ko in kvs}
                    calls = kernel_calls(kvs, cases, lambda ko: slab if ko else None, split)
                    foreign = [c for c in calls if c.slab is not None]
                    assert len({c.case for c in foreign}) == len(foreign) <= 2
                    assert calls[0].slab is None and calls[0].kvs == (0,)
                    for c in foreign:
                        assert [slab_piece(slab, ko, p, split) for ko, p in c.pieces] == list(
                            range(c.start, c.start + len(c.pieces)))
                        want = {(ko, p) for ko in c.kvs for p in ((0,) if c.case is BlockCase.LOWER else (0, 1))}
                        assert set(c.pieces) == want
                    assert sorted(ko for c in calls for ko in c.kvs) == kvs


def test_kernel_calls_one_per_run_of_consecutive_offsets():
    slab = (1, 6)
    lower = {ko: BlockCase.LOWER for ko in range(1, 7)}
    calls = kernel_calls([1, 2, 4, 5], lower, lambda ko: slab, 6)
    assert [c.kvs for c in calls] == [(1, 2), (4, 5)]
    assert [(c.start, len(c.pieces)) for c in calls] == [(0, 2), (3, 2)]  # first pieces only
    upper = {ko: BlockCase.UPPER for ko in range(1, 7)}
    calls = kernel_calls([4], upper, lambda ko: slab, 2)  # a lone upper block: its chunk, whole
    assert [(c.start, c.pieces) for c in calls] == [(2 * 2 + 2, ((4, 0), (4, 1)))]
    calls = kernel_calls([3, 4, 6], upper, lambda ko: slab, 2)
    assert [(c.kvs, c.start, len(c.pieces)) for c in calls] == [((3, 4), 4, 4), ((6,), 10, 2)]
    with pytest.raises(ValueError, match="lower"):  # a case that contradicts the layout's split
        kernel_calls([3], lower, lambda ko: slab, 2)


def _run(a, b, causal, h, hk, dtype=torch.float64, seed=0, **kw):
    shape = MeshShape(a, b)
    n = shape.n
    plans, _ = _grouped_plans(a, b, causal, h, hk, **kw)
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(2, S_LOCAL * n, heads, D, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=causal)
    ro.backward(do)
    res = virtual_mesh_attention(q.to(dtype), k.to(dtype), v.to(dtype), shape, dout=do.to(dtype), causal=causal,
                                 plans=plans)
    got = [res[name] for name in ("out", "lse", "dq", "dk", "dv")]
    refs = [ro.detach(), rl.detach(), qr.grad, kr.grad, vr.grad]
    return [float((x.double() - r).norm() / r.norm()) for x, r in zip(got, refs)], got, res["traffic"], plans


@pytest.mark.parametrize("a,b,causal,h,hk,split", [
    (1, 8, True, 4, 4, False), (1, 5, False, 4, 1, True), (2, 4, True, 4, 2, True), (2, 6, False, 4, 4, False),
    (3, 5, True, 6, 2, False), (4, 3, True, 4, 1, True), (2, 12, True, 4, 2, False),
])
def test_grouped_plans_are_exact_against_float64_reference(a, b, causal, h, hk, split):
    errs, _, traffic, plans = _run(a, b, causal, h, hk, split_gathers=split, split_reductions=split)
    assert max(errs) < 1e-12, errs
    assert len({t.total_sent() for t in traffic}) == 1  # SPMD: every rank moves the same bytes
    if b - 1 > GROUP_WIDTH:
        assert len(plans[0].slabs) == 2  # 2 x 12: two slabs, grouping inside each


def test_grouped_plans_fp32_within_tolerance_and_bitwise_repeatable():
    errs, first, _, _ = _run(2, 5, True, 4, 2, dtype=torch.float32, seed=3)
    assert max(errs) < 1e-5, errs
    _, again, _, _ = _run(2, 5, True, 4, 2, dtype=torch.float32, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("a,b", [(1, 6), (2, 4)])
def test_grouped_plans_run_packed_sequences_block_by_block(a, b):
    """Packed (THD) input: a grouped compute runs each block as its per-document sub-blocks (a
    varlen call takes one chunk's documents), reading the block's pieces where the slab keeps them;
    exact against the float64 block-diagonal reference."""
    n = a * b
    plans, _ = _grouped_plans(a, b, True, 4, 2)
    cu, real = [0, 2 * n, 8 * n, 12 * n], [0, 2 * n, 8 * n - 5, 12 * n - 7]  # padded / real offsets
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(cu[-1], x, D, generator=g, dtype=torch.float64) for x in (4, 2, 2, 4))
    ref = packed_reference(q, k, v, do, cu, real)
    res = virtual_mesh_attention(q, k, v, MeshShape(a, b), dout=do, layout="thd", plans=plans, kernel="torch",
                                 cu_seqlens=torch.tensor(real), cu_seqlens_padded=torch.tensor(cu))
    for name, err in relative_errors(res, ref).items():
        assert err < 1e-12, name


@pytest.mark.parametrize("a,b", [(1, 6), (2, 4)])
def test_grouped_plans_pruned_for_documents(a, b):
    """Documents on the ordinary layout with grouped plans: pruning drops blocks from grouped
    computes and shrinks slabs to the offsets still received (here into several runs); each kept
    block runs as its sub-blocks from where the slab keeps its pieces; exact against float64."""
    n = a * b
    plans, _ = _grouped_plans(a, b, True, 4, 2, split_gathers=True, split_reductions=True)
    cu = [0] + list(range(4, 16 * n, 8)) + [16 * n]  # S = 16n: pieces of 8, each document across one boundary
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(cu[-1], x, D, generator=g, dtype=torch.float64) for x in (4, 2, 2, 4))
    ref = packed_reference(q, k, v, do, cu)
    res = virtual_mesh_attention(*(x[None] for x in (q, k, v)), MeshShape(a, b), dout=do[None], plans=plans,
                                 kernel="torch", cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    pruned = res["plans"]
    assert any(len(p.blocks) < a * b for p in pruned)
    assert any(0 < sum(hi - lo + 1 for lo, hi in p.slabs) < sum(hi - lo + 1 for lo, hi in full.slabs)
               for p, full in zip(pruned, plans))
    for name, err in relative_errors({x: res[x][0] for x in ref}, ref).items():
        assert err < 1e-12, name


def test_validator_counts_slab_memory_and_rejects_bad_groups():
    # 1 x 4 forward: KV offsets 1..3 in one slab, all blocks of the one Q chunk in two computes
    gathers = [Transfer("kv", 1, 0), Transfer("kv", 1, 1), Transfer("kv", 1, 2)]
    ops = [gathers[0], Compute(0, 0), gathers[1], gathers[2], Compute(0, (1, 2, 3)),
           Free("kv", 1), Free("kv", 2), Free("kv", 3)]
    grouped = Plan("forward", 1, 4, tuple(ops), slabs=((1, 3),))
    single = Plan("forward", 1, 4, tuple(ops))
    # own Q + own KV + the O partial + the slab's three chunks from its first receive on
    assert validate(grouped) == 2 + 1 + 3
    assert validate(single) == 2 + 1 + 3  # three separate chunks all live at the group too
    early = [gathers[0], Compute(0, 0), Compute(0, 1), gathers[1], Free("kv", 1), gathers[2],
             Compute(0, (2, 3)), Free("kv", 2), Free("kv", 3)]
    assert validate(Plan("forward", 1, 4, tuple(early))) == 2 + 1 + 2  # chunk 1 freed before 3 arrives
    assert validate(Plan("forward", 1, 4, tuple(early), slabs=((1, 3),))) == 2 + 1 + 3  # the slab is not
    for bad in (Plan("forward", 1, 4, tuple(ops), slabs=((1, 3), (3, 3))),  # overlapping slabs
                Plan("forward", 1, 4, tuple(ops), slabs=((0, 3),)),  # the own chunk is never in a slab
                Plan("forward", 1, 4, tuple(ops[:4] + [Compute(0, (1, 1, 2, 3))] + ops[5:]))):  # a block twice
        with pytest.raises(PlanError):
            validate(bad)
    with pytest.raises(PlanError, match="budget"):
        validate(grouped, max_live=5)


@pytest.mark.parametrize("a,b,causal,h,hk", [(1, 12, True, 8, 2), (2, 6, True, 4, 4), (4, 4, False, 8, 2)])
def test_pool_bytes_equal_peak_live_bytes_with_slabs(a, b, causal, h, hk):
    shape = MeshShape(a, b)
    n = shape.n
    (fwd, bwd), _ = _grouped_plans(a, b, causal, h, hk)
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(S_LOCAL * n, 1, h, D, generator=g) for _ in range(2))
    k, v = (torch.randn(S_LOCAL * n, 1, hk, D, generator=g) for _ in range(2))
    sh = lambda x, r: zigzag_shard(x, n, r, 0)  # noqa: E731
    fwd_in = [dict(q=sh(q, r), k=sh(k, r), v=sh(v, r)) for r in range(n)]
    dims = ChunkDims.of(fwd_in[0]["q"], fwd_in[0]["k"], torch.float32)
    hub, hub_b = VirtualHub(shape), VirtualHub(shape)
    res, _ = run_virtual(fwd, shape, fwd_in, TorchKernel(), causal=causal, scale=0.3, hub=hub)
    bwd_in = [dict(fwd_in[r], out=res[r][0], lse=res[r][1], dout=sh(do, r), delta=(sh(do, r) * res[r][0]).sum(-1))
              for r in range(n)]
    run_virtual(bwd, shape, bwd_in, TorchKernel(), causal=causal, scale=0.3, hub=hub_b)
    assert [c.buffers.nbytes() for c in hub.ranks] == [peak_live_bytes(fwd, dims)] * n
    assert [c.buffers.nbytes() for c in hub_b.ranks] == [peak_live_bytes(bwd, dims)] * n


class _CountingKernel(TorchKernel):
    """The torch kernel, counting its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, *args, **kw):
        self.calls += 1
        return super().forward(*args, **kw)

    def backward(self, *args, **kw):
        self.calls += 1
        return super().backward(*args, **kw)


@pytest.mark.parametrize("a,b,causal", [(1, 7, True), (2, 5, True), (3, 4, False), (2, 11, True)])
def test_simulator_prices_the_executors_kernel_calls_and_bytes(a, b, causal):
    """A cluster where a call costs 1 s and nothing else costs anything: the simulator's compute
    time per phase, summed over ranks, is the number of kernel calls the executor makes; its byte
    counts equal the executor's counters."""
    shape = MeshShape(a, b)
    n = shape.n
    (fwd, bwd), w = _grouped_plans(a, b, causal, 4, 2)
    w = replace(w, bytes_per_element=4, partial_bytes=4)
    unit = replace(H100, block_overhead=1.0, correction_passes=0.0, fwd_flops=1e30, bwd_flops=1e30)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(S_LOCAL * n, 1, x, D, generator=g) for x in (4, 2, 2, 4))
    sh = lambda x, r: zigzag_shard(x, n, r, 0)  # noqa: E731
    fwd_in = [dict(q=sh(q, r), k=sh(k, r), v=sh(v, r)) for r in range(n)]
    kern = _CountingKernel()
    hub = VirtualHub(shape)
    res, traffic = run_virtual(fwd, shape, fwd_in, kern, causal=causal, scale=0.3, hub=hub)
    durations, calls = _block_durations(fwd, w, unit, False)
    priced = sum(d.sum() for d in durations.values())
    assert kern.calls == round(priced) == round(sum(c.sum() for c in calls.values())) < n * a * b  # fewer calls than blocks
    kern.calls = 0
    bwd_in = [dict(fwd_in[r], out=res[r][0], lse=res[r][1], dout=sh(do, r), delta=(sh(do, r) * res[r][0]).sum(-1))
              for r in range(n)]
    _, traffic_b = run_virtual(bwd, shape, bwd_in, kern, causal=causal, scale=0.3, hub=VirtualHub(shape))
    durations, calls = _block_durations(bwd, w, unit, True)
    assert kern.calls == round(sum(d.sum() for d in durations.values())) == round(sum(c.sum() for c in calls.values()))
    sim = {**replay(fwd, H100, w).sent_by_category, **replay(bwd, H100, w).sent_by_category}
    for r in range(n):
        assert {**traffic[r].sent, **traffic_b[r].sent} == sim


def test_grouped_variant_wins_at_the_128k_gqa_row():
    """n = 256, 128K tokens, GQA 32/8 on h100-ib400 as a2a+mesh 8 x 2 x 16 runs its mesh on 4 query
    heads and 4096 tokens per super-rank: blocks small enough that the per-call cost matters. The
    planner must pick a grouped variant there, and it must replay faster than the best ungrouped."""
    inner = ulysses_inner(8, Workload(seq_local=512, heads=32, kv_heads=8, head_dim=128, partial_bytes=2))
    fwd, bwd = build_plans(2, 16, cluster=H100, workload=inner, stride=8)
    assert fwd.slabs and "grouped" in dict(fwd.meta)["config"]
    grouped = sum(replay(p, H100, inner, stride=8, record=None).time for p in (fwd, bwd))
    ungrouped = 0.0
    for phase in ("forward", "backward"):
        cost = PlanCost.of(2, 16, phase, H100, inner, 8)
        ungrouped += min(replay(greedy_plan(2, 16, phase, cost, ChainConfig(g, r)), H100, inner, stride=8,
                                record=None).time for g in (False, True) for r in (False, True))
    assert grouped < 0.9 * ungrouped
    # 1M tokens: blocks 8x larger, a call's fixed cost under GROUP_MIN_SHARE of a block: not planned
    big = replace(inner, seq_local=inner.seq_local * 8)
    assert not grouping_pays(big, H100, False) and not grouping_pays(big, H100, True)
    assert not any(p.slabs for p in build_plans(2, 16, cluster=H100, workload=big, stride=8))
