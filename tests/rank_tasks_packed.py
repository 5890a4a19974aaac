"""Rank functions for the packed-sequence (THD) tests on real gloo groups: exactness against the
float64 block-diagonal reference, bytes against the unpacked call, agreement count, bad input."""

from __future__ import annotations

import torch

import megatron_mesh_cp.attention as attention
from megatron_mesh_cp import mesh_attention
from megatron_mesh_cp.runtime.kernels import BlockKernel
from megatron_mesh_cp.runtime.masks import packed_documents
from megatron_mesh_cp.runtime.packed import thd_shard
from megatron_mesh_cp.reference import packed_reference
from rank_tasks import _sq, get_mesh
from rank_tasks_hybrid import hybrid_mesh

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _mesh(ctx, shape):
    return hybrid_mesh(ctx, shape) if len(shape) == 3 else get_mesh(ctx, shape)


def _counting_agree(ctx):
    """Wrap attention.agree once per process so tests can count the agreement collectives."""
    if "agree_calls" not in ctx.cache:
        ctx.cache["agree_calls"] = [0]
        inner = attention.agree

        def counted(*a, **k):
            ctx.cache["agree_calls"][0] += 1
            return inner(*a, **k)

        attention.agree = counted
    return ctx.cache["agree_calls"]


def exactness(ctx, shape, cu, real, heads, kv_heads, seed=0):
    """One packed forward + backward on this rank's share: squared errors vs float64, the bytes of
    the packed call and of an unpacked call of the same local shape, and agreement counts."""
    mesh = _mesh(ctx, shape)
    n, g = mesh.size, mesh.position
    count = _counting_agree(ctx)
    gen = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k, v, do = (torch.randn(t, x, 8, generator=gen, dtype=torch.float64) for x in (heads, kv_heads, kv_heads, heads))
    ref = packed_reference(q, k, v, do, cu, real)
    local_refs = [thd_shard(ref[name], cu, n, g, dim=1 if name == "lse" else 0) for name in QUANTITIES]
    lq, lk, lv, ldo = (thd_shard(x, cu, n, g).float() for x in (q, k, v, do))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    cu_t, real_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(real, dtype=torch.int32)
    before = count[0]
    mesh.traffic.reset()
    out, lse = mesh_attention(lq, lk, lv, mesh, layout="thd", cu_seqlens=real_t, cu_seqlens_padded=cu_t,
                              return_lse=True)
    out.backward(ldo)
    packed_bytes = dict(mesh.traffic.sent)
    # the same batch again (same tensors, then equal copies): per-batch documents agree every call, unless the
    # batch was agreed once (agree_batch)
    mesh_attention(lq, lk, lv, mesh, layout="thd", cu_seqlens=real_t, cu_seqlens_padded=cu_t)
    mesh_attention(lq, lk, lv, mesh, layout="thd", cu_seqlens=real_t.clone(), cu_seqlens_padded=cu_t.clone())
    agreed_same = count[0] - before
    attention.agree_batch(mesh, packed_documents(real_t, cu_t))
    mesh_attention(lq, lk, lv, mesh, layout="thd", cu_seqlens=real_t, cu_seqlens_padded=cu_t)
    agreed_batch = count[0] - before - agreed_same
    mesh.calls.agreed_batch = None
    got = [out.detach(), lse, lq.grad, lk.grad, lv.grad]
    finite = torch.isfinite(local_refs[1])
    same_inf = bool(torch.equal(torch.isfinite(lse), finite))
    got[1], local_refs[1] = lse[finite], local_refs[1][finite]
    # an unpacked call of the same local shape moves the same bytes
    mesh.traffic.reset()
    x = [y.detach().unsqueeze(0).requires_grad_(True) for y in (lq, lk, lv)]
    mesh_attention(*x, mesh, return_lse=True)[0].backward(ldo.unsqueeze(0))
    return {"errors": {name: _sq(a, b) for name, a, b in zip(QUANTITIES, got, local_refs)}, "same_inf": same_inf,
            "packed_bytes": packed_bytes, "plain_bytes": dict(mesh.traffic.sent), "agreed_same": agreed_same,
            "agreed_batch": agreed_batch}


class _DenseOnly(BlockKernel):
    """A block kernel without varlen support (the default check_varlen refuses)."""

    name = "dense-only"


def bad_input(ctx, what):
    mesh = get_mesh(ctx, (2, 2))
    g = mesh.position
    cu, real = [0, 8, 24, 32], [0, 8, 20, 27]
    kw = dict(layout="thd", cu_seqlens=torch.tensor(real), cu_seqlens_padded=torch.tensor(cu))
    if what == "unpadded":
        kw.update(cu_seqlens=None, cu_seqlens_padded=torch.tensor([0, 6, 24, 32]))
    elif what == "disagree" and g == 2:
        kw.update(cu_seqlens=None, cu_seqlens_padded=torch.tensor([0, 16, 24, 32]))
    elif what == "kernel":
        kw["kernel"] = _DenseOnly()
    elif what == "noncausal":
        kw["causal"] = False
    elif what == "layout":
        kw["layout"] = "sbhd"
    q, k, v = (torch.randn(8, h, 8) for h in (4, 2, 2))
    if what == "layout":
        q, k, v = (x.unsqueeze(1) for x in (q, k, v))
    return mesh_attention(q, k, v, mesh, **kw)
