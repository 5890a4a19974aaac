"""Plans for a masked layer's kept blocks (planning/schedule.py ``plan_scale``): a mask that keeps every
tile block (documents cut over every chunk) is planned for its blocks' real time, a power of two of an
unmasked block's; the scaled plans never hold more live chunks than the unscaled ones, send the same
bytes, run exactly, and are the ones both the executor and the simulator use."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_mesh_cp.call import call_mask, prepare, resolve
from megatron_mesh_cp.planning import Workload, call_plans, document_plans, load_cluster, plan_scale
from megatron_mesh_cp.planning.documents import UnpaddedDocuments
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.runtime import PlanOptions
from megatron_mesh_cp.runtime.layouts import arrange
from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic, validate
from megatron_mesh_cp.virtual import VirtualMesh, virtual_mesh_attention

H100 = load_cluster("h100-ib400")
#: one long document (over every piece of 8 chunks) among short ones, 256K tokens
LONG = (150_000,) + (2_000,) * 53 + (256 * 1024 - 150_000 - 106_000,)


def _layer(n, mask=None, seq=256 * 1024):
    return Workload(seq_local=seq // n, heads=8, kv_heads=8, head_dim=128, partial_bytes=2, mask=mask)


def test_plan_scale_is_a_power_of_two_of_the_kept_blocks():
    assert plan_scale(_layer(8), H100, 8) == 1.0  # unmasked
    split = UnpaddedDocuments(LONG, split=1)
    s = plan_scale(_layer(8, split), H100, 8)
    fwd, bwd = (_layer(8, split).block_times(H100, bw, 8) for bw in (False, True))
    plain = _layer(8)
    ratio = (fwd + bwd)[(fwd + bwd) > 0].mean() / (plain.mean_block_time(H100, False, 8)
                                                   + plain.mean_block_time(H100, True, 8))
    assert s == 2.0 ** round(np.log2(ratio)) and s < 1.0
    tiny = Workload(seq_local=32, heads=2, kv_heads=2, head_dim=8, mask=UnpaddedDocuments((100, 28), split=1))
    assert plan_scale(tiny, H100, 4) == 1.0  # call overhead alone: as unmasked
    with pytest.raises(ValueError, match="plan_scale"):
        replace(plain, plan_scale=0.0)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)])
def test_scaled_plans_keep_memory_and_bytes(shape):
    a, b = shape
    w = _layer(a * b)
    kw = dict(workload=w, cluster=H100, masked=True, keep=None)
    full, scaled = call_plans(a, b, **kw), call_plans(a, b, scale=0.25, **kw)
    dims = ChunkDims(1, w.seq_local, w.heads, w.kv_heads, w.head_dim, torch.bfloat16)
    for f, s in zip(full, scaled):
        assert validate(s) <= validate(f)
        assert plan_traffic(s, dims) == plan_traffic(f, dims)
    if shape == (2, 4):
        assert [p.ops for p in scaled] != [p.ops for p in full]  # the scale reaches the planner


def test_executor_and_simulator_run_the_same_scaled_plans():
    """prepare() (what mesh_attention runs) and document_plans (what the simulator replays) plan a split
    layout for the same scale, so the same ops, and not the unscaled ones."""
    a, b, n = 2, 4, 8
    arr = arrange(LONG, n, "split", split=1)
    w = _layer(n, UnpaddedDocuments(LONG, split=1))
    sim = document_plans(a, b, cluster=H100, workload=w)
    mesh = VirtualMesh((a, b), PlanOptions(cluster=H100))
    q = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, w.seq_local, 8, 128)  # shapes only
    spec = resolve(q, q, q, mesh, layout="bshd", mask=call_mask("bshd", mask=arr.mask), partial_dtype=torch.bfloat16)
    ran = prepare(spec).plans
    assert [p.ops for p in ran] == [p.ops for p in sim]
    unscaled = call_plans(a, b, workload=w.unmasked, cluster=H100, masked=True, keep=w.needed(a, b),
                          slabs=w.blocks(n).zigzag_keys)
    assert [p.ops for p in ran] != [p.ops for p in unscaled]


def test_scaled_plans_run_exactly():
    """The scaled plans on virtual ranks, split documents, GQA: float64 reference within 1e-5 (fp32)."""
    a, b = 2, 4
    plans = call_plans(a, b, workload=_layer(8), cluster=H100, masked=True, keep=None, scale=0.25, slabs=False)
    lengths = [41, 3, 7, 1, 12] + [1] * 8
    total = 8 * 2 * 8
    lengths.append(total - sum(lengths))
    arr = arrange(lengths, 8, "split", split=1)
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(total, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = packed_reference(q, k, v, do, np.concatenate(([0], np.cumsum(lengths))).tolist())
    order = torch.from_numpy(arr.order)
    lay = lambda x: x.index_select(0, order).float()[None]  # noqa: E731
    res = virtual_mesh_attention(lay(q), lay(k), lay(v), (a, b), dout=lay(do), kernel="torch", mask=arr.mask,
                                 plans=plans)
    got = {name: res[name][0] for name in ("out", "dq", "dk", "dv")}
    want = {name: ref[name].index_select(0, order) for name in got}
    for name, err in relative_errors(got, want).items():
        assert err <= 1e-5, (name, err)


def test_a_live_chunk_limit_bounds_the_scaled_plans_and_the_pool_covers_them():
    """With the caller's limit (auto shape's budget) the scaled plans stay within it; the pool a masked
    layer can need is at least every scale's arena (the dry run's estimate for documents)."""
    from megatron_mesh_cp.planning import plan_peak_bytes
    from megatron_mesh_cp.planning.schedule import MIN_PLAN_SCALE, masked_pool_bytes

    w, limit = _layer(8), 12
    pool = masked_pool_bytes(2, 4, H100, w, max_live=limit)
    scale = 1.0
    while scale >= MIN_PLAN_SCALE:
        plans = call_plans(2, 4, workload=w, cluster=H100, masked=True, keep=None, scale=scale, max_live=limit)
        assert all(validate(p) <= limit for p in plans) and plan_peak_bytes(*plans, w) <= pool
        scale /= 2


def test_the_scaled_comparison_stops_slower_orders_early_and_keeps_the_same_plans(monkeypatch):
    """Where a mask keeps most tile blocks but not all, the scaled plan is replayed first and its seconds are the
    floor of the ready-order search (orders that surely replay slower are stopped early): the plans are the
    ones of the search run to its end and then compared with the scaled plan (heavy-tailed draw, a2a+mesh
    8x2x16 GQA: 23 of 32 tile blocks kept), and fewer op steps are replayed."""
    import sys

    from megatron_mesh_cp.planning import choose_layout, sample_documents, ulysses_inner
    from megatron_mesh_cp.planning import schedule
    from megatron_mesh_cp.runtime.prune import prune, without_slabs

    rp = sys.modules["megatron_mesh_cp.planning.replay"]  # the module (the package exports its replay function)
    w = ulysses_inner(8, Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2))
    docs = sample_documents(1 << 20, seed=7, lo=384, hi=512 * 1024, dist="powerlaw").lengths
    layer = replace(w, mask=choose_layout(docs, 2, 16, H100, w, stride=8).arrangement.mask)
    keep, slabs = layer.needed(2, 16), layer.blocks(32).zigzag_keys
    assert 16 < len(keep) < 32 and plan_scale(layer, H100, 32) < 1.0
    kw = dict(workload=w, cluster=H100, stride=8, keep=keep, masked=True, slabs=slabs, layer=layer)
    stopped, real = [], rp.replay

    def counted(*a, **k):
        res = real(*a, **k)
        stopped.append(k.get("floor") is not None and res.time == np.inf)  # stopped by the floor (not by a bound)
        return res

    monkeypatch.setattr(rp, "replay", counted)
    got = call_plans(2, 16, **kw)
    assert any(stopped)
    # the search without a floor, then the scaled plan pruned alike where it replays faster (ties: the search's)
    full = schedule.build_plans(2, 16, cluster=H100, workload=w, stride=8, chains="both-ways")
    scaled = schedule._scaled_plans(2, 16, H100, w, 8, None, plan_scale(layer, H100, 32), slabs)
    want, won = [], []
    for f, s in zip(full, scaled):
        pruned = prune(f, keep) if slabs else without_slabs(prune(f, keep))
        t, plan = schedule._ready(pruned, f, f, keep, slabs, H100, layer, 8, None, False)
        alt = prune(s, keep) if slabs else without_slabs(prune(s, keep))
        won.append(real(alt, H100, layer, stride=8, record=None).time < t)
        want.append(alt if won[-1] else plan)
    assert [p.ops for p in got] == [p.ops for p in want] and any(won)


def test_a_replay_stopped_at_a_floor_is_surely_slower():
    """replay's ``floor``: a plan that ends at or before it replays exactly; one stopped is slower than it."""
    from megatron_mesh_cp.planning.replay import replay

    w = _layer(8, UnpaddedDocuments(LONG))
    for p in call_plans(2, 4, workload=w.unmasked, cluster=H100, masked=True, keep=w.needed(2, 4), layer=w,
                        slabs=w.blocks(8).zigzag_keys):
        t = replay(p, H100, w, record=None).time
        assert replay(p, H100, w, record=None, floor=t).time == t
        assert replay(p, H100, w, record=None, floor=0.5 * t).time == np.inf
        assert replay(p, H100, w, record=None, floor=t * (1 - 1e-6)).time in (t, np.inf)
