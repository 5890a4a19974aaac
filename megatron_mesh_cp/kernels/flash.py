"""``flash`` backend: FlashAttention-3 (Hopper, ``flash_attn_interface``) when installed, else
FlashAttention-2 (``flash_attn``, >= 2.6), both through their ``_flash_attn_forward`` /
``_flash_attn_backward`` as ring-flash-attn and TE call them.

flash-attn takes ``[b, s, h, d]`` with a unit last stride; a transposed view of our sequence-major
chunk qualifies, so nothing is copied. GQA is native. ``softmax_lse`` is ``[b, h, s]`` fp32. The
backward writes into dq/dk/dv buffers we own (reused across blocks of the same shape).
"""

from __future__ import annotations

import inspect
from typing import Dict, Tuple

import torch

from .base import BlockKernel, check_cuda_half

__all__ = ["FlashKernel", "flash_version"]


def _fa3():
    import flash_attn_interface as m  # the hopper/ build of flash-attention

    return m


def _fa2():
    from flash_attn import flash_attn_interface as m

    return m


def flash_version():
    """(3, module) or (2, module) for the best flash-attn importable here; raises ImportError if none."""
    try:
        return 3, _fa3()
    except ImportError:
        pass
    return 2, _fa2()


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


class FlashKernel(BlockKernel):
    name = "flash"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = bool(deterministic)
        self.version, mod = flash_version()
        self._fwd, self._bwd = mod._flash_attn_forward, mod._flash_attn_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)
        if self.version == 2 and "window_size_left" not in self._fwd_params:
            raise ValueError("flash-attn < 2.6 is not supported by the flash kernel; upgrade it or use --mesh-kernel te / torch")
        self._grads: Dict[Tuple, torch.Tensor] = {}

    @classmethod
    def available(cls) -> bool:
        try:
            flash_version()
        except Exception:
            return False
        return torch.cuda.is_available()

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        check_cuda_half(f"the flash kernel (flash-attn {self.version})", q, 9 if self.version == 3 else 8,
                        " or install flash-attn 2" if self.version == 3 else "")

    def forward(self, q, k, v, *, causal: bool, scale: float):
        if self.version == 3:
            res = self._fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=causal)
            out, lse = res[0], res[1]
        else:
            kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
                      window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
            out, lse = self._fwd(_bshd(q), _bshd(k), _bshd(v), **{k_: v_ for k_, v_ in kw.items() if k_ in self._fwd_params})[:2]
        return _bshd(out), lse

    def lse_for_backward(self, lse_sbh: torch.Tensor):
        return lse_sbh.permute(1, 2, 0).contiguous()  # [b, h, s]

    def _buffer(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """dq/dk/dv output buffers, [b, s, h, d], reused for every block of the same shape."""
        key = (role, tuple(like.shape), like.dtype, str(like.device))
        if key not in self._grads:
            self._grads[key] = torch.empty(like.shape[1], like.shape[0], *like.shape[2:], dtype=like.dtype, device=like.device)
        return self._grads[key]

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        dq, dk, dv = self._buffer("dq", q), self._buffer("dk", k), self._buffer("dv", v)
        if self.version == 3:
            self._bwd(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, dq=dq, dk=dk, dv=dv,
                      softmax_scale=scale, is_causal=causal)
        else:
            kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
                      softcap=0.0, alibi_slopes=None, deterministic=self.deterministic, rng_state=None)
            self._bwd(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, dq, dk, dv,
                      **{k_: v_ for k_, v_ in kw.items() if k_ in self._bwd_params})
        return _bshd(dq), _bshd(dk), _bshd(dv)
