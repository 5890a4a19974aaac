"""Packed sequences (THD) in the simulator: the per-block work model against brute-force counting,
its use by the replay, the greedy planner, auto shape and the baselines, and the CLI."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_mesh_cp.planning.autoshape import shape_bound
from megatron_mesh_cp.planning.baselines import simulate_algorithm
from megatron_mesh_cp.planning.cluster import Workload, load_cluster
from megatron_mesh_cp.planning.greedy import PlanCost
from megatron_mesh_cp.planning.packing import Packing, parse_doc_range, read_packing, sample_packing
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning import schedule
from megatron_mesh_cp.planning.schedule import build_plans
from megatron_mesh_cp.runtime.layout import BlockCase
from megatron_mesh_cp.runtime.plan import BACKWARD, FORWARD
from megatron_mesh_cp.runtime.topology import valid_shapes
from megatron_mesh_cp.simulate import main

H100 = load_cluster("h100-ib400")


# --- brute force: the explicit THD partition and the document-causal mask ------------------------


def thd_partition(lengths, n):
    """Per rank, the global token indices it holds, and per global token (document, position, real):
    each document padded to a multiple of 2n, cut into 2n pieces, rank g keeps pieces g and 2n-1-g of
    every document, documents in order (Megatron/TE ``thd_get_partitioned_indices``)."""
    doc, pos, real, ranks = [], [], [], [[] for _ in range(n)]
    start = 0
    for d, length in enumerate(lengths):
        padded = -(-length // (2 * n)) * (2 * n)
        piece = padded // (2 * n)
        for g in range(n):
            for k in (g, 2 * n - 1 - g):
                ranks[g] += range(start + k * piece, start + (k + 1) * piece)
        doc += [d] * padded
        pos += list(range(padded))
        real += [p < length for p in range(padded)]
        start += padded
    return [np.array(r) for r in ranks], np.array(doc), np.array(pos), np.array(real)


def brute_force_work(lengths, n, causal, tile=0):
    """Unmasked (q, k) pairs of every block by enumeration; with a tile, per document the kernel's
    operands (Q rows and keys with any pair, in local order) cut in tile x tile squares, counting the
    squares that hold at least one pair."""
    ranks, doc, pos, real = thd_partition(lengths, n)
    work = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        for j in range(n):
            q, k = ranks[i], ranks[j]
            mask = real[q][:, None] & real[k][None, :] & (doc[q][:, None] == doc[k][None, :])
            if causal:
                mask &= pos[q][:, None] >= pos[k][None, :]
            if not tile:
                work[i, j] = mask.sum()
                continue
            for d in range(len(lengths)):
                m = mask[np.ix_(doc[q] == d, doc[k] == d)]
                m = m[m.any(axis=1)][:, m.any(axis=0)]
                if m.size:
                    rows, cols = -(-m.shape[0] // tile), -(-m.shape[1] // tile)
                    padded = np.zeros((rows * tile, cols * tile), dtype=bool)
                    padded[: m.shape[0], : m.shape[1]] = m
                    work[i, j] += padded.reshape(rows, tile, cols, tile).any(axis=(1, 3)).sum() * tile * tile
    return work


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_block_work_equals_brute_force(n, causal):
    rng = np.random.default_rng(n + 10 * causal)
    cases = [
        list(rng.integers(1, 60, size=6)),  # random lengths, most padded
        [2 * n, 1, 2 * n + 1, 3],  # exactly 2*CP, a single token, one past 2*CP
        [int(rng.integers(100, 200))],  # one long document (with padding)
    ]
    for lengths in cases:
        packing = Packing(tuple(int(x) for x in lengths), 2 * n)
        np.testing.assert_array_equal(packing.block_work(n, causal), brute_force_work(lengths, n, causal))
        # with padding no block holds more pairs than its unmasked zigzag case, and the whole matrix sums
        # to the pairs of attention over whole documents
        assert packing.block_work(n, causal).sum() == packing.sequence_work(causal)


@pytest.mark.parametrize("n,tile", [(2, 3), (4, 2), (4, 5)])
def test_tile_counting_equals_brute_force(n, tile):
    lengths = [int(x) for x in np.random.default_rng(tile).integers(1, 50, size=5)] + [2 * n]
    for causal in (True, False):
        np.testing.assert_array_equal(Packing(tuple(lengths), 2 * n, tile).block_work(n, causal),
                                      brute_force_work(lengths, n, causal, tile))
    exact = Packing(tuple(lengths), 2 * n)
    np.testing.assert_array_equal(exact.with_tile(1).block_work(n), exact.block_work(n))


def test_ulysses_groups_hold_the_coarser_zigzag():
    """A Ulysses group of u ranks holds pieces G and 2(n/u)-1-G of every document: the work of its
    block in the n/u-rank split is the sum of its members' blocks in the n-rank split."""
    n, u = 8, 2
    packing = Packing((5, 37, 16, 64, 1, 90), 2 * n)
    fine, coarse = packing.block_work(n), packing.block_work(n // u)
    for g in range(n // u):
        for h in range(n // u):
            assert coarse[g, h] == fine[g * u:(g + 1) * u, h * u:(h + 1) * u].sum()


# --- the cost model and the replay -------------------------------------------------------------


def _w(n, seq, kv=8, packing=None, causal=True):
    return Workload(seq_local=seq // n, heads=32, kv_heads=kv, head_dim=128, causal=causal, partial_bytes=2,
                    mask=packing)


# no fixed per-call costs: what is left is the kernel work, where one document is the unpacked model
NOFIX = replace(H100, block_overhead=0.0, correction_passes=0)


@pytest.fixture
def ungrouped(monkeypatch):
    """Plan without grouped calls. Packed plans never group blocks into one call (a varlen call
    cannot take a document's keys from several chunks), so packed-vs-unpacked equalities compare
    with the unpacked model planned the same way."""
    monkeypatch.setattr(schedule, "CONFIGS", tuple(c for c in schedule.CONFIGS if not c.group))
    schedule._greedy_plans.cache_clear()
    yield
    schedule._greedy_plans.cache_clear()


def test_one_unpadded_document_is_the_unpacked_model_but_for_the_varlen_calls(ungrouped):
    n, seq = 8, 64 * 1024
    w, wp = _w(n, seq), _w(n, seq, packing=Packing((seq,), 2 * n))
    for backward in (False, True):
        np.testing.assert_allclose(wp.block_times(NOFIX, backward, n), w.block_times(NOFIX, backward, n), rtol=1e-12)
        # the runtime's sub-blocks (packed_slices): 3 varlen calls on the diagonal, 2 off it
        extra = wp.block_times(H100, backward, n) - w.block_times(H100, backward, n)
        over = H100.block_overhead
        assert np.all(np.diag(extra) > 2 * over - 1e-12) and np.all(extra[~np.eye(n, dtype=bool)] > over - 1e-12)
        assert wp.packed_call_costs(NOFIX, BlockCase.DIAG, backward) == 0.0
        no_corr = replace(H100, correction_passes=0)
        assert [wp.packed_call_costs(no_corr, c, backward) / over for c in (BlockCase.DIAG, BlockCase.LOWER,
                BlockCase.UPPER)] == pytest.approx([3, 2, 2], rel=1e-12)
    for algo in ("ring", "mesh:2x4", "a2a+mesh:2x2x2", "usp:2"):
        assert simulate_algorithm(algo, n, NOFIX, wp).time == pytest.approx(
            simulate_algorithm(algo, n, NOFIX, w).time, rel=1e-12), algo
        assert simulate_algorithm(algo, n, H100, wp).time > simulate_algorithm(algo, n, H100, w).time, algo
    # one call over the whole sequence: unpacked charges S^2/2 causal pairs, packed the exact S(S+1)/2
    for algo in ("usp", "ulysses", "allgather"):
        assert simulate_algorithm(algo, n, H100, wp).time == pytest.approx(simulate_algorithm(algo, n, H100, w).time,
                                                                          rel=1e-4), algo


def test_replay_charges_each_block_its_packed_work():
    """Rank 0's blocks in the replay last exactly their packed block times (no overlap slowdown here)."""
    n, seq = 8, 64 * 1024
    cluster = replace(H100, overlap_slowdown_intra=0.0, overlap_slowdown_inter=0.0)
    w = _w(n, seq, packing=sample_packing(seq, 512, 8192, n, seed=3))
    fwd, bwd = build_plans(2, 4, cluster=cluster, workload=w)
    for plan in (fwd, bwd):
        t = w.block_times(cluster, plan.phase == BACKWARD, n)
        res = replay(plan, cluster, w, record=0)
        spans = [(lab, e - s) for lane, s, e, lab in res.timeline if lane == "compute" and lab.startswith("blk")]
        a = plan.a
        for lab, dur in spans:
            q, kv = map(int, lab.split()[1].split(","))
            i, j = (0 - q) % a, ((0 - kv) % plan.b) * a  # rank 0 at (r, c) = (0, 0)
            assert dur == pytest.approx(t[i, j], rel=1e-12), lab
        assert len(spans) == n


def test_packing_keeps_bytes_and_cuts_compute():
    n, seq = 16, 128 * 1024
    packing = sample_packing(seq, 1024, 8192, n, seed=0)
    for kv in (32, 8):
        w, wp = _w(n, seq, kv), _w(n, seq, kv, packing)
        for algo in ("ring", "usp:8", "mesh:4x4", "a2a+mesh:2x2x4"):
            u, p = simulate_algorithm(algo, n, H100, w), simulate_algorithm(algo, n, H100, wp)
            assert p.bytes_sent == u.bytes_sent and p.bytes_by_phase == u.bytes_by_phase, algo
            assert p.compute < 0.5 * u.compute, algo  # ~3.6% of the work, plus the fixed per-call costs
            assert p.time < u.time, algo
        ring_u, ring_p = simulate_algorithm("ring", n, H100, w), simulate_algorithm("ring", n, H100, wp)
        assert ring_p.exposed > ring_u.exposed  # the same KV hops, less compute to hide them behind


def test_greedy_planner_costs_are_the_packed_block_times(ungrouped):
    n, seq = 16, 128 * 1024
    w = _w(n, seq, packing=sample_packing(seq, 1024, 8192, n, seed=1))
    below = np.tril(np.ones((n, n), dtype=bool), -1)
    for phase in (FORWARD, BACKWARD):
        t = w.block_times(H100, phase == BACKWARD, n)
        cost = PlanCost.of(4, 4, phase, H100, w)
        assert cost.block == pytest.approx(t[below].mean(), rel=1e-12)
        assert t[below].max() / t[below].min() < 1.01  # every rank holds 2 pieces of each doc: only padding varies
        assert cost.block < PlanCost.of(4, 4, phase, H100, replace(w, mask=None)).block / 2
    # one unpadded document, no per-call costs: the planner sees exactly the unpacked costs, so it plans the same
    one = _w(n, seq, packing=Packing((seq,), 2 * n))
    for phase in (FORWARD, BACKWARD):
        packed, plain = PlanCost.of(4, 4, phase, NOFIX, one), PlanCost.of(4, 4, phase, NOFIX, replace(one, mask=None))
        assert packed.block == pytest.approx(plain.block, rel=1e-12) and replace(packed, block=plain.block) == plain
    assert [p.ops for p in build_plans(4, 4, cluster=NOFIX, workload=one)] == \
        [p.ops for p in build_plans(4, 4, cluster=NOFIX, workload=replace(one, mask=None))]


def test_shape_bound_stays_a_bound_when_packed():
    n, seq = 16, 128 * 1024
    w = _w(n, seq, kv=32, packing=sample_packing(seq, 1024, 8192, n, seed=2))
    for a, b in valid_shapes(n):
        fwd, bwd = build_plans(a, b, cluster=H100, workload=w)
        sim = replay(fwd, H100, w, record=None).time + replay(bwd, H100, w, record=None).time
        assert shape_bound(a, b, H100, w) <= sim * (1 + 1e-9), (a, b)


# --- distributions, files and bad inputs ----------------------------------------------------------


def test_sampling_fills_the_sequence_deterministically():
    seq, n = 1 << 20, 256
    for dist in ("loguniform", "uniform"):
        p = sample_packing(seq, 4096, 65536, n, dist=dist, seed=7)
        assert p == sample_packing(seq, 4096, 65536, n, dist=dist, seed=7)
        assert p != sample_packing(seq, 4096, 65536, n, dist=dist, seed=8)
        assert p.total == seq and all(x % (2 * n) == 0 for x in p.padded)
        assert all(4096 <= x <= 65536 for x in p.lengths[:-1]) and 1 <= p.lengths[-1] <= 65536
    logu = sample_packing(1 << 24, 4096, 65536, n, seed=0).lengths
    uni = sample_packing(1 << 24, 4096, 65536, n, dist="uniform", seed=0).lengths
    assert np.median(logu) < 0.75 * np.median(uni)  # log-uniform: short documents more often


def test_doc_length_file(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("# lengths\n100, 300\n50 2000 7  # 2000 is cut to the 48 tokens left, 7 does not fit\n")
    p = read_packing(f, 512, 4)  # padded to multiples of 8: 104 + 304 + 56 = 464
    assert p.lengths == (100, 300, 50, 48) and p.total == 512 and "first 4 of 5" in p.label


@pytest.mark.parametrize("make,match", [
    (lambda: Packing((), 8), "at least one document"),
    (lambda: Packing((5, 0), 8), "positive whole number"),
    (lambda: Packing((5,), 7), "multiple of 2\\*CP"),
    (lambda: parse_doc_range("64K-4K"), "LO must not exceed HI"),
    (lambda: parse_doc_range("0-4K"), "at least 1 token"),
    (lambda: parse_doc_range("4K"), "LO-HI"),
    (lambda: sample_packing(1000, 10, 20, 8), "multiple of 2\\*CP = 16"),
    (lambda: sample_packing(1024, 10, 20, 8, dist="zipf"), "loguniform, uniform"),
    (lambda: Packing((100, 28), 8).block_work(8), "pad them to a multiple of 2\\*CP"),
])
def test_bad_packings_name_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_files_and_mismatched_workloads_name_the_fix(tmp_path):
    empty, short, junk = tmp_path / "e.txt", tmp_path / "s.txt", tmp_path / "j.txt"
    empty.write_text("# nothing\n")
    short.write_text("100 100\n")
    junk.write_text("100 abc\n")
    with pytest.raises(ValueError, match="lists no documents"):
        read_packing(empty, 512, 4)
    with pytest.raises(ValueError, match="add documents or lower the sequence length"):
        read_packing(short, 512, 4)
    with pytest.raises(ValueError, match="'abc' is not a whole token count"):
        read_packing(junk, 512, 4)
    with pytest.raises(ValueError, match="does not exist"):
        read_packing(tmp_path / "missing.txt", 512, 4)
    w = _w(8, 64 * 1024, packing=sample_packing(32 * 1024, 512, 4096, 8))
    with pytest.raises(ValueError, match="pack the documents into the global sequence length"):
        simulate_algorithm("ring", 8, H100, w)


def test_cli_packed_vs_unpacked(capsys, tmp_path):
    assert main(["--cp", "8", "--seq", "64K", "--docs", "1K-8K", "--doc-seed", "1", "--doc-layout", "padded",
                 "--algos", "ring,usp,mesh,a2a+mesh"]) == 0
    out = capsys.readouterr().out
    assert "packed: " in out and "loguniform 1024-8192 tokens, seed 1" in out
    table = out.split("packed vs unpacked")[1].splitlines()
    assert [line.split()[0] for line in table[3:7]] == ["ring", "usp", "mesh", "a2a+mesh"]
    assert main(["--cp", "8", "--seq", "64K", "--docs", "64K-4K"]) == 2
    assert "LO must not exceed HI" in capsys.readouterr().err
    assert main(["--cp", "8", "--seq", "64K", "--kernel-tile", "128"]) == 2
    assert "give --docs" in capsys.readouterr().err
    f = tmp_path / "d.txt"
    f.write_text("")
    assert main(["--cp", "8", "--seq", "64K", "--doc-lengths", str(f)]) == 2
    assert "lists no documents" in capsys.readouterr().err
