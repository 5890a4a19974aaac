"""Greedy planner, plan validation, cost model, simulator, auto shape, baselines and the CLI."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megatron_mesh_cp import ChunkDims, MeshShape, build_plans, plan_traffic, valid_shapes, validate
from megatron_mesh_cp.planning.autoshape import choose_shape
from megatron_mesh_cp.planning.baselines import compare, simulate_algorithm
from megatron_mesh_cp.planning.cluster import Cluster, Workload, load_cluster
from megatron_mesh_cp.virtual import virtual_mesh_attention
from megatron_mesh_cp.runtime.plan import Compute, PlanError, Transfer
from megatron_mesh_cp.planning.cluster import workload_dims
from megatron_mesh_cp.planning.replay import replay

H100 = load_cluster("h100-ib400")
GQA = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128)
MHA = replace(GQA, kv_heads=32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- validation of every greedy plan -------------------------------------------------------------


@pytest.mark.parametrize("n", list(range(1, 65)))
def test_greedy_plans_valid_for_every_factorisation(n):
    w = MHA if n % 2 else GQA
    for a, b in valid_shapes(n):
        for plan in build_plans(a, b, cluster=H100, workload=w):
            validate(plan)
            assert plan.name == "greedy"


@pytest.mark.parametrize("n,shapes", [(72, [(8, 9), (9, 8)]), (96, [(8, 12)]), (128, [(8, 16), (16, 8), (1, 128)]),
                                      (144, [(12, 12)]), (192, [(12, 16)]), (256, [(16, 16), (8, 32), (1, 256), (256, 1)])])
def test_greedy_plans_valid_sample_to_256(n, shapes):
    for a, b in shapes:
        for plan in build_plans(a, b, cluster=H100, workload=GQA):
            validate(plan)


def test_greedy_is_deterministic_and_cached():
    p1 = build_plans(4, 8, cluster=H100, workload=GQA)
    p2 = build_plans(4, 8, cluster=H100, workload=GQA)
    assert p1 is p2
    from megatron_mesh_cp.planning.schedule import _greedy_plans

    _greedy_plans.cache_clear()
    p3 = build_plans(4, 8, cluster=H100, workload=GQA)
    assert p3[0].ops == p1[0].ops and p3[1].ops == p1[1].ops


def test_memory_budget_is_respected_and_too_small_fails_clearly():
    free = build_plans(2, 8, cluster=H100, workload=MHA)
    peak = max(validate(p) for p in free)
    budget = peak - 3
    tight = build_plans(2, 8, cluster=H100, workload=MHA, max_live=budget)
    assert all(validate(p, max_live=budget) <= budget for p in tight)
    with pytest.raises(ValueError, match=r"below what any .* needs \(minimum \d+\)"):
        build_plans(2, 8, cluster=H100, workload=MHA, max_live=4)


@pytest.mark.parametrize("shape", [(4, 4), (2, 8), (8, 8)])
def test_greedy_holds_back_own_blocks_for_the_tail(shape):
    """A block of the rank's own row (whose partial never leaves) only runs when no block feeding a
    partial that must leave is ready; so own blocks fill the reduction tail."""
    # one GPU per node and non-causal blocks: the planner's one-rank model is exactly the replay's
    cluster, w = replace(H100, gpus_per_node=1), replace(MHA, causal=False)
    fwd, _ = build_plans(*shape, cluster=cluster, workload=w)
    r = replay(fwd, cluster, w, record=0)
    blocks = [(s, lab) for lane, s, e, lab in r.timeline if lane == "compute" and lab.startswith("blk")]
    ready = lambda i, j: max(r.arrivals[("q", i)], r.arrivals[("kv", j)])  # noqa: E731
    # "blk i,j" or, for a grouped compute, "blk i,j1+j2+...": one entry per block
    parsed = [(s, int(i), int(j)) for s, lab in blocks for i, js in [lab.split()[1].split(",")] for j in js.split("+")]
    for idx, (t, i, j) in enumerate(parsed):
        if i == 0:
            later = [(ii, jj) for _, ii, jj in parsed[idx + 1:] if ii != 0]
            assert all(ready(ii, jj) > t - 1e-12 for ii, jj in later), (t, i, j)
    # the last block computed belongs to the own row: it filled the final reduction wait
    assert parsed[-1][1] == 0


# --- simulator --------------------------------------------------------------------------------


def test_simulator_bytes_equal_executor_bytes():
    """Virtual ranks run the greedy plans for real; their byte counters equal the replay's."""
    shape = MeshShape(2, 4)
    n, s, h, hk, d = shape.n, 8, 4, 2, 8
    w = Workload(seq_local=s, heads=h, kv_heads=hk, head_dim=d, batch=2, bytes_per_element=4, partial_bytes=4)
    fwd, bwd = build_plans(shape.a, shape.b, cluster=H100, workload=w)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, s * n, x, d, generator=g) for x in (h, hk, hk, h))
    res = virtual_mesh_attention(q, k, v, shape, dout=do, plans=(fwd, bwd))
    traffic = res["traffic"]  # forward and backward counted per rank
    sim = {**replay(fwd, H100, w).sent_by_category, **replay(bwd, H100, w).sent_by_category}
    dims = workload_dims(w)
    assert sim == {**plan_traffic(fwd, dims), **plan_traffic(bwd, dims)}
    for r in range(n):
        measured = dict(traffic[r].sent)
        assert measured == sim, (r, measured, sim)
        total = sum(sim.values())
        phases = replay(fwd, H100, w), replay(bwd, H100, w)
        assert sum(float(p.sent["intra"][r] + p.sent["inter"][r]) for p in phases) == total


def test_simulator_limits():
    """No network cost -> time is pure compute; ring on a slow NIC -> time ~ the KV hops."""
    fast = replace(H100, intra_bw=1e30, inter_bw=1e30, intra_lat=0.0, inter_lat=0.0, hbm_bw=1e30)
    full = replace(MHA, causal=False)  # equal blocks on every rank: nothing to wait for
    for w, slack in ((full, 1e-12), (MHA, 0.03)):  # causal: ranks differ a little (half-row blocks)
        for plan in build_plans(4, 4, cluster=fast, workload=w):
            r = replay(plan, fast, w)
            assert r.exposed <= slack * r.time
            assert r.time == pytest.approx(float(r.busy.max()), rel=slack)
    slow = replace(H100, inter_bw=1e9, intra_bw=1e9, intra_lat=0.0, inter_lat=0.0)
    ring_f, _ = build_plans(1, 16, cluster=slow, workload=MHA, chains="one-way")
    r = replay(ring_f, slow, MHA)
    kv_hop = 2 * MHA.seq_local * MHA.heads * MHA.head_dim * 2 / 1e9
    assert 15 * kv_hop <= r.time <= 15 * kv_hop + 2 * float(r.busy.max()) / 16 + 1e-3


def test_link_types_follow_megatron_placement():
    # 16x16 on 8-GPU nodes: row rings of 16 consecutive ranks cross one node boundary; columns always do
    fwd, _ = build_plans(16, 16, cluster=H100, workload=GQA)
    r = replay(fwd, H100, GQA)
    assert r.sent["inter"][0] > 0 and r.sent["intra"][1] > 0
    # 8x32: row rings inside a node, so Q/O never touch the NIC
    fwd, _ = build_plans(8, 32, cluster=H100, workload=GQA)
    r = replay(fwd, H100, GQA)
    dims = workload_dims(GQA)
    kv_bytes = 31 * sum(s.nbytes for s in __import__("megatron_mesh_cp.runtime.plan", fromlist=["payload"]).payload("forward", "kv", dims))
    assert float(r.sent["inter"][0]) == kv_bytes
    # with TP = 8 every CP hop is a node hop
    r8 = replay(fwd, H100, GQA, stride=8)
    assert float(r8.sent["intra"].sum()) == 0


# --- traffic and exposed communication at n = 256 ---------------------------------------------


def test_traffic_and_exposed_targets_at_256():
    w = replace(MHA, seq_local=(1 << 20) // 256, partial_bytes=2)  # TE's Ring sends dK/dV in bf16
    ring = simulate_algorithm("ring", 256, H100, w)
    mesh = simulate_algorithm("mesh:16x16", 256, H100, w)
    assert mesh.bytes_sent <= 0.11 * ring.bytes_sent
    # the square tile itself (auto's default memory budget now picks narrower tiles at n = 256)
    from megatron_mesh_cp.planning.baselines import _plan_algo

    naive = _plan_algo("mesh-naive", 16, 16, H100, w, 1, planner="in-order")
    greedy = mesh
    assert greedy.exposed <= 0.5 * naive.exposed
    # calibrated model (docs/calibration.md): ~2.6x; the uncalibrated one claimed 3.7x by hiding
    # communication for free. The paper reports up to 3.4x, 2.9x on average.
    assert ring.time / greedy.time > 2.5


# --- auto shape ------------------------------------------------------------------------------


def test_auto_shape_depends_on_heads_and_topology(caplog):
    caplog.set_level("INFO", logger="megatron_mesh_cp")
    mha = choose_shape(64, H100, replace(MHA, seq_local=2048))
    mqa = choose_shape(64, H100, replace(MHA, seq_local=2048, kv_heads=1))
    assert mqa.shape.b > mha.shape.b  # cheap KV -> wider tiles
    assert "mesh_shape=auto" in mha.explanation and f"{mha.shape.a}x{mha.shape.b}" in caplog.text
    best = min(t for _, t, _ in mha.table if t is not None)
    assert mha.seconds == best
    one_node = replace(H100, gpus_per_node=64)  # everything on NVLink: a different trade-off
    assert choose_shape(64, one_node, replace(MHA, seq_local=2048)).seconds < mha.seconds


def test_auto_shape_for_16_ranks_beats_ring():
    c = choose_shape(16, H100, MHA)
    ring = next(t for s, t, _ in c.table if s == (1, 16))
    assert c.shape != MeshShape(1, 16) and c.seconds < ring


def test_ring_comparison_says_why_a_faster_ring_was_left_out():
    """The auto-shape line's Ring comparison (choose_shape, choose_hybrid_shape): a ratio only where Ring is
    slower; where it is faster, why auto did not take it."""
    from megatron_mesh_cp.planning.autoshape import _vs

    assert _vs(2.0, 1.0, False, "over the memory budget") == "2.00x slower"
    assert _vs(1.0, 1.0, True, "over the memory budget") == "1.00x slower"
    assert _vs(1.0, 1.5, False, "over the memory budget") == "1.50x faster, but over the memory budget"
    assert _vs(1.0, 1.5, True, "not a layout auto runs") == "1.50x faster, but its sides are not both even"


# --- baselines and bad input -----------------------------------------------------------------


def test_baselines_traffic_is_honest():
    n = 16
    w = replace(GQA, partial_bytes=2)
    u = w.seq_local * w.heads * w.head_dim * 2
    gamma = w.kv_heads / w.heads
    ring = simulate_algorithm("ring", n, H100, w)
    assert ring.bytes_sent == pytest.approx(6 * gamma * u * (n - 1))  # 2 fwd + 4 bwd
    ag = simulate_algorithm("allgather", n, H100, w)
    assert ag.bytes_sent == pytest.approx(6 * gamma * u * (n - 1)) and ag.exposed > 0
    uly = simulate_algorithm("ulysses", n, H100, w)
    assert uly.note == "kv heads replicated to 16"
    usp = simulate_algorithm("usp", n, H100, w)
    assert usp.shape.startswith("a2a ")
    results = compare(["mesh", "usp"], n, H100, w)
    assert [r.algo for r in results] == ["ring", "mesh", "usp"]


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="unknown cluster 'nope'.*presets: .*h100-ib400"):
        load_cluster("nope")
    with pytest.raises(ValueError, match="choose one of"):
        simulate_algorithm("mesh:3x5", 16, H100, GQA)
    with pytest.raises(ValueError, match="heads as CP ranks.*use usp or mesh"):
        simulate_algorithm("ulysses", 64, H100, GQA)
    with pytest.raises(ValueError, match="unknown algorithm"):
        compare(["warp"], 16, H100, GQA)
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\ngpus_per_node: 8\n")
    with pytest.raises(ValueError, match="missing or mistypes"):
        load_cluster(str(bad))


# --- CLI -------------------------------------------------------------------------------------


def test_cli_prints_table_and_plots(tmp_path):
    png = tmp_path / "t.png"
    cmd = [sys.executable, "-m", "megatron_mesh_cp.simulate", "--cp", "16", "--seq", "128K", "--heads", "32",
           "--kv-heads", "8", "--algos", "ring,usp,mesh,mesh-naive,allgather", "--plot", str(png)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("CP=16  S=131072  heads=32/8 kv")
    for algo in ("ring", "usp", "mesh", "mesh-naive", "allgather"):
        assert any(l.startswith(algo + " ") for l in lines), out.stdout
    assert "traffic cut" in out.stdout and png.stat().st_size > 10_000
    bad = subprocess.run(cmd[:3] + ["--cp", "16", "--seq", "1M", "--cluster", "nope"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown cluster" in bad.stderr
