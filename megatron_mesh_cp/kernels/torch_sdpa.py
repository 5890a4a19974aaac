"""``torch`` backend: PyTorch's own attention ops that return the log-sum-exp we merge with.

* CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native, any float
  dtype including fp64, so it doubles as an exact oracle).
* CUDA, fp16/bf16, head dim <= 256, sm80+: the SDPA flash op (``_scaled_dot_product_flash_attention``).
* CUDA otherwise (fp32, larger head dims, older GPUs): the memory-efficient op, K/V heads expanded
  inside the call for GQA (it has no native GQA).

The ops take ``[b, h, s, d]`` views of our sequence-major tensors; no input is copied.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .base import BlockKernel

__all__ = ["TorchKernel"]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] view."""
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] view."""
    return x.permute(2, 0, 1, 3)


class TorchKernel(BlockKernel):
    name = "torch"

    def __init__(self) -> None:
        self._gqa_native = True  # CUDA flash: falls back to expanded K/V once if the op refuses
        self._consts = {}  # per device: the (unused, dropout-free) rng and cu_seqlens arguments

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if q.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the torch kernel runs on cpu or cuda, not {q.device.type}")

    @staticmethod
    def _use_flash(q: torch.Tensor) -> bool:
        if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256 or q.shape[-1] % 8:
            return False
        return torch.cuda.get_device_capability(q.device)[0] >= 8

    def forward(self, q, k, v, *, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
            )
            return _sbhd(out), lse
        if self._use_flash(q):
            kk, vv = self._kv(q, k, v)
            try:
                out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
                    _bhsd(q), kk, vv, 0.0, causal, False, scale=scale
                )
            except RuntimeError:
                if not self._gqa_native or k.shape[2] == q.shape[2]:
                    raise
                self._gqa_native = False
                return self.forward(q, k, v, causal=causal, scale=scale)
            return _sbhd(out), lse
        kk, vv = _expand(q, k, v)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q), kk, vv, None, True, 0.0, causal, scale=scale
        )
        return _sbhd(out), lse[..., : q.shape[0]]

    def _flash_consts(self, device):
        key = str(device)
        if key not in self._consts:  # created once, not per block
            self._consts[key] = (torch.empty(0, dtype=torch.int32, device=device),
                                 torch.zeros(2, dtype=torch.uint64, device=device),
                                 torch.zeros((), dtype=torch.uint64, device=device))
        return self._consts[key]

    def _kv(self, q, k, v):
        if self._gqa_native:
            return _bhsd(k), _bhsd(v)
        return _expand(q, k, v)

    def lse_for_backward(self, lse_sbh: torch.Tensor):
        if lse_sbh.device.type == "cpu":
            return lse_sbh.permute(1, 2, 0)
        lse = lse_sbh.permute(1, 2, 0).contiguous()
        return lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
            )
            return _sbhd(dq), _sbhd(dk), _sbhd(dv)
        sq, sk, hk = q.shape[0], k.shape[0], k.shape[2]
        if self._use_flash(q):
            kk, vv = self._kv(q, k, v)
            empty, seed, offset = self._flash_consts(q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout), _bhsd(q), kk, vv, _bhsd(out), lse, empty, empty, sq, sk, 0.0, causal,
                seed, offset, scale=scale,
            )
        else:
            kk, vv = _expand(q, k, v)
            pad = -(-sq // 32) * 32  # the efficient kernel's lse is padded to a multiple of 32
            lse_p = torch.zeros(lse.shape[:-1] + (pad,), dtype=lse.dtype, device=lse.device)
            lse_p[..., :sq] = lse
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                _bhsd(dout), _bhsd(q), kk, vv, None, _bhsd(out), lse_p, zero, zero, 0.0,
                [True, True, True, False], causal, scale=scale,
            )
        return _sbhd(dq), _fold_heads(dk, hk), _fold_heads(dv, hk)


def _expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """[s, b, hk, d] -> [b, h, s, d] for a kernel that needs h == hk."""
    group = q.shape[2] // k.shape[2]
    k, v = _bhsd(k), _bhsd(v)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _fold_heads(g: torch.Tensor, hk: int) -> torch.Tensor:
    """Sum a [b, h, s, d] gradient over the query heads of each kv head -> [s, b, hk, d]."""
    b, h, s, d = g.shape
    if h == hk:
        return _sbhd(g)
    return _sbhd(g.reshape(b, hk, h // hk, s, d).sum(dim=2))
