"""``mesh_attention``: exact context-parallel attention on an a x b mesh, forward and backward.

Inputs are each rank's zigzag share of the sequence (Megatron's CP layout). Forward gathers Q over
the row ring and KV over the column ring, computes the rank's tile and reduces partial outputs to
their owners; backward re-gathers what it needs and reduces dQ over rows and dK/dV over columns.
Between the passes only the local q, k, v, out and lse are kept, as Ring-Attention would.

The first call with a new signature (shapes, dtypes, mask, scale, layout, kernel, plans, mesh)
checks with one tiny collective that every rank of the CP group makes the same call (agree.py);
the agreed signature is cached on the mesh, so later calls skip both the check and the planning.

Packed sequences (``layout="thd"`` with ``cu_seqlens`` / ``cu_seqlens_padded``, Megatron's
per-document split): the documents join the signature (one agreement per new batch), the chunks
are permuted into packed.py's half-major order around the unchanged executor and plans, and
padding rows come back as zeros with lse = -inf.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Optional, Tuple, Union

import torch

from .planning.cluster import Workload
from .planning.schedule import build_plans, default_cluster
from .runtime.agree import agree, any_rank, plan_digest
from .runtime.execute import Executor
from .runtime.hybrid import UlyssesIn, UlyssesOut
from .runtime.kernels import BlockKernel, lse_dtype, select_kernel
from .runtime.layout import LAYOUTS, seq_dim
from .runtime.packed import PackedLayout, PackedSpec, packed_spec, padding_rows
from .runtime.plan import Plan
from .runtime.ulysses import check_ulysses_heads, kv_repeats

__all__ = ["mesh_attention", "check_inputs", "resolve_scale"]

#: agreed call signatures kept per mesh (a new sequence length every step must not grow memory)
MAX_AGREED = 64
#: tensor scales already read to the host, by object: id -> (tensor, version, value); reading a CUDA
#: tensor syncs the device, so a scale tensor passed on every call is read once per in-place change
_SCALES: "OrderedDict[int, tuple]" = OrderedDict()


def _check_mesh(mesh) -> None:
    if not hasattr(mesh, "shape") or not hasattr(mesh, "comm"):
        raise ValueError(
            f"mesh must be a MeshGroups (MeshGroups.create((a, b)) or MeshGroups.from_groups(...)), "
            f"got {type(mesh).__name__}"
        )


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` as a float: any positive finite real scalar (Python or numpy number, 0-d
    tensor); None means ``1 / sqrt(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    x = softmax_scale
    tensor = isinstance(x, torch.Tensor)
    ok = (tensor and x.dim() == 0 and not x.is_complex() and x.dtype != torch.bool) or (
        isinstance(x, numbers.Real) and not isinstance(x, bool))
    value = (_tensor_scale(x) if tensor else float(x)) if ok else float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be a positive finite real number (or None), got {softmax_scale!r}")
    return value


def _tensor_scale(x: torch.Tensor) -> float:
    """``float(x)`` for a 0-d tensor, read (a device sync on CUDA) once per tensor object and version."""
    if x.is_inference():  # no version counter: read every time
        return float(x)
    hit = _SCALES.pop(id(x), None)
    if hit is None or hit[0] is not x or hit[1] != x._version:
        hit = (x, x._version, float(x))
    _SCALES[id(x)] = hit  # most recent last; at most 8 kept
    while len(_SCALES) > 8:
        _SCALES.popitem(last=False)
    return hit[2]


def check_inputs(q, k, v, mesh, layout: str, softmax_scale) -> None:
    """Raise ``ValueError`` naming the fix for any input the mesh cannot run.

    Uses only local metadata; :func:`mesh_attention` shares the outcome with every rank of the CP
    group (one collective, on a new signature) so all of them raise, not just the one at fault.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (or 'thd' with cu_seqlens for packed sequences), "
                         f"got {layout!r}")
    _check_mesh(mesh)
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
    u = getattr(mesh, "ulysses", 1)
    n = u * mesh.shape.n
    if u > 1:
        check_ulysses_heads(h, hk, u, n)
    s_local = q.shape[s_dim]
    if s_local % 2:
        raise ValueError(
            f"sequence length {s_local * n} (local {s_local} x CP {n}) is not divisible by 2*CP = {2 * n}; "
            f"pad the sequence to a multiple of {2 * n}"
        )
    resolve_scale(softmax_scale, q.shape[3])


def plans_for(q, k, mesh, causal: bool, layout: str, partial_dtype, planner: str) -> Tuple[Plan, Plan]:
    """The cached (forward, backward) plans for these inputs on ``mesh`` (greedy: tuned for its cluster)."""
    s_dim = seq_dim(layout)
    b_dim = 1 - s_dim
    acc = lse_dtype(q.dtype)
    w = Workload(
        seq_local=q.shape[s_dim], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        batch=q.shape[b_dim], causal=bool(causal), bytes_per_element=q.element_size(),
        partial_bytes=(partial_dtype or acc).itemsize,
    )
    cluster = getattr(mesh, "cluster", None) or default_cluster()
    # a2a+mesh: consecutive super-ranks are u CP ranks apart
    stride = getattr(mesh, "stride", 1) * getattr(mesh, "ulysses", 1)
    return build_plans(mesh.shape.a, mesh.shape.b, planner, cluster=cluster, workload=w, stride=stride,
                       max_live=getattr(mesh, "max_live", None))


class _MeshAttention(torch.autograd.Function):
    """Sequence-major ([s, b, h, d]) in and out; lse out as [b, h, s] fp32."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, causal, scale, kernel, plans, partial_dtype, check_finite, varlen=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ex = Executor(plans[0], mesh.comm(), kernel, causal=causal, scale=scale,
                      tensors={"q": q, "k": k, "v": v}, partial_dtype=partial_dtype,
                      buffers=getattr(mesh, "buffers", None), varlen=varlen)
        out, lse = ex.run()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.causal, ctx.scale, ctx.kernel, ctx.plans = mesh, causal, scale, kernel, plans
        ctx.partial_dtype, ctx.check_finite, ctx.varlen = partial_dtype, check_finite, varlen
        lse_out = lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.check_finite:
            _check_finite(ctx.mesh, "the output gradient", dout)
        acc = lse_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
        tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "delta": delta}
        ex = Executor(ctx.plans[1], ctx.mesh.comm(), ctx.kernel, causal=ctx.causal, scale=ctx.scale,
                      tensors=tensors, partial_dtype=ctx.partial_dtype, buffers=getattr(ctx.mesh, "buffers", None),
                      varlen=ctx.varlen)
        dq, dk, dv = ex.run()
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _agreed_calls(mesh) -> "OrderedDict":
    calls = getattr(mesh, "_agreed_calls", None)
    if calls is None:
        calls = mesh._agreed_calls = OrderedDict()
    return calls


def _call_key(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype, planner, check_finite,
              deterministic, spec=None):
    """What a call's validation, planning and agreement depend on (None: not even tensors)."""
    try:
        tensors = tuple((tuple(x.shape), x.dtype, x.device) for x in (q, k, v))
        scale = None if softmax_scale is None else resolve_scale(softmax_scale, 1)
    except (AttributeError, TypeError, ValueError):
        return None
    plan_ids = None if plans is None else tuple(id(p) for p in plans)
    return (tensors, bool(causal), scale, layout, kernel if isinstance(kernel, str) else id(kernel), plan_ids,
            partial_dtype, planner, id(getattr(mesh, "cluster", None)), getattr(mesh, "stride", 1), bool(check_finite),
            bool(deterministic), spec)


def _prepare(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype, planner, deterministic,
             spec: Optional[PackedSpec] = None):
    """Local validation and planning: ``(kernel, scale, plans)``; ``ValueError`` naming the fix."""
    check_inputs(q, k, v, mesh, layout, softmax_scale)
    if spec is not None:
        n = getattr(mesh, "ulysses", 1) * mesh.shape.n
        spec.check(q.shape[seq_dim(layout)] * n, n)
        if not causal:
            raise ValueError("packed sequences (THD) need causal=True (Megatron's padding_causal mask); "
                             "per-document non-causal attention is not supported")
    blk = select_kernel(kernel, q, k, deterministic=deterministic, packed=spec is not None)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if partial_dtype is not None and (not isinstance(partial_dtype, torch.dtype) or not partial_dtype.is_floating_point):
        raise ValueError(f"partial_dtype must be a floating torch.dtype or None, got {partial_dtype!r}")
    if plans is None:  # for what the mesh sees: a2a+mesh gives it u times the tokens on h/u heads
        u = getattr(mesh, "ulysses", 1)
        r = kv_repeats(q.shape[2], k.shape[2], u) if u > 1 else 1
        s_dim = seq_dim(layout)
        mq, mk = (torch.empty(u * x.shape[s_dim], x.shape[1 - s_dim], x.shape[2] * m // u, x.shape[3],
                              dtype=x.dtype, device="meta") for x, m in ((q, 1), (k, r)))
        plans = plans_for(mq, mk, mesh, causal, "sbhd", partial_dtype, planner)
    elif (plans[0].a, plans[0].b, plans[1].a, plans[1].b) != (mesh.shape.a, mesh.shape.b) * 2:
        raise ValueError(f"plans are for {plans[0].a}x{plans[0].b}, the mesh is {mesh.shape}")
    return blk, scale, plans


def _signature(q, k, mesh, causal, layout, partial_dtype, check_finite, deterministic, prepared,
               spec: Optional[PackedSpec] = None) -> dict:
    """The fields every rank of the CP group must agree on (None where this rank could not tell)."""
    blk, scale, plans = prepared or (None, None, None)
    dims = [None] * 5
    if prepared is not None:
        s_dim = seq_dim(layout)
        dims = [q.shape[1 - s_dim], q.shape[s_dim], q.shape[2], k.shape[2], q.shape[3]]
    return {
        "layout": layout, "batch": dims[0], "local sequence length": dims[1], "query heads": dims[2],
        "kv heads": dims[3], "head dim": dims[4], "dtype": str(getattr(q, "dtype", None)), "causal": bool(causal),
        "softmax_scale": scale, "partial_dtype": str(partial_dtype), "kernel": repr(blk) if blk else None,
        "forward plan": plan_digest(plans[0]) if plans else None,
        "backward plan": plan_digest(plans[1]) if plans else None,
        "mesh shape": str(mesh.shape), "ulysses": getattr(mesh, "ulysses", 1), "check_finite": bool(check_finite), "deterministic": bool(deterministic),
        "cu_seqlens_padded": spec.cu_padded if spec is not None else None,
        "cu_seqlens": spec.cu_real if spec is not None else None,
    }


def _comm_device(mesh):
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend(mesh.cp_group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _check_finite(mesh, what: str, *tensors) -> None:
    bad = not all(bool(torch.isfinite(t).all()) for t in tensors)
    group = getattr(mesh, "cp_group", None)
    if group is None:
        if bad:
            raise ValueError(f"mesh attention (check_finite): non-finite values (NaN or Inf) in {what}")
        return
    any_rank("mesh attention (check_finite)", bad, group, _comm_device(mesh), f"non-finite values (NaN or Inf) in {what}")


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
    check_finite: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_padded: Optional[torch.Tensor] = None,
):
    """Context-parallel attention over ``mesh`` (a :class:`~megatron_mesh_cp.MeshGroups`).

    With ``mesh.ulysses = u > 1`` (``a2a+mesh``) the inputs go through an all-to-all over heads in
    the Ulysses group first and the mesh runs over the n/u super-ranks on h/u heads; inputs and
    outputs are the same either way.

    q: ``[b, s_local, h, d]`` and k, v: ``[b, s_local, h_kv, d]`` (``layout="bshd"``; ``"sbhd"``
    swaps the first two dims), each rank holding its zigzag share (pieces g and 2n-1-g). Returns
    the local output in the same layout, plus the fp32 lse ``[b, h, s_local]`` if ``return_lse``.
    ``planner`` picks how the (forward, backward) schedule is built (``greedy``: tuned for the
    mesh's cluster, ``mesh.cluster``; ``in-order``), ``plans`` passes one explicitly;
    ``kernel`` forces a block-kernel backend; ``deterministic`` asks it for a deterministic backward
    (Megatron's ``--deterministic-mode``; off by default, as some GPUs have no such TE backend).
    ``partial_dtype`` is the wire dtype of partial results (O, dQ, dK/dV); the default keeps them
    in fp32, exact to accumulation precision; the input dtype halves their bytes.
    ``softmax_scale``: any positive real scalar (Python or numpy number, 0-d tensor; a tensor is read
    to the host once per object and in-place change, so passing the same one every call costs no sync).
    ``check_finite=True`` checks q, k, v (and, in backward, the output gradient) for NaN/Inf on
    every call and raises the same ``ValueError`` on every rank, naming the ranks that have them,
    before any ring transfer (one tiny collective per call, and a device sync on GPU).

    Packed sequences: ``layout="thd"`` (q ``[t_local, h, d]``, k/v ``[t_local, h_kv, d]``), causal,
    each rank holding its per-document zigzag share (``packed.thd_shard``; Megatron's
    ``get_batch_on_this_cp_rank``); ``cu_seqlens_padded``: the global document offsets, every
    document a multiple of 2·CP long; ``cu_seqlens``: the real ones (padding at each document's
    end: zero output rows, lse = -inf). The offsets are read to the host once per tensor object
    and agreed across the CP group once per new batch. lse is ``[h, t_local]``.

    Every rank of the CP group must make the same call: the first call with a new signature
    checks that with one small collective on ``mesh.cp_group`` and raises the same ``ValueError``
    on every rank otherwise (agree.py); input errors found on one rank are raised on all.
    """
    _check_mesh(mesh)
    spec, packed_error = None, None
    if layout == "thd" or cu_seqlens is not None or cu_seqlens_padded is not None:
        try:
            q, k, v, spec = _as_packed(q, k, v, layout, cu_seqlens, cu_seqlens_padded)
            layout = "sbhd"
        except ValueError as exc:
            packed_error = exc
    key = None if packed_error else _call_key(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans,
                                              partial_dtype, planner, check_finite, deterministic, spec)
    calls = _agreed_calls(mesh)
    prepared = calls.get(key) if key is not None else None
    if prepared is None:
        error = packed_error
        try:
            if error is None:
                prepared = _prepare(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype,
                                    planner, deterministic, spec)
        except ValueError as exc:
            error = exc
        if getattr(mesh, "cp_group", None) is not None:
            fields = _signature(q, k, mesh, causal, layout, partial_dtype, check_finite, deterministic, prepared, spec)
            agree("mesh attention", fields, mesh.cp_group, _comm_device(mesh), error)
        if error is not None:  # only without a CP group: agree() raised it on every rank otherwise
            raise error
        if spec is not None:  # the batch's reorder and padding rows, made once per new batch
            u = getattr(mesh, "ulysses", 1)
            n = u * mesh.shape.n
            prepared += ((PackedLayout(spec, n, u, q.device), padding_rows(spec, n, mesh.position, q.device)),)
        else:
            prepared += (None,)
        if key is not None:
            calls[key] = prepared
            while len(calls) > MAX_AGREED:
                calls.popitem(last=False)
    else:
        calls.move_to_end(key)
    blk, scale, plans, packed = prepared
    if check_finite:
        _check_finite(mesh, "q, k or v", q, k, v)
    if layout == "bshd":  # the executor is sequence-major
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    u = getattr(mesh, "ulysses", 1)
    lay = packed[0] if packed is not None else None
    if u > 1:  # a2a+mesh: all-to-all over heads in the Ulysses group around the unchanged mesh
        q, k, v = UlyssesIn.apply(q, k, v, mesh, kv_repeats(q.shape[2], k.shape[2], u), lay)
    elif lay is not None:  # packed: the batch's half-major order (packed.py)
        q, k, v = (lay.into_mesh(x) for x in (q, k, v))
    out, lse = _MeshAttention.apply(q, k, v, mesh, bool(causal), scale, blk, plans, partial_dtype, bool(check_finite),
                                    lay.varlen if lay is not None else None)
    if u > 1:
        out, lse = UlyssesOut.apply(out, lse, mesh, bool(return_lse), lay)
    elif lay is not None:
        out = lay.out_of_mesh(out)
        lse = lse.index_select(2, lay.from_mesh) if return_lse else lse
    if packed is not None:
        pad = packed[1]
        if pad is not None:  # padding rows: zero output (so zero gradient), lse = -inf
            out = out.masked_fill(pad.view(-1, 1, 1, 1), 0)
            lse = lse.masked_fill(pad.view(1, 1, -1), float("-inf")) if return_lse else lse
        out = out[:, 0]  # back to thd: [t, h, d]; lse [h, t]
        lse = lse[0] if return_lse else lse
    if layout == "bshd":
        out = out.transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


def _as_packed(q, k, v, layout, cu_seqlens, cu_seqlens_padded):
    """thd ``[t, h, d]`` tensors as sbhd with batch 1, and the batch's PackedSpec (host offsets)."""
    if layout != "thd":
        raise ValueError(f"packed sequences (cu_seqlens) take layout='thd' ([t, h, d] tensors), not {layout!r}")
    if cu_seqlens is None and cu_seqlens_padded is None:
        raise ValueError("layout='thd' needs the documents: pass cu_seqlens_padded (and cu_seqlens for padding)")
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D [t, h, d] tensor with layout='thd', got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), packed_spec(cu_seqlens, cu_seqlens_padded)
