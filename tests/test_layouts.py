"""Token layouts (runtime/layouts.py) and the re-laid documents' mask (runtime/masks/arranged.py):
every layout (zigzag, balanced, tiled for the mesh that runs it, split) is a permutation whose
chunks hold S/n tokens, its mask's blocks are the dense definition, and mesh / a2a+mesh run it
exactly (float64 reference, fp32 <= 1e-5, bf16 near the single-device error) for every factorisation
of n in {2, 4, 6, 8} and (2,1,2), (4,1,2): documents longer than S/2, one document over every rank,
many tiny ones, lengths divisible by nothing; gloo runs and their bytes: tests/test_layouts_dist.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from megatron_mesh_cp import valid_shapes
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.runtime.layout import zigzag_positions
from megatron_mesh_cp.runtime.layouts import arrange, half_rows
from megatron_mesh_cp.runtime.masks import Documents
from megatron_mesh_cp.virtual import virtual_mesh_attention


def document_mixes(total, rng):
    """Lengths summing to ``total``: a document longer than half, one document, many tiny ones, a
    random mix of odd lengths, two long documents among short ones."""
    def fill(lengths):
        rest = total - sum(lengths)
        return lengths + ([rest] if rest > 0 else [])
    half = total // 2 + 3
    mixes = [fill([half, 1, 5]), [total], fill([1, 2, 1, 3] * (total // 16)),
             fill([rng.randint(1, total // 5) | 1 for _ in range(5)]),
             fill([total // 3 + 1, total // 4 + 3] + [rng.randint(1, 9) for _ in range(6)])]
    return [m for m in mixes if sum(m) == total and min(m) > 0]


def laid_out(lengths, chunks, causal=True, shape=None):
    """Every layout of ``lengths`` on ``chunks`` chunks: tiled for the mesh ``shape`` (a, b), or for
    every factorisation of ``chunks`` without one."""
    out = [arrange(lengths, chunks, "zigzag", causal=causal), arrange(lengths, chunks, "balanced", causal=causal)]
    for s in ([shape] if shape else valid_shapes(chunks)):
        out.append(arrange(lengths, chunks, "tiled", causal=causal, shape=s, weights=(1.0, 0.1, 0.1, 1.0)))
        out.append(arrange(lengths, chunks, "tiled-cut", causal=causal, shape=s, weights=(1.0, 0.1, 0.1, 1.0)))
    for k in (1, 2):
        if k <= len(lengths):
            try:
                out.append(arrange(lengths, chunks, "split", split=k, causal=causal))
            except ValueError:
                pass
            for s in ([shape] if shape else valid_shapes(chunks)):  # the last h over half of each mesh row
                for h in range(1, k + 1) if len(s) == 2 and half_rows(*s) else ():
                    try:
                        out.append(arrange(lengths, chunks, "split", split=k, causal=causal, shape=s, halves=h))
                    except ValueError:
                        pass
    return out


def dense_of(lengths, order):
    """The definition on x' = x[order]: (query, key) kept iff one document and key not after query."""
    cu = np.concatenate(([0], np.cumsum(lengths)))
    doc = np.searchsorted(cu[1:], np.arange(cu[-1]), side="right")
    o = np.arange(cu[-1]) if order is None else order
    d, p = torch.from_numpy(doc[o]), torch.from_numpy(o)
    return (d[:, None] == d[None, :]) & (p[None, :] <= p[:, None])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_layouts_are_permutations_and_their_blocks_the_dense_mask(n):
    """Each layout is a permutation of the tokens; its mask's kernel calls compute exactly the
    definition's pairs, each once; its work per chunk is the mask's pair count; empty blocks are
    exactly those without a pair."""
    from test_documents import mask_of

    total = 16 * n
    for lengths in document_mixes(total, random.Random(n)):
        for arr in laid_out(lengths, n):
            order = np.arange(total) if arr.order is None else arr.order
            assert sorted(order.tolist()) == list(range(total))
            keep = dense_of(lengths, arr.order)
            blocks = arr.mask.bind(n, total, True)
            work = []
            for i in range(n):
                qi = zigzag_positions(total, n, i)
                work.append(int(keep[qi].sum()))
                for j in range(n):
                    want = keep[qi][:, zigzag_positions(total, n, j)]
                    hits = mask_of(blocks.block(i, j), want.shape[0])
                    assert hits.max() <= 1 and torch.equal(hits.bool(), want), (lengths, arr.name, i, j)
                    assert bool(blocks.nonempty()[i, j]) == bool(want.any())
            assert np.allclose(arr.work, work), (lengths, arr.name, arr.work, work)


def test_order_is_its_runs_laid_back_to_back():
    """A layout's order (built in place from its runs) is each run's tokens in x, run after run."""
    for n in (2, 4):
        for lengths in document_mixes(16 * n, random.Random(10 + n)):
            for arr in laid_out(lengths, n):
                if arr.order is None:
                    continue
                doc, pos, length = arr.runs
                want = np.concatenate([np.arange(arr.starts[d] + p, arr.starts[d] + p + k)
                                       for d, p, k in zip(doc, pos, length)])
                assert arr.order.dtype == np.int64 and np.array_equal(arr.order, want), (lengths, arr.name)


def test_split_layout_balances_a_long_document():
    """A document of 60% of the sequence among short ones: the zigzag's busiest chunk does ~1.5x the
    mean; split, every chunk does about the same (the short documents balanced around it)."""
    rng = random.Random(0)
    total, n = 1 << 14, 16
    lengths = [int(total * 0.6)]
    while sum(lengths) < total:
        lengths.append(min(rng.randint(20, 400), total - sum(lengths)))
    zig, bal = arrange(lengths, n, "zigzag"), arrange(lengths, n, "balanced")
    split = arrange(lengths, n, "split", split=1)
    assert zig.balance > 1.4 and split.balance < 1.05 < bal.balance, (zig.balance, bal.balance, split.balance)
    assert split.order is not None and len(set(split.order.tolist())) == total
    again = arrange(lengths, n, "split", split=1)  # every rank computes the same layout
    assert np.array_equal(again.order, split.order) and again.mask == split.mask


def test_split_pairs_placed_apart_where_keeping_one_together_leaves_no_room():
    """2x2, 8 pieces of 100: in a chunk holding the half-row document (40 a piece), keeping the second
    document's pair (25 + 25) in one piece leaves 20 there, too little for the half-row one's piece; both
    apart fit (30 + 25 + 40 <= 100 each). The greedy placement alone refused this layout."""
    lengths = [240, 200, 160, 50, 50, 50, 50]
    arr = arrange(lengths, 4, "split", split=3, halves=1, shape=(2, 2))
    assert arr.label == "split:3:1" and sorted(arr.order.tolist()) == list(range(sum(lengths)))
    arr.mask.check(sum(lengths), 4, True)
    assert arr.rank_work.sum() == pytest.approx(sum(x * (x + 1) / 2 for x in lengths))
    total, g = sum(lengths), torch.Generator().manual_seed(0)  # exact on the virtual 2x2 mesh
    q, do = (torch.randn(total, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = packed_reference(q, k, v, do, np.concatenate(([0], np.cumsum(lengths))).tolist())
    order = torch.from_numpy(arr.order)
    lay = lambda x: x.index_select(0, order).float()[None]  # noqa: E731
    res = virtual_mesh_attention(lay(q), lay(k), lay(v), (2, 2), dout=lay(do), kernel="torch", mask=arr.mask)
    got = {name: res[name][0] for name in ("out", "dq", "dk", "dv")}
    want = {name: ref[name].index_select(0, order) for name in got}
    for name, err in relative_errors(got, want).items():
        assert err <= 1e-5, (name, err)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        arrange([8, 8], 2, "diagonal")
    from megatron_mesh_cp.simulate import parse_layouts

    for bad in ("split:0", "split:-1", "split:", "tiledcut", "split:2:", "zigzag::", "zigzag::3", "split::1"):
        # (split:0 ran as zigzag, split:2: as split:2)
        with pytest.raises(ValueError, match="unknown layout"):
            parse_layouts(f"auto,{bad}")
    assert parse_layouts("split:1,tiled-cut") == ["split:1", "tiled-cut"]
    # the launcher's spellings name the simulator's fixed-count form; split:0 says K >= 1 and what keeps them whole
    with pytest.raises(ValueError, match="launcher's --mesh-layout split chooses .* split:K \\(e.g. split:2\\)"):
        parse_layouts("split")
    with pytest.raises(ValueError, match="launcher's --mesh-layout split-half .* split:K:K .*split:2:2"):
        parse_layouts("auto,split-half")
    with pytest.raises(ValueError, match="'split:0': split:K cuts the K >= 1 longest .* zigzag, balanced or tiled"):
        parse_layouts("split:0")
    for bad in ("split:3:4", "split:2:0", "split:2:3"):  # a well-formed split:K:H with H out of range names its range
        with pytest.raises(ValueError, match=f"layout '{bad}': H = .* must be 1 .. K"):
            parse_layouts(bad)
    with pytest.raises(ValueError, match="cuts 1 .. 2 documents"):
        arrange([8, 8], 2, "split", split=3)
    with pytest.raises(ValueError, match="not a multiple of 2\\*2"):
        arrange([8, 7], 2, "zigzag")
    mask = arrange([20, 4], 2, "split", split=1).mask
    with pytest.raises(ValueError, match="tile its positions"):
        type(mask)(mask.cuts, mask.docs, (0,) * len(mask.docs)).check(24, 2)


SHAPES = [s for n in (2, 4, 6, 8) for s in valid_shapes(n)] + [(2, 1, 2), (4, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layouts_exact_against_float64(shape):
    """Every layout of every mix, mesh and a2a+mesh on virtual ranks, MHA and GQA: the re-laid
    inputs give the reference's outputs and gradients re-laid, fp32 within 1e-5."""
    n = math.prod(shape)
    chunks = n // shape[0] if len(shape) == 3 else n
    total = 8 * n
    rng = random.Random(n)
    for mi, lengths in enumerate(document_mixes(total, rng)[:4]):
        h, hk = (4, 2) if mi % 2 else (4, 4)
        g = torch.Generator().manual_seed(mi)
        q, do = (torch.randn(total, h, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(total, hk, 8, generator=g, dtype=torch.float64) for _ in range(2))
        ref = packed_reference(q, k, v, do, np.concatenate(([0], np.cumsum(lengths))).tolist())
        for arr in laid_out(lengths, chunks, shape=tuple(shape[-2:])):
            order = torch.arange(total) if arr.order is None else torch.from_numpy(arr.order)
            lay = lambda x: x.index_select(0, order).float()[None]  # noqa: E731
            kw = ({"cu_seqlens": torch.tensor(arr.mask.cu, dtype=torch.int32)} if isinstance(arr.mask, Documents)
                  else {"mask": arr.mask})
            res = virtual_mesh_attention(lay(q), lay(k), lay(v), shape, dout=lay(do), kernel="torch", **kw)
            got = {name: res[name][0] for name in ("out", "dq", "dk", "dv")}
            want = {name: ref[name].index_select(0, order) for name in got}
            got["lse"], want["lse"] = res["lse"][0], ref["lse"].index_select(1, order)
            for name, err in relative_errors(got, want).items():
                assert err <= 1e-5, (shape, lengths, arr.name, name, err)


def test_split_layout_bf16_close_to_single_device_bf16():
    """bf16 inputs through the split layout: the mesh's error vs float64 stays within 1.3x the
    single-device bf16 error (one bf16 varlen call over the whole sequence)."""
    from test_documents import single_device_bf16

    total = 256
    lengths = [total // 2 + 9, 3, 40, total // 2 - 52]
    cu = np.concatenate(([0], np.cumsum(lengths))).tolist()
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(total, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = packed_reference(q, k, v, do, cu)
    base = relative_errors(single_device_bf16(q, k, v, do, cu), ref)
    for shape in ((2, 2), (1, 8), (2, 1, 2)):
        chunks = 2 if len(shape) == 3 else math.prod(shape)
        arr = arrange(lengths, chunks, "split", split=1)
        order = torch.from_numpy(arr.order)
        lay = lambda x: x.index_select(0, order).bfloat16()[None]  # noqa: E731
        res = virtual_mesh_attention(lay(q), lay(k), lay(v), shape, dout=lay(do), kernel="torch", mask=arr.mask)
        back = torch.argsort(order)  # x' -> x
        got = {name: res[name][0].index_select(0, back) for name in ("out", "dq", "dk", "dv")}
        got["lse"] = res["lse"][0].index_select(1, back)
        got = relative_errors(got, ref)
        for name in base:
            assert got[name] <= 1.3 * base[name], (shape, name, got[name], base[name])


def test_re_laid_documents_keep_no_kv_slab():
    """A lower block (Q chunk after KV chunk) of re-laid documents can need keys from its KV chunk's
    second piece, which a grouped plan's KV slab keeps apart from the first: the kernel got 0 keys
    (a floating-point exception in PyTorch's CPU op). Their plans keep every KV chunk whole; zigzag
    documents keep the slabs (their lower blocks need first pieces only), and the call is exact."""
    from megatron_mesh_cp.call import plan, resolve
    from megatron_mesh_cp.runtime.masks import arranged_of
    from megatron_mesh_cp.virtual import VirtualMesh

    # a split layout of documents [19, 1, 5, 7] on 4 chunks whose whole documents cross pieces
    cuts = (0, 1, 4, 5, 8, 9, 12, 14, 18, 20, 22, 23, 24, 26, 27, 28, 30, 31, 32)
    docs = (2, 0, 2, 0, 2, 0, 3, 0, 2, 0, 3, 1, 0, 3, 3, 0, 3, 3)
    starts = (0, 0, 1, 3, 2, 6, 2, 9, 3, 13, 4, 0, 15, 1, 5, 17, 0, 6)
    mask = arranged_of(cuts, docs, starts)
    lengths = [19, 1, 5, 7]
    origin = np.concatenate(([0], np.cumsum(lengths)))[np.asarray(docs)] + np.asarray(starts)
    order = np.concatenate([np.arange(o, o + n) for o, n in zip(origin, np.diff(cuts))])
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(32, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    cu = np.concatenate(([0], np.cumsum(lengths))).tolist()
    ref = packed_reference(q, k, v, do, cu)
    lay = lambda x: x.index_select(0, torch.from_numpy(order)).float()[None]  # noqa: E731
    mesh = VirtualMesh((1, 4))
    local = lay(q)[:, :8]  # one rank's share: what a call's planning sees
    grouped = plan(resolve(local, local, local, mesh, mask=Documents(tuple(cu))))[0]
    relaid = plan(resolve(local, local, local, mesh, mask=mask))[0]
    assert any(p.slabs for p in grouped), "the zigzag documents' plans are expected to group here"
    assert not any(p.slabs for p in relaid)
    res = virtual_mesh_attention(lay(q), lay(k), lay(v), (1, 4), dout=lay(do), kernel="torch", mask=mask)
    idx = torch.from_numpy(order)
    want = {name: ref[name].index_select(0, idx) for name in ("out", "dq", "dk", "dv")}
    for name, err in relative_errors({name: res[name][0] for name in want}, want).items():
        assert err <= 1e-5, (name, err)


#: auto's choice on a2a+mesh 8x2x16 (GQA 32/8, h100-ib400) for docs/packing.md's two sets, n = 256, 1M
#: tokens: (sample_documents arguments, label, every candidate's seconds), computed before the choice
#: was made fast (lockstep balance searches, vectorised run calls) and pinned to the bit; the split
#: entries re-pinned when their searches were cut to SPLIT_ITERS moves (runtime/layouts.py)
PINNED_CHOICES = [
    (dict(lo=4096, hi=65536, seed=0), "balanced",
     [("zigzag", 0.01848301344581818), ("balanced", 0.014601385129425454), ("split:1", 0.021994337152000002),
      ("split:2", 0.020590339034285716), ("split:3", 0.023028370190045715), ("split:4", 0.02548272532243844)]),
    (dict(lo=384, hi=512 * 1024, dist="powerlaw", seed=7), "split:3",
     [("zigzag", 0.14605884514055756), ("balanced", 0.10373177495789229), ("split:1", 0.09432291368122077),
      ("split:2", 0.09078606558261298), ("split:3", 0.08180228807716051), ("split:4", 0.08405952417488173)]),
    (dict(lo=384, hi=512 * 1024, dist="powerlaw", seed=0), "split:2",
     [("zigzag", 0.20573764553847684), ("balanced", 0.11885984132124605), ("split:1", 0.0862254126787799),
      ("split:2", 0.07355439202503239), ("split:3", 0.07660577620193558), ("split:4", 0.07833427055153627)]),
]


@pytest.mark.parametrize("draw, label, seconds", PINNED_CHOICES)
def test_layout_choice_is_pinned(draw, label, seconds):
    """choose_layout picks the same layout at the same predicted seconds as before it was made fast,
    every candidate priced to the bit, and the same again (every rank chooses alike); the split
    candidates it skips could not have won."""
    from megatron_mesh_cp.planning import (Workload, candidate_layouts, choose_layout, load_cluster, sample_documents,
                                           ulysses_inner)
    from megatron_mesh_cp.planning.bounds import full_comm_bound

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2))
    lengths = sample_documents(1 << 20, **draw).lengths
    pinned = candidate_layouts(lengths, 32, True)  # no mesh shape: the candidates before the tiled layout
    choice = choose_layout(lengths, 2, 16, cluster, inner, stride=8, candidates=pinned)
    assert [(n, s) for n, s, _ in choice.candidates] == seconds
    assert choice.seconds == dict(seconds)[label] and choice.describe().startswith(f"layout {label} ")
    # auto's own candidates: tiled and tiled-cut as well, the split ones only where their exact bound lets
    # them win
    again = choose_layout(lengths, 2, 16, cluster, inner, stride=8)
    priced = [(n, s) for n, s, _ in again.candidates if n not in ("tiled", "tiled-cut") and n.count(":") < 2]
    assert priced == seconds[:len(priced)] and again.seconds <= choice.seconds
    bound = full_comm_bound(2, 16, cluster, inner, 8)
    assert all(s >= bound for n, s in seconds if n.startswith("split"))  # the bound is one
    if len(priced) < len(seconds):  # skipped: a layout already priced is no slower than any split one
        assert min(s for _, s, _ in again.candidates) <= bound
    third = choose_layout(lengths, 2, 16, cluster, inner, stride=8)
    assert third.seconds == again.seconds and np.array_equal(third.arrangement.order, again.arrangement.order)


@pytest.mark.parametrize("kv, shape, label", [(8, (2, 16), "split:3:3"), (32, (4, 8), "split:3:3")])
def test_auto_takes_documents_over_half_rows_where_they_replay_faster(kv, shape, label):
    """docs/packing.md's heavy-tailed draw on a2a+mesh: auto prices split:K:H (the last H of the best split
    count's documents over half of each mesh row) and takes one only where its plans replay faster than
    the fastest other candidate's (the bound misses the waits its uneven tile blocks cause). Its rank
    work is balanced and every rank derives the same."""
    from megatron_mesh_cp.planning import Workload, choose_layout, load_cluster, sample_documents, ulysses_inner
    from megatron_mesh_cp.planning.layouts import _replay_seconds

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=4096, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2))
    from megatron_mesh_cp.planning.schedule import document_plans

    lengths = sample_documents(1 << 20, 384, 512 * 1024, dist="powerlaw", seed=7).lengths
    cached = document_plans.cache_info()
    choice = choose_layout(lengths, *shape, cluster, inner, stride=8)
    # the candidates' replays (split:3 and split:3:1..3 here) build their plans outside document_plans' cache
    assert document_plans.cache_info() == cached
    arr = choice.arrangement
    assert arr.label == label and arr.halves and arr.shape == shape and arr.balance < 1.05, arr.describe()
    by = {a.label: a for a in [arr]}
    names = [n for n, _, _ in choice.candidates]
    assert {"split:3:1", "split:3:2", "split:3:3"} <= set(names)
    others = {n: s for n, s, _ in choice.candidates if n.count(":") < 2}
    base = min(others, key=others.get)
    assert base == "split:3"
    from megatron_mesh_cp.runtime.layouts import arrange

    by[base] = arrange(lengths, 32, "split", split=3)
    assert _replay_seconds(arr, *shape, cluster, inner, 8) < _replay_seconds(by[base], *shape, cluster, inner, 8)
    again = choose_layout(lengths, *shape, cluster, inner, stride=8)
    assert np.array_equal(again.arrangement.order, arr.order)


def test_replaying_a_candidate_layout_leaves_the_plan_cache_as_it_was():
    """Auto's candidates that do not run would evict the plans of the layouts that do: their replays take
    document_plans' plans without its cache, to the same seconds."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import Workload, load_cluster
    from megatron_mesh_cp.planning.layouts import _replay_seconds
    from megatron_mesh_cp.planning.replay import replay
    from megatron_mesh_cp.planning.schedule import document_plans

    cluster = load_cluster("h100-ib400")
    w = Workload(seq_local=256, heads=8, kv_heads=2, head_dim=64, partial_bytes=2)
    lengths = [300, 200, 60, 120, 70, 90, 80, 104]
    for arr in (arrange(lengths, 4, "split", split=1), arrange(lengths, 4, "split", split=1, shape=(2, 2), halves=1),
                arrange(lengths, 4, "zigzag")):
        cached = document_plans.cache_info()
        seconds = _replay_seconds(arr, 2, 2, cluster, w, 1)
        assert document_plans.cache_info() == cached
        masked = replace(w, mask=arr.mask)
        assert seconds == sum(replay(p, cluster, masked, stride=1, record=None).time
                              for p in document_plans(2, 2, cluster=cluster, workload=masked, stride=1))


def test_auto_cuts_more_documents_over_half_rows_than_fit_over_every_chunk():
    """A heavy-tailed draw with two documents of ~390K (seed 49): split:2 does not fit (the second
    document's pair fits neither half of a chunk beside the first's), so the best count over every chunk
    is 1; auto also prices split:2:2 .. split:4:4 (every split document over half rows), takes split:2:2,
    and its plans replay faster than the best other candidate's (tiled)."""
    from megatron_mesh_cp.planning import Workload, choose_layout, load_cluster, sample_documents, ulysses_inner
    from megatron_mesh_cp.planning.layouts import _replay_seconds, tile_weights

    cluster = load_cluster("h100-ib400")
    inner = ulysses_inner(8, Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2))
    lengths = sample_documents(1 << 20, 384, 512 * 1024, dist="powerlaw", seed=49).lengths
    with pytest.raises(ValueError, match="do not fit"):
        arrange(lengths, 32, "split", split=2)
    choice = choose_layout(lengths, 2, 16, cluster, inner, stride=8)
    names = [n for n, _, _ in choice.candidates]
    assert "split:2" not in names and {"split:1", "split:1:1", "split:2:2", "split:3:3"} <= set(names), names
    assert choice.arrangement.label == "split:2:2", choice.describe()
    others = {n: s for n, s, _ in choice.candidates if n.count(":") < 2}
    assert min(others, key=others.get) == "tiled"
    tiled = arrange(lengths, 32, "tiled", shape=(2, 16), weights=tile_weights(inner, cluster))
    assert (_replay_seconds(choice.arrangement, 2, 16, cluster, inner, 8)
            < _replay_seconds(tiled, 2, 16, cluster, inner, 8))


def test_candidates_search_in_lockstep_as_one_by_one():
    """arrange_whole and arrange_splits (the split searches in lockstep) build exactly what arrange builds
    one layout at a time: runs, work and mask, for documents of every mix."""
    from megatron_mesh_cp.planning import sample_documents
    from megatron_mesh_cp.runtime.layouts import arrange_splits, arrange_whole

    draws = [sample_documents(1 << 16, 64, 8192, seed=3).lengths,
             sample_documents(1 << 16, 16, 1 << 15, dist="powerlaw", seed=1).lengths]
    for lengths in draws + document_mixes(1 << 12, random.Random(2)):
        for chunks, causal in ((8, True), (16, False)):
            got = arrange_whole(lengths, chunks, causal=causal) + arrange_splits(lengths, chunks, 4, causal=causal)
            want = laid_out(lengths, chunks, causal)[:2]
            for k in range(1, 5):
                try:
                    want.append(arrange(lengths, chunks, "split", split=k, causal=causal))
                except ValueError:
                    break
            for k in (3,) if causal else ():  # the last h of k split over half of each row of a 2 x 4 mesh
                shape = (2, chunks // 2)
                halves = [h for h in range(1, k + 1)]
                got += arrange_splits(lengths, chunks, k, causal=causal, shape=shape, halves=[(k, h) for h in halves])
                for h in halves:
                    try:
                        want.append(arrange(lengths, chunks, "split", split=k, causal=causal, shape=shape, halves=h))
                    except ValueError:
                        pass
            assert [(g.name, g.split, g.halves) for g in got] == [(w.name, w.split, w.halves) for w in want]
            for g, w in zip(got, want):
                assert all(np.array_equal(x, y) for x, y in zip(g.runs, w.runs)) and np.array_equal(g.work, w.work)
                assert g.mask == w.mask


def test_a_layout_encoded_for_the_step_decodes_to_itself():
    """What the data loader hands the step (runtime/layouts.encode) decodes to the same layout, only for
    the micro-batch it was made for; the launcher's dataset attaches it to each sample (picklable for
    the loader's workers)."""
    import pickle

    from megatron_mesh_cp.megatron.layout import AHEAD_FIELDS, LaidOutDataset, LayoutPolicy, _choice_of
    from megatron_mesh_cp.planning import Workload, load_cluster
    from megatron_mesh_cp.runtime.layouts import decode, encode

    lengths = [300, 7, 9, 64, 33, 1, 2] + [4] * 38
    lengths.append(1024 - sum(lengths))
    cut = arrange(lengths, 8, "tiled-cut", shape=(2, 4), weights=(1.0, 0.1, 0.1, 1.0))
    relaid = laid_out(lengths, 8, shape=(2, 4)) + [cut]
    assert any(arr.halves for arr in relaid)
    for arr in relaid:
        back = decode(*encode(arr), lengths, 8)
        assert back.cut == arr.cut and back.halves == arr.halves and back.label == arr.label
        assert (back.name, back.split, back.given, back.shape, back.mask) == (arr.name, arr.split, arr.given, arr.shape,
                                                                              arr.mask)
        assert np.array_equal(back.work, arr.work) and back.balance == arr.balance
        assert (arr.order is None and back.order is None) or np.array_equal(arr.order, back.order)
        with pytest.raises(ValueError, match="does not lay out this micro-batch"):
            decode(*encode(arr), lengths[1:] + [lengths[0]], 8)

    w = Workload(seq_local=128, heads=4, kv_heads=4, head_dim=64)
    ds = pickle.loads(pickle.dumps(LaidOutDataset(_Tokens(lengths), LayoutPolicy("auto", 8, (2, 4), load_cluster("h100-ib400"),
                                                                          w), eod=0)))
    assert ds.split == "train" and len(ds) == 2
    sample = ds[0]
    arr = decode(sample["mesh_layout"], sample["mesh_layout_work"].numpy(), lengths, 8)
    choice = _choice_of(arr, sample["mesh_layout_report"].tolist())
    assert choice is not None and choice.host_seconds > 0 and {n for n, _, _ in choice.candidates} >= {"zigzag", "tiled"}
    assert set(AHEAD_FIELDS) <= set(sample)


class _Tokens(torch.utils.data.Dataset):
    """Samples of documents ``lengths``, each ending with the EOD token 0 (as Megatron's GPTDataset's)."""

    split = "train"

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return 2

    def __getitem__(self, i):
        t = torch.arange(1, sum(self.lengths) + 1) % 97 + 1
        t[torch.tensor(np.cumsum(self.lengths)[:-1] - 1)] = 0
        return {"tokens": t}


def test_an_inconsistent_layout_code_is_refused():
    """decode refuses a code whose header contradicts its runs (given, kind, split, mesh)."""
    from megatron_mesh_cp.runtime.layouts import decode, encode

    lengths = [40, 3, 5, 9, 7] + [2] * 10
    lengths.append(128 - sum(lengths))
    arr = arrange(lengths, 4, "balanced")
    code, work = encode(arr)
    for field, value in ((3, 1 - int(arr.given)), (1, 2), (4, 2)):  # given, split on a whole layout, a mesh
        bad = code.copy()
        bad[field] = value
        with pytest.raises(ValueError, match="inconsistent"):
            decode(bad, work, lengths, 4)
    halves = arrange(lengths, 4, "split", split=2, shape=(2, 2), halves=1)
    code, work = encode(halves)
    for field, value in ((6, 3), (4, 0), (4, 1)):  # more halves than split documents, no mesh, an odd one
        bad = code.copy()
        bad[field] = value
        if field == 4 and value == 1:
            bad[5] = 4
        with pytest.raises(ValueError, match="inconsistent"):
            decode(bad, work, lengths, 4)


def test_label_ids_have_room_for_every_layout_name():
    """auto's report packs a candidate as its name's index + LABEL_BASE x its split count: a name for every
    layout, the same ids as before (base 8), and an import-time error if LAYOUT_CHOICES outgrows the base."""
    from megatron_mesh_cp.megatron import layout

    assert layout.LABEL_BASE == 8 and len(layout.LAYOUT_CHOICES) <= layout.LABEL_BASE
    assert layout._label_id("zigzag") == 1 and layout._label_id("split:3") == 5 + 8 * 3
    assert layout._label_id("split:3:2") == 5 + 8 * (3 + 64 * 2)
    for label in list(layout.LAYOUT_CHOICES) + ["split:1", "split:4", "split:4:1", "split:3:3"]:
        assert layout._label_of(layout._label_id(label)) == label
    with pytest.raises(RuntimeError, match="9 layout names .* raise LABEL_BASE"):
        layout._check_label_base(tuple(f"l{i}" for i in range(9)))


def test_each_of_several_validation_sets_is_laid_out(monkeypatch):
    """Megatron's multiple_validation_sets builds the valid split as a list of datasets: each is wrapped (a
    LaidOutDataset of a list would index the list, not a sample)."""
    from megatron_mesh_cp.megatron import layout

    monkeypatch.setattr(layout, "policy", lambda args: layout.LayoutPolicy("zigzag", 8, (2, 4)))
    train, v1, v2 = _Tokens([512, 512]), _Tokens([1000, 24]), _Tokens([1024])
    got = layout.wrap_datasets([train, [v1, v2], None], None, eod=0)
    assert isinstance(got[0], layout.LaidOutDataset) and got[0].dataset is train and got[2] is None
    assert isinstance(got[1], list) and [d.dataset for d in got[1]] == [v1, v2]
    assert all(isinstance(d, layout.LaidOutDataset) and "mesh_layout" in d[0] for d in got[1])


def test_a_tiled_cut_layout_in_the_given_order_decodes():
    """tiled-cut of one document (or of documents the tiled order leaves in their order, none re-laid)
    has runs equal to the documents as given, so it is ``given`` (x' is x) and the data loader's code of
    it decodes (it raised 'a token layout's code is inconsistent (tiled-cut, ...given 0...)': review h48)."""
    from megatron_mesh_cp.runtime.layouts import decode, encode

    for lengths in ([64], [64 * 1024]):
        arr = arrange(lengths, 4, "tiled-cut", shape=(2, 2))
        back = decode(*encode(arr), lengths, 4)
        assert back.name == "tiled-cut" and back.mask == arr.mask and arr.given and back.given and arr.order is None
