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

Documents on the ordinary layout (``layout="bshd"``/``"sbhd"`` with ``cu_seqlens`` alone: global
offsets of documents of any length, batch 1): the documents join the signature too; the plans are
the cached full plans pruned to the blocks some rank needs (prune.py), and each rank runs every
block as the sub-blocks its documents leave (documents.py).
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .planning.cluster import Workload
from .planning.schedule import build_plans, default_cluster
from .runtime.agree import agree, any_rank, plan_digest
from .runtime.documents import DocumentMask, Documents, check_window, documents_of
from .runtime.execute import Executor
from .runtime.hybrid import UlyssesIn, UlyssesOut
from .runtime.kernels import BlockKernel, lse_dtype, select_kernel
from .runtime.layout import LAYOUTS, seq_dim
from .runtime.packed import PackedLayout, PackedSpec, packed_spec, padding_rows
from .runtime.plan import Plan
from .runtime.prune import prune
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
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same heads, got {tuple(k.shape)} and {tuple(v.shape)}")
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


def plans_for(q, k, mesh, causal: bool, layout: str, partial_dtype, planner: str,
              chains: str = "auto", v_head_dim: Optional[int] = None) -> Tuple[Plan, Plan]:
    """The cached (forward, backward) plans for these inputs on ``mesh`` (greedy: tuned for its
    cluster; ``chains="both-ways"`` for the full plans that documents prune; ``v_head_dim``: V's head
    dim where it differs from q/k's, MLA, so the plans are tuned for what the chunks weigh)."""
    s_dim = seq_dim(layout)
    b_dim = 1 - s_dim
    acc = lse_dtype(q.dtype)
    w = Workload(
        seq_local=q.shape[s_dim], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        batch=q.shape[b_dim], causal=bool(causal), bytes_per_element=q.element_size(),
        partial_bytes=(partial_dtype or acc).itemsize, head_dim_v=v_head_dim,
    )
    cluster = getattr(mesh, "cluster", None) or default_cluster()
    # a2a+mesh: consecutive super-ranks are u CP ranks apart
    stride = getattr(mesh, "stride", 1) * getattr(mesh, "ulysses", 1)
    return build_plans(mesh.shape.a, mesh.shape.b, planner, cluster=cluster, workload=w, stride=stride,
                       max_live=getattr(mesh, "max_live", None), chains=chains)


@dataclass(frozen=True)
class _Call:
    """What one mesh call runs with, besides its tensors (made once per agreed signature)."""

    mesh: object
    causal: bool
    scale: float
    kernel: BlockKernel
    plans: Tuple[Plan, Plan]
    partial_dtype: Optional[torch.dtype]
    check_finite: bool
    varlen: object = None  # packed THD: the batch's Varlen
    sub_blocks: object = None  # documents / windows: this rank's kernel calls per block
    max_logit: bool = False


@dataclass(frozen=True)
class _Variant:
    """A call's attention variant: sliding window (as given), sink (shape, dtype, device of the
    tensor), whether the max logit is asked for. Part of the call signature."""

    window: Optional[tuple] = None
    sink: Optional[tuple] = None
    max_logit: bool = False

    @classmethod
    def of(cls, window, sink, max_logit) -> "_Variant":
        """From the user's arguments (``TypeError`` if they cannot be a signature)."""
        w = None if window is None else tuple(window)
        hash(w)
        sk = None if sink is None else ((tuple(sink.shape), sink.dtype, sink.device) if isinstance(sink, torch.Tensor)
                                        else ("not a tensor", type(sink).__name__))
        return cls(w, sk, bool(max_logit))


def _check_sink(variant: _Variant, q) -> None:
    if variant.sink is None:
        return
    h = q.shape[2]
    if variant.sink != ((h,), torch.float32, q.device):
        raise ValueError(f"sink must be an fp32 tensor [{h}] (one logit per local query head) on {q.device}, got "
                         f"{variant.sink}")


class _MeshAttention(torch.autograd.Function):
    """Sequence-major ([s, b, h, d]) in and out; lse out as [b, h, s] fp32 (the sink included);
    with ``call.max_logit`` also this rank's max logit [h] (not reduced)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, call: _Call):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ex = Executor(call.plans[0], call.mesh.comm(), call.kernel, causal=call.causal, scale=call.scale,
                      tensors={"q": q, "k": k, "v": v}, partial_dtype=call.partial_dtype,
                      buffers=getattr(call.mesh, "buffers", None), varlen=call.varlen, sub_blocks=call.sub_blocks,
                      sink=None if sink is None else sink.detach(), max_logit=call.max_logit)
        out, lse, *top = ex.run()
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.call = call
        lse_out = lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse_out, *top)
        return (out, lse_out, *top)

    @staticmethod
    def backward(ctx, dout, _dlse, *_dtop):
        q, k, v, out, lse, sink = ctx.saved_tensors
        call = ctx.call
        dout = dout.contiguous()
        if call.check_finite:
            _check_finite(call.mesh, "the output gradient", dout)
        acc = lse_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
        tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "delta": delta}
        ex = Executor(call.plans[1], call.mesh.comm(), call.kernel, causal=call.causal, scale=call.scale,
                      tensors=tensors, partial_dtype=call.partial_dtype, buffers=getattr(call.mesh, "buffers", None),
                      varlen=call.varlen, sub_blocks=call.sub_blocks)
        dq, dk, dv = ex.run()
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:  # the sink is a key of value 0: -sum P_sink * delta
            dsink = sink_grad(sink, lse, delta)
        return dq, dk, dv, dsink, None


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The sink logits' gradient from this rank's rows: ``-sum_rows exp(sink - lse) * delta`` per
    head (``lse`` the final one, sink included; ``delta = rowsum(dout * out)``, both ``[s, b, h]``)."""
    p = torch.exp(sink.to(lse.dtype) - lse)
    return -(p * delta.to(lse.dtype)).sum(dim=(0, 1)).to(sink.dtype)


def _agreed_calls(mesh) -> "OrderedDict":
    calls = getattr(mesh, "_agreed_calls", None)
    if calls is None:
        calls = mesh._agreed_calls = OrderedDict()
    return calls


def _call_key(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype, planner, check_finite,
              deterministic, spec=None, variant: Optional[_Variant] = None):
    """What a call's validation, planning and agreement depend on (None: not even tensors)."""
    try:
        tensors = tuple((tuple(x.shape), x.dtype, x.device) for x in (q, k, v))
        scale = None if softmax_scale is None else resolve_scale(softmax_scale, 1)
    except (AttributeError, TypeError, ValueError):
        return None
    plan_ids = None if plans is None else tuple(id(p) for p in plans)
    return (tensors, bool(causal), scale, layout, kernel if isinstance(kernel, str) else id(kernel), plan_ids,
            partial_dtype, planner, id(getattr(mesh, "cluster", None)), getattr(mesh, "stride", 1), bool(check_finite),
            bool(deterministic), spec, variant)


def _prepare(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype, planner, deterministic,
             spec=None, variant: _Variant = _Variant()):
    """Local validation and planning: ``(kernel, scale, plans, mask)``; ``ValueError`` naming the fix.
    ``spec``: packed THD documents (PackedSpec) or documents on the ordinary layout (Documents);
    ``variant``: sliding window, sink, max logit."""
    check_inputs(q, k, v, mesh, layout, softmax_scale)
    n = getattr(mesh, "ulysses", 1) * mesh.shape.n
    window = check_window(variant.window, causal)
    _check_sink(variant, q)
    if window is not None and isinstance(spec, PackedSpec):
        raise ValueError("a sliding window with packed THD (padded) documents is not built; pass the documents as "
                         "cu_seqlens on the ordinary layout (layout 'bshd'/'sbhd'), which takes windows")
    if isinstance(spec, PackedSpec):
        spec.check(q.shape[seq_dim(layout)] * n, n)
        if not causal:
            raise ValueError("packed sequences (THD) need causal=True (Megatron's padding_causal mask); "
                             "per-document non-causal attention is not supported")
    elif spec is not None:
        spec.check(q.shape[seq_dim(layout)] * n)
        batch = q.shape[1 - seq_dim(layout)]
        if batch != 1:
            raise ValueError(f"document masking (cu_seqlens with layout {layout!r}) takes one sequence per call, got "
                             f"batch {batch}; run one sequence per micro-batch (Megatron: --micro-batch-size 1)")
    # the kernels see sequence-major blocks: ask them with sequence-major views (TE reads max_seqlen from dim 0)
    sq, sk, sv = (x.transpose(0, 1) if seq_dim(layout) == 1 else x for x in (q, k, v))
    blk = select_kernel(kernel, sq, sk, deterministic=deterministic, packed=spec is not None, v=sv)
    if window is not None:
        blk.check_window(sq, sk, sv, documents=isinstance(spec, Documents))
    if variant.max_logit:
        if isinstance(spec, PackedSpec):
            spec.check_max_logit()
        blk.check_max_logit(sq, packed=spec is not None)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if partial_dtype is not None and (not isinstance(partial_dtype, torch.dtype) or not partial_dtype.is_floating_point):
        raise ValueError(f"partial_dtype must be a floating torch.dtype or None, got {partial_dtype!r}")
    if plans is None:  # for what the mesh sees: a2a+mesh gives it u times the tokens on h/u heads
        u = getattr(mesh, "ulysses", 1)
        r = kv_repeats(q.shape[2], k.shape[2], u) if u > 1 else 1
        s_dim = seq_dim(layout)
        mq, mk = (torch.empty(u * x.shape[s_dim], x.shape[1 - s_dim], x.shape[2] * m // u, x.shape[3],
                              dtype=x.dtype, device="meta") for x, m in ((q, 1), (k, r)))
        plans = plans_for(mq, mk, mesh, causal, "sbhd", partial_dtype, planner,
                          "both-ways" if isinstance(spec, Documents) or window is not None else "auto", v.shape[3])
    elif (plans[0].a, plans[0].b, plans[1].a, plans[1].b) != (mesh.shape.a, mesh.shape.b) * 2:
        raise ValueError(f"plans are for {plans[0].a}x{plans[0].b}, the mesh is {mesh.shape}")
    mask = None
    if isinstance(spec, Documents) or window is not None:  # blocks nothing attends to leave the plans
        mask = DocumentMask(spec if isinstance(spec, Documents) else None, mesh.shape.n, causal, window,
                            total=q.shape[seq_dim(layout)] * n)
        keep = mask.needed(mesh.shape)
        plans = (prune(plans[0], keep), prune(plans[1], keep))
    return blk, scale, plans, mask


def _signature(q, k, mesh, causal, layout, partial_dtype, check_finite, deterministic, prepared,
               spec: Optional[PackedSpec] = None, variant: Optional[_Variant] = None) -> dict:
    """The fields every rank of the CP group must agree on (None where this rank could not tell)."""
    blk, scale, plans = prepared[:3] if prepared else (None, None, None)
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
        "cu_seqlens_padded": spec.cu_padded if isinstance(spec, PackedSpec) else None,
        "cu_seqlens": spec.cu_real if isinstance(spec, PackedSpec) else None,
        "documents": spec.cu if isinstance(spec, Documents) else None,
        "attention variant": repr(variant),
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
    window: Optional[Tuple[int, int]] = None,
    sink: Optional[torch.Tensor] = None,
    return_max_logit: bool = False,
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

    Documents of any length on the ordinary layout: ``cu_seqlens`` alone (global offsets, int32,
    0 .. S) with ``bshd``/``sbhd`` and batch 1; a token sees its own document only. ``window`` =
    (left, right): query i sees key j iff i - left <= j <= i + right (-1: unbounded; causal: right
    0), flash-attn's ``window_size``. Both run the pruned plans (blocks nothing sees are not
    computed, chunks nothing needs are not sent).

    ``sink``: fp32 ``[h]`` learnable sink logits (gpt-oss): every row's softmax denominator gains
    exp(sink_h); its gradient on this rank covers this rank's rows (reduce it over the CP group like
    any parameter's; Megatron does). ``return_max_logit``: also return the fp32 ``[h]`` maximum of
    ``scale * q.k`` over every allowed pair of the whole sequence (under ``te`` rounded to the input
    dtype, as TE returns it), the same on every rank (one tiny all-reduce). Returns ``out``, then
    ``lse`` if asked, then the max logit if asked.

    Every rank of the CP group must make the same call: the first call with a new signature
    checks that with one small collective on ``mesh.cp_group`` and raises the same ``ValueError``
    on every rank otherwise (agree.py); input errors found on one rank are raised on all.
    """
    _check_mesh(mesh)
    spec, packed_error, variant = None, None, None
    try:
        variant = _Variant.of(window, sink, return_max_logit)
        if layout == "thd" or cu_seqlens_padded is not None:
            q, k, v, spec = _as_packed(q, k, v, layout, cu_seqlens, cu_seqlens_padded)
            layout = "sbhd"
        elif cu_seqlens is not None:  # documents on the ordinary layout
            spec = documents_of(cu_seqlens)
    except TypeError:
        packed_error = ValueError(f"window must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window!r}")
    except ValueError as exc:
        packed_error = exc
    key = None if packed_error else _call_key(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans,
                                              partial_dtype, planner, check_finite, deterministic, spec, variant)
    calls = _agreed_calls(mesh)
    prepared = calls.get(key) if key is not None else None
    if prepared is None:
        error = packed_error
        try:
            if error is None:
                prepared = _prepare(q, k, v, mesh, causal, softmax_scale, layout, kernel, plans, partial_dtype,
                                    planner, deterministic, spec, variant)
        except ValueError as exc:
            error = exc
        if getattr(mesh, "cp_group", None) is not None:
            fields = _signature(q, k, mesh, causal, layout, partial_dtype, check_finite, deterministic, prepared, spec,
                                variant)
            agree("mesh attention", fields, mesh.cp_group, _comm_device(mesh), error)
        if error is not None:  # only without a CP group: agree() raised it on every rank otherwise
            raise error
        blk, scale, plans, mask = prepared
        packed = sub_blocks = None
        if isinstance(spec, PackedSpec):  # the batch's reorder and padding rows, made once per new batch
            u = getattr(mesh, "ulysses", 1)
            n = u * mesh.shape.n
            packed = (PackedLayout(spec, n, u, q.device), padding_rows(spec, n, mesh.position, q.device))
        elif mask is not None:  # this rank's kernel calls per block, made once per new batch
            sub_blocks = mask.rank_parts(mesh.shape, getattr(mesh, "mesh_position", mesh.position), q.device)
        prepared = (blk, scale, plans, packed, sub_blocks)
        if key is not None:
            calls[key] = prepared
            while len(calls) > MAX_AGREED:
                calls.popitem(last=False)
    else:
        calls.move_to_end(key)
    blk, scale, plans, packed, sub_blocks = prepared
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
    call = _Call(mesh, bool(causal), scale, blk, plans, partial_dtype, bool(check_finite),
                 lay.varlen if lay is not None else None, sub_blocks, bool(return_max_logit))
    slot = mesh.position % u
    if sink is not None and u > 1:  # this member's head group (ulysses.heads_to_members)
        sink = sink.view(u, -1)[slot]
    out, lse, *top = _MeshAttention.apply(q, k, v, sink, call)
    if top:
        top = _all_max_logit(mesh, top[0], u, slot)
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
    return (out,) + ((lse,) if return_lse else ()) + tuple(top) if (return_lse or return_max_logit) else out


def _all_max_logit(mesh, top: torch.Tensor, u: int, slot: int) -> list:
    """This rank's max logit of its (inner) heads -> all local heads' max over the CP group."""
    import torch.distributed as dist

    if u > 1:  # the other members hold the other head groups
        full = torch.full((u, top.numel()), float("-inf"), dtype=top.dtype, device=top.device)
        full[slot] = top
        top = full.flatten()
    group = getattr(mesh, "cp_group", None)
    if group is not None:
        device = _comm_device(mesh)
        x = top.to(device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        top = x.to(top.device)
    return [top]


def _as_packed(q, k, v, layout, cu_seqlens, cu_seqlens_padded):
    """thd ``[t, h, d]`` tensors as sbhd with batch 1, and the batch's PackedSpec (host offsets)."""
    if layout != "thd":
        raise ValueError(f"cu_seqlens_padded (documents padded to a multiple of 2*CP) takes layout='thd' ([t, h, d] "
                         f"tensors), not {layout!r}; for documents of any length in the {layout} layout pass "
                         "cu_seqlens alone")
    if cu_seqlens is None and cu_seqlens_padded is None:
        raise ValueError("layout='thd' needs the documents: pass cu_seqlens_padded (and cu_seqlens for padding)")
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D [t, h, d] tensor with layout='thd', got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), packed_spec(cu_seqlens, cu_seqlens_padded)
