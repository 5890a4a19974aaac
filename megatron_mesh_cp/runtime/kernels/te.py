"""``te`` backend: Transformer Engine's fused attention (cuDNN), the kernels Megatron runs.

Calls ``fused_attn_fwd`` / ``fused_attn_bwd`` from ``transformer_engine.pytorch.cpp_extensions``
as TE's own context-parallel code does: ``sbhd_sbhd_sbhd`` layout (our chunks are sequence-major,
so every block slice is already contiguous), ``causal`` with ``window_size=(-1, 0)`` (what TE's
DotProductAttention passes for causal) or ``no_mask`` with ``(-1, -1)``, the F16 arbitrary-seqlen
backend; GQA native. The forward's ``Stats`` ([b, h, s, 1], fp32) is the log-sum-exp.

Supported: TE >= 2.0 (``fake_dtype`` API). Two backward call forms: 2.0-2.14 take ``dqkv_dtype``
positionally between ``fake_dtype`` and ``aux_ctx_tensors``; 2.15+ dropped it and added
``o_format`` / ``do_format`` / ``dqkv_layout``. Which configurations TE can run is asked of TE
itself (``get_attention_backend``, the selection DotProductAttention makes), once per
configuration, in :meth:`TEKernel.check`: head dim > 128 in training needs sm90 and cuDNN >= 9.5,
deterministic backward needs sm90+ (and cuDNN >= 9.18.1 on sm100+, never sm120), and so on --
whatever the installed TE and cuDNN say.

Packed sequences (THD): ``thd_thd_thd`` with ``padding_causal`` / ``padding`` masks, q and kv sharing
the batch's ``cu_seqlens`` (also passed as the ``_padded`` offsets: a packed sub-block has no gaps).
TE's softmax stats for THD (``fused_attn_f16_arbitrary_seqlen.cu``) are *ragged* where TE's
``use_ragged_stats`` holds -- cuDNN >= 9.6 and not sm120 -- and dense ``[b, h, max_seqlen, 1]``
otherwise. Ragged stats come back as ``[max_tokens(t), h, 1]`` up to TE 2.10 (``get_max_tokens``:
at least 1024 rows, the ones past t unwritten) and ``[t, h, 1]`` from 2.11, so only their first t
rows are read; the backward reads ragged stats through their first t rows, so ``[t, h, 1]`` is
passed. TE 2.14-2.17 run THD on sm120 but allocate its dense stats as ``[t, h, 1]``, smaller than
what cuDNN writes; they are refused there (2.18 allocates ``[b, h, max_seqlen, 1]``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

from .base import BlockKernel, Varlen, check_cuda_half, check_square

__all__ = ["TEKernel"]

#: where ``get_attention_backend`` / ``AttentionParams`` live: 2.4+, 2.2-2.3, 2.0-2.1
_SELECTION_MODULES = ("transformer_engine.pytorch.attention.dot_product_attention.utils",
                      "transformer_engine.pytorch.dot_product_attention.utils",
                      "transformer_engine.pytorch.attention")


def _te():
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.cpp_extensions import fused_attn as fa

    return fa, TE_DType


def _selection():
    """TE's backend selection (``get_attention_backend``, ``AttentionParams``) for this TE version."""
    for name in _SELECTION_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "get_attention_backend") and hasattr(mod, "AttentionParams"):
            return mod.get_attention_backend, mod.AttentionParams
    raise ValueError("this Transformer Engine has no get_attention_backend (TE >= 2.0 has one); "
                     "upgrade TE")


def _window(causal: bool) -> Tuple[int, int]:
    return (-1, 0) if causal else (-1, -1)


def _cudnn_version() -> Tuple[int, ...]:
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version())


def _te_version() -> Tuple[int, ...]:
    import transformer_engine

    return tuple(int(x) for x in re.findall(r"\d+", str(getattr(transformer_engine, "__version__", "0")))[:2])


def _te_bucket(tokens: int) -> int:
    """The token count TE's cuDNN graph key holds for a ragged (THD) tensor of ``tokens`` rows
    (``get_max_tokens``, common/fused_attn/utils.cu@v2.18): 1024 up to 1024, the next power of two
    up to 32K, then the next multiple of 32K."""
    if tokens <= 1024:
        return 1024
    if tokens <= 32768:
        return 1 << (tokens - 1).bit_length()
    return -(-tokens // 32768) * 32768


class _Stats:
    """A row range's final lse (``[s, 1, h]``) as TE's backward reads it, each form made on first use
    (once per chunk and row range, as :meth:`TEKernel.lse_for_backward` promises): ``[1, h, s, 1]``
    for an sbhd call, ``[s, h, 1]`` (ragged softmax stats) for a THD call of one sequence."""

    __slots__ = ("_lse", "_dense", "_ragged")

    def __init__(self, lse_sbh: torch.Tensor) -> None:
        self._lse, self._dense, self._ragged = lse_sbh, None, None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._lse.permute(1, 2, 0).unsqueeze(-1).contiguous()
        return self._dense

    def ragged(self) -> torch.Tensor:
        if self._ragged is None:
            self._ragged = self._lse[:, 0].unsqueeze(-1).contiguous()
        return self._ragged


def _ragged_stats(device) -> bool:
    """TE's ``use_ragged_stats`` (2.14+; before, sm120 never runs THD): cuDNN >= 9.6 and not sm120."""
    return _cudnn_version() >= (9, 6, 0) and tuple(torch.cuda.get_device_capability(device)) != (12, 0)


#: the most cu_seqlens tensors a TE kernel keeps (TEKernel._cu_seqlens)
_CU_SIZE = 64


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
                "Transformer Engine < 2.0 is not supported by the te kernel; upgrade TE"
            )
        self._select, self._params = _selection()
        self._dqkv_dtype = "dqkv_dtype" in self._bwd_params  # 2.0-2.14: positional, before aux_ctx_tensors
        self._checked: Dict[Tuple, str] = {}
        # offsets per (batch, length, device), the most recent last: document sub-blocks bring new lengths every
        # batch (the one-sequence THD route), so at most _CU_SIZE are kept
        self._cu: "OrderedDict[Tuple[int, int, str], torch.Tensor]" = OrderedDict()
        self._rng: Dict[str, torch.Tensor] = {}
        self._ragged_stats: Dict[str, bool] = {}  # per device: TE's use_ragged_stats
        self._rows: Dict[int, tuple] = {}  # per packed batch: each row's (document, offset), for [b, h, s, 1] stats
        self._te = _te_version()
        self._buckets: Dict[str, bool] = {}  # per device: whether TE buckets THD sizes in its graph keys
        self._routes: Dict[Tuple, bool] = {}  # per configuration: whether TE runs it as a THD call of one sequence

    @classmethod
    def available(cls) -> bool:
        try:
            _te()
        except Exception:
            return False
        return torch.cuda.is_available()

    def _supported(self, q, k, causal: bool, deterministic: bool, thd: bool = False, dv: Optional[int] = None,
                   window=None, mask: Optional[str] = None) -> bool:
        """Whether TE's own selection offers the F16 arbitrary-seqlen fused backend for training
        on these inputs (batch, heads, head dim, dtype, mask, determinism, layout; this GPU and cuDNN)."""
        sq, b, h, d = q.shape
        fields = {f.name for f in dataclasses.fields(self._params)}
        mask = mask or (("padding_causal" if causal else "padding") if thd else ("causal" if causal else "no_mask"))
        # no bias: TE's determinism filter drops FusedAttention while core_attention_bias_requires_grad
        # (default True) is set, so pass what TE's DotProductAttention passes without a bias
        values = dict(qkv_type=torch.Tensor, qkv_dtype=q.dtype, qkv_layout="thd_thd_thd" if thd else "sbhd_sbhd_sbhd",
                      batch_size=b, num_heads=h, num_gqa_groups=(k.shape[2] if k is not None else h), max_seqlen_q=sq,
                      max_seqlen_kv=(k.shape[0] if k is not None else sq), head_dim_qk=d, head_dim_v=dv or d,
                      attn_mask_type=mask,
                      core_attention_bias_type="no_bias", core_attention_bias_requires_grad=False,
                      window_size=window or _window(causal), attention_dropout=0.0, context_parallel=False,
                      deterministic=deterministic, is_training=True, fp8=False,
                      bottom_right_diagonal=True if window is not None else None)
        res = self._select(self._params(**{key: val for key, val in values.items() if key in fields}))
        available, backend = res[-1], (res[2] if len(res) == 5 else res[3])  # 2.0-2.1: 5-tuple; 2.2+: 6-tuple
        return bool(available[1]) and backend == self._backend

    def check(self, q: torch.Tensor, k: torch.Tensor, v=None) -> None:
        check_cuda_half("the te kernel (TE fused attention)", q, 8)
        major, minor = torch.cuda.get_device_capability(q.device)
        dv = v.shape[-1] if v is not None else None
        key = (q.dtype, tuple(q.shape[1:]), k.shape[2], dv, major, minor)
        if key not in self._checked:
            why = ""
            if not self._supported(q, k, True, self.deterministic, dv=dv):
                what = (f"{str(q.dtype)[6:]}, {q.shape[2]} heads ({k.shape[2]} kv), head dim {q.shape[-1]}"
                        + (f" (value head dim {dv})" if dv not in (None, q.shape[-1]) else "") + ", training")
                if self.deterministic and self._supported(q, k, True, False, dv=dv):
                    why = (f"Transformer Engine has no deterministic fused-attention backward for {what} on "
                           f"sm{major}{minor} with this cuDNN; drop deterministic mode (--deterministic-mode)")
                else:
                    why = (f"Transformer Engine has no fused-attention backend for {what} on sm{major}{minor} "
                           "with this cuDNN (head dim > 128 needs sm90 and cuDNN >= 9.5)")
            self._checked[key] = why
        if self._checked[key]:
            raise ValueError(self._checked[key])

    def check_window(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                     documents: bool = False) -> None:
        """Windows need TE's ``bottom_right_diagonal`` (2.12+): our window calls are rectangles whose
        window is aligned to the bottom-right corner, which older TE does not let us ask for; and TE's
        selection must offer the fused backend for a causal window and for a two-sided one with the
        mask it will run with (:meth:`_window_mask`). Not over ``documents``: their windowed calls
        can have more query rows than keys, which TE's fused attention refuses for any window
        (``max_seqlen_q <= max_seqlen_kv``, fused_attn.cpp)."""
        if documents:
            raise ValueError("the te kernel cannot run a sliding window over documents: their windowed blocks can have "
                             "more query rows than keys, which Transformer Engine's fused attention refuses for a "
                             "window (it needs max_seqlen_q <= max_seqlen_kv); drop the window or the document "
                             "mask (cu_seqlens / --reset-attention-mask)")
        if not {"bottom_right_diagonal"} <= self._fwd_params & self._bwd_params:
            raise ValueError("this Transformer Engine cannot align a sliding window to the bottom-right corner "
                             "(bottom_right_diagonal: TE >= 2.12); upgrade TE")
        k = q if k is None else k
        dv = v.shape[-1] if v is not None and v.shape[-1] != q.shape[-1] else None  # MLA: the value head dim
        major, minor = torch.cuda.get_device_capability(q.device)
        key = ("window", q.dtype, tuple(q.shape[1:]), k.shape[2], dv, major, minor, k.shape[0] > 1024)  # cuDNN 9.14.0
        if key not in self._checked:
            ok = self._supported(q, k, True, self.deterministic, dv=dv, window=(64, 0)) and \
                self._supported(q, k, False, self.deterministic, dv=dv, window=(64, 64), mask=self._window_mask())
            self._checked[key] = "" if ok else (
                f"Transformer Engine has no fused-attention backend for sliding windows with {str(q.dtype)[6:]}, head "
                f"dim {q.shape[-1]} on sm{major}{minor} with this cuDNN (windows need cuDNN >= 9.6); upgrade cuDNN or drop "
                "the window")
        if self._checked[key]:
            raise ValueError(self._checked[key])

    def _window_mask(self) -> str:
        """The mask of a non-causal windowed sbhd call. TE 2.12-2.15 have two-sided windows only with
        the bottom-right and padding masks (the 9.6 sliding-window list of ``nvte_get_fused_attn_backend``,
        fused_attn.cpp@v2.15 L463-L479); ``no_mask`` joins it in 2.16 (@v2.16 L439). Before 2.16 such a
        call runs as ``padding`` with every sequence full length (``cu_seqlens`` = 0, s, 2s, ...): the
        same attention, the band aligned to the same corner."""
        return "no_mask" if self._te >= (2, 16) else "padding"

    def check_max_logit(self, q: torch.Tensor, *, packed: bool = False) -> None:
        """``return_max_logit`` exists from TE 2.9. From 2.14 TE's cuDNN graph returns Stats and Max
        together, which cuDNN < 9.21 rejects (2.17+ find no backend, 2.14-2.16 fail in the forward).
        Packed (THD): TE < 2.11 reduce ragged stats over rows never written, TE < 2.14 dense stats over
        the documents' padding rows; the reduced [h] value cannot be repaired from outside."""
        if "return_max_logit" not in self._fwd_params:
            raise ValueError("this Transformer Engine cannot return the max logit (return_max_logit: TE >= 2.9); "
                             "upgrade TE")
        te, cudnn = _te_version(), _cudnn_version()
        if te >= (2, 14) and cudnn < (9, 21, 0):
            raise ValueError(f"Transformer Engine {te[0]}.{te[1]} returns the max logit only with cuDNN >= 9.21 (its "
                             f"softmax stats and max come from one cuDNN node; this is cuDNN "
                             f"{'.'.join(map(str, cudnn))}); upgrade cuDNN, or use TE 2.9-2.13 for unpacked inputs")
        if packed:
            ragged = self._ragged(q.device)
            need = (2, 11) if ragged else (2, 14)
            if te < need:
                raise ValueError(f"Transformer Engine {te[0]}.{te[1]} reduces the max logit of packed sequences (thd) "
                                 + ("over softmax-stat rows it never wrote" if ragged else "over the documents' padding "
                                    "rows") + f"; upgrade TE to {need[0]}.{need[1]}+ (with cuDNN >= 9.21 from TE 2.14)")

    def check_varlen(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> None:
        check_cuda_half("the te kernel (TE fused attention, thd)", q, 8)
        k = q if k is None else k
        dv = v.shape[-1] if v is not None and v.shape[-1] != q.shape[-1] else None  # MLA: the value head dim
        major, minor = torch.cuda.get_device_capability(q.device)
        key = ("thd", q.dtype, tuple(q.shape[1:]), k.shape[2], dv, major, minor)
        if key not in self._checked:
            why = ""
            if not self._supported(q, k, True, self.deterministic, thd=True, dv=dv):
                why = (f"Transformer Engine has no fused-attention backend for packed sequences (thd, padding_causal) "
                       f"with {str(q.dtype)[6:]}, {q.shape[2]} heads ({k.shape[2]} kv), head dim {q.shape[-1]} on "
                       f"sm{major}{minor} with this cuDNN (thd needs sm90+ and cuDNN 9.1 or >= 9.6 -- TE has no "
                       "padding-mask backend with cuDNN 9.2-9.5 -- and as many heads as kv heads below cuDNN 9.6); "
                       "upgrade cuDNN")
            elif (major, minor) == (12, 0) and _te_version() < (2, 18):
                why = ("Transformer Engine 2.14-2.17 allocate sm120's dense thd softmax stats as [t, h, 1], smaller "
                       "than the [b, h, max_seqlen, 1] cuDNN writes; upgrade TE to 2.18+")
            self._checked[key] = why
        if self._checked[key]:
            raise ValueError(self._checked[key])

    def _thd_common(self, causal: bool, scale: float, params, window=None) -> Dict:
        kw = dict(attn_scale=scale, dropout=0.0, fast_zero_fill=True, qkv_layout="thd_thd_thd", attn_bias_type="no_bias",
                  attn_mask_type="padding_causal" if causal else "padding", window_size=window or _window(causal),
                  bottom_right_diagonal=True if window is not None else None,
                  deterministic=self.deterministic, o_format="thd", do_format="thd", dqkv_layout="thd_thd_thd")
        return {key: val for key, val in kw.items() if key in params}

    def _row_index(self, varlen: Varlen) -> tuple:
        """Each packed row's (document, offset) as device tensors, once per batch."""
        hit = self._rows.get(id(varlen))
        if hit is None or hit[0] is not varlen:
            lens = torch.tensor(varlen.lens, dtype=torch.long)
            doc = torch.repeat_interleave(torch.arange(len(varlen.lens)), lens)
            off = torch.arange(int(doc.numel())) - (torch.cumsum(lens, 0) - lens)[doc]
            if len(self._rows) > 8:
                self._rows.clear()
            hit = self._rows[id(varlen)] = (varlen, doc.to(varlen.cu.device), off.to(varlen.cu.device))
        return hit[1], hit[2]

    def _forward_thd(self, q, k, v, causal: bool, scale: float, varlen: Varlen, window=None, **top):
        cu, m = varlen.cu, varlen.max_len
        res = self._fwd(True, m, m, cu, cu, q[:, 0], k[:, 0], v[:, 0], q.dtype, self._backend,
                        cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                        **self._thd_common(causal, scale, self._fwd_params, window), **top)
        out, aux = res[:2]
        stats = aux[0]
        if self._ragged(q.device):  # [>= t, h, 1]: rows past t are TE 2.0-2.10's max_tokens padding
            lse = stats[: q.shape[0], :, 0].T
        else:  # [b, h, max_seqlen, 1]
            if stats.dim() != 4:
                raise ValueError(f"Transformer Engine returned thd softmax stats {tuple(stats.shape)} where this GPU "
                                 "uses the dense [b, h, max_seqlen, 1] layout; upgrade TE to 2.18+")
            doc, off = self._row_index(varlen)
            lse = stats[doc, :, off, 0].T
        if top:
            return out.unsqueeze(1), lse.unsqueeze(0), res[2].float()
        return out.unsqueeze(1), lse.unsqueeze(0)

    def _ragged(self, device) -> bool:
        key = str(device)
        if key not in self._ragged_stats:
            self._ragged_stats[key] = _ragged_stats(device)
        return self._ragged_stats[key]

    def _stats_thd(self, lse_sbh: torch.Tensor, varlen: Varlen) -> torch.Tensor:
        """Our [t, 1, h] lse as TE's THD softmax stats for the backward (the layout TE's backward reads)."""
        if self._ragged(lse_sbh.device):
            return lse_sbh[:, 0].unsqueeze(-1).contiguous()  # [t, h, 1]
        doc, off = self._row_index(varlen)
        buf = torch.zeros(len(varlen.lens), lse_sbh.shape[2], max(varlen.max_len, 1), 1, dtype=lse_sbh.dtype,
                          device=lse_sbh.device)
        buf[doc, :, off, 0] = lse_sbh[:, 0]
        return buf

    def _backward_thd(self, dout, q, k, v, out, stats, causal: bool, scale: float, varlen: Varlen, window=None):
        cu, m = varlen.cu, varlen.max_len
        return self._thd_backward(dout, q, k, v, out, stats, causal, scale, window, (m, m), (cu, cu))

    def _thd_backward(self, dout, q, k, v, out, stats, causal: bool, scale: float, window, max_len, cu):
        """One THD backward call: ``max_len`` and ``cu`` are (q, kv) pairs, the offsets also as padded ones."""
        args = [*max_len, *cu, q[:, 0], k[:, 0], v[:, 0], out[:, 0], dout[:, 0], q.dtype]
        if self._dqkv_dtype:
            args.append(self._dtype[q.dtype])
        args += [[stats, self._rng_state(q.device)], self._backend]
        grads = self._bwd(*args, cu_seqlens_q_padded=cu[0], cu_seqlens_kv_padded=cu[1],
                          **self._thd_common(causal, scale, self._bwd_params, window))
        return grads[0].unsqueeze(1), grads[1].unsqueeze(1), grads[2].unsqueeze(1)

    def _cu_seqlens(self, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        key = (batch, seq, str(device))
        hit = self._cu.get(key)
        if hit is None:
            hit = self._cu[key] = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
            while len(self._cu) > _CU_SIZE:  # bounded: new sub-block lengths every batch must not grow it
                self._cu.popitem(last=False)
        else:
            self._cu.move_to_end(key)
        if hit.is_cuda:  # an evicted tensor's memory is reused only after the kernels of this stream that read it
            hit.record_stream(torch.cuda.current_stream(hit.device))
        return hit

    def _common(self, causal: bool, scale: float, params, window=None) -> Dict:
        mask = "causal" if causal else self._window_mask() if window is not None else "no_mask"
        kw = dict(attn_scale=scale, dropout=0.0, fast_zero_fill=True, qkv_layout="sbhd_sbhd_sbhd",
                  attn_bias_type="no_bias", attn_mask_type=mask,
                  window_size=window or _window(causal), deterministic=self.deterministic,
                  bottom_right_diagonal=True if window is not None else None,
                  o_format="sbhd", do_format="sbhd", dqkv_layout="sbhd_sbhd_sbhd")  # the last three: TE 2.15+
        return {key: val for key, val in kw.items() if key in params}

    def _bucketed(self, device) -> bool:
        """Whether TE's graph keys bucket THD sizes here: cuDNN >= 9.6 and not sm120 (from TE 2.14,
        which runs THD there with exact sizes: fused_attn_f16_arbitrary_seqlen.cu@v2.18 L113-L129);
        THD itself needs sm90+."""
        key = str(device)
        if key not in self._buckets:
            cap = tuple(torch.cuda.get_device_capability(device))
            self._buckets[key] = _cudnn_version() >= (9, 6, 0) and (9, 0) <= cap != (12, 0)
        return self._buckets[key]

    def _one_sequence(self, q, k, v, causal: bool, window, max_logit: bool = False) -> bool:
        """Whether a dense call (batch 1) runs as a THD call of one sequence. TE keys its cuDNN graph
        caches (one ``static thread_local std::map`` per direction, never emptied) by the exact b,
        s_q, s_kv of an sbhd call, but by TE's token buckets (:func:`_te_bucket`) for THD: document
        sub-blocks, new sizes every batch and rank, would otherwise build (and keep) a graph per
        size in both directions. The same attention: one sequence, full length, ``padding`` /
        ``padding_causal``, the window aligned to the same corner. Calls already of bucket sizes
        stay sbhd (their key is as shared; no offset kernels); so do max-logit calls on TE < 2.11,
        whose ragged Max has rows it never wrote, and configurations TE's selection has no THD for."""
        if q.shape[1] != 1 or not self._bucketed(q.device):
            return False
        sq, sk = q.shape[0], k.shape[0]
        if (_te_bucket(sq), _te_bucket(sk)) == (sq, sk) or (max_logit and self._te < (2, 11)):
            return False
        dv = v.shape[-1] if v.shape[-1] != q.shape[-1] else None
        key = (str(q.device), q.dtype, tuple(q.shape[2:]), k.shape[2], dv, causal, window is not None, sq <= sk)
        if key not in self._routes:
            self._routes[key] = self._supported(q, k, causal, self.deterministic, thd=True, dv=dv, window=window)
        return self._routes[key]

    def _rng_state(self, device) -> torch.Tensor:
        dev = str(device)
        if dev not in self._rng:
            self._rng[dev] = torch.zeros(2, dtype=torch.int64, device=device)  # unused: no dropout
        return self._rng[dev]

    def _forward_one(self, q, k, v, causal: bool, scale: float, window=None, **top):
        sq, sk = q.shape[0], k.shape[0]
        cq, ck = self._cu_seqlens(1, sq, q.device), self._cu_seqlens(1, sk, q.device)
        res = self._fwd(True, sq, sk, cq, ck, q[:, 0], k[:, 0], v[:, 0], q.dtype, self._backend,
                        cu_seqlens_q_padded=cq, cu_seqlens_kv_padded=ck,
                        **self._thd_common(causal, scale, self._fwd_params, window), **top)
        lse = res[1][0][:sq, :, 0].T.unsqueeze(0)  # ragged stats [>= sq, h, 1] -> [1, h, sq]
        if top:
            return res[0].unsqueeze(1), lse, res[2].float()
        return res[0].unsqueeze(1), lse

    def _backward_one(self, dout, q, k, v, out, stats, causal: bool, scale: float, window=None):
        sq, sk = q.shape[0], k.shape[0]
        cq, ck = self._cu_seqlens(1, sq, q.device), self._cu_seqlens(1, sk, q.device)
        return self._thd_backward(dout, q, k, v, out, stats, causal, scale, window, (sq, sk), (cq, ck))

    def forward(self, q, k, v, *, causal: bool, scale: float, varlen: Optional[Varlen] = None, window=None,
                return_max_logit: bool = False):
        check_square(q, k, causal)
        top = {"return_max_logit": True} if return_max_logit else {}
        if varlen is not None:
            return self._forward_thd(q, k, v, causal, scale, varlen, window, **top)
        if self._one_sequence(q, k, v, causal, window, return_max_logit):
            return self._forward_one(q, k, v, causal, scale, window, **top)
        sq, b = q.shape[0], q.shape[1]
        sk = k.shape[0]
        res = self._fwd(
            True, sq, sk, self._cu_seqlens(b, sq, q.device), self._cu_seqlens(b, sk, q.device),
            q, k, v, q.dtype, self._backend, **self._common(causal, scale, self._fwd_params, window), **top,
        )
        out, aux = res[:2]
        stats = aux[0]  # [b, h, sq, 1]
        lse = stats.reshape(stats.shape[0], stats.shape[1], sq)
        return (out, lse, res[2].float()) if return_max_logit else (out, lse)  # TE's max logit: [h], O's dtype

    def lse_for_backward(self, lse_sbh: torch.Tensor, varlen: Optional[Varlen] = None):
        if varlen is not None:
            return self._stats_thd(lse_sbh, varlen)
        if lse_sbh.shape[1] == 1 and self._bucketed(lse_sbh.device):  # a call may run sbhd or THD (_one_sequence)
            return _Stats(lse_sbh)
        return lse_sbh.permute(1, 2, 0).unsqueeze(-1).contiguous()  # [b, h, sq, 1]

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, varlen: Optional[Varlen] = None,
                 window=None):
        check_square(q, k, causal)
        if varlen is not None:
            return self._backward_thd(dout, q, k, v, out, lse, causal, scale, varlen, window)
        if isinstance(lse, _Stats):
            if self._one_sequence(q, k, v, causal, window):
                return self._backward_one(dout, q, k, v, out, lse.ragged(), causal, scale, window)
            lse = lse.dense()
        sq, b = q.shape[0], q.shape[1]
        sk = k.shape[0]
        args = [sq, sk, self._cu_seqlens(b, sq, q.device), self._cu_seqlens(b, sk, q.device),
                q, k, v, out, dout, q.dtype]
        if self._dqkv_dtype:
            args.append(self._dtype[q.dtype])
        args += [[lse, self._rng_state(q.device)], self._backend]
        grads = self._bwd(*args, **self._common(causal, scale, self._bwd_params, window))
        return grads[0], grads[1], grads[2]
