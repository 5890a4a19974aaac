"""One mesh-attention call as a value: its specification, every rule it must meet, and what it runs.

``mesh_attention`` (process groups) and ``virtual_mesh_attention`` (all ranks in one process) take
the same arguments and run the same pipeline; they differ only in how tokens are sharded and how
ranks exchange data. Both turn their arguments into a :class:`CallSpec` with :func:`resolve` --
every rule checked once, each by one function below, each error naming its fix -- and the spec into
a :class:`Prepared` call with :func:`prepare`: the block kernel chosen for what the blocks need, the
(forward, backward) plans for the mesh (pruned to the blocks the mask leaves) and the mask's block
engine. The spec is also what the ranks of a CP group agree on (:func:`agreement`), and what the
mesh's call cache keys (:class:`~megatron_mesh_cp.runtime.mesh.CallCache`).
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

import torch

from .planning import Workload, call_plans
from .runtime.agree import plan_digest
from .runtime.kernels import BlockKernel, KernelNeeds, input_spec, lse_dtype, select_kernel
from .runtime.layout import LAYOUTS, seq_dim
from .runtime.masks import (
    FULL, Mask, PackedDocuments, Window, as_mask, documents_of, intersect, packed_documents,
)
from .runtime.mesh import MeshLike
from .runtime.packed import PackedLayout, padding_rows
from .runtime.plan import Plan
from .runtime.ulysses import check_ulysses_heads, kv_repeats

__all__ = ["CallSpec", "Prepared", "resolve", "prepare", "plan", "agreement", "resolve_scale", "call_mask", "call_key"]

ALL_LAYOUTS = LAYOUTS + ("thd",)


@dataclass(frozen=True)
class CallSpec:
    """What one mesh attention call runs with besides its tensors, resolved and validated.

    Shapes are the local (per CP rank) ones, sequence-major: ``seq`` tokens, ``batch`` sequences
    (1 for ``thd``), ``heads`` / ``kv_heads`` of ``head_dim`` (V: ``v_head_dim``). ``mask`` holds
    the documents, window and chunks as one value; ``kernel`` the backend asked for (a name or an
    instance); ``plans`` plans passed explicitly (None: planned for this call)."""

    layout: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float
    mask: Mask
    kernel: Union[str, BlockKernel]
    plans: Optional[Tuple[Plan, Plan]]
    partial_dtype: Optional[torch.dtype]
    planner: str
    deterministic: bool
    check_finite: bool
    sink: bool
    max_logit: bool
    shape: object  # the mesh's MeshShape (super-ranks under a2a+mesh)
    ulysses: int
    plan_options: object  # the mesh's PlanOptions

    @property
    def cp(self) -> int:
        """CP size: u * a * b."""
        return self.ulysses * self.shape.n

    @property
    def total(self) -> int:
        """Tokens of the whole sequence (of one batch entry)."""
        return self.seq * self.cp

    @property
    def packed(self) -> bool:
        """Packed THD documents (their own layout: per-document zigzag, half-major in the mesh)."""
        return isinstance(self.mask, PackedDocuments)

    def block_dims(self) -> Tuple[Tuple[int, int, int, int], Tuple[int, int, int, int]]:
        """(q, k) shapes ``[s, b, h, d]`` of what the mesh's blocks see: under a2a+mesh u times the
        tokens on h/u query heads and (replicated where needed) kv heads."""
        u = self.ulysses
        r = kv_repeats(self.heads, self.kv_heads, u) if u > 1 else 1
        q = (u * self.seq, self.batch, self.heads // u, self.head_dim)
        k = (u * self.seq, self.batch, self.kv_heads * r // u, self.head_dim)
        return q, k

    def kernel_needs(self) -> KernelNeeds:
        """What the block kernels must support for this call, with the shapes the blocks run."""
        q, k = self.block_dims()
        mask = self.mask.kernel_needs()
        return KernelNeeds(
            q=input_spec(q, self.dtype, self.device), k=input_spec(k, self.dtype, self.device),
            v=input_spec(k[:3] + (self.v_head_dim,), self.dtype, self.device),
            deterministic=self.deterministic, varlen=mask["varlen"], window=mask["window"],
            window_documents=mask["window_documents"], max_logit=self.max_logit,
            max_logit_packed=self.max_logit and (mask["varlen"] or mask["padded"]),
        )


# --- the rules, one function each -------------------------------------------------------------------


def check_mesh(mesh, process_groups: bool = True) -> None:
    """A mesh of the mesh protocol; ``process_groups``: one over real process groups (a MeshGroups)."""
    if not isinstance(mesh, MeshLike) or (process_groups and not hasattr(mesh, "cp_group")):
        raise ValueError(
            f"mesh must be a MeshGroups (MeshGroups.create((a, b)) or MeshGroups.from_groups(...)), "
            f"got {type(mesh).__name__}"
        )


def check_layout(layout: str) -> None:
    if layout not in ALL_LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (or 'thd' with cu_seqlens for packed sequences), "
                         f"got {layout!r}")


def check_tensors(q, k, v, layout: str) -> None:
    """Tensors of one floating dtype on one device, 4-D (3-D for thd)."""
    dims = 3 if layout == "thd" else 4
    for name, x in zip("qkv", (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != dims:
            if layout == "thd":
                raise ValueError(f"{name} must be a 3-D [t, h, d] tensor with layout='thd', got {tuple(x.shape)}")
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ ({q.device}, {k.device}, {v.device}); move them to one device")


def check_shapes(q, k, v, layout: str) -> None:
    """Self-attention shapes: equal batch and length, K and V alike, heads a multiple of kv heads."""
    if layout != "thd":
        s_dim = seq_dim(layout)
        b_dim = 1 - s_dim
        if not (q.shape[b_dim] == k.shape[b_dim] == v.shape[b_dim]):
            raise ValueError(
                f"batch sizes differ: q {q.shape[b_dim]}, k {k.shape[b_dim]}, v {v.shape[b_dim]} "
                f"(layout {layout!r}: batch is dim {b_dim}); is the layout right?"
            )
    else:
        s_dim = 0
    if not (q.shape[s_dim] == k.shape[s_dim] == v.shape[s_dim]):
        raise ValueError(
            f"local sequence lengths differ: q {q.shape[s_dim]}, k {k.shape[s_dim]}, v {v.shape[s_dim]} "
            f"(layout {layout!r}: sequence is dim {s_dim}); self-attention needs equal lengths"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} differs from k/v head dim {k.shape[-1]}")
    h, hk = q.shape[-2], k.shape[-2]
    if hk < 1 or h % hk:
        raise ValueError(
            f"query heads ({h}) must be a multiple of kv heads ({hk}); "
            "use num_query_groups that divides num_attention_heads"
        )


def check_divisible(seq_local: int, cp: int) -> None:
    """The zigzag layout cuts the sequence into 2 * CP equal pieces."""
    if seq_local % 2:
        raise ValueError(
            f"sequence length {seq_local * cp} (local {seq_local} x CP {cp}) is not divisible by 2*CP = {2 * cp}; "
            f"pad the sequence to a multiple of {2 * cp}"
        )


#: tensor scales already read to the host, by object: id -> (tensor, version, value); reading a CUDA
#: tensor syncs the device, so a scale tensor passed on every call is read once per in-place change
_SCALES: "OrderedDict[int, tuple]" = OrderedDict()


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


def check_sink(sink, heads: int, device) -> None:
    if sink is None:
        return
    got = (tuple(sink.shape), sink.dtype, sink.device) if isinstance(sink, torch.Tensor) else (
        "not a tensor", type(sink).__name__)
    if got != ((heads,), torch.float32, device):
        raise ValueError(f"sink must be an fp32 tensor [{heads}] (one logit per local query head) on {device}, got "
                         f"{got}")


def check_partial_dtype(partial_dtype) -> None:
    if partial_dtype is not None and (not isinstance(partial_dtype, torch.dtype) or not partial_dtype.is_floating_point):
        raise ValueError(f"partial_dtype must be a floating torch.dtype or None, got {partial_dtype!r}")


def check_plans(plans, shape) -> None:
    if plans is not None and (plans[0].a, plans[0].b, plans[1].a, plans[1].b) != (shape.a, shape.b) * 2:
        raise ValueError(f"plans are for {plans[0].a}x{plans[0].b}, the mesh is {shape}")


def call_mask(layout: str, cu_seqlens=None, cu_seqlens_padded=None, window=None, mask=None) -> Mask:
    """The one mask value of a call's mask arguments: ``cu_seqlens`` alone on bshd/sbhd (documents),
    with ``layout="thd"`` (and ``cu_seqlens_padded``) packed documents, ``window`` and ``mask`` (any
    mask value, e.g. :class:`~megatron_mesh_cp.runtime.masks.Chunked`) intersected with them."""
    if layout == "thd" or cu_seqlens_padded is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens_padded (documents padded to a multiple of 2*CP) takes layout='thd' "
                             f"([t, h, d] tensors), not {layout!r}; for documents of any length in the {layout} "
                             "layout pass cu_seqlens alone")
        docs = packed_documents(cu_seqlens, cu_seqlens_padded)
        if docs is None:
            raise ValueError("layout='thd' needs the documents: pass cu_seqlens_padded (and cu_seqlens for padding)")
    else:
        docs = documents_of(cu_seqlens) if cu_seqlens is not None else None
    win = None
    if window is not None:
        try:
            left, right = window
            win = Window(left, right)
        except (TypeError, ValueError):
            raise ValueError(f"window must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window!r}") \
                from None
    return intersect(docs, win, as_mask(mask))


def resolve(q, k, v, mesh, *, causal: bool = True, softmax_scale=None, layout: str = "bshd",
            kernel: Union[str, BlockKernel] = "auto", plans=None, partial_dtype=None, planner: str = "greedy",
            deterministic: bool = False, check_finite: bool = False, mask: Mask = FULL, sink=None,
            return_max_logit: bool = False) -> CallSpec:
    """The :class:`CallSpec` of a call on ``mesh`` with local tensors ``q, k, v`` in ``layout``; every
    rule checked, ``ValueError`` naming the fix. ``mask`` is the one mask value (:func:`call_mask`)."""
    check_layout(layout)
    check_mesh(mesh, process_groups=False)
    check_tensors(q, k, v, layout)
    check_shapes(q, k, v, layout)
    u, shape = mesh.ulysses, mesh.shape
    cp = u * shape.n
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if u > 1:
        check_ulysses_heads(heads, kv_heads, u, cp)
    s_dim = 0 if layout == "thd" else seq_dim(layout)
    seq, batch = q.shape[s_dim], 1 if layout == "thd" else q.shape[1 - s_dim]
    check_divisible(seq, cp)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if layout == "thd" and not isinstance(mask, PackedDocuments):
        raise ValueError("packed sequences take layout='thd' together with cu_seqlens / cu_seqlens_padded")
    mask.check(seq * cp, cp, bool(causal), batch)
    if return_max_logit and mask.max_logit_error:
        raise ValueError(mask.max_logit_error)
    check_sink(sink, heads, q.device)
    check_partial_dtype(partial_dtype)
    check_plans(plans, shape)
    return CallSpec(
        layout=layout, batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=q.shape[-1],
        v_head_dim=v.shape[-1], dtype=q.dtype, device=q.device, causal=bool(causal), scale=scale, mask=mask,
        kernel=kernel, plans=plans, partial_dtype=partial_dtype, planner=planner, deterministic=bool(deterministic),
        check_finite=bool(check_finite), sink=sink is not None, max_logit=bool(return_max_logit), shape=shape,
        ulysses=u, plan_options=mesh.plan_options,
    )


# --- what a call runs -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Prepared:
    """A resolved call ready to run: its kernel, plans (pruned to the mask's blocks) and the mask's
    block engine over the mesh's chunks (made once per spec; per rank: :meth:`for_rank`)."""

    spec: CallSpec
    kernel: BlockKernel
    plans: Tuple[Plan, Plan]
    blocks: object

    def for_rank(self, mesh_position: int, cp_position: int, device) -> "RankCall":
        """What one rank runs: its kernel calls per masked block, and for packed THD the batch's
        reorder and padding rows (made once per batch)."""
        spec = self.spec
        parts = self.blocks.rank_parts(spec.shape, mesh_position, device)
        packed = pad = None
        if spec.packed:
            packed = PackedLayout(spec.mask, spec.cp, spec.ulysses, device)
            pad = padding_rows(spec.mask, spec.cp, cp_position, device)
        return RankCall(self, parts, packed, pad)


@dataclass(frozen=True, eq=False)
class RankCall:
    """One rank's share of a prepared call."""

    call: Prepared
    parts: Optional[dict]  # (q offset, kv offset) -> kernel calls; None: unmasked
    packed: Optional[PackedLayout]  # packed THD: the batch's half-major reorder
    padding: Optional[torch.Tensor]  # packed THD: this rank's padding rows (None: none)


def prepare(spec: CallSpec) -> Prepared:
    """Kernel, plans and block engine of ``spec``; ``ValueError`` naming the fix if no kernel can run it."""
    blk = select_kernel(spec.kernel, spec.kernel_needs())
    plans, blocks = plan(spec)
    return Prepared(spec, blk, plans, blocks)


def plan(spec: CallSpec):
    """``((forward, backward) plans, block engine)`` of ``spec``: the plans for the mesh's blocks
    (planning.call_plans: the full plans, pruned to the blocks the mask leaves) or those given."""
    blocks = spec.mask.bind(spec.shape.n, spec.total, spec.causal)
    plans = spec.plans
    if plans is None:
        q, k = spec.block_dims()
        opts = spec.plan_options
        w = Workload(seq_local=q[0], heads=q[2], kv_heads=k[2], head_dim=spec.head_dim, batch=spec.batch,
                     causal=spec.causal, bytes_per_element=spec.dtype.itemsize,
                     partial_bytes=(spec.partial_dtype or lse_dtype(spec.dtype)).itemsize, head_dim_v=spec.v_head_dim)
        layer = replace(w, mask=spec.mask) if blocks.pruned else None  # the masked layer: plans planned for it
        plans = call_plans(spec.shape.a, spec.shape.b, spec.planner, workload=w, cluster=opts.cluster,
                           stride=opts.stride * spec.ulysses, max_live=opts.max_live, keep=blocks.needed(spec.shape),
                           masked=blocks.pruned, slabs=blocks.zigzag_keys, layer=layer, reorder=opts.reorder,
                           search=opts.search)
    else:
        from .runtime.prune import prune, without_slabs

        keep = blocks.needed(spec.shape)
        if keep is not None:
            plans = (prune(plans[0], keep), prune(plans[1], keep))
        if not blocks.zigzag_keys:
            plans = (without_slabs(plans[0]), without_slabs(plans[1]))
    return plans, blocks


def agreement(spec: Optional[CallSpec], prepared: Optional[Prepared]) -> dict:
    """The fields every rank of the CP group must agree on, in a fixed order (None where this rank
    could not tell). The mask is one field, named by what it holds (documents, window, ...)."""
    ok = spec is not None and prepared is not None
    mask = spec.mask.agreement() if ok else {}
    values = (spec.layout, spec.batch, spec.seq, spec.heads, spec.kv_heads, spec.head_dim, spec.v_head_dim,
              str(spec.dtype), spec.causal, spec.scale, tuple(mask.values()), str(spec.partial_dtype),
              repr(prepared.kernel), plan_digest(prepared.plans[0]), plan_digest(prepared.plans[1]), str(spec.shape),
              spec.ulysses, spec.check_finite, spec.deterministic, spec.sink, spec.max_logit) if ok else (None,) * 21
    names = ("layout", "batch", "local sequence length", "query heads", "kv heads", "head dim", "value head dim",
             "dtype", "causal", "softmax_scale", ", ".join(mask) or "mask", "partial_dtype", "kernel", "forward plan",
             "backward plan", "mesh shape", "ulysses", "check_finite", "deterministic", "sink", "max logit")
    return dict(zip(names, values))


def call_key(q, k, v, mesh, layout, mask, options: tuple):
    """What a call's validation, planning and agreement depend on (None: not even tensors): the
    tensors' shapes, dtypes and devices, the mask value, the options as given and the mesh's."""
    try:
        tensors = tuple((tuple(x.shape), x.dtype, x.device) for x in (q, k, v))
        hash(options)
    except (AttributeError, TypeError):
        return None
    return tensors, layout, mask, options, id(mesh.plan_options)


def sequence_major(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The executor's ``[s, b, h, d]`` view of a tensor in ``layout`` (thd: batch 1)."""
    return x.unsqueeze(1) if layout == "thd" else x.transpose(0, 1) if layout == "bshd" else x


def user_layout(out: torch.Tensor, lse: torch.Tensor, layout: str):
    """Output ``[s, b, h, d]`` and lse ``[b, h, s]`` back in the caller's layout (thd: ``[t, h, d]``, ``[h, t]``)."""
    if layout == "thd":
        return out[:, 0], lse[0] if lse.dim() == 3 else lse
    return (out.transpose(0, 1).contiguous() if layout == "bshd" else out), lse


def sink_slot(sink, u: int, slot: int):
    """Under a2a+mesh a member runs its own head group's sink logits (ulysses.heads_to_members)."""
    return sink if sink is None or u == 1 else sink.view(u, -1)[slot]


__all__ += ["RankCall", "sink_slot", "sequence_major", "user_layout", "check_mesh"]
