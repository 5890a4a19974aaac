"""The executor's host work per layer stays where the prepared steps brought it: launching ops, views and
allocations per rank of a small mesh, counted with the torch profiler on virtual ranks exactly as
scripts/bench_host.py counts them (the figures in docs/performance.md, "Host cost")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from megatron_mesh_cp.planning.cluster import Workload
from megatron_mesh_cp.planning.schedule import build_plans, default_cluster

ROOT = Path(__file__).resolve().parent.parent


def _bench_host():
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "scripts" / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_launching_ops_per_rank_and_layer_stay_near_the_measured_figures():
    """2x4 mesh, greedy plans of a 32K-token GQA layer (KV slabs and grouped calls in both phases,
    fresh and merged partials, both reductions), one warm layer forward + backward. Measured with the
    prepared steps: 90.5 launching ops (13 of them the transport's one copy per transfer), 172 views,
    0 allocations per rank; before it: 133.5, 262 and 0. The bounds leave ~8% for small additions."""
    bh = _bench_host()
    torch.set_num_threads(1)
    a, b = 2, 4
    w = Workload(seq_local=32768 // (a * b), heads=32, kv_heads=8, head_dim=128)
    plans = build_plans(a, b, "greedy", cluster=default_cluster(), workload=w)
    assert all(p.slabs for p in plans)  # grouped kernel calls over a KV slab are part of what is counted
    layer, pieces, kern, hub, ranks = bh.mesh_layer(a, b, plans, 8, 4)
    hub.copies = kern.calls = 0
    launch, views, alloc = bh.count_ops(pieces())
    assert hub.copies / ranks == sum(len(p.transfers) for p in plans)  # one transport op per transfer
    assert launch / ranks <= 98, f"{launch / ranks:.1f} launching ops per rank and layer (measured 90.5 with the prepared steps)"
    assert views / ranks <= 186, f"{views / ranks:.1f} views per rank and layer (measured 172)"
    assert alloc <= kern.calls, f"{alloc} allocations for {kern.calls} kernel calls"


def test_bench_host_compares_two_runs_like_for_like():
    """``bench_host.py --compare``: before -> after per row, launching ops also with the transport as
    one op per transfer in both runs (earlier runs counted one copy per tensor)."""
    bh = _bench_host()
    row = dict(algo="mesh", n=32, shape="8x4", views=973.0, allocations=0.0, kernel_calls=42.0, transfers=37,
               us_per_call=139.0, host_us_per_call=101.0)
    before = [dict(row, launching=471.0, executor_launching=385.0)]
    after = [dict(row, launching=361.0, executor_launching=324.0, views=632.0, host_us_per_call=70.0)]
    line = bh.compare(before, after).splitlines()[-1]
    assert line.startswith("| mesh | 32 | 8x4 | 471 -> 361 | 422 -> 361 | 385 -> 324 | 973 -> 632 | 0 -> 0 | 42 |")
    assert line.endswith("| 139 -> 139 | 101 -> 70 |")


def test_what_the_executor_skips_changes_no_value():
    """The identities the fewer ops rest on, bit for bit: merging a partial into an untouched one
    (out = 0, lse = -inf) gives the partial itself (the executor copies the first call in instead),
    adding to zeros gives the addend, and with a finite lse the merge's NaN guard changes nothing
    (merge_into(finite=True)); for fp32 and bf16 kernel outputs into fp32 accumulators."""
    from megatron_mesh_cp.runtime.merge import empty_partial, merge_into

    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        out = (torch.randn(6, 1, 4, 8, generator=g) * 3).to(dt)
        lse = torch.randn(6, 1, 4, generator=g) * 5
        acc_out, acc_lse = empty_partial(out, torch.float32)
        merge_into(acc_out, acc_lse, out, lse)
        assert torch.equal(acc_out, out.float()) and torch.equal(acc_lse, lse)
        grad = torch.randn(6, 1, 4, 8, generator=g).to(dt)
        assert torch.equal(torch.zeros(6, 1, 4, 8).add_(grad), grad.float())
        other = (torch.randn(6, 1, 4, 8, generator=g)).to(dt), torch.randn(6, 1, 4, generator=g)
        guarded, fast = [(acc_out.clone(), acc_lse.clone()) for _ in range(2)]
        for (o, s), finite in ((guarded, False), (fast, True)):
            o[:3], s[:3] = 0, float("-inf")  # rows untouched on the accumulator's side only
            merge_into(o, s, *other, finite=finite)
        assert torch.equal(guarded[0], fast[0]) and torch.equal(guarded[1], fast[1])
        assert torch.isfinite(fast[0]).all() and torch.isfinite(fast[1]).all()
