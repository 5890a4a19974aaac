"""Rank functions for releasing a mesh's process groups (MeshGroups.destroy and the context manager)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from megatron_mesh_cp import MeshGroups, mesh_attention
from rank_groups import proc_status, released_groups


def _call(mesh, seq=8):
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, seq, heads, 8, generator=g) for heads in (4, 2, 2))
    return mesh_attention(q, k, v, mesh)


def destroy_cycle(ctx, shape, ulysses=1):
    """create -> one attention call -> destroy (twice: idempotent); this rank's status around it, and
    what a call on the destroyed mesh raises (on every rank, as for any bad input)."""
    before = proc_status(ctx)
    mesh = MeshGroups.create(tuple(shape), ulysses=ulysses)
    owned = [g for g in (mesh.row_group, mesh.col_group, mesh.ulysses_group) if g is not None]
    _call(mesh)
    during = proc_status(ctx)
    registered = dist.distributed_c10d._world.pg_map
    mesh.destroy()
    mesh.destroy()
    gone = [g not in registered for g in owned]
    del owned
    gc.collect()
    after = proc_status(ctx)
    error = None
    try:
        _call(mesh)
    except ValueError as exc:
        error = str(exc)
    return {"before": before, "during": during, "after": after, "gone": gone, "error": error, "repr": repr(mesh),
            "groups": (mesh.row_group, mesh.col_group, mesh.ulysses_group)}


def with_block(ctx, shape):
    """``with MeshGroups.create(...) as mesh``: released at the end of the block, also when it raises."""
    before = proc_status(ctx)["groups"]
    with MeshGroups.create(tuple(shape)) as mesh:
        _call(mesh)
        inside = proc_status(ctx)["groups"]
    clean = proc_status(ctx)["groups"]
    try:
        with MeshGroups.create(tuple(shape)):
            raise KeyError("boom")
    except KeyError:
        pass
    return {"before": before, "inside": inside, "after": clean, "after_error": proc_status(ctx)["groups"]}


def adopted_stay(ctx):
    """destroy() on a mesh adopted with from_groups leaves the caller's groups registered and working."""
    with released_groups():
        world = dist.get_world_size()
        rows = [dist.new_group(list(range(r, r + 2))) for r in range(0, world, 2)]
        cols = [dist.new_group(list(range(c, world, 2))) for c in range(2)]
        me = dist.get_rank()
        mesh = MeshGroups.from_groups(None, rows[me // 2], cols[me % 2])
        _call(mesh)
        groups = proc_status(ctx)["groups"]
        mesh.destroy()
        x = torch.ones(1)
        dist.all_reduce(x, group=rows[me // 2])
        dist.all_reduce(x, group=cols[me % 2])
        registered = dist.distributed_c10d._world.pg_map
        kept = rows[me // 2] in registered and cols[me % 2] in registered
        return {"groups_before": groups, "groups_after": proc_status(ctx)["groups"], "kept": kept,
                "sum": float(x), "destroyed": mesh.row_group is None}


def with_block_group_gone(ctx, shape):
    """A block that raises after one of the mesh's groups was destroyed elsewhere (a teardown that releases every
    group): the block's own error comes out of the ``with``, and the mesh's other groups are released."""
    before = proc_status(ctx)["groups"]
    try:
        with MeshGroups.create(tuple(shape)) as mesh:
            dist.destroy_process_group(mesh.col_group)
            raise KeyError("boom")
    except KeyError as exc:
        raised = f"KeyError: {exc}"
    except Exception as exc:  # noqa: BLE001  (what the test reports)
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "before": before, "after": proc_status(ctx)["groups"], "destroyed": "destroyed" in repr(mesh)}
