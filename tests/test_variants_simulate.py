"""Sliding-window and MLA workloads in the simulator: every windowed block's calls against the runtime's
sub-blocks, the pruned plans' bytes (replay = plan_traffic = the executor's counters) with a window
and with MLA head dims, equal head dims reproducing the old workload, TE's algorithms as TE runs (or
refuses) windows, auto's bound, and the CLI. All figures here are simulated."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_mesh_cp.planning.autoshape import _mesh_time, choose_shape, shape_bound
from megatron_mesh_cp.planning.baselines import simulate_algorithm
from megatron_mesh_cp.planning.cluster import Workload, load_cluster, workload_dims
from megatron_mesh_cp.planning.costs import ulysses_inner
from megatron_mesh_cp.planning.documents import UnpaddedDocuments
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning.schedule import build_plans, default_cluster, document_plans
from megatron_mesh_cp.planning.window_baselines import compare_windows, format_window_table, te_a2a_refusal
from megatron_mesh_cp.planning.windows import row_pairs, sequence_pairs, window_block_calls
from megatron_mesh_cp.runtime.plan import plan_traffic
from megatron_mesh_cp.runtime.topology import valid_shapes
from megatron_mesh_cp.simulate import main
from megatron_mesh_cp.virtual import virtual_mesh_attention
from megatron_mesh_cp.runtime.masks import Window
from test_documents import dense_mask, document_sets, span_blocks

H100 = load_cluster("h100-ib400")


def lengths_of(cu):
    return tuple(b - a for a, b in zip(cu[:-1], cu[1:]))


def windows(m, causal):
    if causal:
        return [(0, 0), (1, 0), (m - 1, 0), (m, 0), (m + 1, 0), (3 * m, 0), (10 ** 6, 0)]
    return [(4, 4), (2, 9), (-1, 3), (5, -1), (0, 0), (m + 1, 2 * m)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_window_calls_are_the_runtime_sub_blocks(n):
    """Call for call (rows, keys, band pairs) what SpanBlocks.block runs under a window, with and
    without documents, causal and not; the blocks with calls are the runtime's nonempty ones."""
    for cu in document_sets(n, random.Random(n)) + [[0, 8 * n]]:
        docs = UnpaddedDocuments(lengths_of(cu))
        m = cu[-1] // (2 * n)
        for causal in (True, False):
            for win in windows(m, causal):
                mask = span_blocks(docs, n, causal, win)
                got = {}
                for i, j, r, k, w in zip(*window_block_calls(mask.span, n, causal)):
                    got.setdefault((int(i), int(j)), []).append((int(r), int(k), int(w)))
                for i in range(n):
                    for j in range(n):
                        want = sorted((s.rows.stop - s.rows.start, s.cols.stop - s.cols.start, s.pairs)
                                      for s in mask.block(i, j))
                        assert sorted(got.get((i, j), [])) == want, (cu, causal, win, i, j)
                assert np.array_equal(mask.nonempty(), np.array(
                    [[bool(got.get((i, j))) for j in range(n)] for i in range(n)]))


def test_window_pairs_of_whole_sequence_calls():
    """Ulysses' one call and each all-gather rank's rows: the band's pairs, against the dense mask."""
    n = 3
    for cu in ([0, 48], [0, 5, 20, 48]):
        docs = UnpaddedDocuments(lengths_of(cu))
        for causal, win in ((True, (4, 0)), (False, (2, 9)), (False, (-1, 3))):
            dense = [[int(dense_mask(cu, n, i, j, causal, win).sum()) for j in range(n)] for i in range(n)]
            span = (docs & Window(*win)).span(docs.total, causal)
            assert sequence_pairs(span, causal) == sum(map(sum, dense))
            assert row_pairs(span, n, causal).tolist() == [sum(r) for r in dense]


def test_windowed_block_times_price_every_call():
    n = 8
    w = Workload(seq_local=8192, heads=64, kv_heads=8, head_dim=64, head_dim_v=48, partial_bytes=2, mask=Window(300, 0))
    mask = w.blocks(n)
    for backward in (False, True):
        t = w.block_times(H100, backward, n)
        assert not t.flags.writeable and np.array_equal(t > 0, mask.nonempty()) and (t == 0).sum() > n
        for i, j in ((0, 0), (3, 2), (2, 3), (7, 0)):
            want = 0.0
            for s in mask.block(i, j):
                rows, keys = s.rows.stop - s.rows.start, s.cols.stop - s.cols.start
                want += (H100.attention_time(w.pair_flops(s.pairs, backward), rows, backward)
                         + w._call_cost(H100, rows, backward) + w._keys_cost(H100, keys, backward))
            assert t[i, j] == pytest.approx(want, rel=1e-12), (i, j)


def _run(shape, window, d=8, dv=8, t=64):
    g = torch.Generator().manual_seed(t + dv)
    q, k = (torch.randn(1, t, x, d, generator=g) for x in (4, 2))
    v, do = (torch.randn(1, t, x, dv, generator=g) for x in (2, 4))
    return virtual_mesh_attention(q, k, v, shape, dout=do, window=window, kernel="torch")


@pytest.mark.parametrize("shape,window,dv", [((2, 2), (7, 0), 8), ((1, 4), (3, 0), 8), ((2, 1, 2), (9, 0), 8),
                                             ((2, 2), (5, 0), 4), ((1, 4), None, 4), ((2, 1, 2), None, 12)])
def test_window_and_mla_bytes_are_the_runtime_plans_and_payloads(shape, window, dv):
    """The plans the simulator replays are the ones virtual_mesh_attention runs (window-pruned, or full
    for MLA alone), and its bytes per phase and category are plan_traffic of them (V, O, dO, dV at the
    value head dim) and every rank's measured counters; the algorithm's total adds the all-to-all."""
    res = _run(shape, window, dv=dv)
    n, u = math.prod(shape), (shape[0] if len(shape) == 3 else 1)
    a, b = shape[-2:]
    w = Workload(seq_local=64 // n, heads=4, kv_heads=2, head_dim=8, head_dim_v=dv, bytes_per_element=4,
                 partial_bytes=4, mask=None if window is None else Window(*window))
    inner = ulysses_inner(u, w)
    if window is not None:
        plans = document_plans(a, b, cluster=default_cluster(), workload=inner, stride=u)
        assert [p.ops for p in plans] == [p.ops for p in res["plans"]]
        full = build_plans(a, b, cluster=default_cluster(), workload=inner.unmasked, stride=u, chains="both-ways")
    else:
        plans = full = build_plans(a, b, cluster=default_cluster(), workload=inner, stride=u)
    dims = workload_dims(inner)
    assert dims.dv == dv
    want = {**plan_traffic(plans[0], dims), **plan_traffic(plans[1], dims)}
    assert sum(want.values()) <= sum(sum(plan_traffic(p, dims).values()) for p in full)
    sim = {}
    for p in plans:
        sim.update(replay(p, default_cluster(), inner, stride=u).sent_by_category)
    assert sim == want
    for tr in res["traffic"]:
        assert {key: x for key, x in tr.sent.items() if not key[1].startswith("a2a")} == want
    algo = ("mesh:" if u == 1 else "a2a+mesh:") + "x".join(map(str, shape))
    r = simulate_algorithm(algo, n, default_cluster(), w)
    a2a = sum(x for key, x in res["traffic"][0].sent.items() if key[1].startswith("a2a") and key[1] != "a2a-LSE")
    assert r.bytes_sent == pytest.approx(sum(want.values()) + a2a)


def test_equal_head_dims_are_the_old_workload_and_mla_changes_bytes_and_flops():
    w = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2)
    same = replace(w, head_dim_v=128)
    assert same == w and hash(same) == hash(w) and same.head_dim_v is None
    for algo in ("ring", "mesh:4x4", "usp", "allgather", "ulysses", "a2a+mesh:2x2x4"):
        x, y = simulate_algorithm(algo, 16, H100, w), simulate_algorithm(algo, 16, H100, same)
        assert (x.time, x.bytes_sent, x.peak_bytes) == (y.time, y.bytes_sent, y.peak_bytes)
    mla = Workload(seq_local=4096, heads=32, kv_heads=32, head_dim=192, head_dim_v=128, partial_bytes=2)
    assert mla.pair_flops(10, False) == 2 * 32 * (192 + 128) * 10  # QK^T at 192, PV at 128
    assert mla.pair_flops(10, True) == 2 * 32 * (3 * 192 + 2 * 128) * 10
    wide = replace(mla, head_dim_v=192)
    for algo in ("ring", "usp", "mesh:4x4"):
        r, r_wide = simulate_algorithm(algo, 16, H100, mla), simulate_algorithm(algo, 16, H100, wide)
        assert r.bytes_sent < r_wide.bytes_sent and r.compute < r_wide.compute
    ring = simulate_algorithm("ring", 16, H100, mla)  # 15 hops of K (192) + V (128), twice, and dK/dV, in bf16
    assert ring.bytes_sent == 15 * 4096 * 32 * (192 + 128) * 2 * 3
    with pytest.raises(ValueError, match="head_dim_v"):
        Workload(seq_local=8, heads=1, kv_heads=1, head_dim=8, head_dim_v=0)


def test_te_algorithms_under_a_window():
    """TE's p2p and a2a+p2p refuse windows (shown at the full layer's cost, marked); TE's a2a (ulysses)
    and all_gather run them with the band cutting their compute and every byte as before."""
    n = 16
    full = Workload(seq_local=2048, heads=32, kv_heads=8, head_dim=64, partial_bytes=2)
    w = replace(full, mask=Window(127, 0))
    for algo in ("ring", "usp", "usp:4"):
        with pytest.raises(ValueError, match="cannot run a sliding window"):
            simulate_algorithm(algo, n, H100, w)
    for algo in ("ulysses", "allgather"):
        x, y = simulate_algorithm(algo, n, H100, w), simulate_algorithm(algo, n, H100, full)
        assert x.bytes_sent == y.bytes_sent and x.compute < 0.2 * y.compute
    rows = {r.algo: r for r in compare_windows(["usp", "mesh", "ulysses", "allgather"], n, H100, w)}
    assert list(rows) == ["ring-pruned", "ring", "usp", "mesh", "ulysses", "allgather"]
    assert rows["usp"].status.startswith("cannot window") and rows["usp"].result.time == simulate_algorithm(
        "usp", n, H100, full).time
    assert rows["mesh"].status == "runs the window" and rows["mesh"].result.bytes_sent < rows["ring"].result.bytes_sent
    assert "divisible by CP" in rows["ulysses"].reason and "replicated" in rows["ulysses"].reason  # 8 kv heads
    assert te_a2a_refusal(8, w) == "" and "runs up to CP 8" in te_a2a_refusal(n, w)
    table = format_window_table(list(rows.values()))
    assert "cannot window" in table and table.count("runs the window") == 4
    with pytest.raises(ValueError, match="give the workload a window"):
        compare_windows(["mesh"], n, H100, full)
    with pytest.raises(ValueError, match="causal query sees no key to its right"):
        replace(full, mask=Window(4, 4))
    with pytest.raises(ValueError, match="packed THD"):
        from megatron_mesh_cp.planning.packing import sample_packing
        replace(full, mask=Window(4, 0) & sample_packing(n * 2048, 512, 4096, n))


def test_auto_bound_stays_a_bound_for_windows_and_auto_is_the_exhaustive_best():
    n = 8
    w = Workload(seq_local=8192, heads=32, kv_heads=8, head_dim=128, partial_bytes=2, mask=Window(3000, 0))
    times = {}
    for a, b in valid_shapes(n):
        times[(a, b)] = _mesh_time(a, b, H100, w, 1, None)
        assert shape_bound(a, b, H100, w) <= times[(a, b)] * (1 + 1e-9), (a, b)
    choice = choose_shape(n, H100, w, memory_budget=float("inf"))
    assert (choice.shape.a, choice.shape.b) == min(times, key=times.get)
    assert times[min(times, key=times.get)] < _mesh_time(1, n, H100, w.unmasked, 1, None)


def test_cli_prices_windows_and_mla(capsys):
    assert main(["--cp", "8", "--seq", "64K", "--heads", "16", "--kv-heads", "8", "--head-dim", "64",
                 "--window", "127,0", "--algos", "ring,usp,mesh,ulysses,allgather", "--no-unpacked"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out.splitlines()[0] and "window=127,0" in out.splitlines()[0]
    rows = {ln.split()[0]: ln for ln in out.splitlines()[3:] if ln.strip()}
    assert list(rows) == ["ring-pruned", "ring", "usp", "mesh", "ulysses", "allgather"]
    assert "cannot window" in rows["ring"] and "cannot window" in rows["usp"] and "runs the window" in rows["mesh"]
    assert main(["--cp", "4", "--seq", "16K", "--heads", "8", "--head-dim", "192", "--head-dim-v", "128",
                 "--algos", "ring,mesh"]) == 0
    out = capsys.readouterr().out
    assert "d=192 (v 128)" in out.splitlines()[0]
    w = Workload(seq_local=4096, heads=8, kv_heads=8, head_dim=192, head_dim_v=128, bytes_per_element=2,
                 partial_bytes=4)
    ring = [ln for ln in out.splitlines() if ln.startswith("ring ")][0]
    assert f"{simulate_algorithm('ring', 4, H100, w).bytes_sent / 2**20:.1f}" in ring
    for argv, match in ((["--window", "4,4"], "causal query sees no key"), (["--window=-1,0"], "is no window"),
                        (["--window", "8,0", "--docs", "1K-4K"], "--window with --docs"),
                        (["--window=-2,0"], "ints >= -1"), (["--algos", "ring-pruned"], "give documents")):
        assert main(["--cp", "4", "--seq", "16K"] + argv) == 2 and match in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["--cp", "4", "--seq", "16K", "--window", "8"])
