"""Single-device reference attention (plain math, any dtype; fp64 is the oracle the tests use)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["reference_attention"]


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
