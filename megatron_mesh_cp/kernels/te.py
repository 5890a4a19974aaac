"""``te`` backend: Transformer Engine's fused attention (cuDNN), the kernels Megatron runs.

Calls ``fused_attn_fwd`` / ``fused_attn_bwd`` from ``transformer_engine.pytorch.cpp_extensions``
as TE's own context-parallel code does: ``sbhd_sbhd_sbhd`` layout (our chunks are sequence-major,
so every block slice is already contiguous), ``causal`` or ``no_mask``, the F16 arbitrary-seqlen
backend; GQA native. The forward's ``Stats`` ([b, h, s, 1], fp32) is the log-sum-exp.

Supported: TE >= 2.0 (``fake_dtype`` API). The signature moved between releases (``dqkv_dtype``
dropped in 2.1x, ``o_format``/``do_format`` added), so optional arguments are passed only when the
installed version has them.
"""

from __future__ import annotations

import inspect
from typing import Dict, Tuple

import torch

from .base import BlockKernel, check_cuda_half

__all__ = ["TEKernel"]


def _te():
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.cpp_extensions import fused_attn as fa

    return fa, TE_DType


class TEKernel(BlockKernel):
    name = "te"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = bool(deterministic)
        fa, te_dtype = _te()
        self._fwd, self._bwd, self._dtype = fa.fused_attn_fwd, fa.fused_attn_bwd, te_dtype
        self._backend = fa.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)
        if "fake_dtype" not in self._fwd_params:
            raise ValueError(
                "Transformer Engine < 2.0 is not supported by the te kernel; upgrade TE or use "
                "--mesh-kernel flash / torch"
            )
        self._cu: Dict[Tuple[int, int, str], torch.Tensor] = {}
        self._rng: Dict[str, torch.Tensor] = {}

    @classmethod
    def available(cls) -> bool:
        try:
            _te()
        except Exception:
            return False
        return torch.cuda.is_available()

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        check_cuda_half("the te kernel (TE fused attention)", q, 8)

    def _cu_seqlens(self, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        key = (batch, seq, str(device))
        if key not in self._cu:
            self._cu[key] = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
        return self._cu[key]

    def _common(self, causal: bool, scale: float, params) -> Dict:
        kw = dict(attn_scale=scale, dropout=0.0, fast_zero_fill=True, qkv_layout="sbhd_sbhd_sbhd",
                  attn_bias_type="no_bias", attn_mask_type="causal" if causal else "no_mask",
                  deterministic=self.deterministic)
        for extra in ("o_format", "do_format"):
            if extra in params:
                kw[extra] = "sbhd"
        if "dqkv_layout" in params:
            kw["dqkv_layout"] = "sbhd_sbhd_sbhd"
        return {key: val for key, val in kw.items() if key in params}

    def forward(self, q, k, v, *, causal: bool, scale: float):
        sq, b = q.shape[0], q.shape[1]
        sk = k.shape[0]
        out, aux = self._fwd(
            True, sq, sk, self._cu_seqlens(b, sq, q.device), self._cu_seqlens(b, sk, q.device),
            q, k, v, q.dtype, self._backend, **self._common(causal, scale, self._fwd_params),
        )[:2]
        stats = aux[0]  # [b, h, sq, 1]
        return out, stats.reshape(stats.shape[0], stats.shape[1], sq)

    def lse_for_backward(self, lse_sbh: torch.Tensor):
        return lse_sbh.permute(1, 2, 0).unsqueeze(-1).contiguous()  # [b, h, sq, 1]

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        sq, b = q.shape[0], q.shape[1]
        sk = k.shape[0]
        dev = str(q.device)
        if dev not in self._rng:
            self._rng[dev] = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused: no dropout
        args = [sq, sk, self._cu_seqlens(b, sq, q.device), self._cu_seqlens(b, sk, q.device),
                q, k, v, out, dout, q.dtype]
        if "dqkv_dtype" in self._bwd_params:
            args.append(self._dtype[q.dtype])
        args += [[lse, self._rng[dev]], self._backend]
        grads = self._bwd(*args, **self._common(causal, scale, self._bwd_params))
        return grads[0], grads[1], grads[2]
