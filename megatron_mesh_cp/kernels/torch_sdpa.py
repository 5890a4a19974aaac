"""``torch`` backend: PyTorch's own flash-attention ops, which return the log-sum-exp we merge with.

On CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native, any
float dtype including fp64, so it doubles as an exact oracle). On CUDA: the SDPA flash op.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .base import BlockKernel

__all__ = ["TorchKernel"]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class TorchKernel(BlockKernel):
    name = "torch"

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if q.device.type == "cuda":
            if q.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"the torch CUDA flash kernel takes fp16/bf16, got {q.dtype}; "
                    "cast the inputs or run on CPU"
                )
        elif q.device.type != "cpu":
            raise ValueError(f"the torch kernel runs on cpu or cuda, not {q.device.type}")

    def forward(self, q, k, v, *, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
            )
        else:
            out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
                _bhsd(q), *_expand_kv(q, k, v), 0.0, causal, False, scale=scale
            )
        return _bhsd(out), lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
            )
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        kx, vx = _expand_kv(q, k, v)
        sq, sk = q.shape[1], k.shape[1]
        cu_q = torch.tensor([0, sq], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, sk], dtype=torch.int32, device=q.device)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout), _bhsd(q), kx, vx, _bhsd(out), lse.contiguous(),
            cu_q, cu_k, sq, sk, 0.0, causal, zero, zero, scale=scale,
        )
        return _bhsd(dq), _fold_heads(dk, k.shape[2]), _fold_heads(dv, k.shape[2])


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """[b, s, hk, d] -> [b, h, s, d] views for a kernel that needs h == hk (CUDA flash)."""
    group = q.shape[2] // k.shape[2]
    k, v = _bhsd(k), _bhsd(v)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _fold_heads(g: torch.Tensor, hk: int) -> torch.Tensor:
    """Sum a [b, h, s, d] gradient over the query heads of each kv head -> [b, s, hk, d]."""
    b, h, s, d = g.shape
    if h == hk:
        return _bhsd(g)
    return _bhsd(g.view(b, hk, h // hk, s, d).sum(dim=2))
