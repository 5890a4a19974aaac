"""Virtual ranks: mesh attention for all n ranks in one process, on one device.

``virtual_mesh_attention`` shards full-sequence inputs in Megatron's zigzag layout, runs the same
forward and backward plans the real executor runs for every rank in lockstep through an in-memory
communicator, and gathers the results back. It exercises the executor, the plans and the block
kernels (with real GPU kernels on one GPU) without a process group.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch

from .comm import VirtualHub
from .execute import run_virtual
from .kernels import BlockKernel, lse_dtype, select_kernel
from .layout import seq_dim, zigzag_gather, zigzag_shard
from .plan import Plan
from .topology import MeshShape

__all__ = ["virtual_mesh_attention"]


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

    Returns ``{"out", "lse" ([b, h, s]), "dq", "dk", "dv" (with dout), "traffic" (per rank)}``.
    """
    from .attention import plans_for

    mesh_shape = shape if isinstance(shape, MeshShape) else MeshShape(*shape)
    n = mesh_shape.n
    sd = seq_dim(layout)
    if q.shape[sd] % (2 * n):
        raise ValueError(f"sequence length {q.shape[sd]} is not divisible by 2*CP = {2 * n}")
    seq_major = lambda x: x if layout == "sbhd" else x.transpose(0, 1)  # noqa: E731
    qs, ks, vs = (seq_major(x) for x in (q, k, v))
    blk = select_kernel(kernel, qs, ks, deterministic=deterministic)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if plans is None:
        fake = type("VirtualMesh", (), {"shape": mesh_shape, "cluster": None, "stride": 1})()
        plans = plans_for(qs, ks, fake, causal, "sbhd", partial_dtype, "greedy")
    shard = lambda x: [zigzag_shard(x, n, r, dim=0) for r in range(n)]  # noqa: E731
    lq, lk, lv = shard(qs), shard(ks), shard(vs)
    hub = VirtualHub(mesh_shape)
    res, traffic = run_virtual(plans[0], mesh_shape, [dict(q=lq[r], k=lk[r], v=lv[r]) for r in range(n)], blk,
                               causal=causal, scale=scale, hub=hub, partial_dtype=partial_dtype)
    result: Dict[str, object] = {}
    out = zigzag_gather([r[0] for r in res], dim=0)
    lse = zigzag_gather([r[1] for r in res], dim=0)  # [s, b, h]
    result["out"] = out if layout == "sbhd" else out.transpose(0, 1)
    result["lse"] = lse.permute(1, 2, 0)
    if dout is not None:
        ldo = shard(seq_major(dout).contiguous())
        acc = lse_dtype(q.dtype)
        per = []
        for r in range(n):
            o, l = res[r]
            delta = (ldo[r].to(acc) * o.to(acc)).sum(-1)
            per.append(dict(q=lq[r], k=lk[r], v=lv[r], out=o, lse=l, dout=ldo[r], delta=delta))
        grads, _ = run_virtual(plans[1], mesh_shape, per, blk, causal=causal, scale=scale, hub=hub,
                               partial_dtype=partial_dtype)
        for i, name in enumerate(("dq", "dk", "dv")):
            g = zigzag_gather([x[i] for x in grads], dim=0)
            result[name] = g if layout == "sbhd" else g.transpose(0, 1)
    result["traffic"] = traffic
    return result
