"""Unpadded documents in the simulator: every block's calls against the runtime's sub-blocks, empty
blocks at 0, the pruned plans' bytes (replay = plan_traffic = the executor's counters), a rank
waiting only for the chunks it computes with, auto's bound, TE's padded baselines unchanged, the
CLI and the table. All figures here are simulated."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_mesh_cp.planning.autoshape import _mesh_time, choose_shape, shape_bound
from megatron_mesh_cp.planning.baselines import simulate_algorithm
from megatron_mesh_cp.planning.cluster import Workload, load_cluster
from megatron_mesh_cp.planning.costs import ulysses_inner
from megatron_mesh_cp.planning.doc_baselines import compare_documents, document_sets, format_documents_table
from megatron_mesh_cp.planning.documents import (UnpaddedDocuments, _block_calls, block_calls, call_seconds,
                                                 sample_documents)
from megatron_mesh_cp.planning.packing import _rect, _tri, sample_packing
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning.schedule import build_plans, default_cluster, document_plans
from megatron_mesh_cp.runtime.plan import ChunkDims, Compute, Free, Plan, Transfer, plan_traffic
from megatron_mesh_cp.runtime.topology import valid_shapes
from megatron_mesh_cp.simulate import main
from megatron_mesh_cp.virtual import virtual_mesh_attention
from test_documents import document_sets as runtime_document_sets

H100 = load_cluster("h100-ib400")


def lengths_of(cu):
    return tuple(b - a for a, b in zip(cu[:-1], cu[1:]))


def _w(n, docs, kv=8, causal=True, **kw):
    return Workload(seq_local=docs.total // n, heads=32, kv_heads=kv, head_dim=128, causal=causal, partial_bytes=2,
                    mask=docs, **kw)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("tile", [0, 3])
def test_block_calls_are_the_runtime_sub_blocks(n, tile):
    """Call for call (rows, keys, work) what SpanBlocks.block runs, causal and not, vectorised."""
    for cu in runtime_document_sets(n, random.Random(n)) + [[0, 1, 4 * n]]:
        docs = UnpaddedDocuments(lengths_of(cu), tile)
        for causal in (True, False):
            mask = docs.bind(n, docs.total, causal)
            got = {}
            for i, j, r, k, w in zip(*block_calls(docs.span(), n, causal)):
                got.setdefault((int(i), int(j)), []).append((int(r), int(k), int(w)))
            for i in range(n):
                for j in range(n):
                    want = []
                    for s in mask.block(i, j):
                        r, k = s.rows.stop - s.rows.start, s.cols.stop - s.cols.start
                        if s.lens is not None:
                            lens = np.array(s.lens)
                            w = int((_tri(lens, tile) if causal else _rect(lens, lens, tile)).sum())
                        elif s.causal:
                            w = int(_tri(np.array(r), tile))
                        else:
                            w = int(_rect(np.array(r), np.array(k), tile))
                        assert tile or w == s.pairs
                        want.append((r, k, w))
                    assert sorted(got.get((i, j), [])) == sorted(want), (cu, causal, i, j)
            assert np.array_equal(mask.nonempty(), np.array(
                [[bool(got.get((i, j))) for j in range(n)] for i in range(n)]))


def test_empty_blocks_cost_nothing_and_every_call_is_charged():
    n = 8
    docs = sample_documents(64 * 1024, 256, 4096, seed=3)
    w = _w(n, docs)
    mask = docs.bind(n, docs.total, True)
    for backward in (False, True):
        t = w.block_times(H100, backward, n)
        assert not t.flags.writeable
        assert np.array_equal(t > 0, mask.nonempty()) and (t == 0).sum() > n  # most blocks are empty
        for i, j in ((0, 0), (3, 2), (2, 3), (7, 6)):
            want = 0.0
            for s in mask.block(i, j):  # each sub-block: its kernel at its rows' throughput and its own call costs
                rows, keys = s.rows.stop - s.rows.start, s.cols.stop - s.cols.start
                want += (H100.attention_time(w.pair_flops(s.pairs, backward), rows, backward)
                         + w._call_cost(H100, rows, backward) + w._keys_cost(H100, keys, backward))
            assert t[i, j] == pytest.approx(want, rel=1e-12), (i, j)


def test_call_seconds_are_the_parts_block_times_sum():
    """call_seconds splits every call's seconds (bench_documents' breakdown of a rank's block seconds): the
    parts add up to block_times exactly, the kernel never runs faster than its peak rate, and the
    peak-rate parts sum to the mask's work at that rate."""
    n = 8
    docs = sample_documents(64 * 1024, 256, 16384, seed=5)
    w = _w(n, docs)
    calls = w.mask_calls(n)
    for backward in (False, True):
        sec = call_seconds(w, H100, backward, calls)
        total = np.bincount(calls.i * n + calls.j, weights=sec.kernel + sec.call + sec.keys, minlength=n * n)
        assert np.array_equal(total.reshape(n, n), w.block_times(H100, backward, n))
        assert (sec.peak > 0).all() and (sec.kernel > sec.peak).all() and (sec.call > 0).all()
        assert (sec.keys > 0).all() if backward else not sec.keys.any()
        rate = H100.bwd_flops if backward else H100.fwd_flops
        assert sec.peak.sum() == pytest.approx(w.pair_flops(float(calls.work.sum()), backward) / rate, rel=1e-12)


def test_block_times_at_256_are_vectorised():
    docs = sample_documents(1 << 20, 4096, 65536, seed=0)
    _block_calls.cache_clear()
    t0 = time.process_time()
    t = _w(256, docs).block_times(replace(H100, name="uncached"), True, 256)
    assert time.process_time() - t0 < 2.0 and t.shape == (256, 256)  # 65,536 blocks, no loop over them


def _tensors(cu, heads=4, kv_heads=2, d=8):
    g = torch.Generator().manual_seed(len(cu))
    t = cu[-1]
    return [torch.randn(1, t, x, d, generator=g) for x in (heads, kv_heads, kv_heads, heads)]


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (2, 1, 2)])
def test_pruned_plan_bytes_replay_equal_plan_traffic_and_the_executor(shape):
    """The plans the simulator replays are the ones virtual_mesh_attention runs, and its bytes (per
    phase and category) are plan_traffic of them and every rank's measured counters."""
    cu = [0, 5, 40, 43, 80, 81, 128]
    q, k, v, do = _tensors(cu)
    res = virtual_mesh_attention(q, k, v, shape, dout=do, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                 kernel="torch")
    n, u = int(np.prod(shape)), (shape[0] if len(shape) == 3 else 1)
    a, b = shape[-2:]
    docs = UnpaddedDocuments(lengths_of(cu))
    w = Workload(seq_local=cu[-1] // n, heads=4, kv_heads=2, head_dim=8, bytes_per_element=4, partial_bytes=4,
                 mask=docs)
    inner = ulysses_inner(u, w)
    plans = document_plans(a, b, cluster=default_cluster(), workload=inner, stride=u)
    assert [p.ops for p in plans] == [p.ops for p in res["plans"]]
    dims = ChunkDims(1, inner.seq_local, inner.heads, inner.kv_heads, 8, torch.float32)
    want = {**plan_traffic(plans[0], dims), **plan_traffic(plans[1], dims)}
    full = build_plans(a, b, cluster=default_cluster(), workload=replace(inner, mask=None), stride=u,
                       chains="both-ways")
    assert sum(want.values()) <= sum(sum(plan_traffic(p, dims).values()) for p in full)
    sim = {}
    for p in plans:
        sim.update(replay(p, default_cluster(), inner, stride=u).sent_by_category)
    assert sim == want
    for tr in res["traffic"]:  # the executor's counters, all-to-all categories aside
        assert {key: x for key, x in tr.sent.items() if not key[1].startswith("a2a")} == want
    algo = "mesh:" + "x".join(map(str, shape)) if u == 1 else "a2a+mesh:" + "x".join(map(str, shape))
    r = simulate_algorithm(algo, n, default_cluster(), w)
    # the virtual run also returns the lse (a2a-LSE); the simulator, like Megatron's call, does not
    a2a = sum(x for key, x in res["traffic"][0].sent.items() if key[1].startswith("a2a") and key[1] != "a2a-LSE")
    assert r.bytes_sent == pytest.approx(sum(want.values()) + a2a)


def test_a_rank_waits_only_for_the_chunks_it_computes_with():
    """Ring 1x4: one document spans KV chunk 0's first piece and Q chunk 1's, so KV offset 1 stays in
    the plan (rank 1 needs it); rank 2 receives chunk 1 too but computes nothing with it, and does not
    wait for it (a slow link, so the chunk arrives after rank 2's own block)."""
    m = 32
    docs = UnpaddedDocuments((m // 2, m + m // 2) + (m // 4,) * 24)
    w = _w(4, docs)
    fwd, _ = document_plans(1, 4, cluster=H100, workload=w)
    assert (0, 1) in fwd.tile_blocks
    slow = replace(H100, intra_bw=1e8)
    res = replay(fwd, slow, w, record=2)
    (blk,) = [(s, e) for lane, s, e, lab in res.timeline if lane == "compute" and lab == "blk 0,1"]
    assert blk[1] == blk[0] and blk[0] < res.arrivals[("kv", 1)]
    res1 = replay(fwd, slow, w, record=1)
    (blk1,) = [(s, e) for lane, s, e, lab in res1.timeline if lane == "compute" and lab == "blk 0,1"]
    assert blk1[0] >= res1.arrivals[("kv", 1)] and blk1[1] > blk1[0]
    # the executor's Free waits for its chunk on the compute stream: rank 2's own block, planned after
    # the Free of the chunk it never read, starts once that chunk has arrived
    late = Plan(fwd.phase, 1, 4, (Transfer("kv", 1, 0), Compute(0, 1), Free("kv", 1), Compute(0, 0)),
                tile=fwd.tile_blocks)
    res2 = replay(late, slow, w, record=2)
    (own,) = [s for lane, s, e, lab in res2.timeline if lane == "compute" and lab == "blk 0,0"]
    assert own >= res2.arrivals[("kv", 1)]


def test_auto_bound_stays_a_bound_and_auto_is_the_exhaustive_best():
    n = 16
    docs = sample_documents(256 * 1024, 2048, 32768, seed=5)
    for kv in (32, 8):
        w = _w(n, docs, kv)
        times = {}
        for a, b in valid_shapes(n):
            times[(a, b)] = _mesh_time(a, b, H100, w, 1, None)
            assert shape_bound(a, b, H100, w) <= times[(a, b)] * (1 + 1e-9), (a, b)
        choice = choose_shape(n, H100, w, memory_budget=float("inf"))
        assert (choice.shape.a, choice.shape.b) == min(times, key=times.get)
        assert choice.seconds == pytest.approx(min(times.values()), rel=1e-12)


def test_te_baselines_stay_padded_and_send_every_chunk():
    n, seq = 16, 256 * 1024
    packing, docs = document_sets(seq, n, lo_hi=(2048, 32768), seed=1)
    assert packing.lengths[:-1] == docs.lengths[:len(packing.lengths) - 1]  # the same draws
    assert docs.total == packing.total == seq and packing.real < seq
    w = Workload(seq_local=seq // n, heads=32, kv_heads=8, head_dim=128, partial_bytes=2)
    res = {r.algo: r for r in compare_documents(["usp", "mesh:4x4"], n, H100, w, packing, docs)}
    assert list(res) == ["ring", "ring-pruned", "usp", "mesh:4x4"]
    for algo in ("ring", "usp"):
        padded = simulate_algorithm(algo, n, H100, replace(w, mask=packing))
        plain = simulate_algorithm(algo, n, H100, w)
        assert res[algo].time == padded.time and res[algo].bytes_sent == padded.bytes_sent == plain.bytes_sent
    assert res["ring-pruned"].bytes_sent < 0.6 * res["ring"].bytes_sent  # pruning alone
    assert res["ring-pruned"].time < res["ring"].time
    with pytest.raises(ValueError, match="cannot run unpadded documents"):
        simulate_algorithm("usp", n, H100, replace(w, mask=docs))
    with pytest.raises(ValueError, match="give documents"):
        simulate_algorithm("ring-pruned", n, H100, w)
    with pytest.raises(ValueError, match="not both"):
        replace(w, mask=docs & packing)
    with pytest.raises(ValueError, match="must fill the global sequence length"):
        simulate_algorithm("mesh:4x4", n, H100, replace(w, mask=sample_documents(seq // 2, 2048, 32768)))
    table = format_documents_table(list(res.values()), packing, docs).splitlines()
    assert table[0].split()[:3] == ["algorithm", "shape", "documents"]
    rows = {ln.split()[0]: ln for ln in table[2:]}
    assert "padded THD (TE)" in rows["usp"] and "1.00x" in rows["usp"] and str(packing.real) in rows["usp"]
    assert "unpadded, zigzag" in rows["ring-pruned"] and rows["ring-pruned"].rstrip().endswith(str(seq))


def test_sampling_documents():
    docs = sample_documents(1 << 20, 4096, 65536, seed=7)
    assert docs == sample_documents(1 << 20, 4096, 65536, seed=7) and docs.total == 1 << 20
    assert docs.lengths[:-1] == sample_packing(1 << 24, 4096, 65536, 256, seed=7).lengths[:len(docs.lengths) - 1]
    heavy = np.array(sample_documents(1 << 24, 384, 512 * 1024, dist="powerlaw", seed=0).lengths)
    assert heavy.min() >= 384 and heavy.max() <= 512 * 1024
    assert 0.6 < (heavy < 4096).mean() < 0.8 and np.mean(heavy) > 3 * np.median(heavy)  # a heavy tail


def test_cli_prices_documents_unpadded_and_te_padded(capsys):
    assert main(["--cp", "8", "--seq", "64K", "--docs", "1K-8K", "--doc-seed", "1",
                 "--algos", "ring,usp,mesh,a2a+mesh"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out.splitlines()[0]
    assert "documents, unpadded (mesh family)" in out and "documents, padded THD (TE's ring and usp)" in out
    rows = {ln.split()[0]: ln for ln in out.split("real tokens")[1].split("\n\n")[0].splitlines()[2:]}
    assert list(rows) == ["ring", "ring-pruned", "usp", "mesh", "a2a+mesh"]
    assert all(("unpadded, auto: " in rows[a]) == (a not in ("ring", "usp")) for a in rows)  # auto names its choice
    assert "without documents" in out
    for argv, match in ((["--doc-layout", "padded"], "give --docs"), (["--docs", "1K-8K", "--batch", "2"], "--batch 1"),
                        (["--algos", "ring-pruned"], "give documents"),
                        (["--docs", "1K-8K", "--doc-layout", "padded", "--algos", "ring-pruned"], "give documents"),
                        (["--layout", "tiled"], "--layout prices documents; give --docs"),
                        (["--docs", "1K-8K", "--doc-layout", "padded", "--layout", "tiled"], "drop one of them")):
        assert main(["--cp", "8", "--seq", "64K"] + argv) == 2
        assert match in capsys.readouterr().err, argv


def test_cli_refuses_document_options_it_would_ignore(tmp_path, capsys):
    """--doc-dist and --doc-seed draw --docs' lengths, --no-unpacked skips a comparison only documents or a window
    make: given without them they changed nothing (the table was the same), so they are refused."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["4096"] * 16))
    for argv, match in ((["--doc-seed", "1"], "--doc-seed draws the lengths of --docs"),
                        (["--doc-dist", "powerlaw"], "--doc-dist draws the lengths of --docs"),
                        (["--doc-lengths", str(lengths), "--doc-seed", "3"], "--doc-lengths reads them from its file"),
                        (["--no-unpacked"], "--no-unpacked skips the comparison")):
        assert main(["--cp", "8", "--seq", "64K", "--algos", "ring,mesh"] + argv) == 2, argv
        assert match in capsys.readouterr().err, argv
    assert main(["--cp", "8", "--seq", "64K", "--algos", "mesh", "--doc-lengths", str(lengths), "--no-unpacked"]) == 0


def test_cli_max_live_is_refused_where_no_row_takes_it_and_names_the_rows_it_bounds(capsys):
    """--max-live bounds the mesh plans only: with passq / ring alone it changed nothing (refused), and with a mesh row
    the output names the rows it bounds (ring-pruned and passq ran their own plans' memory, unsaid)."""
    assert main(["--cp", "8", "--seq", "64K", "--algos", "ring,passq", "--max-live", "4"]) == 2
    assert "none of --algos ring,passq takes it" in capsys.readouterr().err
    assert main(["--cp", "8", "--seq", "64K", "--algos", "passq,mesh:2x4", "--max-live", "10"]) == 0
    assert "--max-live 10: bounds mesh:2x4; the other rows run their own plans' memory" in capsys.readouterr().out


def test_split_half_rows_say_when_the_mesh_ran_split():
    # split:K:H needs a and b even; on Ring 1xn it runs as split:K, and the row says why
    n, seq = 8, 64 * 1024
    packing, docs = document_sets(seq, n, lo_hi=(512, 16384), dist="powerlaw", seed=1)
    w = Workload(seq_local=seq // n, heads=8, kv_heads=8, head_dim=64, partial_bytes=2)
    res = {r.algo: r for r in compare_documents(["mesh:2x4", "mesh", "a2a+mesh"], n, H100, w, packing, docs,
                                                 layouts=["split:1:1"])}
    assert res["ring-pruned"].layout == "split:1 (split:1:1 needs a, b even)"
    assert res["mesh:2x4"].layout == "split:1:1"
    # the auto shapes choose among even meshes, as the launcher's --mesh-layout split-half with --mesh-shape auto
    for algo in ("mesh", "a2a+mesh"):
        assert all(int(x) % 2 == 0 for x in res[algo].shape.split("x")[-2:]), res[algo].shape
        assert res[algo].layout == "split:1:1"


def test_cli_max_live_is_taken_by_mesh_naive_whose_shape_it_chooses(capsys):
    """mesh-naive runs on the shape mesh's auto picks within --max-live (baselines.simulate_algorithm: choose_shape
    with max_live): at CP = 32, 256K, --max-live 16 moves it from 2x16 to 1x32, so the flag is not ignored there
    and is not refused ('none of --algos mesh-naive takes it' before), and the output names the row it shapes."""
    from megatron_mesh_cp.planning import Workload
    from megatron_mesh_cp.planning.baselines import simulate_algorithm
    from megatron_mesh_cp.planning.schedule import default_cluster

    w = Workload(seq_local=256 * 1024 // 32, heads=32, kv_heads=8, head_dim=128)
    shapes = {ml: simulate_algorithm("mesh-naive", 32, default_cluster(), w, max_live=ml).shape for ml in (None, 16)}
    assert shapes[None] != shapes[16], shapes  # the budget changes mesh-naive's row
    argv = ["--cp", "32", "--seq", "256K", "--heads", "32", "--kv-heads", "8", "--algos", "ring,mesh-naive"]
    assert main(argv + ["--max-live", "16"]) == 0, capsys.readouterr().err
    assert "--max-live 16: bounds mesh-naive" in capsys.readouterr().out
