"""Order search (planning/search.py): searched plans validate, keep the pruned plan's ops and bytes,
never replay slower, come out the same on every call, run exactly (fp32 within 1e-5 of float64,
forward and backward, MHA and GQA), and are the plans the simulator replays."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_mesh_cp.planning import UnpaddedDocuments, Workload, load_cluster, simulate_algorithm
from megatron_mesh_cp.planning.costs import ulysses_inner
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning.schedule import (call_plans, default_cluster, document_plans, orders_ahead,
                                                 uncached_document_plans)
from megatron_mesh_cp.planning.search import MAX_BUDGET, search_order
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.runtime.mesh import PlanOptions
from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic, validate
from megatron_mesh_cp.runtime.topology import valid_shapes
from megatron_mesh_cp.virtual import VirtualMesh, virtual_mesh_attention
from test_documents import document_sets


def _layer(cu, n, heads=4, kv_heads=2):
    lengths = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
    return Workload(seq_local=cu[-1] // n, heads=heads, kv_heads=kv_heads, head_dim=8, bytes_per_element=4,
                    partial_bytes=4, mask=UnpaddedDocuments(lengths))


@pytest.mark.parametrize("n", [4, 6, 8])
def test_searched_plans_keep_the_ops_and_bytes_and_never_replay_slower(n):
    rng = random.Random(n)
    cl = default_cluster()
    dims = ChunkDims(1, 16 * n, 4, 2, 8, torch.float32)
    moved = 0
    for a, b in valid_shapes(n):
        for cu in document_sets(n, rng):
            w = _layer(cu, n)
            plain = document_plans(a, b, cluster=cl, workload=w)
            searched = uncached_document_plans(a, b, cluster=cl, workload=w, search=12)
            assert searched == uncached_document_plans(a, b, cluster=cl, workload=w, search=12)  # deterministic
            for p, s in zip(plain, searched):
                validate(s)
                assert sorted(map(repr, s.ops)) == sorted(map(repr, p.ops))
                assert s.tile == p.tile and s.slabs == p.slabs
                assert plan_traffic(s, dims) == plan_traffic(p, dims)
                assert replay(s, cl, w).time <= replay(p, cl, w).time
                moved += s.ops != p.ops
    assert moved  # some plans really are re-ordered


def test_no_budget_is_the_plan_itself_and_a_negative_one_is_refused():
    n, cu = 4, (0, 10, 30, 64)
    w, cl = _layer(cu, n), default_cluster()
    plans = document_plans(2, 2, cluster=cl, workload=w)
    assert document_plans(2, 2, cluster=cl, workload=w, search=0) == plans
    assert search_order(plans[1], cl, w, budget=0)[1] is plans[1]
    with pytest.raises(ValueError, match="replays"):
        search_order(plans[1], cl, w, budget=-1)
    with pytest.raises(ValueError, match="replays per phase of the order search"):
        call_plans(2, 2, workload=w.unmasked, cluster=cl, search=-1)
    for bad in (-1, True, 2.0, MAX_BUDGET + 1):
        with pytest.raises(ValueError, match="replays per phase of the order search"):
            PlanOptions(search=bad)
    with pytest.raises(ValueError, match="over the cap"):
        search_order(plans[1], cl, w, budget=MAX_BUDGET + 1)
    PlanOptions(search=MAX_BUDGET)  # the cap itself is a budget
    with pytest.raises(ValueError, match="reorder=False"):
        PlanOptions(search=4, reorder=False)
    with pytest.raises(ValueError, match="reorder=False"):
        call_plans(2, 2, workload=w.unmasked, cluster=cl, search=4, reorder=False)


@pytest.mark.parametrize("algo,shape", [("passq", (8, 1)), ("ring-pruned", (1, 8)), ("mesh:2x4", (2, 4))])
def test_the_simulator_replays_the_searched_plans(algo, shape):
    """simulate_algorithm(..., search=N) is the replay of the searched plans, for every algorithm it takes it."""
    rng = random.Random(3)
    cl = default_cluster()
    searched_some = False
    for cu in document_sets(8, rng):
        w = _layer(cu, 8)
        plans = document_plans(*shape, cluster=cl, workload=w, search=40)
        want = sum(replay(p, cl, w).time for p in plans)
        assert simulate_algorithm(algo, 8, cl, w, search=40).time == pytest.approx(want, rel=1e-12)
        searched_some |= want < sum(replay(p, cl, w).time for p in document_plans(*shape, cluster=cl, workload=w))
    assert searched_some, algo


def test_the_simulator_refuses_a_search_it_would_not_run():
    w = Workload(seq_local=64, heads=4, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="search re-orders"):
        simulate_algorithm("a2a+mesh", 4, default_cluster(), w, search=4)  # no mask: no pruned plans
    docs = Workload(seq_local=16, heads=4, kv_heads=2, head_dim=8, mask=UnpaddedDocuments((10, 20, 34)))
    with pytest.raises(ValueError, match="search re-orders"):
        simulate_algorithm("mesh-naive", 4, default_cluster(), docs, search=4)


def test_the_simulate_command_says_its_plans_were_searched(capsys):
    from megatron_mesh_cp.simulate import main

    argv = ["--cp", "8", "--seq", "32K", "--docs", "1K-8K", "--algos", "mesh", "--no-unpacked"]
    assert main(argv + ["--plan-search", "4"]) == 0
    assert "plans searched: " in capsys.readouterr().out
    assert main(argv) == 0
    assert "plans searched" not in capsys.readouterr().out
    for bad, match in ((argv + ["--plan-search", "-1"], "N >= 0"), (argv[:4] + ["--plan-search", "4"], "give --docs")):
        assert main(bad) == 2
        assert match in capsys.readouterr().err, bad


SHAPES = [(2, 2), (1, 4), (2, 3), (2, 4), (2, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_searched_plans_exact_against_float64(shape):
    """The executor runs the searched plans (the simulator's, op for op): fp32 forward and backward
    within 1e-5 of float64, MHA and GQA; its byte counters are plan_traffic of them."""
    n = math.prod(shape)
    u = shape[0] if len(shape) == 3 else 1
    a, b = shape[-2:]
    rng = random.Random(n * 11 + len(shape))
    g = torch.Generator().manual_seed(n)
    moved = 0
    for s, cu in enumerate(document_sets(n, rng)[:3]):
        for heads, kv_heads in ((4, 2), (4, 4)) if s == 0 else ((4, 2),):
            t = cu[-1]
            q, k, v, do = (torch.randn(t, x, 8, generator=g, dtype=torch.float64)
                           for x in (heads, kv_heads, kv_heads, heads))
            ref = packed_reference(q, k, v, do, cu, causal=True)
            mesh = VirtualMesh(shape, PlanOptions(search=40))
            res = virtual_mesh_attention(*(x.float()[None] for x in (q, k, v)), mesh, dout=do.float()[None],
                                         cu_seqlens=torch.tensor(cu, dtype=torch.int32), kernel="torch")
            got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
            for name, err in relative_errors(got, ref).items():
                assert err <= 1e-5, (shape, heads, kv_heads, cu, name, err)
            inner = ulysses_inner(u, _layer(cu, n, heads, kv_heads))
            want = document_plans(a, b, cluster=default_cluster(), workload=inner, stride=u, search=40)
            assert [p.ops for p in res["plans"]] == [p.ops for p in want]
            plain = document_plans(a, b, cluster=default_cluster(), workload=inner, stride=u)
            moved += any(p.ops != q.ops for p, q in zip(want, plain))
            if u == 1:
                dims = ChunkDims(1, t // n, heads, kv_heads, 8, torch.float32)
                sent = {**plan_traffic(want[0], dims), **plan_traffic(want[1], dims)}
                assert all(dict(tr.sent) == sent for tr in res["traffic"]), (shape, cu)
    assert moved, shape  # the searched plans did run


def test_orders_found_ahead_are_taken_for_the_same_plans_and_checked():
    """The launcher's data loader searches ahead (orders_ahead); the step, given those orders, takes them
    for the plans with the same digest -- the plans a search there gives -- and searches only the others."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import search
    from megatron_mesh_cp.runtime.masks import Documents
    from megatron_mesh_cp.runtime.plan import PlanError
    from megatron_mesh_cp.runtime.topology import MeshShape

    cu = (0, 10, 40, 41, 90, 128)
    w, mask = _layer(cu, 8).unmasked, Documents(cu)
    blocks = mask.bind(8, 128, True)
    kw = dict(workload=w, keep=blocks.needed(MeshShape(2, 4)), masked=True, slabs=blocks.zigzag_keys,
              layer=replace(w, mask=mask))
    codes = orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=40)
    here = call_plans(2, 4, search=40, **kw)
    before = dict(search.SEARCHES)
    assert search.remember_encoded(codes) == 2
    assert call_plans(2, 4, search=40, **kw) == here  # the orders found ahead are the search's
    assert search.SEARCHES["ahead"] == before.get("ahead", 0) + 2 and search.SEARCHES["here"] == before.get("here", 0)
    assert orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=0).size == 0
    with pytest.raises(ValueError, match="cut short"):
        search.remember_encoded(codes[:-1])
    for cut in (codes[:1], codes[:3 + int(codes[1])]):  # a digest alone, without its length
        with pytest.raises(ValueError, match="cut short"):
            search.remember_encoded(cut)
    base = call_plans(2, 4, **kw)[1]
    inputs = search.search_inputs(default_cluster(), kw["layer"], 1, None)
    key = search.digest(base, mask, 40, inputs)
    assert key != search.digest(base, mask, 41, inputs) and key != search.digest(base, Documents((0, 64, 128)), 40, inputs)
    assert int(codes[0]) in (key, search.digest(call_plans(2, 4, **kw)[0], mask, 40, inputs))  # the step's own key
    # orders found for other inputs (another cost model, another live-chunk limit) are a miss: searched here, counted
    for other in (dict(cluster=load_cluster("a100-ib200")), dict(max_live=64)):
        search.forget()
        before = dict(search.SEARCHES)
        search.remember_encoded(orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=40, **other))
        assert call_plans(2, 4, search=40, **kw) == here, other
        assert search.SEARCHES["ahead"] == before.get("ahead", 0) and search.SEARCHES["here"] == before.get("here", 0) + 2
    try:
        search.remember(key, list(range(len(base.ops) - 1)))  # not an order of its ops
        with pytest.raises(PlanError, match="does not re-order"):
            call_plans(2, 4, search=40, **kw)
        search.remember(key, list(range(len(base.ops)))[::-1])  # its ops, backwards: invalid
        with pytest.raises(PlanError):
            call_plans(2, 4, search=40, **kw)
    finally:
        search.forget()


def test_the_simulate_command_searches_a_windows_plans(capsys):
    """simulate --plan-search N --window: the window's pruned plans searched (no documents needed), and a budget
    over the cap refused with exit 2."""
    from megatron_mesh_cp.simulate import main

    base = ["--cp", "8", "--seq", "16K", "--heads", "4", "--kv-heads", "2", "--window", "512,0", "--algos", "mesh:2x4"]
    assert main(base + ["--plan-search", "20"]) == 0
    out = capsys.readouterr().out
    assert "plans searched" in out and "20 replays per phase" in out
    assert main(base + ["--plan-search", str(MAX_BUDGET + 1)]) == 2
    assert "over the cap" in capsys.readouterr().err


def test_the_loader_searches_the_plans_the_call_makes_under_mla():
    """The launcher's data loader searches the plans of megatron/cp_layer.attention_workload (layout.policy's
    layer); the step takes those orders only for the plans it makes itself. Under MLA the call's head dims are
    q/k qk_head_dim + qk_pos_emb_head_dim and v v_head_dim: the loader's layer now has them (it had kv_channels
    or hidden / heads for both, so no order found ahead matched and every plan was searched again in the step)."""
    from argparse import Namespace

    from megatron_mesh_cp.call import plan, resolve
    from megatron_mesh_cp.megatron.cp_layer import attention_workload
    from megatron_mesh_cp.planning import search
    from megatron_mesh_cp.runtime.masks import Documents

    cu, n, heads = (0, 10, 40, 41, 90, 128), 8, 4
    args = Namespace(context_parallel_size=n, tensor_model_parallel_size=1, num_attention_heads=heads,
                     num_query_groups=None, group_query_attention=False, bf16=True, fp16=False, seq_length=cu[-1],
                     kv_channels=None, hidden_size=64, micro_batch_size=1, mesh_partial_dtype="fp32",
                     multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
    w, mask = attention_workload(args), Documents(cu)
    assert (w.head_dim, w.dv) == (24, 16)
    mesh = VirtualMesh((2, 4), plan_options=PlanOptions(search=40))
    q, k = (torch.empty(1, cu[-1] // n, heads, 24, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, cu[-1] // n, heads, 16, dtype=torch.bfloat16)
    spec = resolve(q, k, v, mesh, mask=mask)
    search.forget()
    try:
        assert search.remember_encoded(orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=40)) == 2
        before = dict(search.SEARCHES)
        plan(spec)
        assert search.SEARCHES["ahead"] == before.get("ahead", 0) + 2, dict(search.SEARCHES)
        assert search.SEARCHES["here"] == before.get("here", 0), dict(search.SEARCHES)
    finally:
        search.forget()


def test_a_plan_the_search_cannot_move_is_not_counted_as_searched_in_the_step():
    """searched() counts "here" only where search_order could move something: a 1x1 mesh's plan (one block, no
    transfer) under a budget was counted, so the end-of-run log overstated the searches run in the step."""
    from megatron_mesh_cp.planning import search

    n, cu = 1, (0, 10, 30, 64)
    w, cl = _layer(cu, n), default_cluster()
    plan = document_plans(1, 1, cluster=cl, workload=w)[0]
    before = dict(search.SEARCHES)
    assert search.searched(plan, cl, w, budget=50) is plan
    assert search.SEARCHES["here"] == before.get("here", 0)
    moving = document_plans(2, 2, cluster=cl, workload=_layer(cu, 4))[0]
    search.searched(moving, cl, _layer(cu, 4), budget=4)
    assert search.SEARCHES["here"] == before.get("here", 0) + 1


def test_orders_ahead_hands_on_no_order_for_a_plan_the_search_cannot_move(monkeypatch):
    """A plan over the ready order's host-cost cap (ready.MAX_RANK_OPS, e.g. Ring 1 x 256) is not searched: the step
    does not count it as searched there (65efdd1), and the data loader must not hand its unchanged order on either,
    or the step counted it as an order found ahead ("plan_searches_ahead") though no search ran."""
    from dataclasses import replace

    from megatron_mesh_cp.planning import ready, search
    from megatron_mesh_cp.runtime.masks import Documents
    from megatron_mesh_cp.runtime.topology import MeshShape

    cu = (0, 10, 40, 41, 90, 128)
    w, mask = _layer(cu, 8).unmasked, Documents(cu)
    blocks = mask.bind(8, 128, True)
    kw = dict(workload=w, keep=blocks.needed(MeshShape(2, 4)), masked=True, slabs=blocks.zigzag_keys,
              layer=replace(w, mask=mask))
    assert search.remember_encoded(orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=40)) == 2  # searchable
    monkeypatch.setattr(ready, "MAX_RANK_OPS", 1)  # every plan over the cap
    search.forget()
    try:
        assert search.remember_encoded(orders_ahead(2, 4, "greedy", workload=w, mask=mask, budget=40)) == 0
        before = dict(search.SEARCHES)
        call_plans(2, 4, search=40, **kw)
        assert dict(search.SEARCHES) == before, (dict(search.SEARCHES), before)
    finally:
        search.forget()
