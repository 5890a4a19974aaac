"""Ready order (planning/ready.py): pruned plans re-ordered by when their chunks are ready run
exactly (fp32 within 1e-5 of float64, forward and backward), validate, move the same bytes as the
pruned order, and are the plans the simulator replays."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from megatron_mesh_cp.planning import UnpaddedDocuments, Workload, load_cluster
from megatron_mesh_cp.planning.costs import ulysses_inner
from megatron_mesh_cp.planning.documents import sample_documents
from megatron_mesh_cp.planning.layouts import resolve_layout
from megatron_mesh_cp.planning.ready import MAX_RANK_OPS, ready_orders, reorder
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning.schedule import call_plans, default_cluster, document_plans
from megatron_mesh_cp.reference import packed_reference, relative_errors
from megatron_mesh_cp.runtime.mesh import PlanOptions
from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic, validate
from megatron_mesh_cp.runtime.topology import valid_shapes
from megatron_mesh_cp.virtual import VirtualMesh, virtual_mesh_attention
from test_documents import document_sets

H100 = load_cluster("h100-ib400")


def _lengths(cu):
    return tuple(b - a for a, b in zip(cu[:-1], cu[1:]))


def _layer(cu, n, heads=4, kv_heads=2):
    return Workload(seq_local=cu[-1] // n, heads=heads, kv_heads=kv_heads, head_dim=8, bytes_per_element=4,
                    partial_bytes=4, mask=UnpaddedDocuments(_lengths(cu)))


def _both(a, b, layer, **kw):
    """(pruned, re-ordered) plans of one masked layer."""
    return (document_plans(a, b, cluster=default_cluster(), workload=layer, reorder=False, **kw),
            document_plans(a, b, cluster=default_cluster(), workload=layer, reorder=True, **kw))


@pytest.mark.parametrize("n", [4, 6, 8])
def test_forced_ready_orders_validate_keep_the_ops_and_bytes(n):
    rng = random.Random(n)
    dims = ChunkDims(1, 16 * n, 4, 2, 8, torch.float32)
    moved = 0
    for a, b in valid_shapes(n):
        for cu in document_sets(n, rng):
            for pruned, ready in zip(*_both(a, b, _layer(cu, n))):
                validate(ready)
                assert sorted(map(repr, ready.ops)) == sorted(map(repr, pruned.ops))
                assert ready.tile == pruned.tile and ready.slabs == pruned.slabs
                assert plan_traffic(ready, dims) == plan_traffic(pruned, dims)
                moved += ready.ops != pruned.ops
    assert moved  # some plans really are re-ordered


SHAPES = [(2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_reordered_plans_exact_against_float64(shape):
    """The executor runs the forced re-ordered plans (the simulator's, op for op): fp32 forward and
    backward within 1e-5 of float64, MHA and GQA, and its byte counters are plan_traffic of them,
    which is the pruned order's."""
    n = math.prod(shape)
    u = shape[0] if len(shape) == 3 else 1
    a, b = shape[-2:]
    rng = random.Random(n * 7 + len(shape))
    g = torch.Generator().manual_seed(n)
    moved = 0
    for s, cu in enumerate(document_sets(n, rng)):
        for heads, kv_heads in ((4, 2), (4, 4)) if s == 0 else ((4, 2),):
            t = cu[-1]
            q, k, v, do = (torch.randn(t, x, 8, generator=g, dtype=torch.float64)
                           for x in (heads, kv_heads, kv_heads, heads))
            ref = packed_reference(q, k, v, do, cu, causal=True)
            mesh = VirtualMesh(shape, PlanOptions(reorder=True))
            res = virtual_mesh_attention(*(x.float()[None] for x in (q, k, v)), mesh, dout=do.float()[None],
                                         cu_seqlens=torch.tensor(cu, dtype=torch.int32), kernel="torch")
            got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
            for name, err in relative_errors(got, ref).items():
                assert err <= 1e-5, (shape, heads, kv_heads, cu, name, err)
            inner = ulysses_inner(u, _layer(cu, n, heads, kv_heads))
            pruned, ready = _both(a, b, inner, stride=u)
            assert [p.ops for p in res["plans"]] == [p.ops for p in ready]
            for p in res["plans"]:
                validate(p)
            moved += any(p.ops != q.ops for p, q in zip(ready, pruned))
            if u == 1:
                dims = ChunkDims(1, t // n, heads, kv_heads, 8, torch.float32)
                want = {**plan_traffic(pruned[0], dims), **plan_traffic(pruned[1], dims)}
                assert {**plan_traffic(ready[0], dims), **plan_traffic(ready[1], dims)} == want
                assert all(dict(tr.sent) == want for tr in res["traffic"]), (shape, cu)
    assert moved or shape in ((4, 1),), shape  # the re-ordered plans did run


def _target(u, layout="tiled"):
    """The issue's case (1M tokens of 4K-64K documents on 256 ranks, GQA 32/8) inside a2a groups of u
    on the 2 x 16 mesh (u=8), or all 256 ranks as one mesh (u=1)."""
    docs = sample_documents(1 << 20, 4096, 65536, seed=0).with_layout(layout)
    w = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2, mask=docs)
    return resolve_layout(ulysses_inner(u, w), 2, 16, H100, u) if u > 1 else w


def test_auto_keeps_the_faster_order_and_the_simulator_replays_it():
    """reorder=None keeps whichever order the replay scores faster (never slower than pruning's), and
    the executor's plans are document_plans' (the simulator's) for the same documents."""
    w = _target(8)
    from megatron_mesh_cp.planning.cluster import workload_dims
    from megatron_mesh_cp.planning.schedule import build_plans
    from megatron_mesh_cp.runtime.memory import peak_live_bytes

    dims = workload_dims(w)
    full = build_plans(2, 16, cluster=H100, workload=w.unmasked, stride=8, max_live=35, chains="both-ways")
    for pruned, auto, f in zip(*(document_plans(2, 16, cluster=H100, workload=w, stride=8, max_live=35, reorder=r)
                                 for r in (False, None)), full):
        assert replay(auto, H100, w, stride=8).time <= replay(pruned, H100, w, stride=8).time
        validate(auto, max_live=35)  # within the limit and the pool the full plans were sized by
        assert peak_live_bytes(auto, dims) <= peak_live_bytes(f, dims)
        assert auto.tile == pruned.tile
    fwd, bwd = document_plans(2, 16, cluster=H100, workload=w, stride=8, max_live=35)
    assert fwd.name.endswith("+ready") or bwd.name.endswith("+ready")  # the target case re-orders


def test_host_cost_is_bounded_and_large_plans_keep_the_pruned_order():
    """The ready order of a 2x16 mesh costs a few ms of host time (one thread); plans over
    MAX_RANK_OPS rank-ops (Ring 1x256) are not re-ordered unless forced."""
    w32 = _target(8)
    full = call_plans(2, 16, workload=w32.unmasked, cluster=H100, stride=8, max_live=35, keep=w32.needed(2, 16),
                      masked=True, slabs=w32.blocks(32).zigzag_keys)
    t0 = time.process_time()
    for p in full:
        reorder(p, H100, w32, stride=8, max_live=35)
    assert time.process_time() - t0 < 0.05
    w256 = resolve_layout(_target(1, "balanced"), 1, 256, H100)
    ring = call_plans(1, 256, workload=w256.unmasked, cluster=H100, keep=w256.needed(1, 256), masked=True,
                      slabs=w256.blocks(256).zigzag_keys)
    for p in ring:
        assert 256 * len(p.ops) > MAX_RANK_OPS
        assert reorder(p, H100, w256) is p


def test_the_executors_masked_layer_gives_the_simulators_plans():
    """call.py re-orders for the layer with the runtime's mask (Documents of cu_seqlens), the simulator for
    its UnpaddedDocuments: the same documents give the same (re-ordered) plans, op for op."""
    from dataclasses import replace

    from megatron_mesh_cp.runtime.masks import Documents
    from megatron_mesh_cp.runtime.topology import MeshShape

    docs = sample_documents(1 << 20, 4096, 65536, seed=0)
    cu = [0]
    for x in docs.lengths:
        cu.append(cu[-1] + x)
    base = Workload(seq_local=32768, heads=4, kv_heads=1, head_dim=128, partial_bytes=2)
    blocks = Documents(tuple(cu)).bind(32, cu[-1], True)
    got = [call_plans(2, 16, workload=base, cluster=H100, stride=8, max_live=35, keep=blocks.needed(MeshShape(2, 16)),
                      masked=True, slabs=blocks.zigzag_keys, layer=layer)
           for layer in (replace(base, mask=docs), replace(base, mask=Documents(tuple(cu))))]
    assert [p.ops for p in got[0]] == [p.ops for p in got[1]]
    assert any(p.name.endswith("+ready") for p in got[0])  # the re-order is in play


@pytest.mark.parametrize("shape", [(2, 4), (1, 8), (2, 1, 4)], ids=["2x4", "1x8", "2x1x4"])
def test_reordered_window_and_documents_exact_against_float64(shape):
    """A sliding window over documents (pruned plans of their intersection), re-ordered by force: fp32
    within 1e-5 of float64 forward and backward."""
    from megatron_mesh_cp.reference import variant_reference

    n = math.prod(shape)
    cu = [0, 5, 40, 43, 80, 81, 16 * n]
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(cu[-1], x, 8, generator=g, dtype=torch.float64) for x in (4, 2, 2, 4))
    ref = variant_reference(q, k, v, do, cu, causal=True, window=(7, 0))
    res = virtual_mesh_attention(*(x.float()[None] for x in (q, k, v)), VirtualMesh(shape, PlanOptions(reorder=True)),
                                 dout=do.float()[None], cu_seqlens=torch.tensor(cu, dtype=torch.int32), window=(7, 0),
                                 kernel="torch")
    got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
    for name, err in relative_errors(got, {x: ref[x] for x in got}).items():
        assert err <= 1e-5, (shape, name, err)
    assert any(p.name.endswith("+ready") for p in res["plans"])
    for p in res["plans"]:
        validate(p)


@pytest.mark.parametrize("slabs", [True, False], ids=["slabs", "no-slabs"])
def test_the_ready_orders_room_is_the_full_plans_pool_in_the_form_that_runs(monkeypatch, slabs):
    """The pool a re-ordered plan must fit is the full plan's peak bytes as the call runs it: without
    KV slabs where the mask needs that (split layouts), not the slab form's smaller pool."""
    from megatron_mesh_cp.planning import schedule
    from megatron_mesh_cp.planning.cluster import workload_dims
    from megatron_mesh_cp.runtime.memory import peak_live_bytes
    from megatron_mesh_cp.runtime.prune import without_slabs

    docs = sample_documents(1 << 17, 512, 8192, seed=0).with_layout("balanced")
    w = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128, partial_bytes=2, mask=docs)  # plans with slabs
    rooms, real = [], schedule.scored_reorder
    monkeypatch.setattr(schedule, "scored_reorder", lambda plan, *a, room=None, **kw: (rooms.append(room),
                                                                                      real(plan, *a, room=room, **kw))[1])
    full = schedule.build_plans(2, 16, cluster=H100, workload=w.unmasked, stride=8, chains="both-ways")
    call_plans(2, 16, workload=w.unmasked, cluster=H100, stride=8, keep=w.needed(2, 16), masked=True, slabs=slabs,
               layer=w, reorder=True)
    dims = workload_dims(w)
    want = [peak_live_bytes(p if slabs else without_slabs(p), dims) for p in full]
    assert rooms[:2] == want
    assert any(p.slabs for p in full) and (slabs or want != [peak_live_bytes(p, dims) for p in full])
