"""Rank functions for the attention-variant tests on real gloo groups: window + sink + max logit
(+ MLA head dims) against the float64 reference, bytes = the pruned plans' (+ the all-to-all), bad
input on every rank."""

from __future__ import annotations

import torch

import megatron_mesh_cp.attention as attention
from megatron_mesh_cp import mesh_attention, zigzag_shard
from megatron_mesh_cp.runtime.kernels import BlockKernel
from megatron_mesh_cp.reference import variant_reference
from rank_tasks import _sq, expected_bytes
from rank_tasks_packed import _mesh

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def exactness(ctx, shape, causal, window, heads, kv_heads, d, dv, seed=0):
    """Forward + backward of this rank's share with a window, a sink and the max logit: squared
    errors per quantity (the sink gradient summed over ranks by the caller), the max logit, bytes."""
    mesh = _mesh(ctx, shape)
    n, g, u = mesh.size, mesh.position, mesh.ulysses
    gen = torch.Generator().manual_seed(seed)
    t = 16 * n
    q, k = (torch.randn(t, x, d, generator=gen, dtype=torch.float64) for x in (heads, kv_heads))
    v, do = (torch.randn(t, x, dv, generator=gen, dtype=torch.float64) for x in (kv_heads, heads))
    sink = torch.randn(heads, generator=gen, dtype=torch.float64)
    cu = [0, 5, 4 + t // 8, t // 2 + 3, t]
    ref = variant_reference(q, k, v, do, cu, causal=causal, window=tuple(window), sink=sink)
    local_refs = [zigzag_shard(ref[name], n, g, dim=1 if name == "lse" else 0) for name in QUANTITIES]
    lq, lk, lv, ldo = (zigzag_shard(x, n, g, dim=0).float().unsqueeze(0) for x in (q, k, v, do))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    s = sink.float().requires_grad_(True)
    mesh.traffic.reset()
    out, lse, top = mesh_attention(lq, lk, lv, mesh, causal=causal, window=tuple(window), sink=s,
                                   cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_lse=True,
                                   return_max_logit=True)
    out.backward(ldo)
    plans = mesh.calls.last().call.plans
    want, _ = expected_bytes(plans, u, t, n, heads, kv_heads, d, dv)
    got = [out[0].detach(), lse[0], lq.grad[0], lk.grad[0], lv.grad[0]]
    return {"errors": {name: _sq(a, b) for name, a, b in zip(QUANTITIES, got, local_refs)},
            "dsink": s.grad.double(), "dsink_ref": ref["dsink"], "max_logit": top.double(),
            "max_logit_ref": ref["max_logit"], "sent": dict(mesh.traffic.sent), "want": want,
            "kept": len(plans[0].blocks), "tile": plans[0].a * plans[0].b}


class _NoWindow(BlockKernel):
    """A block kernel without sliding windows (the default check_window refuses)."""

    name = "no-window"


def bad_input(ctx, what):
    mesh = _mesh(ctx, (2, 2))
    kw = {}
    if what == "window":
        kw["window"] = (3, -2)
    elif what == "window-type":
        kw["window"] = (3.5, 0)
    elif what == "causal-right":
        kw["window"] = (3, 2)
    elif what == "sink-shape":
        kw["sink"] = torch.zeros(3)
    elif what == "sink-dtype":
        kw["sink"] = torch.zeros(4, dtype=torch.bfloat16)
    elif what == "kernel":
        kw.update(window=(3, 0), kernel=_NoWindow())
    elif what == "max-logit-kernel":
        kw.update(return_max_logit=True, kernel=_NoWindow())
    q, k, v = (torch.randn(1, 8, h, 8) for h in (4, 2, 2))
    return mesh_attention(q, k, v, mesh, **kw)


def chunked(ctx, shape, seed=0):
    """Chunked local attention with documents on this rank's zigzag share: squared errors against the
    float64 dense definition, and the bytes sent against the pruned plans' (+ the all-to-all)."""
    from megatron_mesh_cp.runtime.masks import Chunked
    from test_masks import chunked_keep, dense_reference

    mesh = _mesh(ctx, shape)
    n, g, u = mesh.size, mesh.position, mesh.ulysses
    t, size, heads, kv_heads = 16 * n, 5, 4, 2
    cu = [0, 7, t // 2 + 1, t]
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(t, heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(t, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = dense_reference(q, k, v, do, chunked_keep(t, size, cu, True), 8 ** -0.5)
    local_refs = [zigzag_shard(ref[name], n, g, dim=1 if name == "lse" else 0) for name in QUANTITIES]
    lq, lk, lv, ldo = (zigzag_shard(x, n, g, dim=0).float().unsqueeze(0) for x in (q, k, v, do))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    mesh.traffic.reset()
    out, lse = mesh_attention(lq, lk, lv, mesh, mask=Chunked(size), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                              return_lse=True)
    out.backward(ldo)
    plans = mesh.calls.last().call.plans
    want, _ = expected_bytes(plans, u, t, n, heads, kv_heads)
    got = [out[0].detach(), lse[0], lq.grad[0], lk.grad[0], lv.grad[0]]
    errors = {name: _sq(a, b) for name, a, b in zip(QUANTITIES, got, local_refs)}
    nonzero = lambda d: {key: val for key, val in d.items() if val}  # noqa: E731
    return {**errors, "sent": nonzero(mesh.traffic.sent), "want": nonzero(want)}
