"""``mesh_attention``: exact context-parallel attention on an a x b mesh, forward and backward.

Inputs are each rank's zigzag share of the sequence (Megatron's CP layout). Forward gathers Q over
the row ring and KV over the column ring, computes the rank's tile and reduces partial outputs to
their owners; backward re-gathers what it needs and reduces dQ over rows and dK/dV over columns.
Between the passes only the local q, k, v, out and lse are kept, as Ring-Attention would.

This module is the process-group adapter of the call pipeline (call.py): the call is resolved,
prepared and agreed on once per new call (cached on the mesh, ``mesh.calls``), its tensors go
through the Ulysses all-to-all over process groups and the executor runs the plans over the mesh's
rings, inside one autograd node per direction. The ranks of the CP group agree on every new call
with one tiny collective (agree.py), and on every call whose mask changes per batch (documents),
unless the batch's mask was agreed already (:func:`agree_batch`, once per micro-batch).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .call import (
    CallSpec, RankCall, agreement, call_key, call_mask, check_mesh, prepare, resolve, resolve_scale, sequence_major,
    sink_slot, user_layout,
)
from .runtime.agree import agree, any_rank
from .runtime.execute import Executor
from .runtime.hybrid import UlyssesIn, UlyssesOut
from .runtime.kernels import BlockKernel, lse_dtype
from .runtime.masks import Mask
from .runtime.merge import sink_grad
from .runtime.plan import Plan
from .runtime.ulysses import kv_repeats

__all__ = ["mesh_attention", "agree_batch", "resolve_scale"]


class _MeshAttention(torch.autograd.Function):
    """Sequence-major ([s, b, h, d]) in and out; lse out as [b, h, s] fp32 (the sink included);
    with the max logit also this rank's max logit [h] (not reduced)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mesh, rank: RankCall):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        call = rank.call
        spec = call.spec
        ex = Executor(call.plans[0], mesh.comm(), call.kernel, causal=spec.causal, scale=spec.scale,
                      tensors={"q": q, "k": k, "v": v}, partial_dtype=spec.partial_dtype, buffers=mesh.buffers,
                      parts=rank.parts, sink=None if sink is None else sink.detach(), max_logit=spec.max_logit)
        out, lse, *top = ex.run()
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mesh, ctx.rank = mesh, rank
        lse_out = lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse_out, *top)
        return (out, lse_out, *top)

    @staticmethod
    def backward(ctx, dout, _dlse, *_dtop):
        q, k, v, out, lse, sink = ctx.saved_tensors
        mesh, rank = ctx.mesh, ctx.rank
        call = rank.call
        spec = call.spec
        dout = dout.contiguous()
        if spec.check_finite:
            _check_finite(mesh, "the output gradient", dout)
        acc = lse_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
        tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "delta": delta}
        ex = Executor(call.plans[1], mesh.comm(), call.kernel, causal=spec.causal, scale=spec.scale,
                      tensors=tensors, partial_dtype=spec.partial_dtype, buffers=mesh.buffers, parts=rank.parts)
        dq, dk, dv = ex.run()
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:  # the sink is a key of value 0: -sum P_sink * delta
            dsink = sink_grad(sink, lse, delta)
        return dq, dk, dv, dsink, None, None


def _comm_device(mesh):
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend(mesh.cp_group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _check_finite(mesh, what: str, *tensors) -> None:
    bad = not all(bool(torch.isfinite(t).all()) for t in tensors)
    any_rank("mesh attention (check_finite)", bad, mesh.cp_group, _comm_device(mesh),
             f"non-finite values (NaN or Inf) in {what}")


def _options(softmax_scale, causal, kernel, plans, partial_dtype, planner, deterministic, check_finite, sink,
             return_max_logit) -> tuple:
    """The options of a call as its cache key holds them (a tensor scale by its value, plans by identity)."""
    scale = None if softmax_scale is None else resolve_scale(softmax_scale, 1)
    sink_meta = None if sink is None else ((tuple(sink.shape), sink.dtype, sink.device)
                                           if isinstance(sink, torch.Tensor) else ("not a tensor", type(sink).__name__))
    return (scale, bool(causal), kernel, None if plans is None else tuple(id(p) for p in plans), partial_dtype,
            planner, bool(deterministic), bool(check_finite), sink_meta, bool(return_max_logit))


def _prepared(mesh, q, k, v, layout, mask_args, options: dict) -> RankCall:
    """This rank's share of the call: from the mesh's cache, or resolved, prepared and agreed on now.
    Every rank of the CP group raises the same ``ValueError`` for a bad call, before any transfer."""
    error, mask, key, spec, prepared = None, None, None, None, None
    try:
        mask = call_mask(layout, *mask_args)
        key = call_key(q, k, v, mesh, layout, mask, _options(**options))
    except (ValueError, TypeError) as exc:
        error = exc if isinstance(exc, ValueError) else ValueError(str(exc))
    hit = mesh.calls.get(key) if error is None else None
    per_batch = hit is not None and mask.per_batch and mesh.calls.agreed_batch != mask
    if hit is not None and not per_batch:
        return hit
    if hit is None and error is None:
        try:
            spec = resolve(q, k, v, mesh, layout=layout, mask=mask, **options)
            prepared = prepare(spec)
        except ValueError as exc:
            error = exc
    elif hit is not None:
        prepared = hit.call
        spec = prepared.spec
    agree("mesh attention", agreement(spec, prepared), mesh.cp_group, _comm_device(mesh), error)
    if hit is not None:
        return hit
    rank = prepared.for_rank(mesh.mesh_position, mesh.position, q.device)
    mesh.calls.put(key, rank)
    return rank


def agree_batch(mesh, mask: Optional[Mask], error: Optional[BaseException] = None) -> None:
    """Agree once, over the CP group, on a micro-batch's per-batch mask (its documents): later calls
    with exactly this mask skip their per-call agreement. Collective: every rank of the CP group calls
    it for every micro-batch (the launcher does, when it reads the batch's documents); a rank with
    other documents makes every rank raise the same ``ValueError``, and so does a rank that could not
    read its batch (``error``, ``mask`` None there): it joins the agreement instead of leaving the others
    waiting in it."""
    check_mesh(mesh)
    fields = {"documents": None} if error is not None else dict(mask.agreement())
    if len(fields) != 1:  # one field on every rank: a rank with an error cannot know how many the others send
        fields = {", ".join(fields): tuple(fields.values())}
    agree("mesh attention (batch)", fields, mesh.cp_group, _comm_device(mesh), error)
    mesh.calls.agreed_batch = mask


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
    mask: Optional[Mask] = None,
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
    mesh's ``plan_options``; ``in-order``), ``plans`` passes one explicitly;
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
    end: zero output rows, lse = -inf). The offsets are read to the host once per tensor object.
    lse is ``[h, t_local]``.

    Masks on the ordinary layout: ``cu_seqlens`` alone (global offsets of documents of any length,
    int32, 0 .. S) with ``bshd``/``sbhd`` and batch 1: a token sees its own document only.
    ``window`` = (left, right): query i sees key j iff i - left <= j <= i + right (-1: unbounded;
    causal: right 0), flash-attn's ``window_size``. ``mask``: any mask value of
    :mod:`megatron_mesh_cp.runtime.masks` (e.g. ``Chunked(8192)``, chunked local attention), alone or
    intersected with the documents and window. All run pruned plans (blocks nothing sees are not
    computed, chunks nothing needs are not sent).

    ``sink``: fp32 ``[h]`` learnable sink logits (gpt-oss): every row's softmax denominator gains
    exp(sink_h); its gradient on this rank covers this rank's rows (reduce it over the CP group like
    any parameter's; Megatron does). ``return_max_logit``: also return the fp32 ``[h]`` maximum of
    ``scale * q.k`` over every allowed pair of the whole sequence (under ``te`` rounded to the input
    dtype, as TE returns it), the same on every rank (one tiny all-reduce). Returns ``out``, then
    ``lse`` if asked, then the max logit if asked.

    Every rank of the CP group must make the same call: a new call is checked with one small
    collective on ``mesh.cp_group`` and raises the same ``ValueError`` on every rank otherwise
    (agree.py); so is every call whose documents change per batch (unless :func:`agree_batch`
    agreed on the batch). Input errors found on one rank are raised on all.
    """
    check_mesh(mesh)
    options = dict(causal=causal, softmax_scale=softmax_scale, kernel=kernel, plans=plans, partial_dtype=partial_dtype,
                   planner=planner, deterministic=deterministic, check_finite=check_finite, sink=sink,
                   return_max_logit=return_max_logit)
    rank = _prepared(mesh, q, k, v, layout, (cu_seqlens, cu_seqlens_padded, window, mask), options)
    spec: CallSpec = rank.call.spec
    if spec.check_finite:
        _check_finite(mesh, "q, k or v", q, k, v)
    q, k, v = (sequence_major(x, spec.layout) for x in (q, k, v))
    u, lay = spec.ulysses, rank.packed
    if u > 1:  # a2a+mesh: all-to-all over heads in the Ulysses group around the unchanged mesh
        q, k, v = UlyssesIn.apply(q, k, v, mesh, kv_repeats(spec.heads, spec.kv_heads, u), lay)
    elif lay is not None:  # packed: the batch's half-major order (packed.py)
        q, k, v = (lay.into_mesh(x) for x in (q, k, v))
    slot = mesh.position % u
    out, lse, *top = _MeshAttention.apply(q, k, v, sink_slot(sink, u, slot), mesh, rank)
    if top:
        top = _all_max_logit(mesh, top[0], u, slot)
    if u > 1:
        out, lse = UlyssesOut.apply(out, lse, mesh, bool(return_lse), lay)
    elif lay is not None:
        out = lay.out_of_mesh(out)
        lse = lse.index_select(2, lay.from_mesh) if return_lse else lse
    if rank.padding is not None:  # padding rows: zero output (so zero gradient), lse = -inf
        out = out.masked_fill(rank.padding.view(-1, 1, 1, 1), 0)
        lse = lse.masked_fill(rank.padding.view(1, 1, -1), float("-inf")) if return_lse else lse
    out, lse = user_layout(out, lse, spec.layout)
    return (out,) + ((lse,) if return_lse else ()) + tuple(top) if (return_lse or return_max_logit) else out


def _all_max_logit(mesh, top: torch.Tensor, u: int, slot: int) -> list:
    """This rank's max logit of its (inner) heads -> all local heads' max over the CP group."""
    import torch.distributed as dist

    if u > 1:  # the other members hold the other head groups
        full = torch.full((u, top.numel()), float("-inf"), dtype=top.dtype, device=top.device)
        full[slot] = top
        top = full.flatten()
    x = top.to(_comm_device(mesh))
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=mesh.cp_group)
    return [x.to(top.device)]
