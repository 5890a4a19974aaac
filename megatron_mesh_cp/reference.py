"""Single-device reference attention (plain math, any dtype; fp64 is the oracle the tests use)."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

__all__ = ["reference_attention", "packed_reference_attention", "packed_reference", "relative_errors", "variant_reference"]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
    softmax_scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-sequence attention on bshd tensors (K/V may have fewer heads): returns (out, lse [b, h, s]).

    Written with explicit matmuls and softmax (no fused kernel) so it shares no code with the
    block kernels it checks. Differentiable.
    """
    b, s, h, d = q.shape
    group = h // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s, k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(1, 2), lse


def packed_reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_padded, cu_seqlens=None, *,
    softmax_scale: Optional[float] = None, causal: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed (thd ``[t, h, d]``) attention with a block-diagonal mask: a token sees the real tokens
    of its own document (up to itself when ``causal``); padding tokens (``cu_seqlens`` shorter than
    ``cu_seqlens_padded``) see and are seen by nothing and give out = 0, lse = -inf.
    Returns (out ``[t, h, d]``, lse ``[h, t]``). Dense math, differentiable."""
    t, h, d = q.shape
    group = h // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    padded = torch.as_tensor(cu_seqlens_padded, device=q.device).long().flatten()
    real = padded if cu_seqlens is None else torch.as_tensor(cu_seqlens, device=q.device).long().flatten()
    pos = torch.arange(t, device=q.device)
    doc = torch.searchsorted(padded[1:], pos, right=True)
    is_real = (pos - padded[doc]) < (real[1:] - real[:-1])[doc]
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    keep &= is_real[:, None] & is_real[None, :]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(-1, -2)) * scale
    empty = ~keep.any(dim=-1)  # padding rows: computed over everything, then zeroed (no NaN, no gradient)
    scores = scores.masked_fill(~(keep | empty[:, None]), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(0, 1)
    return out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(empty, float("-inf"))


def packed_reference(q, k, v, dout, cu_seqlens_padded, cu_seqlens=None, causal: bool = True) -> Dict[str, torch.Tensor]:
    """out, lse and the gradients dq, dk, dv for ``dout`` of :func:`packed_reference_attention`
    (in the inputs' dtype: float64 for the oracle the tests use)."""
    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = packed_reference_attention(qr, kr, vr, cu_seqlens_padded, cu_seqlens, causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}


def relative_errors(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Relative L2 error, in float64, of every quantity of ``ref`` found in ``got``; lse only where
    the reference is finite (padding rows are -inf in both, which the caller checks)."""
    errors = {}
    for name, r in ref.items():
        x, r = got[name].double(), r.double()
        if name == "lse":
            finite = torch.isfinite(r)
            x, r = x[finite], r[finite]
        errors[name] = float((x - r).norm() / r.norm())
    return errors


def variant_reference(q, k, v, dout, cu_seqlens=None, *, causal: bool = True, window=None, sink=None,
                      softmax_scale: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """Dense attention on ``[t, h, d]`` tensors (v may have its own head dim) with every variant:
    documents ``cu_seqlens`` (None: one), a sliding ``window`` (left, right; -1 unbounded: query i
    sees key j iff i - left <= j <= i + right), a learnable ``sink`` ``[h]`` (an extra key of value 0
    and logit sink_h in every row's softmax). Returns out, lse (sink included), the max logit ``[h]``
    over the allowed pairs and, for ``dout``, dq, dk, dv and dsink. Explicit math, any dtype."""
    t, h, d = q.shape
    group = h // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    sr = None if sink is None else sink.detach().clone().to(q.dtype).requires_grad_(True)
    pos = torch.arange(t, device=q.device)
    keep = torch.ones(t, t, dtype=torch.bool, device=q.device)
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens, device=q.device).long().flatten()
        doc = torch.searchsorted(cu[1:], pos, right=True)
        keep &= doc[:, None] == doc[None, :]
    diff = pos[None, :] - pos[:, None]  # key - query
    if causal:
        keep &= diff <= 0
    if window is not None:
        left, right = window
        keep &= ((diff >= -left) | (left < 0)) & ((diff <= right) | (right < 0))
    kh = kr.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = vr.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (torch.matmul(qr.transpose(0, 1), kh.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    top = scores.detach().amax(dim=(1, 2))
    if sr is not None:  # the sink column: logit sink_h, value 0
        scores = torch.cat([scores, sr.view(h, 1, 1).expand(h, t, 1)], dim=-1)
        vh = torch.cat([vh, vh.new_zeros(h, 1, vh.shape[-1])], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(0, 1)
    result = {"out": out.detach(), "lse": lse.detach(), "max_logit": top}
    if dout is not None:
        out.backward(dout)
        result.update(dq=qr.grad, dk=kr.grad, dv=vr.grad)
        if sr is not None:
            result["dsink"] = sr.grad
    return result
