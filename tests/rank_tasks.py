"""Functions the multi-rank tests run on every rank of a :class:`~megatron_mesh_cp.spawn.RankPool`.

Each rank builds the same full-sequence inputs from a seed, computes the float64 reference itself,
runs mesh attention on its zigzag share and returns squared error norms, so only numbers travel
back to the test process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_mesh_cp import MeshGroups, mesh_attention, zigzag_shard
from megatron_mesh_cp.reference import reference_attention
from rank_groups import released_groups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def expected_bytes(plans, u, t, n, heads, kv_heads, d=8, dv=None):
    """(bytes a rank's call sends by its forward and backward plans, plus a2a+mesh's all-to-all, fp32; the
    inner chunk dims the plans run on): what ``mesh.traffic.sent`` must equal, exactly."""
    from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic
    from megatron_mesh_cp.runtime.ulysses import kv_repeats, ulysses_traffic

    r = kv_repeats(heads, kv_heads, u) if u > 1 else 1
    inner = ChunkDims(1, u * (t // n), heads // u, kv_heads * r // u, d, torch.float32, v_head_dim=dv)
    want = {**plan_traffic(plans[0], inner), **plan_traffic(plans[1], inner)}
    local = ChunkDims(1, t // n, heads, kv_heads, d, torch.float32, v_head_dim=dv)
    want.update(ulysses_traffic(u, local, "forward", return_lse=True))
    want.update(ulysses_traffic(u, local, "backward"))
    return want, inner


def get_mesh(ctx, shape) -> MeshGroups:
    """MeshGroups for ``shape`` over the whole world, built once per process (same order on all ranks)."""
    key = ("mesh", tuple(shape))
    if key not in ctx.cache:
        ctx.cache[key] = MeshGroups.create(tuple(shape))
    return ctx.cache[key]


def make_inputs(seed, batch, seq, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64)
    do = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    return q, k, v, do


def reference(q, k, v, do, causal):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=causal)
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_mesh(mesh, q, k, v, do, *, causal, layout, dtype, plans=None, partial_dtype=None):
    """Mesh attention forward + backward on local bshd shares; returns (out, lse, dq, dk, dv) in bshd."""
    n, g = mesh.shape.n, mesh.position
    shard = lambda x: zigzag_shard(x, n, g, dim=1).to(dtype)  # noqa: E731
    lq, lk, lv, ldo = (shard(x) for x in (q, k, v, do))
    if layout == "sbhd":
        lq, lk, lv, ldo = (x.transpose(0, 1).contiguous() for x in (lq, lk, lv, ldo))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    out, lse = mesh_attention(lq, lk, lv, mesh, causal=causal, layout=layout, return_lse=True, plans=plans,
                              partial_dtype=partial_dtype)
    out.backward(ldo)
    grads = [lq.grad, lk.grad, lv.grad]
    if layout == "sbhd":
        out = out.transpose(0, 1)
        grads = [x.transpose(0, 1) for x in grads]
    return (out.detach(), lse, *grads)


def _sq(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).sum()), float(ref.pow(2).sum())


def exactness(ctx, shape, cases, seed=0):
    """For each case dict, squared error norms of (out, lse, dq, dk, dv) on this rank plus bytes moved.

    A case: causal, heads, kv_heads, layout, dtype ("fp32"/"bf16"), batch, seq, dim.
    With bf16, rank 0 also reports the single-device bf16 errors (the tolerance's yardstick).
    """
    mesh = get_mesh(ctx, shape)
    n, g = mesh.shape.n, mesh.position
    results = []
    for idx, case in enumerate(cases):
        q, k, v, do = make_inputs(seed + idx, case["batch"], case["seq"], case["heads"], case["kv_heads"], case["dim"])
        refs = reference(q, k, v, do, case["causal"])
        mesh.traffic.reset()
        got = run_mesh(mesh, q, k, v, do, causal=case["causal"], layout=case["layout"], dtype=DTYPES[case["dtype"]],
                       partial_dtype=DTYPES.get(case.get("partial")))
        local_refs = [zigzag_shard(r, n, g, dim=2 if name == "lse" else 1) for name, r in zip(QUANTITIES, refs)]
        item = {
            "errors": {name: _sq(x, r) for name, x, r in zip(QUANTITIES, got, local_refs)},
            "traffic": dict(mesh.traffic.sent),
            "received": dict(mesh.traffic.received),
        }
        if case["dtype"] == "bf16" and g == 0:
            item["single_device"] = single_device_errors(q, k, v, do, case["causal"], refs)
        results.append(item)
    return results


def single_device_errors(q, k, v, do, causal, refs):
    """Relative errors of one-device bf16 attention (the torch kernel on the whole sequence)."""
    from megatron_mesh_cp.runtime.kernels import TorchKernel

    kern = TorchKernel()
    qb, kb, vb, dob = (x.to(torch.bfloat16).transpose(0, 1).contiguous() for x in (q, k, v, do))  # seq-major
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = kern.forward(qb, kb, vb, causal=causal, scale=scale)
    dq, dk, dv = kern.backward(dob, qb, kb, vb, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=causal, scale=scale)
    got = (out.transpose(0, 1), lse, dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1))
    return {name: math.sqrt(_sq(x, r)[0] / _sq(x, r)[1]) for name, x, r in zip(QUANTITIES, got, refs)}


def bitwise_twice(ctx, shape, case, seed=0):
    """Run the same inputs twice; True if outputs and gradients are bitwise identical."""
    mesh = get_mesh(ctx, shape)
    q, k, v, do = make_inputs(seed, case["batch"], case["seq"], case["heads"], case["kv_heads"], case["dim"])
    kw = dict(causal=case["causal"], layout=case["layout"], dtype=DTYPES[case["dtype"]])
    first = run_mesh(mesh, q, k, v, do, **kw)
    second = run_mesh(mesh, q, k, v, do, **kw)
    return all(torch.equal(x, y) for x, y in zip(first, second))


def shapes_agree(ctx, shapes, case, seed=0):
    """Run every shape on the same inputs; return local outputs/grads per shape (as float64 lists)."""
    q, k, v, do = make_inputs(seed, case["batch"], case["seq"], case["heads"], case["kv_heads"], case["dim"])
    out = {}
    for shape in shapes:
        mesh = get_mesh(ctx, shape)
        got = run_mesh(mesh, q, k, v, do, causal=case["causal"], layout="bshd", dtype=DTYPES[case["dtype"]])
        out[tuple(shape)] = [x.double() for x in got]
    return out


# --- bad input: each returns nothing; the error must come from the library on every rank -------


def bad_input(ctx, what):
    world = dist.get_world_size()
    mesh = get_mesh(ctx, (2, world // 2)) if world % 2 == 0 else get_mesh(ctx, (1, world))
    b, s, h, d = 2, 8, 4, 8
    q = torch.randn(b, s, h, d)
    k = torch.randn(b, s, h, d)
    v = torch.randn(b, s, h, d)
    if what == "odd_sequence":
        q, k, v = (x[:, :7] for x in (q, k, v))
    elif what == "heads":
        k, v = torch.randn(b, s, 3, d), torch.randn(b, s, 3, d)
    elif what == "dtype":
        k = k.to(torch.float64)
    elif what == "device":
        k = torch.empty(b, s, h, d, device="meta")
    elif what == "batch":
        k, v = torch.randn(1, s, h, d), torch.randn(1, s, h, d)
    elif what == "layout":
        return mesh_attention(q, k, v, mesh, layout="bhsd")
    elif what == "shape_product":
        return MeshGroups.create((3, world))
    elif what == "group_sizes":
        # a row group of 2 and a column group of 1 cannot tile a world of 4
        with released_groups():
            rows = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
            singles = [dist.new_group([r]) for r in range(world)]
            me = dist.get_rank()
            return MeshGroups.from_groups(None, rows[me // 2], singles[me])
    elif what == "group_members":
        # the column rings passed as row rings
        with released_groups():
            cols = [dist.new_group([c, c + 2]) for c in range(2)]
            rows = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
            me = dist.get_rank()
            return MeshGroups.from_groups(None, cols[me % 2], rows[me // 2])
    else:
        raise AssertionError(f"unknown case {what}")
    return mesh_attention(q, k, v, mesh)
