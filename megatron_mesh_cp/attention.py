"""``mesh_attention``: exact context-parallel attention on an a x b mesh, forward and backward.

Inputs are each rank's zigzag share of the sequence (Megatron's CP layout). Forward gathers Q over
the row ring and KV over the column ring, computes the rank's tile and reduces partial outputs to
their owners; backward re-gathers what it needs and reduces dQ over rows and dK/dV over columns.
Between the passes only the local q, k, v, out and lse are kept, as Ring-Attention would.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .kernels import BlockKernel, lse_dtype, select_kernel
from .layout import LAYOUTS, seq_dim
from .plan import Plan
from .schedule import build_plans

__all__ = ["mesh_attention", "check_inputs"]


def check_inputs(q, k, v, mesh, layout: str, softmax_scale) -> None:
    """Raise ``ValueError`` naming the fix for any input the mesh cannot run.

    Uses only local metadata, so every rank of an SPMD program raises the same error before any
    communication starts.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not hasattr(mesh, "shape") or not hasattr(mesh, "comm"):
        raise ValueError(
            f"mesh must be a MeshGroups (MeshGroups.create((a, b)) or MeshGroups.from_groups(...)), "
            f"got {type(mesh).__name__}"
        )
    names = ("q", "k", "v")
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ ({q.device}, {k.device}, {v.device}); move them to one device")
    s_dim = seq_dim(layout)
    b_dim = 1 - s_dim
    if not (q.shape[b_dim] == k.shape[b_dim] == v.shape[b_dim]):
        raise ValueError(
            f"batch sizes differ: q {q.shape[b_dim]}, k {k.shape[b_dim]}, v {v.shape[b_dim]} "
            f"(layout {layout!r}: batch is dim {b_dim}); is the layout right?"
        )
    if not (q.shape[s_dim] == k.shape[s_dim] == v.shape[s_dim]):
        raise ValueError(
            f"local sequence lengths differ: q {q.shape[s_dim]}, k {k.shape[s_dim]}, v {v.shape[s_dim]} "
            f"(layout {layout!r}: sequence is dim {s_dim}); self-attention needs equal lengths"
        )
    if k.shape[2:] != v.shape[2:]:
        raise ValueError(f"k and v must have the same heads and head dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} differs from k/v head dim {k.shape[3]}")
    h, hk = q.shape[2], k.shape[2]
    if hk < 1 or h % hk:
        raise ValueError(
            f"query heads ({h}) must be a multiple of kv heads ({hk}); "
            "use num_query_groups that divides num_attention_heads"
        )
    n = mesh.shape.n
    s_local = q.shape[s_dim]
    if s_local % 2:
        raise ValueError(
            f"sequence length {s_local * n} (local {s_local} x CP {n}) is not divisible by 2*CP = {2 * n}; "
            f"pad the sequence to a multiple of {2 * n}"
        )
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")


def plans_for(q, k, mesh, causal: bool, layout: str, partial_dtype, planner: str) -> Tuple[Plan, Plan]:
    """The cached (forward, backward) plans for these inputs on ``mesh`` (greedy: tuned for its cluster)."""
    from .cluster import Workload
    from .schedule import default_cluster

    s_dim = seq_dim(layout)
    b_dim = 1 - s_dim
    acc = lse_dtype(q.dtype)
    w = Workload(
        seq_local=q.shape[s_dim], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        batch=q.shape[b_dim], causal=bool(causal), bytes_per_element=q.element_size(),
        partial_bytes=torch.empty((), dtype=partial_dtype or acc).element_size(),
    )
    cluster = getattr(mesh, "cluster", None) or default_cluster()
    return build_plans(mesh.shape.a, mesh.shape.b, planner, cluster=cluster, workload=w,
                       stride=getattr(mesh, "stride", 1))


class _MeshAttention(torch.autograd.Function):
    """Sequence-major ([s, b, h, d]) in and out; lse out as [b, h, s] fp32."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, causal, scale, kernel, plans, partial_dtype):
        from .execute import Executor

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ex = Executor(plans[0], mesh.comm(), kernel, causal=causal, scale=scale,
                      tensors={"q": q, "k": k, "v": v}, partial_dtype=partial_dtype,
                      buffers=getattr(mesh, "buffers", None))
        out, lse = ex.run()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.causal, ctx.scale, ctx.kernel, ctx.plans = mesh, causal, scale, kernel, plans
        ctx.partial_dtype = partial_dtype
        lse_out = lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(ctx, dout, _dlse):
        from .execute import Executor

        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        acc = lse_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
        tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "delta": delta}
        ex = Executor(ctx.plans[1], ctx.mesh.comm(), ctx.kernel, causal=ctx.causal, scale=ctx.scale,
                      tensors=tensors, partial_dtype=ctx.partial_dtype, buffers=getattr(ctx.mesh, "buffers", None))
        dq, dk, dv = ex.run()
        return dq, dk, dv, None, None, None, None, None, None


def mesh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    layout: str = "bshd",
    return_lse: bool = False,
    kernel: Union[str, BlockKernel] = "auto",
    plans: Optional[Tuple[Plan, Plan]] = None,
    partial_dtype: Optional[torch.dtype] = None,
    planner: str = "greedy",
    deterministic: bool = False,
):
    """Context-parallel attention over ``mesh`` (a :class:`~megatron_mesh_cp.MeshGroups`).

    q: ``[b, s_local, h, d]`` and k, v: ``[b, s_local, h_kv, d]`` (``layout="bshd"``; ``"sbhd"``
    swaps the first two dims), each rank holding its zigzag share (pieces g and 2n-1-g). Returns
    the local output in the same layout, plus the fp32 lse ``[b, h, s_local]`` if ``return_lse``.
    ``planner`` picks how the (forward, backward) schedule is built (``greedy``: tuned for the
    mesh's cluster, ``mesh.cluster``; ``in-order``), ``plans`` passes one explicitly;
    ``kernel`` forces a block-kernel backend; ``deterministic`` asks it for a deterministic backward
    (Megatron's ``--deterministic-mode``; off by default, as some GPUs have no such TE backend).
    ``partial_dtype`` is the wire dtype of partial results (O, dQ, dK/dV); the default keeps them
    in fp32, exact to accumulation precision; the input dtype halves their bytes.
    """
    check_inputs(q, k, v, mesh, layout, softmax_scale)
    blk = select_kernel(kernel, q, k, deterministic=deterministic)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if partial_dtype is not None and (not isinstance(partial_dtype, torch.dtype) or not partial_dtype.is_floating_point):
        raise ValueError(f"partial_dtype must be a floating torch.dtype or None, got {partial_dtype!r}")
    if plans is None:
        plans = plans_for(q, k, mesh, causal, layout, partial_dtype, planner)
    elif (plans[0].a, plans[0].b, plans[1].a, plans[1].b) != (mesh.shape.a, mesh.shape.b) * 2:
        raise ValueError(f"plans are for {plans[0].a}x{plans[0].b}, the mesh is {mesh.shape}")
    if layout == "bshd":  # the executor is sequence-major
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    out, lse = _MeshAttention.apply(q, k, v, mesh, bool(causal), scale, blk, plans, partial_dtype)
    if layout == "bshd":
        out = out.transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out
