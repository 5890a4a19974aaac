"""The block-kernel interface every backend implements (DESIGN.md section 6).

A block kernel computes one (Q_i, KV_j) block of attention. Tensors are sequence-major
(``[seq, batch, heads, head_dim]``, Megatron's layout; contiguous row ranges of a chunk); K/V carry
their own (kv) head count, so GQA/MQA never replicate K/V outside the kernel. ``lse`` is
``[batch, heads, seq_q]`` in fp32 (fp64 for fp64 inputs), the base-e log-sum-exp of the scaled
scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["BlockKernel", "KernelNeeds", "Varlen", "lse_dtype", "check_cuda_half", "check_square"]


@dataclass(frozen=True, eq=False)
class Varlen:
    """The documents of one packed (THD) block: every sub-block of a packed chunk is square per
    document, so q and kv share these lengths (packed.py). ``cu``: int32 ``[D + 1]`` offsets on the
    device (made once per batch); ``lens``/``max_len``: the same on the host, so no call syncs."""

    cu: torch.Tensor
    lens: Tuple[int, ...]
    max_len: int


@dataclass(frozen=True, eq=False)
class KernelNeeds:
    """What a call asks of its block kernel: inputs like ``q``, ``k``, ``v`` (sequence-major
    ``[s, b, h, d]`` tensors or ``kernels.input_spec`` namespaces, with the shapes the blocks run),
    a deterministic backward, varlen calls (several documents per call: documents, chunks, packed
    THD), sliding windows (``window_documents``: over documents, so windowed calls may have more
    query rows than keys) and the max logit (``max_logit_packed``: of varlen calls)."""

    q: object
    k: object
    v: object = None
    deterministic: bool = False
    varlen: bool = False
    window: bool = False
    window_documents: bool = False
    max_logit: bool = False
    max_logit_packed: bool = False

    def key(self) -> tuple:
        """What ``auto``'s choice depends on (it runs on every attention call); not the sequence
        length, which may change every batch, except whether a window's keys pass 1024 (cuDNN 9.14.0
        has no non-causal windowed backend past it: fused_attn.cpp, TE v2.12-v2.18)."""
        q, k, v = self.q, self.k, self.v
        return (q.device.type, getattr(q.device, "index", None), q.dtype, tuple(q.shape[1:]), k.shape[2],
                None if v is None else v.shape[-1], self.deterministic, self.varlen, self.window,
                self.window and k.shape[0] > 1024, self.window_documents, self.max_logit, self.max_logit_packed)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for lse and partial outputs: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_cuda_half(what: str, q, min_sm: int, hint: str = "") -> None:
    """The common limits of the fused GPU kernels: CUDA tensors, fp16/bf16, head dim <= 256 and a
    multiple of 8, compute capability >= ``min_sm`` (major); ``select_kernel`` appends the kernels that can."""
    if q.device.type != "cuda":
        raise ValueError(f"{what} needs CUDA tensors")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{what} takes fp16/bf16, not {q.dtype}")
    d = q.shape[-1]
    if d > 256 or d % 8:
        raise ValueError(f"{what} needs a head dim <= 256 and a multiple of 8 (got {d})")
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < min_sm:
        raise ValueError(f"{what} needs sm{min_sm}0+ (this GPU is sm{major}x){hint}")


def check_square(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """A causal block must be square: TE, the efficient op and the CPU op align the causal mask to
    the top-left corner, FA2/FA3 and aten's CUDA flash op to the bottom-right; they agree only when
    the block has as many query rows as keys, which every block of our plans has (DESIGN.md 3)."""
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"causal block with {q.shape[0]} query rows and {k.shape[0]} keys: block kernels only take "
            "square causal blocks (the libraries disagree on where a rectangular causal mask starts)"
        )


class BlockKernel:
    """One attention block: forward -> (out, lse); backward from the FINAL out and lse -> grads."""

    name: str = "abstract"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
        varlen: Optional[Varlen] = None, window: Optional[Tuple[int, int]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``out`` ``[sq, b, h, d]`` (dtype of q) and ``lse`` ``[b, h, sq]`` (fp32).

        With ``varlen`` (packed sequences; batch 1) attention stays inside each document, causal
        per document when ``causal``; only kernels whose :meth:`check_varlen` passes get one.
        ``window`` = (left, right): query row r sees key c iff ``r + (sk - sq) - left <= c <= r + (sk -
        sq) + right`` (-1: unbounded; flash-attn's and TE's ``window_size``, bottom-right aligned;
        per document with ``varlen``); only kernels whose :meth:`check_window` passes get one.
        ``return_max_logit=True`` (only for kernels whose :meth:`check_max_logit` passes) also
        returns, third, the fp32 ``[h]`` maximum of ``scale * q.k`` over the pairs the call computed
        (TE's: rounded to the input dtype first).
        """
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse,
        *,
        causal: bool,
        scale: float,
        varlen: Optional[Varlen] = None,
        window: Optional[Tuple[int, int]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``dq, dk, dv`` for this block given the final ``out`` / ``lse`` of the Q rows.

        ``lse`` is what :meth:`lse_for_backward` made of the rows' final lse. ``out`` is only used
        through ``rowsum(dout * out)``, which is why the executor may pass a stand-in with the same
        row sums (see ``execute.delta_stand_in``).
        """
        raise NotImplementedError

    def lse_for_backward(self, lse_sbh: torch.Tensor, varlen: Optional[Varlen] = None):
        """The rows' final lse (``[sq, b, h]``, fp32) in the form :meth:`backward` takes.

        Called once per Q chunk and row range (not per block), so a backend that needs a copy in
        another layout pays for it once.
        """
        return lse_sbh.permute(1, 2, 0)

    def check(self, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor] = None) -> None:
        """Raise ``ValueError`` (saying why) if this backend cannot run these inputs
        (``v`` given: its head dim too, which may differ from q/k's under MLA)."""

    def check_varlen(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> None:
        """Raise ``ValueError`` (saying what is missing) unless this backend runs packed (THD)
        blocks of inputs like ``q`` / ``k`` (None: as many kv heads as heads); backends that can override it."""
        raise ValueError(f"the {self.name} attention kernel cannot run document (varlen) calls")

    def check_max_logit(self, q: torch.Tensor, *, packed: bool = False) -> None:
        """Raise ``ValueError`` (saying what is missing) unless this backend's forward can return the
        max logit (``return_max_logit=True``) for inputs like ``q`` (``packed``: of packed/THD blocks)."""
        raise ValueError(f"the {self.name} attention kernel cannot return the max logit")

    def check_window(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                     documents: bool = False) -> None:
        """Raise ``ValueError`` (saying why) unless this backend runs sliding-window
        blocks (``window=``) of inputs like ``q`` / ``k`` / ``v`` (``documents``: over documents, whose
        windowed blocks can have more query rows than keys); backends that can override it."""
        raise ValueError(f"the {self.name} attention kernel has no sliding window")

    def unsupported(self, needs: KernelNeeds) -> Optional[str]:
        """Why this backend cannot run a call with these ``needs`` (None: it can): its checks in the
        order a call meets them -- inputs, varlen, window, max logit."""
        q, k, v = needs.q, needs.k, needs.v
        try:
            self.check(q, k, v)
            if needs.varlen:
                self.check_varlen(q, k, v)
            if needs.window:
                self.check_window(q, k, v, documents=needs.window_documents)
            if needs.max_logit:
                self.check_max_logit(q, packed=needs.max_logit_packed)
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process (its library imports, its device exists)."""
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
