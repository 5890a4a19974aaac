"""``torch`` backend: PyTorch's own attention ops that return the log-sum-exp we merge with.

* CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward (GQA native, any float
  dtype including fp64, so it doubles as an exact oracle).
* CUDA, fp16/bf16, head dim <= 256 and a multiple of 8, sm80+: the SDPA flash op
  (``_scaled_dot_product_flash_attention`` and its backward; GQA native).
* CUDA otherwise (fp32, other head dims, older GPUs): the memory-efficient op, K/V heads expanded
  for GQA. It has fp32, fp16 and bf16 kernels only, bf16 from sm80 (``sdp_utils.cpp``,
  ``can_use_mem_efficient_attention``; its dispatch raises "Only fp32, half & bf16 supported"), so
  ``check`` refuses fp64 on CUDA (and bf16 below sm80) before any communication.

The ops take ``[b, h, s, d]`` views of our sequence-major tensors, and the forwards copy no input.
The CUDA flash backward makes ``dout`` and ``out`` contiguous in ``[b, s, h, d]``, a copy of each
per call when b > 1 (for b = 1 the view already is); the efficient op gets expanded K/V copies for
GQA and its backward sums the expanded gradients back.

Packed sequences (THD) and sliding windows run on CPU only: the CPU op takes an additive mask, so a
packed or windowed block is one call with a block-diagonal (per-document, causal, windowed) mask,
made once per batch and mask kind -- exact, and dense (O(rows^2) mask memory, fine for CPU-sized
blocks). On CUDA use te or flash.

Deterministic backward (``deterministic=True``, Megatron's ``--deterministic-mode``): the CUDA ops
read ``torch.are_deterministic_algorithms_enabled()`` when called (``attention_backward.cu``:
"Flash Attention defaults to a non-deterministic algorithm"), so the backward op runs with it on
(and the setting restored after); the CPU op is deterministic anyway.

The CUDA flash backward decides dense vs varlen by whether ``cum_seq_q`` is *defined*
(``attention_backward.cu``, ``_flash_attention_backward``); the dense forward returns undefined
tensors (``None`` in Python) there, so the backward is given ``None``, never an empty tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Optional, Tuple

import torch

from .base import BlockKernel, Varlen, check_square

__all__ = ["TorchKernel"]

#: the aten namespace the ops are looked up in (tests substitute CPU stand-ins with the ops' rules)
_aten = torch.ops.aten
#: the efficient kernel's lse rows are padded to a multiple of this (``kAlignLSE`` in PyTorch)
LSE_ALIGN = 32


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] view."""
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h, d] view."""
    return x.permute(2, 0, 1, 3)


def cuda_path(q: torch.Tensor) -> str:
    """Which op family runs ``q`` on CUDA: ``flash`` (fp16/bf16, d <= 256, d % 8 == 0, sm80+) or ``efficient``."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256 or q.shape[-1] % 8:
        return "efficient"
    return "flash" if torch.cuda.get_device_capability(q.device)[0] >= 8 else "efficient"


class TorchKernel(BlockKernel):
    name = "torch"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = bool(deterministic)
        self._gqa_native = True  # CUDA flash: expanded K/V from the first call the op refuses GQA on
        self._consts = {}  # per device: the (unused, dropout-free) philox seed and offset
        self._masks: "OrderedDict[tuple, tuple]" = OrderedDict()  # packed blocks' masks, per batch

    def check(self, q: torch.Tensor, k: torch.Tensor, v=None) -> None:
        if q.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the torch kernel runs on cpu or cuda, not {q.device.type}")
        if v is not None and v.shape[-1] != q.shape[-1] and q.device.type != "cpu":
            raise ValueError(f"the torch kernel runs a value head dim ({v.shape[-1]}) other than the query/key head dim "
                             f"({q.shape[-1]}, MLA) on CPU only")
        if q.device.type == "cuda" and cuda_path(q) == "efficient":
            sm80 = torch.cuda.get_device_capability(q.device)[0] >= 8
            if q.dtype not in ((torch.float16, torch.bfloat16, torch.float32) if sm80 else (torch.float16, torch.float32)):
                raise ValueError(f"the torch kernel's CUDA memory-efficient op has no {str(q.dtype)[6:]} kernel "
                                 f"(fp32, fp16{', bf16' if sm80 else ''} only); cast to float32 or bfloat16, or run "
                                 "float64 on CPU")

    def check_varlen(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> None:
        if q.device.type != "cpu":
            raise ValueError("the torch attention kernel runs document (varlen) calls -- packed THD or cu_seqlens -- on CPU only")

    def check_window(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                     documents: bool = False) -> None:
        if q.device.type != "cpu":
            raise ValueError("the torch attention kernel runs sliding windows on CPU only")

    def check_max_logit(self, q: torch.Tensor, *, packed: bool = False) -> None:
        if q.device.type != "cpu":
            raise ValueError("the torch attention kernel returns the max logit on CPU only")

    def _max_logit(self, q, k, scale, causal, mask) -> torch.Tensor:
        """fp32 ``[h]``: the largest ``scale * q.k`` of every head over the call's unmasked pairs
        (an explicit product: the CPU op does not return it)."""
        self.check_max_logit(q)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", q.to(acc), kk.to(acc)) * scale
        if mask is not None:
            scores = scores + mask.to(acc)
        elif causal:
            keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return scores.amax(dim=(0, 2, 3)).float()

    def _check_masked(self, q, varlen) -> None:
        if varlen is not None:
            self.check_varlen(q)
        else:
            self.check_window(q)

    def _mask(self, varlen: Optional[Varlen], causal: bool, dtype: torch.dtype, window=None, sq: int = 0,
              sk: int = 0) -> torch.Tensor:
        """Additive ``[sq, sk]`` mask: 0 inside a document (and at or below the diagonal if causal,
        inside the window if one is given, bottom-right aligned), -inf elsewhere; built once per
        batch (or block shape), mask kind and dtype."""
        key = (id(varlen), causal, dtype, window, sq, sk)
        hit = self._masks.get(key)
        if hit is None or hit[0] is not varlen:
            if varlen is not None:
                doc = torch.repeat_interleave(torch.arange(len(varlen.lens)), torch.tensor(varlen.lens, dtype=torch.long))
                keep = doc[:, None] == doc[None, :]
                start = torch.cumsum(torch.tensor((0,) + varlen.lens[:-1]), 0)[doc]
                r = c = torch.arange(doc.numel()) - start  # position inside the document (square)
                d = c[None, :] - r[:, None]
            else:
                keep = torch.ones(sq, sk, dtype=torch.bool)
                d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
            left, right = window if window is not None else (-1, -1)
            if causal:
                right = 0
            if left >= 0:
                keep &= d >= -left
            if right >= 0:
                keep &= d <= right
            mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
            hit = self._masks[key] = (varlen, mask)
            while len(self._masks) > 8:
                self._masks.popitem(last=False)
        return hit[1]

    @staticmethod
    def _is_cuda(t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def _path(self, q: torch.Tensor) -> str:
        return cuda_path(q) if self._is_cuda(q) else "cpu"

    def forward(self, q, k, v, *, causal: bool, scale: float, varlen: Optional[Varlen] = None, window=None,
                return_max_logit: bool = False):
        check_square(q, k, causal)
        path = self._path(q)
        mask = None
        if v.shape[-1] != q.shape[-1]:  # MLA on CPU: the op wants one head dim; zero columns change nothing
            self.check(q, k, v)
            res = self.forward(*_one_head_dim(q, k, v), causal=causal, scale=scale, varlen=varlen, window=window,
                               return_max_logit=return_max_logit)
            return (res[0][..., :v.shape[-1]],) + tuple(res[1:])
        if varlen is not None or window is not None:
            self._check_masked(q, varlen)
            mask = self._mask(varlen, causal, q.dtype, window, q.shape[0], k.shape[0])
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, False, attn_mask=mask, scale=scale
            )
        elif path == "cpu":
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
            )
        else:
            if return_max_logit:
                self.check_max_logit(q)
            return self._forward_cuda(q, k, v, causal, scale, path)
        if return_max_logit:
            return _sbhd(out), lse, self._max_logit(q, k, scale, causal, mask)
        return _sbhd(out), lse

    def _forward_cuda(self, q, k, v, causal: bool, scale: float, path: str):
        if path == "flash":
            kk, vv = self._kv(q, k, v)
            try:
                out, lse, *_ = _aten._scaled_dot_product_flash_attention(
                    _bhsd(q), kk, vv, 0.0, causal, False, scale=scale
                )
            except RuntimeError as exc:
                if not self._gqa_native or k.shape[2] == q.shape[2] or not _refuses_gqa(exc):
                    raise  # an OOM or any other failure is not the op refusing GQA
                kk, vv = _expand(q, k, v)
                out, lse, *_ = _aten._scaled_dot_product_flash_attention(
                    _bhsd(q), kk, vv, 0.0, causal, False, scale=scale
                )
                self._gqa_native = False  # only once expanded K/V ran where native K/V did not
            return _sbhd(out), lse
        kk, vv = _expand(q, k, v)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            _bhsd(q), kk, vv, None, True, 0.0, causal, scale=scale
        )
        return _sbhd(out), lse[..., : q.shape[0]]

    def _philox(self, path: str, device):
        """(seed, offset) as the ``path``'s forward returns them (flash: uint64 [2] and [];
        efficient: int64 scalars); created once per device, read by the ops only with dropout."""
        key = (path, str(device))
        if key not in self._consts:
            if path == "flash":
                self._consts[key] = (torch.zeros(2, dtype=torch.uint64, device=device),
                                     torch.zeros((), dtype=torch.uint64, device=device))
            else:
                self._consts[key] = (torch.zeros((), dtype=torch.int64, device=device),) * 2
        return self._consts[key]

    def _kv(self, q, k, v):
        if self._gqa_native:
            return _bhsd(k), _bhsd(v)
        return _expand(q, k, v)

    def lse_for_backward(self, lse_sbh: torch.Tensor, varlen: Optional[Varlen] = None):
        """CPU: a ``[b, h, s]`` view. CUDA: a contiguous ``[b, h, s]`` tensor whose storage is padded
        to a multiple of 32 rows (what the efficient backward reads); the flash backward takes the
        unpadded contiguous form. Made once per chunk and row range, not per block."""
        lse = lse_sbh.permute(1, 2, 0)
        if not self._is_cuda(lse_sbh):
            return lse
        sq = lse.shape[-1]
        pad = -(-sq // LSE_ALIGN) * LSE_ALIGN
        if pad == sq:
            return lse.contiguous()
        buf = torch.zeros(lse.shape[:-1] + (pad,), dtype=lse.dtype, device=lse.device)
        buf[..., :sq] = lse
        return buf[..., :sq]

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, varlen: Optional[Varlen] = None,
                 window=None):
        check_square(q, k, causal)
        path = self._path(q)
        d, dv = q.shape[-1], v.shape[-1]
        if dv != d:  # MLA on CPU, as in forward; the zero columns' gradients are dropped
            self.check(q, k, v)
            qq, kk, vv = _one_head_dim(q, k, v)
            width = vv.shape[-1]
            grads = self.backward(_pad_last(dout, width), qq, kk, vv, _pad_last(out, width), lse, causal=causal,
                                  scale=scale, varlen=varlen, window=window)
            return grads[0][..., :d], grads[1][..., :d], grads[2][..., :dv]
        if varlen is not None or window is not None:
            self._check_masked(q, varlen)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, False,
                attn_mask=self._mask(varlen, causal, q.dtype, window, q.shape[0], k.shape[0]), scale=scale
            )
            return _sbhd(dq), _sbhd(dk), _sbhd(dv)
        if path == "cpu":
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
            )
            return _sbhd(dq), _sbhd(dk), _sbhd(dv)
        sq, sk, hk = q.shape[0], k.shape[0], k.shape[2]
        if path == "flash":
            kk, vv = self._kv(q, k, v)
            seed, offset = self._philox(path, q.device)
            lse = lse if lse.is_contiguous() else lse.contiguous()  # only when sq % 32 != 0
            with _deterministic(self.deterministic):
                dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                    _bhsd(dout), _bhsd(q), kk, vv, _bhsd(out), lse, None, None, sq, sk, 0.0, causal,
                    seed, offset, scale=scale,
                )
        else:
            kk, vv = _expand(q, k, v)
            seed, offset = self._philox(path, q.device)
            with _deterministic(self.deterministic):
                dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                    _bhsd(dout), _bhsd(q), kk, vv, None, _bhsd(out), lse, seed, offset, 0.0,
                    [True, True, True, False], causal, scale=scale,
                )
        return _sbhd(dq), _fold_heads(dk, hk), _fold_heads(dv, hk)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended to its last dim up to ``width`` (itself if already there)."""
    if x.shape[-1] == width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[:-1] + (width - x.shape[-1],))], dim=-1)


def _one_head_dim(q, k, v):
    """q, k, v padded with zero columns to one head dim (max of q/k's and v's)."""
    width = max(q.shape[-1], v.shape[-1])
    return _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)


@contextmanager
def _deterministic(on: bool):
    """``torch.use_deterministic_algorithms(True)`` around one op when ``on`` (restored after)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if not on or (was and not warn):
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _refuses_gqa(exc: RuntimeError) -> bool:
    """Whether the flash op's error is about the K/V head count (not an OOM, not anything else)."""
    return not isinstance(exc, torch.cuda.OutOfMemoryError) and "head" in str(exc).lower()


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
