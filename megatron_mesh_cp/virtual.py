"""Virtual ranks: mesh attention for all n ranks in one process, on one device.

``virtual_mesh_attention`` shards full-sequence inputs in Megatron's zigzag layout, runs the same
forward and backward plans the real executor runs for every rank in lockstep through an in-memory
communicator, and gathers the results back. It exercises the executor, the plans and the block
kernels (with real GPU kernels on one GPU) without a process group. A shape ``(u, a, b)`` runs
``a2a+mesh``: the Ulysses all-to-all in memory (the same packing and reorder as on process groups,
:mod:`megatron_mesh_cp.runtime.ulysses`) around one a x b mesh per Ulysses slot.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .attention import plans_for
from .runtime.comm import Traffic, VirtualHub
from .runtime.execute import run_virtual
from .runtime.kernels import BlockKernel, lse_dtype, select_kernel
from .runtime.layout import seq_dim, zigzag_gather, zigzag_shard
from .runtime.plan import BACKWARD, FORWARD, Plan
from .runtime.topology import MeshShape
from .runtime.ulysses import (
    a2a_bytes, check_ulysses_heads, fold_replicas, heads_to_members, kv_repeats, members_to_heads,
    members_to_super, replicate_kv, super_to_members,
)

__all__ = ["virtual_mesh_attention"]


def _split_shape(shape) -> Tuple[int, MeshShape]:
    """``(a, b)``, a MeshShape or ``(u, a, b)`` -> (u, a x b MeshShape)."""
    if isinstance(shape, MeshShape):
        return 1, shape
    dims = tuple(shape)
    if len(dims) == 3:
        return int(dims[0]), MeshShape(int(dims[1]), int(dims[2]))
    return 1, MeshShape(*dims)


def _a2a(xs: List[torch.Tensor], u: int, pack: Callable, unpack: Callable, traffic: List[Traffic],
         phase: str, category: str) -> List[torch.Tensor]:
    """The all-to-all of every Ulysses group in memory: ``xs[g]`` is CP rank g's tensor."""
    if u == 1:
        return xs
    out: List[torch.Tensor] = []
    for start in range(0, len(xs), u):
        packs = [pack(x, u) for x in xs[start:start + u]]
        for j in range(u):  # member j receives entry j of every member's send buffer
            out.append(unpack(torch.stack([p[j] for p in packs]), u))
            nbytes = a2a_bytes(packs[j])
            traffic[start + j].add(phase, category, nbytes, nbytes)
    return out


def virtual_mesh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape,
    *,
    dout: Optional[torch.Tensor] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    layout: str = "bshd",
    kernel: Union[str, BlockKernel] = "auto",
    plans: Optional[Tuple[Plan, Plan]] = None,
    partial_dtype: Optional[torch.dtype] = None,
    deterministic: bool = False,
) -> Dict[str, object]:
    """Full-sequence ``q, k, v`` (and ``dout`` for a backward) -> gathered results.

    ``shape``: ``(a, b)`` for a mesh, ``(u, a, b)`` for ``a2a+mesh`` (Ulysses degree u).
    Returns ``{"out", "lse" ([b, h, s]), "dq", "dk", "dv" (with dout), "traffic" (per CP rank)}``.
    """
    from .attention import plans_for

    u, mesh_shape = _split_shape(shape)
    n_mesh = mesh_shape.n
    n = u * n_mesh
    sd = seq_dim(layout)
    if q.shape[sd] % (2 * n):
        raise ValueError(f"sequence length {q.shape[sd]} is not divisible by 2*CP = {2 * n}")
    r = 1
    if u > 1:
        check_ulysses_heads(q.shape[2], k.shape[2], u, n)
        r = kv_repeats(q.shape[2], k.shape[2], u)
    seq_major = lambda x: x if layout == "sbhd" else x.transpose(0, 1)  # noqa: E731
    qs, ks, vs = (seq_major(x) for x in (q, k, v))
    blk = select_kernel(kernel, qs, ks, deterministic=deterministic)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    traffic = [Traffic() for _ in range(n)]

    def a2a_in(xs, phase, category):
        return _a2a(xs, u, heads_to_members, members_to_super, traffic, phase, category)

    def a2a_out(xs, phase, category):
        return _a2a(xs, u, super_to_members, members_to_heads, traffic, phase, category)

    shard = lambda x: [zigzag_shard(x, n, g, dim=0) for g in range(n)]  # noqa: E731
    lq = a2a_in(shard(qs), FORWARD, "a2a-Q")
    lk = a2a_in([replicate_kv(x, r) for x in shard(ks)], FORWARD, "a2a-KV")
    lv = a2a_in([replicate_kv(x, r) for x in shard(vs)], FORWARD, "a2a-KV")
    if plans is None:
        fake = type("VirtualMesh", (), {"shape": mesh_shape, "cluster": None, "stride": 1, "ulysses": u})()
        plans = plans_for(lq[0], lk[0], fake, causal, "sbhd", partial_dtype, "greedy")
    # CP rank g = super-rank G * u + slot j; each slot runs its own a x b mesh over the super-ranks
    slots = [list(range(j, n, u)) for j in range(u)]

    def run(plan, per_rank):
        results: List[object] = [None] * n
        for ranks in slots:
            hub = VirtualHub(mesh_shape)
            res, counts = run_virtual(plan, mesh_shape, [per_rank[g] for g in ranks], blk, causal=causal,
                                      scale=scale, hub=hub, partial_dtype=partial_dtype)
            for g, x, t in zip(ranks, res, counts):
                results[g] = x
                for (p, c), nbytes in t.sent.items():
                    traffic[g].add(p, c, nbytes, t.received[(p, c)])
        return results

    res = run(plans[0], [dict(q=lq[g], k=lk[g], v=lv[g]) for g in range(n)])
    result: Dict[str, object] = {}
    out = zigzag_gather(a2a_out([x[0] for x in res], FORWARD, "a2a-O"), dim=0)
    lse = zigzag_gather(a2a_out([x[1] for x in res], FORWARD, "a2a-LSE"), dim=0)  # [s, b, h]
    result["out"] = out if layout == "sbhd" else out.transpose(0, 1)
    result["lse"] = lse.permute(1, 2, 0)
    if dout is not None:
        ldo = a2a_in(shard(seq_major(dout).contiguous()), BACKWARD, "a2a-dO")
        acc = lse_dtype(q.dtype)
        per = []
        for g in range(n):
            o, lse_g = res[g]
            delta = (ldo[g].to(acc) * o.to(acc)).sum(-1)
            per.append(dict(q=lq[g], k=lk[g], v=lv[g], out=o, lse=lse_g, dout=ldo[g], delta=delta))
        grads = run(plans[1], per)
        for i, (name, cat) in enumerate((("dq", "a2a-dQ"), ("dk", "a2a-dKV"), ("dv", "a2a-dKV"))):
            local = a2a_out([x[i] for x in grads], BACKWARD, cat)
            if name != "dq":
                local = [fold_replicas(x, r) for x in local]
            g = zigzag_gather(local, dim=0)
            result[name] = g if layout == "sbhd" else g.transpose(0, 1)
    result["traffic"] = traffic
    return result
