"""Rank functions for the document-masking tests on real gloo groups: exactness against the float64
reference, measured bytes against the pruned plans' bytes, the pool against their peak, one
agreement per call (or per batch, agreed once), bad input on every rank (a warm cache too)."""

from __future__ import annotations

import torch

import megatron_mesh_cp.attention as attention
from megatron_mesh_cp import mesh_attention, zigzag_shard
from megatron_mesh_cp.runtime.kernels import BlockKernel
from megatron_mesh_cp.runtime.masks import Documents
from megatron_mesh_cp.runtime.memory import peak_live_bytes
from megatron_mesh_cp.reference import packed_reference
from rank_tasks import _sq, expected_bytes
from rank_tasks_packed import _counting_agree, _mesh

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def exactness(ctx, shape, cu, heads, kv_heads, seed=0):
    """One forward + backward of this rank's zigzag share with documents ``cu``: squared errors vs
    float64, the bytes sent vs the pruned plans' (plus the all-to-all under a2a+mesh), the pool vs
    their peak, the blocks the plans kept, and how many agreements the batch and its repeats cost."""
    mesh = _mesh(ctx, shape)
    n, g = mesh.size, mesh.position
    count = _counting_agree(ctx)
    gen = torch.Generator().manual_seed(seed)
    t = cu[-1]
    q, k, v, do = (torch.randn(t, x, 8, generator=gen, dtype=torch.float64) for x in (heads, kv_heads, kv_heads, heads))
    ref = packed_reference(q, k, v, do, cu)
    local_refs = [zigzag_shard(ref[name], n, g, dim=1 if name == "lse" else 0) for name in QUANTITIES]
    lq, lk, lv, ldo = (zigzag_shard(x, n, g, dim=0).float().unsqueeze(0) for x in (q, k, v, do))  # bshd, batch 1
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    before = count[0]
    mesh.traffic.reset()
    mesh.buffers._arenas.clear()
    out, lse = mesh_attention(lq, lk, lv, mesh, cu_seqlens=cu_t, return_lse=True)
    out.backward(ldo)
    sent = dict(mesh.traffic.sent)
    pool = mesh.buffers.nbytes()
    plans = mesh.calls.last().call.plans
    mesh_attention(lq, lk, lv, mesh, cu_seqlens=cu_t)  # the same batch again: per-batch documents agree every call
    mesh_attention(lq, lk, lv, mesh, cu_seqlens=cu_t.clone())
    agreed = count[0] - before
    attention.agree_batch(mesh, Documents(tuple(cu)))  # the launcher's once-per-micro-batch agreement
    mesh_attention(lq, lk, lv, mesh, cu_seqlens=cu_t)
    mesh_attention(lq, lk, lv, mesh, cu_seqlens=cu_t.clone())
    agreed_batch = count[0] - before - agreed
    mesh.calls.agreed_batch = None
    u = mesh.ulysses
    want, inner = expected_bytes(plans, u, t, n, heads, kv_heads)
    got = [out[0].detach(), lse[0], lq.grad[0], lk.grad[0], lv.grad[0]]
    return {"errors": {name: _sq(a, b) for name, a, b in zip(QUANTITIES, got, local_refs)}, "sent": sent,
            "want": want, "pool": pool, "peak": max(peak_live_bytes(p, inner) for p in plans),
            "kept": len(plans[0].blocks), "tile": plans[0].a * plans[0].b, "agreed": agreed,
            "agreed_batch": agreed_batch}


class _DenseOnly(BlockKernel):
    """A block kernel without varlen support (the default check_varlen refuses)."""

    name = "dense-only"


def bad_input(ctx, what):
    mesh = _mesh(ctx, (2, 2))
    g = mesh.position
    cu = [0, 5, 20, 32]
    kw = {}
    if what == "start":
        cu = [3, 20, 32]
    elif what == "end":
        cu = [0, 5, 20, 30]
    elif what == "order":
        cu = [0, 20, 5, 32]
    elif what == "disagree" and g == 2:
        cu = [0, 6, 20, 32]
    elif what == "warm":  # every rank runs this batch once, then rank 2 alone gets other documents
        q, k, v = (torch.randn(1, 8, h, 8) for h in (4, 2, 2))
        mesh_attention(q, k, v, mesh, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        cu = [0, 6, 20, 32] if g == 2 else cu
    elif what == "kernel":
        kw["kernel"] = _DenseOnly()
    elif what == "unread":  # rank 2 could not read its batch (the launcher's damaged sample): it joins the agreement
        bad = ValueError("a token layout's code is inconsistent") if g == 2 else None
        attention.agree_batch(mesh, None if bad else Documents(tuple(cu)), bad)
    batch = 2 if what == "batch" else 1
    q, k, v = (torch.randn(batch, 8, h, 8) for h in (4, 2, 2))
    return mesh_attention(q, k, v, mesh, cu_seqlens=torch.tensor(cu, dtype=torch.int32), **kw)
