"""The document order that balances the mesh's ranks (runtime/tile_balance.py): its per-rank costs are
the block calls the simulator prices (planning/documents.block_calls, the runtime's calls) summed over
each rank's tile, it is a deterministic permutation never worse than its start, and where a rank's
tile work differs from its chunk's (4K-64K documents on 4x8 and 2x16) it beats the chunk-balanced order."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_mesh_cp.planning.documents import UnpaddedDocuments, block_calls, sample_documents
from megatron_mesh_cp.runtime.balance import balance_order
from megatron_mesh_cp.runtime.layouts import arrange
from megatron_mesh_cp.runtime.tile_balance import tile_order, tile_work

SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (1, 4), (4, 2), (2, 4)]


def _draw(rng, total):
    k = int(rng.integers(1, min(total, 10) + 1))
    cuts = np.sort(rng.choice(np.arange(1, total), size=k - 1, replace=False)) if k > 1 else np.zeros(0, int)
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


@pytest.mark.parametrize("causal", [True, False])
def test_tile_work_is_the_block_calls_of_each_ranks_tile(causal):
    """Random documents, shapes and call weights: each rank's cost is its tile's calls (one per block
    off the diagonal under the causal mask, one per shared document without it, one on the diagonal)
    priced per call, row, key and pair, exactly; several orders at once give each order's."""
    rng = np.random.default_rng(0)
    for trial in range(90):
        a, b = SHAPES[trial % len(SHAPES)]
        n = a * b
        lengths = _draw(rng, 2 * n * int(rng.integers(1, 12)))
        weights = tuple(rng.random(4))
        orders = [rng.permutation(len(lengths)) for _ in range(3)]
        got = tile_work(lengths, a, b, causal=causal, weights=weights, orders=orders)
        for o, row in zip(orders, got):
            calls = block_calls(UnpaddedDocuments(tuple(lengths[i] for i in o)).span(), n, causal)
            cost = weights[0] + weights[1] * calls.rows + weights[2] * calls.keys + weights[3] * calls.work
            want = np.bincount((calls.i // a) * a + calls.j % a, weights=cost, minlength=n)
            np.testing.assert_allclose(row, want, rtol=1e-12, atol=1e-9)


def test_tile_order_is_a_deterministic_permutation_never_worse_than_its_start():
    rng = np.random.default_rng(1)
    for a, b in ((2, 2), (1, 4), (4, 2), (2, 4)):
        for _ in range(6):
            lengths = _draw(rng, 2 * a * b * 24)
            start = balance_order(lengths, a * b)
            order = tile_order(lengths, a, b, iters=256, patience=64)
            assert sorted(order) == list(range(len(lengths))) and order == tile_order(lengths, a, b, iters=256,
                                                                                      patience=64)
            assert tile_work(lengths, a, b, orders=[order]).max() <= tile_work(lengths, a, b, orders=[start]).max()
            starved = tile_order(lengths, a, b, budget=1)  # one move scored: still a permutation, never worse
            assert sorted(starved) == list(range(len(lengths)))
            assert tile_work(lengths, a, b, orders=[starved]).max() <= tile_work(lengths, a, b, orders=[start]).max()


@pytest.mark.parametrize("shape", [(4, 8), (2, 16)], ids=["4x8", "2x16"])
def test_tiled_layout_balances_ranks_the_balanced_order_does_not(shape):
    """4K-64K documents over 1M tokens (docs/packing.md's set): ordered for the chunks, the busiest rank
    of the a x b mesh does 1.4-1.6x the mean rank's attention pairs (documents crossing pieces land
    their blocks on particular ranks); ordered for the ranks, well under that."""
    a, b = shape
    lengths = list(sample_documents(1 << 20, 4096, 65536, seed=0).lengths)
    bal = arrange(lengths, a * b, "balanced")
    tiled = arrange(lengths, a * b, "tiled", shape=shape)
    ratio = {}
    for arr in (bal, tiled):
        w = tile_work([lengths[i] for i in arr.runs[0]], a, b)
        ratio[arr.name] = w.max() / w.mean()
    print(f"[tile balance] {a}x{b}: busiest / mean rank pairs balanced {ratio['balanced']:.2f} -> tiled "
          f"{ratio['tiled']:.2f}")
    assert ratio["balanced"] > 1.35 and ratio["tiled"] < ratio["balanced"] - 0.15, ratio
    assert tiled.shape == shape and "4x8" in arrange(lengths, 32, "tiled", shape=(4, 8)).describe()


def test_bad_tiled_requests_are_refused():
    with pytest.raises(ValueError, match="shape=\\(a, b\\) with a \\* b = 4"):
        arrange([8, 8], 4, "tiled", shape=(2, 3))
    with pytest.raises(ValueError, match="shape=\\(a, b\\)"):
        arrange([8, 8], 2, "tiled")
    with pytest.raises(ValueError, match="not a multiple of 2\\*4"):
        tile_work([8, 7], 2, 2)
    with pytest.raises(ValueError, match="permutation"):
        tile_work([8, 8], 1, 2, orders=[[0, 0]])
    with pytest.raises(ValueError, match="start must be a permutation"):
        tile_order([8, 8], 1, 2, start=[1, 1])


def test_auto_offers_tiled_per_mesh_and_the_simulator_runs_it():
    """Auto prices tiled beside the other layouts with the cost model's per-call weights: on 4K-64K
    documents a2a+mesh's inner 4x8 mesh prices it below the balanced order (its busiest rank lower,
    the bytes the same) and tiled-cut the same as it (MHA: both phases bound by their transfers), so
    auto takes tiled-cut, whose busiest rank's block seconds are lower; a fixed ``tiled`` workload is
    laid out for the mesh it runs on, and its pruned plans replay."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import Workload, document_plans, load_cluster, ulysses_inner
    from megatron_mesh_cp.planning.bounds import mesh_bound
    from megatron_mesh_cp.planning.layouts import choose_layout, resolve_layout, tile_weights
    from megatron_mesh_cp.planning.replay import replay

    cluster = load_cluster("h100-ib400")
    docs = sample_documents(1 << 20, 4096, 65536, seed=0)
    inner = ulysses_inner(8, Workload(seq_local=(1 << 20) // 256, heads=32, kv_heads=32, head_dim=128,
                                      partial_bytes=2))
    choice = choose_layout(docs.lengths, 4, 8, cluster, inner, stride=8)
    seconds = dict((name, s) for name, s, _ in choice.candidates)
    assert seconds["tiled"] < seconds["balanced"] and seconds["tiled-cut"] == seconds["tiled"], seconds
    assert choice.arrangement.name == "tiled-cut", seconds
    from megatron_mesh_cp.planning.documents import tile_bound

    busiest = {name: sum(tile_bound(replace(inner, mask=resolve_layout(replace(inner, mask=docs.with_layout(name)), 4,
                                                                        8, cluster, 8).mask), cluster, 4, 8, bwd)[0]
                         for bwd in (False, True)) for name in ("tiled", "tiled-cut")}
    assert busiest["tiled-cut"] < busiest["tiled"], busiest
    tiled = resolve_layout(replace(inner, mask=docs.with_layout("tiled")), 4, 8, cluster, 8)
    assert tiled.mask.mesh == (4, 8) and tiled.mask.weights == tile_weights(inner, cluster)
    assert mesh_bound(4, 8, cluster, tiled, 8) == pytest.approx(seconds["tiled"], rel=1e-12)
    auto = resolve_layout(replace(inner, mask=docs.with_layout("auto")), 4, 8, cluster, 8)
    cut = resolve_layout(replace(inner, mask=docs.with_layout("tiled-cut")), 4, 8, cluster, 8)
    assert auto.mask.layout == "tiled-cut" and auto.mask.arranged(32) == cut.mask.arranged(32)
    fwd, bwd = document_plans(4, 8, cluster=cluster, workload=tiled, stride=8)
    assert replay(fwd, cluster, tiled, stride=8).time > 0 and replay(bwd, cluster, tiled, stride=8).time > 0
    with pytest.raises(ValueError, match="resolve it for the mesh first"):
        docs.with_layout("tiled").arranged(32)


def test_a_tiled_layout_reports_the_rank_balance_it_optimises():
    """A tiled layout's busiest / mean is its ranks' attention pairs (tile_work), not its chunks'; the other
    layouts keep the chunk figure, and the description says which."""
    from megatron_mesh_cp.planning import sample_documents
    from megatron_mesh_cp.runtime.layouts import arrange
    from megatron_mesh_cp.runtime.tile_balance import tile_work

    lengths = sample_documents(1 << 16, 512, 8192, seed=5).lengths
    tiled = arrange(lengths, 8, "tiled", shape=(2, 4))
    ranks = tile_work(lengths, 2, 4, orders=[tiled.runs[0]])[0]
    assert tiled.balance == pytest.approx(ranks.max() / ranks.mean(), rel=1e-12)
    assert tiled.balance != pytest.approx(tiled.work.max() / tiled.work.mean(), rel=1e-6)
    assert "busiest / mean rank work" in tiled.describe()
    assert "busiest / mean chunk work" in arrange(lengths, 8, "balanced").describe()


def test_tiled_cut_lowers_the_busiest_rank_within_the_tiled_tile_blocks():
    """tiled-cut on 4K-64K documents, a2a+mesh's inner 2x16 mesh (GQA) priced by the cost model: a few
    documents re-laid, some of their tokens trading places with another document's, no tile
    block kept that the tiled one leaves empty (same chunks sent), the busiest rank's pairs lower;
    its rank pairs are the block engine's exact pairs; every rank builds the same; auto takes it where
    its bound is lower, and without the causal mask nothing is cut."""
    from megatron_mesh_cp.planning import Workload, load_cluster, ulysses_inner
    from megatron_mesh_cp.planning.layouts import choose_layout, tile_weights
    from megatron_mesh_cp.runtime.layouts import tiled_cut
    from megatron_mesh_cp.runtime.masks.spans import needed_blocks
    from megatron_mesh_cp.runtime.topology import MeshShape

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=(1 << 20) // 256, heads=32, kv_heads=8, head_dim=128,
                                      partial_bytes=2))
    lengths = sample_documents(1 << 20, 4096, 65536, seed=0).lengths
    weights = tile_weights(inner, cluster)
    tiled = arrange(lengths, 32, "tiled", shape=(2, 16), weights=weights)
    cut = arrange(lengths, 32, "tiled-cut", shape=(2, 16), weights=weights)
    assert cut.cut >= 2 and cut.balance < tiled.balance - 0.03, (cut.cut, cut.balance, tiled.balance)
    assert "re-laid" in cut.describe()
    total, shape = sum(lengths), MeshShape(2, 16)
    blocks, whole = cut.mask.bind(32, total, True), tiled.mask.bind(32, total, True)
    assert needed_blocks(blocks.nonempty(), shape) <= needed_blocks(whole.nonempty(), shape)
    pairs = np.zeros(32)
    for i, j in zip(*np.nonzero(blocks.nonempty())):
        pairs[shape.owner(int(i), int(j))] += sum(s.pairs for s in blocks.block(int(i), int(j)))
    assert np.allclose(pairs, cut.rank_work) and pairs.sum() == pytest.approx(tiled.rank_work.sum())
    doc_of = lambda arr: np.repeat(arr.runs[0], arr.runs[2])  # noqa: E731 (each x' token's document)
    moved = doc_of(cut) != doc_of(tiled)  # tokens that traded places: each document keeps its token count
    assert moved.any() and np.array_equal(np.bincount(doc_of(cut)), np.bincount(doc_of(tiled)))
    pos = [np.sort(np.concatenate([np.arange(p, p + l) for d, p, l in zip(*cut.runs) if d == k]))
           for k in range(len(lengths))]
    assert all(np.array_equal(p, np.arange(lengths[k])) for k, p in enumerate(pos))  # every position once
    again = tiled_cut(tiled, weights=weights)
    assert np.array_equal(again.order, cut.order) and again.mask == cut.mask
    choice = choose_layout(lengths, 2, 16, cluster, inner, stride=8)
    seconds = dict((name, s) for name, s, _ in choice.candidates)
    assert choice.arrangement.name == "tiled-cut" and seconds["tiled-cut"] < seconds["tiled"], seconds
    # the simulator's path: --layout tiled-cut (and auto) laid out for the mesh, priced as auto priced it
    from dataclasses import replace

    from megatron_mesh_cp.planning.bounds import mesh_bound
    from megatron_mesh_cp.planning.layouts import resolve_layout
    from megatron_mesh_cp.simulate import parse_layouts

    assert parse_layouts("tiled,tiled-cut") == ["tiled", "tiled-cut"]
    docs = UnpaddedDocuments(tuple(lengths))
    fixed = resolve_layout(replace(inner, mask=docs.with_layout("tiled-cut")), 2, 16, cluster, 8)
    assert fixed.mask.layout == "tiled-cut" and fixed.mask.arranged(32) == cut.mask
    assert mesh_bound(2, 16, cluster, fixed, 8) == pytest.approx(seconds["tiled-cut"], rel=1e-12)
    auto = resolve_layout(replace(inner, mask=docs.with_layout("auto")), 2, 16, cluster, 8)
    assert auto.mask.layout == "tiled-cut" and auto.mask.arranged(32) == cut.mask
    assert "tiled-cut" not in dict((n, s) for n, s, _ in choose_layout(lengths, 2, 16, cluster, inner, stride=8,
                                                                        max_split=0).candidates)
    assert arrange(lengths, 32, "tiled-cut", causal=False, shape=(2, 16)).cut == 0
    with pytest.raises(ValueError, match="shape=\\(a, b\\)"):
        arrange([8, 8], 2, "tiled-cut")
    with pytest.raises(ValueError, match="starts from a tiled layout"):
        tiled_cut(arrange(lengths, 32, "balanced"))


def test_auto_restarts_the_tiled_cut_where_its_busiest_rank_stays_high():
    """4K-64K documents (seed 6) on a2a+mesh's 4x8 mesh (MHA): cut from the first tiled order the busiest
    rank stays above CUT_GOAL times the mean (the order's footprints and tile blocks leave no re-lay
    that unloads it); auto takes the cut from a restarted rank search, modelled more balanced, priced and
    replayed no slower, rebuilt the same from its restart (the simulator's path), its tile blocks its own
    tiled order's, every document's positions once; a fixed tiled-cut stays the first order's."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import Workload, load_cluster, ulysses_inner
    from megatron_mesh_cp.planning.layouts import (CUT_GOAL, CUT_MARGIN, _replay_seconds, choose_layout,
                                                   resolve_layout, tile_weights)
    from megatron_mesh_cp.runtime.masks.spans import needed_blocks
    from megatron_mesh_cp.runtime.topology import MeshShape

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=(1 << 20) // 256, heads=32, kv_heads=32, head_dim=128,
                                      partial_bytes=2))
    lengths = sample_documents(1 << 20, 4096, 65536, seed=6).lengths
    weights = tile_weights(inner, cluster)
    first = arrange(lengths, 32, "tiled-cut", shape=(4, 8), weights=weights)
    assert first.restart == 0 and first.cut_balance > CUT_GOAL, first.cut_balance
    choice = choose_layout(lengths, 4, 8, cluster, inner, stride=8)
    got = choice.arrangement
    assert got.name == "tiled-cut" and got.restart >= 1, (got.name, got.restart)
    assert got.cut_balance <= first.cut_balance - CUT_MARGIN, (got.cut_balance, first.cut_balance)
    assert _replay_seconds(got, 4, 8, cluster, inner, 8) < _replay_seconds(first, 4, 8, cluster, inner, 8)
    again = arrange(lengths, 32, "tiled-cut", shape=(4, 8), weights=weights, restart=got.restart)
    assert np.array_equal(again.order, got.order) and again.mask == got.mask
    docs = UnpaddedDocuments(tuple(lengths))
    auto = resolve_layout(replace(inner, mask=docs.with_layout("auto")), 4, 8, cluster, 8)
    assert auto.mask.layout == "tiled-cut" and auto.mask.restart == got.restart
    assert auto.mask.arranged(32) == got.mask
    fixed = resolve_layout(replace(inner, mask=docs.with_layout("tiled-cut")), 4, 8, cluster, 8)
    assert fixed.mask.arranged(32) == first.mask
    tiled = arrange(lengths, 32, "tiled", shape=(4, 8), weights=weights, restart=got.restart)
    total, shape = sum(lengths), MeshShape(4, 8)
    assert needed_blocks(got.mask.bind(32, total, True).nonempty(), shape) <= needed_blocks(
        tiled.mask.bind(32, total, True).nonempty(), shape)
    pos = [np.sort(np.concatenate([np.arange(p, p + n) for d, p, n in zip(*got.runs) if d == k]))
           for k in range(len(lengths))]
    assert all(np.array_equal(p, np.arange(lengths[k])) for k, p in enumerate(pos))


def test_restart_is_taken_by_the_tiled_layouts_only():
    """arrange's restart restarts the tiled rank search: tiled and tiled-cut take it (and carry it); any other
    layout, which has no such search, refuses it rather than building its unrestarted self; a bool or a
    negative count is refused."""
    from dataclasses import replace

    lengths = [300, 200, 60, 120, 70, 90, 80, 104]
    assert arrange(lengths, 4, "tiled", shape=(2, 2), restart=1).restart == 1
    assert arrange(lengths, 4, "tiled-cut", shape=(2, 2), restart=1).restart == 1
    for layout, kw in (("zigzag", {}), ("balanced", {}), ("split", dict(split=1))):
        assert arrange(lengths, 4, layout, restart=0, **kw).restart == 0
        with pytest.raises(ValueError, match=f"tiled and tiled-cut layouts take it, not '{layout}'"):
            arrange(lengths, 4, layout, restart=1, **kw)
    for bad in (True, -1):
        with pytest.raises(ValueError, match="restart"):
            arrange(lengths, 4, "tiled", shape=(2, 2), restart=bad)
    # the simulator's documents: restart only with tiled-cut (its _tiled_cut rebuilds from it; tiled's would not)
    docs = UnpaddedDocuments(tuple(lengths))
    assert replace(docs.with_layout("tiled-cut"), restart=1).restart == 1
    for layout in ("tiled", "balanced", "split:1", "auto"):
        with pytest.raises(ValueError, match=f"applies to the tiled-cut layout, not '{layout}'"):
            replace(docs.with_layout(layout), restart=1)


def test_tiled_cut_cuts_documents_of_the_exactness_mixes():
    """The float64 exactness test (tests/test_layouts.py) runs tiled-cut layouts that do re-lay documents,
    some of them trading tokens with another document's."""
    import random

    from megatron_mesh_cp import valid_shapes
    from test_layouts import document_mixes

    doc_of = lambda arr: np.repeat(arr.runs[0], arr.runs[2])  # noqa: E731 (each x' token's document)
    traded = 0
    for n in (4, 6, 8):
        cut = []
        for lengths in document_mixes(8 * n, random.Random(n))[:4]:
            for s in valid_shapes(n):
                arr = arrange(lengths, n, "tiled-cut", shape=s, weights=(1.0, 0.1, 0.1, 1.0))
                tiled = arrange(lengths, n, "tiled", shape=s, weights=(1.0, 0.1, 0.1, 1.0))
                cut.append(arr.cut)
                traded += bool((doc_of(arr) != doc_of(tiled)).any())  # tokens moved to another document's place
        assert max(cut) >= 1, (n, cut)
    assert traded >= 4, traded


def test_tiled_cut_exchanges_never_raise_the_modelled_busiest_rank():
    """tile_cut's exchanges (tokens traded between two documents' parts in different chunks) start from
    the re-lays' best state and keep their own best: the modelled busiest rank is no higher than with
    the re-lays alone, and on a2a+mesh's 4x8 (MHA) mesh of 4K-64K documents lower; every run's tokens
    still add up to each document once."""
    from megatron_mesh_cp.planning import Workload, load_cluster, ulysses_inner
    from megatron_mesh_cp.planning.layouts import tile_weights
    from megatron_mesh_cp.runtime.tile_cut import cut_documents

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=(1 << 20) // 256, heads=32, kv_heads=32, head_dim=128,
                                      partial_bytes=2))
    weights = tile_weights(inner, cluster)
    for seed in (0, 1):
        lengths = np.array(sample_documents(1 << 20, 4096, 65536, seed=seed).lengths)
        order = arrange(lengths.tolist(), 32, "tiled", shape=(4, 8), weights=weights).runs[0]
        m = int(lengths.sum()) // 64
        base = np.full(32, weights[0] + (weights[1] + weights[2]) * 2 * m)
        runs0, _, total0, _ = cut_documents(lengths, order, 4, 8, weights=weights, base=base, exchanges=0)
        runs, cut, total, _ = cut_documents(lengths, order, 4, 8, weights=weights, base=base)
        assert total.max() < total0.max() - 1e-3 * total0.mean(), (seed, total.max(), total0.max())
        assert cut >= 2
        got = np.zeros(len(lengths), dtype=np.int64)
        for d, p, n in runs:
            assert 0 <= p and p + n <= lengths[d]
            got[d] += n
        assert np.array_equal(got, lengths)


def test_tiled_cut_survives_documents_whose_every_trade_stays_in_one_chunk():
    """Review h48: short documents (512-1536 tokens, 16K over CP=4) where every exchange candidate of
    the busiest rank's document lies in that document's own chunk: ``_exchange``'s trades filter
    every row away; tiled-cut and auto still build (they raised ``max() iterable argument is empty``)."""
    from megatron_mesh_cp.planning import Workload, load_cluster
    from megatron_mesh_cp.planning.layouts import choose_layout

    lengths = [512 * x for x in (1, 1, 3, 1, 2, 2, 1, 3, 1, 1, 1, 1, 1, 1, 1, 3, 2, 2, 3, 1)]
    for shape in ((2, 2), (1, 4), (4, 1)):
        arr = arrange(lengths, 4, "tiled-cut", shape=shape, weights=(1.0, 0.1, 0.1, 1.0))
        arr.mask.check(sum(lengths), 4)
        choose_layout(lengths, *shape, load_cluster("h100-ib400"),
                      Workload(seq_local=sum(lengths) // 4, heads=32, kv_heads=8, head_dim=128))


def test_fastest_never_takes_a_layout_priced_slower():
    """Review h48 (planning/layouts.py ``_fastest``): the tile_bound tie-break acts only among candidates
    priced exactly the same. The candidate with the highest busiest-rank block seconds wins when it is
    priced one ulp below the rest; with all priced the same, the one whose block seconds are lowest
    (the first of equals); and choose_layout's pick is priced at the minimum of its candidates."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import Workload, load_cluster, ulysses_inner
    from megatron_mesh_cp.planning.documents import tile_bound
    from megatron_mesh_cp.planning.layouts import _fastest, candidate_layouts, choose_layout, tile_weights

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=(1 << 20) // 256, heads=32, kv_heads=32, head_dim=128,
                                      partial_bytes=2))
    lengths = list(sample_documents(1 << 20, 4096, 65536, seed=0).lengths)
    cands = candidate_layouts(lengths, 32, True, max_split=1, shape=(4, 8), weights=tile_weights(inner, cluster))
    busiest = [sum(tile_bound(replace(inner, mask=c.mask), cluster, 4, 8, bwd)[0] for bwd in (False, True))
               for c in cands]
    worst, best = int(np.argmax(busiest)), int(np.argmin(busiest))
    assert busiest[worst] > busiest[best]
    rows = [(c.name, 1.0, 1.0) for c in cands]
    assert _fastest(cands, rows, 4, 8, cluster, inner) == best
    rows[worst] = (cands[worst].name, float(np.nextafter(1.0, 0.0)), 1.0)
    assert _fastest(cands, rows, 4, 8, cluster, inner) == worst
    for seed in (0, 1, 2):
        docs = sample_documents(1 << 20, 1024, 65536, seed=seed)
        choice = choose_layout(docs.lengths, 4, 8, cluster, inner, stride=8)
        assert choice.seconds == min(s for _, s, _ in choice.candidates), choice.candidates


def test_a_document_over_many_pieces_is_priced_in_few_re_lays():
    """Pricing a document's re-lays costs (re-lays) x parts^2; over more than MAX_INTERLEAVE_PARTS pieces it
    is tried in its rotations alone (review h48: one 1M-token document over 2x128's 512 pieces made ~1,540
    re-lays, 33 s and 21 GB per micro-batch), below that with its interleaves as before."""
    from megatron_mesh_cp.runtime import arrange
    from megatron_mesh_cp.runtime.tile_cut import MAX_INTERLEAVE_PARTS, ROTATIONS, _candidates

    m = 64
    few = _candidates(0, 8 * m, m, ROTATIONS)[0]
    many = _candidates(0, (MAX_INTERLEAVE_PARTS + 1) * m, m, ROTATIONS)[0]
    assert len(few) > ROTATIONS and len(many) == ROTATIONS
    arr = arrange([1 << 16], 128, "tiled-cut", shape=(2, 64))  # 256 pieces of one document: done at once
    assert sorted(arr.order.tolist() if arr.order is not None else range(1 << 16)) == list(range(1 << 16))
