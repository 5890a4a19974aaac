"""Rank functions for the ``a2a+mesh`` tests: Ulysses x mesh on real gloo groups, and Megatron's groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mesh_cp import MeshGroups, mesh_attention, zigzag_shard
from rank_groups import megatron_task, released_groups
from rank_tasks import DTYPES, QUANTITIES, _sq, make_inputs, reference, single_device_errors


def hybrid_mesh(ctx, shape) -> MeshGroups:
    """MeshGroups for ``(u, a, b)`` over the world, built once per process."""
    key = ("hybrid", tuple(shape))
    if key not in ctx.cache:
        u, a, b = shape
        ctx.cache[key] = MeshGroups.create((a, b), ulysses=u)
    return ctx.cache[key]


def build_meshes(ctx, shapes) -> None:
    """Create the groups of every shape (a cheap first call: process start-up and group creation
    get their own answer timeout, apart from the runs)."""
    for shape in shapes:
        hybrid_mesh(ctx, shape)


def _run(mesh, q, k, v, do, case):
    n, g = mesh.size, mesh.position
    dtype = DTYPES[case["dtype"]]
    lq, lk, lv, ldo = (zigzag_shard(x, n, g, dim=1).to(dtype) for x in (q, k, v, do))
    if case["layout"] == "sbhd":
        lq, lk, lv, ldo = (x.transpose(0, 1).contiguous() for x in (lq, lk, lv, ldo))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    out, lse = mesh_attention(lq, lk, lv, mesh, causal=case["causal"], layout=case["layout"], return_lse=True)
    out.backward(ldo)
    got = [out.detach(), lse, lq.grad, lk.grad, lv.grad]
    if case["layout"] == "sbhd":
        got = [x if i == 1 else x.transpose(0, 1) for i, x in enumerate(got)]
    return got


def exactness(ctx, shapes, cases, seed=0):
    """For each (u, a, b) shape and case: squared error norms on this rank, bytes moved, and
    whether a second run is bitwise identical (cases with ``"twice": True``)."""
    results = {}
    for si, shape in enumerate(shapes):
        mesh = hybrid_mesh(ctx, shape)
        n, g = mesh.size, mesh.position
        per_case = []
        for idx, case in enumerate(cases[tuple(shape)]):
            q, k, v, do = make_inputs(seed + 100 * si + idx, case["batch"], case["seq"], case["heads"],
                                      case["kv_heads"], case["dim"])
            refs = reference(q, k, v, do, case["causal"])
            mesh.traffic.reset()
            got = _run(mesh, q, k, v, do, case)
            local_refs = [zigzag_shard(r, n, g, dim=2 if name == "lse" else 1) for name, r in zip(QUANTITIES, refs)]
            item = {
                "errors": {name: _sq(x, r) for name, x, r in zip(QUANTITIES, got, local_refs)},
                "traffic": dict(mesh.traffic.sent),
                "received": dict(mesh.traffic.received),
            }
            if case.get("twice"):
                again = _run(mesh, q, k, v, do, case)
                item["bitwise"] = all(torch.equal(x, y) for x, y in zip(got, again))
            if case["dtype"] == "bf16" and g == 0:
                item["single_device"] = single_device_errors(q, k, v, do, case["causal"], refs)
            per_case.append(item)
        results[tuple(shape)] = per_case
    return results


@megatron_task
def megatron_groups(ctx, sizes):
    """Megatron's hierarchical CP groups for ``sizes`` = [u, a, b], adopted by MeshGroups.from_groups
    (which checks their membership); returns the rank lists of (Ulysses, row, column) groups."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    n = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=n, hierarchical_context_parallel_sizes=list(sizes))
    try:
        hcp = parallel_state.get_hierarchical_context_parallel_groups()
        mesh = MeshGroups.from_groups(parallel_state.get_context_parallel_group(), hcp[1], hcp[2], ulysses_group=hcp[0])
        ranks = [dist.get_process_group_ranks(x) for x in (mesh.ulysses_group, mesh.row_group, mesh.col_group)]
        return {"ranks": ranks, "shape": (mesh.ulysses, mesh.shape.a, mesh.shape.b), "position": mesh.mesh_position}
    finally:
        parallel_state.destroy_model_parallel()


def bad_input(ctx, what):
    """Each case must raise ValueError on every rank, before any communication."""
    world = dist.get_world_size()
    b, s, d = 2, 8, 8
    if what == "ulysses_size":
        return MeshGroups.create((1, 1), ulysses=3)
    if what == "ulysses_shape":
        return MeshGroups.create((2, 2), ulysses=2)
    if what == "ulysses_group":
        # Ulysses groups of stride 2 instead of consecutive ranks
        with released_groups():
            pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            singles = [dist.new_group([r]) for r in range(world)]
            me = dist.get_rank()
            return MeshGroups.from_groups(None, singles[me], pairs[me % 2], ulysses_group=pairs[me % 2])
    mesh = hybrid_mesh(ctx, (2, 1, world // 2))
    if what == "heads":  # u = 2 does not divide 3 query heads
        q, k = torch.randn(b, s, 3, d), torch.randn(b, s, 1, d)
        return mesh_attention(q, k, k.clone(), mesh)
    if what == "plans":
        from megatron_mesh_cp import build_plans

        q = torch.randn(b, s, 4, d)
        return mesh_attention(q, q.clone(), q.clone(), mesh, plans=build_plans(world, 1, "in-order"))
    raise AssertionError(f"unknown case {what}")
