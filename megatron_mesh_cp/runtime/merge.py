"""Merging partial attention results (DESIGN.md section 4), in fp32, overflow- and NaN-safe.

A partial result of Q rows against a subset of keys is ``(out, lse)``; two partials of the same
rows combine exactly as

    out = out - sigmoid(lse_blk - lse) * (out - out_blk)
    lse = logaddexp(lse, lse_blk)

Rows a partial never touched carry ``lse = -inf`` and ``out = 0``; merging two untouched rows
keeps them untouched (the NaN that ``sigmoid(-inf - -inf)`` would produce is mapped to 0).

A learnable attention sink (gpt-oss) is one more partial: output 0, lse = the head's sink logit,
merged once into the final result (:func:`merge_sink`), so every row's softmax denominator gains
exp(sink) exactly once whatever the blocks and merges before it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["merge_into", "merge_sink", "sink_grad", "empty_partial"]


def empty_partial(like: torch.Tensor, dtype: torch.dtype):
    """An untouched partial for the rows of ``like`` (``[..., d]``): out = 0, lse = -inf (``[...]``)."""
    out = torch.zeros(like.shape, dtype=dtype, device=like.device)
    lse = torch.full(like.shape[:-1], float("-inf"), dtype=dtype, device=like.device)
    return out, lse


def merge_into(
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scratch: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    finite: bool = False,
) -> None:
    """Merge partial ``(out, lse)`` into ``(acc_out, acc_lse)`` in place.

    Shapes: out ``[..., d]``, lse ``[...]`` (views allowed); acc tensors in fp32/fp64.
    ``scratch(like)`` may supply reusable buffers shaped like ``like`` so the merge allocates nothing.
    ``finite``: ``lse`` has no -inf row (an unmasked kernel call's: every query sees a key), so no
    row is untouched on both sides and the NaN guard is skipped (it would change nothing).
    Five ops when ``out`` has the accumulator's dtype (``acc + w * (out - acc)`` is one ``lerp_``),
    six otherwise (``lerp_`` takes one dtype), one less when ``finite``: on a GPU each is a launch.
    """
    w = torch.sub(lse, acc_lse) if scratch is None else torch.sub(lse, acc_lse, out=scratch(acc_lse))
    w.sigmoid_()
    if not finite:
        w.nan_to_num_(nan=0.0)  # rows untouched on both sides: sigmoid(NaN) -> 0, they stay so
    if out.dtype == acc_out.dtype:
        acc_out.lerp_(out, w.unsqueeze(-1))
    else:
        diff = torch.sub(out, acc_out) if scratch is None else torch.sub(out, acc_out, out=scratch(acc_out))
        acc_out.addcmul_(diff, w.unsqueeze(-1))
    torch.logaddexp(acc_lse, lse, out=acc_lse)


def merge_sink(acc_out: torch.Tensor, acc_lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Merge the sink partial (output 0, lse = ``sink`` per head, the last dim of ``acc_lse``)
    into the final ``(acc_out [..., h, d], acc_lse [..., h])`` in place."""
    total = torch.logaddexp(acc_lse, sink.to(acc_lse.dtype))
    acc_out.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
    acc_lse.copy_(total)


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The sink logits' gradient from one rank's rows: ``-sum_rows exp(sink - lse) * delta`` per
    head (``lse`` the final one, sink included; ``delta = rowsum(dout * out)``, both ``[s, b, h]``):
    the sink is a key of value 0, so its score's gradient is ``-P_sink * delta``."""
    p = torch.exp(sink.to(lse.dtype) - lse)
    return -(p * delta.to(lse.dtype)).sum(dim=(0, 1)).to(sink.dtype)
