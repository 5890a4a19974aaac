"""Rank functions for token layouts on real gloo groups: a re-laid micro-batch (runtime/layouts.py) against the
float64 reference of the documents in their own order, and the bytes sent against the plans' bytes."""

from __future__ import annotations

import numpy as np
import torch

from megatron_mesh_cp import mesh_attention, zigzag_shard
from megatron_mesh_cp.reference import packed_reference
from megatron_mesh_cp.runtime.layouts import arrange
from megatron_mesh_cp.runtime.masks import Documents
from rank_tasks import _sq, expected_bytes
from rank_tasks_documents import QUANTITIES
from rank_tasks_packed import _mesh


def relaid_exactness(ctx, shape, lengths, layout, split, heads, kv_heads, seed=0, halves=0):
    """One forward + backward of this rank's share of the re-laid sequence: squared errors vs float64
    (the reference re-laid the same way), bytes sent vs the plans' (plus the all-to-all under a2a+mesh)."""
    mesh = _mesh(ctx, shape)
    n, g, u = mesh.size, mesh.position, mesh.ulysses
    per_mesh = layout in ("tiled", "tiled-cut") or halves
    arr = arrange(lengths, n // u, layout, split=split, shape=tuple(shape[-2:]) if per_mesh else None, halves=halves)
    assert arr.halves == halves
    t = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(t, x, 8, generator=gen, dtype=torch.float64) for x in (heads, kv_heads, kv_heads, heads))
    ref = packed_reference(q, k, v, do, np.concatenate(([0], np.cumsum(lengths))).tolist())
    order = torch.arange(t) if arr.order is None else torch.from_numpy(np.asarray(arr.order))
    local_refs = [zigzag_shard(ref[name].index_select(1 if name == "lse" else 0, order), n, g,
                               dim=1 if name == "lse" else 0) for name in QUANTITIES]
    lq, lk, lv, ldo = (zigzag_shard(x.index_select(0, order), n, g, dim=0).float().unsqueeze(0) for x in (q, k, v, do))
    lq, lk, lv = (x.requires_grad_(True) for x in (lq, lk, lv))
    kw = ({"cu_seqlens": torch.tensor(arr.mask.cu, dtype=torch.int32)} if isinstance(arr.mask, Documents)
          else {"mask": arr.mask})
    mesh.traffic.reset()
    out, lse = mesh_attention(lq, lk, lv, mesh, return_lse=True, kernel="torch", **kw)
    out.backward(ldo)
    sent = dict(mesh.traffic.sent)
    plans = mesh.calls.last().call.plans
    want, _ = expected_bytes(plans, u, t, n, heads, kv_heads)
    got = [out[0].detach(), lse[0], lq.grad[0], lk.grad[0], lv.grad[0]]
    return {"errors": {name: _sq(a, b) for name, a, b in zip(QUANTITIES, got, local_refs)}, "sent": sent,
            "want": want, "name": arr.name, "split": arr.split}
