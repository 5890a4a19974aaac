"""CPU stand-ins for Transformer Engine's attention entry points, and the shared math.

TE: ``fused_attn_fwd``/``fused_attn_bwd`` in both call forms (2.0-2.14 with a positional
``dqkv_dtype``; 2.15+ with ``o_format``/``do_format``/``dqkv_layout``) and its backend selection
(``get_attention_backend`` with the F16 rules of the real one), enforcing TE's rules (packed sbhd,
fp16/bf16, causal with ``window_size=(-1, 0)``; sliding windows bottom-right aligned; no backend --
``nvte_fused_attn_fwd`` raises -- where ``nvte_get_fused_attn_backend``'s sliding-window clause for
that TE and cuDNN fails, e.g. windows on calls with more query rows than keys, two-sided ``no_mask``
windows before TE 2.16, padding masks with cuDNN 9.2-9.5: ``fake_te_backend``), and they record the
cuDNN graph key of every call as TE v2.18 forms it (``fake_te_backend.GRAPHS``). THD (``thd_thd_thd``,
``padding_causal`` / ``padding``): int32 ``cu_seqlens`` and ``cu_seqlens_*_padded`` on the device, ``[t, h, d]``
tensors; softmax stats as TE's ``fused_attn_f16_arbitrary_seqlen.cu`` allocates them: ragged with
cuDNN >= 9.6 (``[get_max_tokens(t), h, 1]`` up to TE 2.10, the rows past t unwritten; ``[t, h, 1]``
from 2.11), dense ``[b, h, max_seqlen, 1]`` before 9.6 and on sm120 from TE 2.14 (2.14-2.17
allocate that layout as ``[t, h, 1]``, too small: what does not fit is lost); the backward reads the
ragged form through its first t rows, the dense one whole. The selection stand-in has TE's THD
rules (sm90+; heads == kv heads below cuDNN 9.6; sm120 only from TE 2.14 with cuDNN >= 9.18.1) and
its determinism filter (``core_attention_bias_requires_grad``, default True). flash-attn's surfaces are in ``fake_flash``, the
CUDA SDPA ops in ``fake_aten``. All compute with plain math from the lse and out they are given, so
our adapters' argument passing, layouts, lse handling and the delta stand-in are checked on CPU.
They are test doubles, not kernels.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import types
from typing import Optional

import torch

from fake_te_backend import get_max_tokens, record_graph, window_backend


def _mask(sq, sk, align, device):
    """Causal mask: ``top-left`` (TE, efficient, CPU: key j <= query i) or ``bottom-right``
    (FA2/FA3, aten CUDA flash: j <= i + sk - sq); they agree only when sq == sk."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0 if align == "top-left" else sk - sq)


def _band(sq, sk, window, device):
    """Sliding window ``(left, right)`` aligned to the bottom-right corner (TE with
    ``bottom_right_diagonal``, FA2/FA3): row r sees key c iff ``-left <= c - r - (sk - sq) <= right``."""
    d = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if window[0] >= 0:
        keep &= d >= -window[0]
    if window[1] >= 0:
        keep &= d <= window[1]
    return keep


def _scores(q, k, scale, causal, align, window):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2], align, q.device), float("-inf"))
    if window is not None:
        s = s.masked_fill(~_band(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    return s


def math_forward(q, k, v, scale, causal, align="top-left", window=None):
    """q [b, h, sq, d], k/v [b, hk, sk, d] -> out [b, h, sq, d], lse [b, h, sq] (``window``: a
    bottom-right aligned band on top of the causal mask)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = _scores(q, k, scale, causal, align, window)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def row_max(q, k, scale, causal, align="top-left", window=None):
    """Every row's largest allowed ``scale * q.k``: ``[b, h, sq]`` (what cuDNN's ``Max`` output holds)."""
    s = _scores(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1), scale, causal, align, window)
    return s.amax(-1)


def _max_logit_rule(return_max_logit):
    """TE 2.14+ ask cuDNN for Stats and Max together, which cuDNN < 9.21 rejects (2.17+: no backend,
    fused_attn.cpp:479@v2.18; 2.14-2.16: the graph fails to build); either way the forward raises."""
    if return_max_logit and TE["version"] >= (2, 14) and CUDNN["version"] < (9, 21, 0):
        raise RuntimeError("cuDNN < 9.21 rejects the softmax Stats + Max output combination (return_max_logit)")


def math_backward(do, q, k, v, o, lse, scale, causal, align="top-left", window=None):
    """The flash backward: P from the given lse, D = rowsum(dO * O) from the given O."""
    hk = k.shape[1]
    g = q.shape[1] // hk
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = _scores(q, kx, scale, causal, align, window)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vx.transpose(-1, -2))
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    b, h, sk, d = dk.shape
    return dq, dk.reshape(b, hk, g, sk, d).sum(2), dv.reshape(b, hk, g, sk, dv.shape[-1]).sum(2)


# --- Transformer Engine -------------------------------------------------------------------------

class FusedAttnBackend(enum.Enum):
    F16_max512_seqlen = 0
    F16_arbitrary_seqlen = 1
    FP8 = 2
    No_Backend = -1


TE_DTYPE = {torch.float16: 5, torch.bfloat16: 6, torch.float32: 4}
#: what the TE stand-ins saw last (e.g. the deterministic flag of the backward)
SEEN = {}
#: the cuDNN version TE's backend selection stand-in assumes
CUDNN = {"version": (9, 10, 0)}
#: the TE release the stand-ins model (``install`` sets it from its ``te`` argument)
TE = {"version": (2, 15)}


#: False: the TE stand-ins check every rule and form every graph key but skip the math (zeros come
#: back), so a long-context workload's calls can be counted on CPU
COMPUTE = {"on": True}


def _capability() -> tuple:
    try:
        return tuple(torch.cuda.get_device_capability())
    except (RuntimeError, AssertionError):  # no pretend_cuda: the stand-ins' default GPU
        return (9, 0)


def _ragged_stats() -> bool:
    """TE's ``use_ragged_stats``: cuDNN >= 9.6, and (from TE 2.14, which runs THD on sm120) not on sm120."""
    sm120 = _capability() == (12, 0) and TE["version"] >= (2, 14)
    return CUDNN["version"] >= (9, 6, 0) and not sm120


def _from_sbhd(x):
    assert x.is_contiguous(), "TE needs packed sbhd tensors"
    return x.permute(1, 2, 0, 3)


def _te_rules(q, k, fake_dtype, qkv_layout, attn_mask_type, window_size, dropout, backend, bottom_right_diagonal,
              max_seqlen_q, max_seqlen_kv):
    """TE's rules for every call: fp16/bf16, the F16 arbitrary-seqlen backend, the mask/window spellings
    (check_set_window_size: causal masks take (-1, 0) or (>= 0, 0), the others (>= -1, >= -1)), our
    windows bottom-right aligned, and ``nvte_get_fused_attn_backend``'s sliding-window clause for this
    TE and cuDNN (fake_te_backend.window_backend; no backend: ``nvte_fused_attn_fwd`` raises).
    Returns (causal, window to mask with or None)."""
    assert q.dtype in (torch.float16, torch.bfloat16) and fake_dtype == q.dtype, "F16 fused attention: fp16/bf16"
    assert backend == FusedAttnBackend.F16_arbitrary_seqlen and dropout == 0.0
    thd = qkv_layout == "thd_thd_thd"
    assert qkv_layout in ("sbhd_sbhd_sbhd", "thd_thd_thd"), qkv_layout
    masks = ("padding_causal", "padding") if thd else ("causal", "no_mask", "padding")
    assert attn_mask_type in masks, (qkv_layout, attn_mask_type)
    causal = attn_mask_type in ("causal", "padding_causal")
    left, right = window_size = tuple(window_size)
    assert left >= -1 and (right == 0 if causal else right >= -1), (attn_mask_type, window_size)
    window = None if window_size == ((-1, 0) if causal else (-1, -1)) else window_size
    if window is not None:
        assert bottom_right_diagonal is True, "our windows are aligned to the bottom-right corner"
    if not window_backend(attn_mask_type, window_size, max_seqlen_q, max_seqlen_kv, "thd" if thd else "sbhd",
                          TE["version"], CUDNN["version"], _capability()):
        raise RuntimeError("Invalid combination of data type and sequence length for fused attention (no backend for "
                           f"{attn_mask_type} with window {window_size}, max_seqlen_q {max_seqlen_q}, max_seqlen_kv "
                           f"{max_seqlen_kv} on TE {TE['version']} with cuDNN {CUDNN['version']})")
    return causal, window


def _sbhd_rules(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
    """sbhd: max_seqlen = the tensors' sequence dims, cu_seqlens their full lengths (what a padding
    mask then applies: the stand-in models no shorter sequences on sbhd)."""
    b = q.shape[1]
    assert max_seqlen_q == q.shape[0] and cu_seqlens_q.tolist() == list(range(0, (b + 1) * q.shape[0], q.shape[0]))
    assert max_seqlen_kv == k.shape[0] and cu_seqlens_kv.tolist() == list(range(0, (b + 1) * k.shape[0], k.shape[0]))


def _graph(direction, q, k, v, b, max_q, max_kv, scale, layout, mask, window_size, bottom_right, deterministic=False,
           max_logit=False):
    return record_graph(direction, b=b, h=q.shape[-2], hg=k.shape[-2], s_q=max_q, s_kv=max_kv, t_q=q.shape[0],
                        t_kv=k.shape[0], d_qk=q.shape[-1], d_v=v.shape[-1], scale=scale, layout=layout, mask=mask,
                        window=tuple(window_size), bottom_right=bottom_right, deterministic=deterministic,
                        dtype=q.dtype, max_logit=max_logit, te=TE["version"], cudnn=CUDNN["version"], cap=_capability())


def _te_forward(q, k, v, attn_scale, causal, window=None, return_max_logit=False):
    _max_logit_rule(return_max_logit)
    if not COMPUTE["on"]:
        b, h, sq = q.shape[1], q.shape[2], q.shape[0]
        res = (q.new_zeros(q.shape[:-1] + v.shape[-1:]), [torch.zeros(b, h, sq, 1), torch.zeros(2, dtype=torch.int64)])
        return res + (torch.zeros(h, dtype=q.dtype),) if return_max_logit else res
    qs, ks, vs = (_from_sbhd(x).float() for x in (q, k, v))
    out, lse = math_forward(qs, ks, vs, attn_scale, causal, window=window)
    res = (out.permute(2, 0, 1, 3).to(q.dtype).contiguous(), [lse.unsqueeze(-1).contiguous(), torch.zeros(2, dtype=torch.int64)])
    if not return_max_logit:
        return res
    top = row_max(qs, ks, attn_scale, causal, window=window).amax(dim=(0, 2))
    return res + (top.to(q.dtype),)  # [h] in O's dtype, as TE returns it


def _te_backward(q, k, v, o, d_o, aux_ctx_tensors, attn_scale, causal, deterministic, window=None):
    SEEN["deterministic"] = deterministic
    stats = aux_ctx_tensors[0]
    assert stats.is_contiguous() and stats.shape == (q.shape[1], q.shape[2], q.shape[0], 1)
    if not COMPUTE["on"]:
        return [torch.zeros_like(x) for x in (q, k, v)]
    grads = math_backward(*(_from_sbhd(x).float() for x in (d_o, q, k, v, o)), stats.squeeze(-1), attn_scale,
                          causal, window=window)
    return [x.permute(2, 0, 1, 3).to(q.dtype).contiguous() for x in grads]


def _te_thd_rules(q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv):
    assert q.dim() == 3 and k.dim() == 3 and q.is_contiguous() and k.is_contiguous(), "thd: contiguous [t, h, d]"
    assert CUDNN["version"] >= (9, 6, 0) or q.shape[1] == k.shape[1], "no fused backend: thd below cuDNN 9.6 needs h == h_kv"
    for cu, pad, x, m in ((cu_q, cu_q_pad, q, max_q), (cu_kv, cu_kv_pad, k, max_kv)):
        assert pad is not None and pad.dtype == cu.dtype == torch.int32 and cu.device == pad.device == x.device
        assert int(pad[-1]) <= x.shape[0] and bool(((cu[1:] - cu[:-1]) <= (pad[1:] - pad[:-1])).all())
        assert int((cu[1:] - cu[:-1]).max()) <= m, "max_seqlen below a sequence's length"


def _te_thd_segments(cu_q, cu_kv, pad_q, pad_kv):
    """(q rows, kv rows) of every sequence: real lengths from cu_seqlens at the padded offsets."""
    lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_kv[1:] - cu_kv[:-1]).tolist()
    return [((a, a + x), (c, c + y)) for a, x, c, y in zip(pad_q[:-1].tolist(), lq, pad_kv[:-1].tolist(), lk)]


def _te_thd_forward(q, k, v, attn_scale, causal, cu_q, cu_kv, pad_q, pad_kv, max_q, return_max_logit=False,
                    window=None):
    """Per sequence: causal top-left (``padding_causal``), the window bottom-right aligned to the
    sequence's own lengths (``bottom_right_diagonal`` with a padding mask)."""
    _max_logit_rule(return_max_logit)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32)
    lse = torch.zeros(q.shape[0], q.shape[1])
    top = torch.full((q.shape[0], q.shape[1]), float("-inf"))
    for (a, b), (c, d) in _te_thd_segments(cu_q, cu_kv, pad_q, pad_kv) if COMPUTE["on"] else ():
        if b > a:
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).float() for x in (q[a:b], k[c:d], v[c:d]))
            o, l = math_forward(qs, ks, vs, attn_scale, causal, window=window)
            out[a:b], lse[a:b] = o[0].transpose(0, 1), l[0].T
            top[a:b] = row_max(qs, ks, attn_scale, causal, window=window)[0].T
    t, h = q.shape[0], q.shape[1]
    if _ragged_stats():  # [max_tokens(t), h, 1] through TE 2.10 (rows past t never written), [t, h, 1] after
        rows = get_max_tokens(t) if TE["version"] < (2, 11) else t
        stats = torch.full((rows, h, 1), float("nan"))
        stats[:t, :, 0] = lse
    else:  # dense [b, h, max_seqlen, 1]
        dense = torch.zeros(cu_q.numel() - 1, h, max_q, 1)
        for i, ((a, b), _) in enumerate(_te_thd_segments(cu_q, cu_kv, pad_q, pad_kv)):
            dense[i, :, : b - a, 0] = lse[a:b].T
        stats = dense
        if CUDNN["version"] >= (9, 6, 0) and TE["version"] < (2, 18):  # sm120, TE 2.14-2.17: allocated [t, h, 1]
            stats = dense.reshape(-1)[: t * h].reshape(t, h, 1).clone()  # cuDNN wrote the rest past its end
    res = (out.to(q.dtype), [stats, torch.zeros(2, dtype=torch.int64)])
    if not return_max_logit:
        return res
    # TE reduces its Max buffer whole: through 2.10 ragged [max_tokens, h, 1] (rows past t never written),
    # before 2.14 dense [b, h, max_seqlen, 1] with the padding rows; both modelled as holding garbage
    stale = (_ragged_stats() and TE["version"] < (2, 11)) or (not _ragged_stats() and TE["version"] < (2, 14))
    reduced = torch.maximum(top.amax(0), torch.full_like(top[0], 1e4)) if stale else top.amax(0)
    return res + (reduced.to(q.dtype),)


def _te_thd_backward(q, k, v, o, d_o, aux_ctx_tensors, attn_scale, causal, deterministic, cu_q, cu_kv, pad_q,
                     pad_kv, max_q, window=None):
    SEEN["deterministic"] = deterministic
    stats = aux_ctx_tensors[0]
    segments = _te_thd_segments(cu_q, cu_kv, pad_q, pad_kv)
    if _ragged_stats():  # read through ragged offsets: the first t rows of a [>= t, h, 1] tensor
        assert stats.is_contiguous() and stats.dim() == 3 and stats.shape[0] >= q.shape[0], stats.shape
        assert stats.shape[1:] == (q.shape[1], 1), stats.shape
    else:  # dense: [b, h, max_seqlen, 1]
        assert stats.is_contiguous() and stats.shape == (cu_q.numel() - 1, q.shape[1], max_q, 1), stats.shape
    grads = [torch.zeros(x.shape, dtype=q.dtype) for x in (q, k, v)]
    for i, ((a, b), (c, d)) in enumerate(segments) if COMPUTE["on"] else ():
        if b > a:
            lse = stats[a:b, :, 0].T if stats.dim() == 3 else stats[i, :, : b - a, 0]
            g = math_backward(*(x.transpose(0, 1).unsqueeze(0).float() for x in (d_o[a:b], q[a:b], k[c:d], v[c:d], o[a:b])),
                              lse.unsqueeze(0).float(), attn_scale, causal, window=window)
            for buf, x, (lo, hi) in zip(grads, g, ((a, b), (c, d), (c, d))):
                buf[lo:hi] = x[0].transpose(0, 1).to(q.dtype)
    return grads


def _fwd(max_q, max_kv, cu_q, cu_kv, q, k, v, fake_dtype, backend, pad_q, pad_kv, attn_scale, dropout, layout, mask,
         window_size, bottom_right_diagonal, return_max_logit):
    causal, window = _te_rules(q, k, fake_dtype, layout, mask, window_size, dropout, backend, bottom_right_diagonal,
                               max_q, max_kv)
    if layout == "thd_thd_thd":
        _te_thd_rules(q, k, cu_q, cu_kv, pad_q, pad_kv, max_q, max_kv)
        _graph("fwd", q, k, v, cu_q.numel() - 1, max_q, max_kv, attn_scale, layout, mask, window_size,
               bottom_right_diagonal, max_logit=return_max_logit)
        return _te_thd_forward(q, k, v, attn_scale, causal, cu_q, cu_kv, pad_q, pad_kv, max_q, return_max_logit, window)
    _sbhd_rules(q, k, cu_q, cu_kv, max_q, max_kv)
    _graph("fwd", q, k, v, q.shape[1], max_q, max_kv, attn_scale, layout, mask, window_size, bottom_right_diagonal,
           max_logit=return_max_logit)
    return _te_forward(q, k, v, attn_scale, causal, window, return_max_logit)


def _bwd(max_q, max_kv, cu_q, cu_kv, q, k, v, o, d_o, fake_dtype, aux, backend, pad_q, pad_kv, attn_scale, dropout,
         layout, mask, window_size, bottom_right_diagonal, deterministic):
    causal, window = _te_rules(q, k, fake_dtype, layout, mask, window_size, dropout, backend, bottom_right_diagonal,
                               max_q, max_kv)
    if layout == "thd_thd_thd":
        _te_thd_rules(q, k, cu_q, cu_kv, pad_q, pad_kv, max_q, max_kv)
        _graph("bwd", q, k, v, cu_q.numel() - 1, max_q, max_kv, attn_scale, layout, mask, window_size,
               bottom_right_diagonal, deterministic)
        return _te_thd_backward(q, k, v, o, d_o, aux, attn_scale, causal, deterministic, cu_q, cu_kv, pad_q, pad_kv,
                                max_q, window)
    _sbhd_rules(q, k, cu_q, cu_kv, max_q, max_kv)
    _graph("bwd", q, k, v, q.shape[1], max_q, max_kv, attn_scale, layout, mask, window_size, bottom_right_diagonal,
           deterministic)
    return _te_backward(q, k, v, o, d_o, aux, attn_scale, causal, deterministic, window)


def fused_attn_fwd_2_0(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                       fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                       page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
                       rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False):
    """TE 2.0 .. 2.14 (2.14's keyword set; the positional part is the same since 2.0)."""
    return _fwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, fused_attention_backend,
                cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, dropout, qkv_layout, attn_mask_type, window_size,
                bottom_right_diagonal, return_max_logit)


def fused_attn_bwd_2_0(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                       dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                       attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
                       deterministic=False, cuda_graph=False):
    """TE 2.0 .. 2.14: ``dqkv_dtype`` (a TE dtype) positionally between fake_dtype and aux_ctx_tensors."""
    assert dqkv_dtype == TE_DTYPE[q.dtype], f"dqkv_dtype must be TE_DType[{q.dtype}], got {dqkv_dtype!r}"
    return _bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, aux_ctx_tensors,
                fused_attention_backend, cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, dropout, qkv_layout,
                attn_mask_type, window_size, bottom_right_diagonal, deterministic)


def fused_attn_fwd_2_15(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                        fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                        page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                        dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", qkv_scale_inv_format=None,
                        attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                        bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False,
                        cuda_graph=False):
    """TE 2.15+: ``o_format``."""
    assert o_format == qkv_layout.split("_")[0], (o_format, qkv_layout)
    return _fwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, fused_attention_backend,
                cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, dropout, qkv_layout, attn_mask_type, window_size,
                bottom_right_diagonal, return_max_logit)


def fused_attn_bwd_2_15(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                        aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                        s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                        fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd",
                        dqkv_layout="sbh3d", qkv_scale_inv_format=None, do_scale_inv_format=None,
                        attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla",
                        window_size=(-1, -1), bottom_right_diagonal=None, deterministic=False, cuda_graph=False):
    """TE 2.15+: no dqkv_dtype; o_format / do_format / dqkv_layout."""
    fmt = qkv_layout.split("_")[0]
    assert dqkv_layout == qkv_layout and do_format == o_format == fmt, (qkv_layout, o_format, do_format, dqkv_layout)
    return _bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, aux_ctx_tensors,
                fused_attention_backend, cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_scale, dropout, qkv_layout,
                attn_mask_type, window_size, bottom_right_diagonal, deterministic)


@dataclasses.dataclass
class AttentionParams:
    """The fields of TE's AttentionParams the te kernel fills (2.14 has more, all defaulted)."""

    qkv_type: type = torch.Tensor
    qkv_dtype: torch.dtype = torch.bfloat16
    qkv_layout: str = "sbh3d"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: str = "no_mask"
    window_size: tuple = None
    core_attention_bias_type: str = "no_bias"
    core_attention_bias_shape: str = "1hss"
    core_attention_bias_requires_grad: bool = True  # TE's default; its DotProductAttention passes False without a bias
    attention_dropout: float = 0.0
    context_parallel: bool = False
    deterministic: bool = False
    is_training: bool = True
    fp8: bool = False


def get_attention_backend(params: AttentionParams):
    """The F16 fused-attention rules of TE 2.14's selection (``get_attention_backend`` and
    ``nvte_get_fused_attn_backend``): sm80+, fp16/bf16, head dim <= 128 (<= 256 in training only on
    sm90 with cuDNN >= 9.5); thd needs sm90+ and, below cuDNN 9.6, as many heads as kv heads, and on
    sm120 TE >= 2.14 with cuDNN >= 9.18.1; a deterministic training backward needs sm90+, and cuDNN
    >= 9.18.1 on sm100+, none on sm120, and ``core_attention_bias_requires_grad`` False (TE's
    determinism filter reads it whatever the bias type); on sm100+ training above 128 only q/k 192 with
    v 128 (MLA, cuDNN >= 9.11); the sliding-window clause per TE and cuDNN version
    (``fake_te_backend.window_backend``: no padding masks with cuDNN 9.2-9.5, two-sided ``no_mask``
    windows only from TE 2.16). Returns the 2.2+ 6-tuple."""
    cap, cudnn, d = tuple(torch.cuda.get_device_capability()), CUDNN["version"], params.head_dim_qk
    ok = params.qkv_dtype in (torch.float16, torch.bfloat16) and cap >= (8, 0) and d % 8 == 0
    ok = ok and (d <= 128 or (d <= 256 and (not params.is_training or (cap == (9, 0) and cudnn >= (9, 5, 0))))
                 # fused_attn.cpp (main): on sm100+ training above 128 only MLA's 192/128, cuDNN >= 9.11
                 or (cap >= (10, 0) and (d, params.head_dim_v) == (192, 128) and cudnn >= (9, 11, 0)))
    if params.qkv_layout == "thd_thd_thd":  # fused_attn.cpp's qkv-format rule; utils.py's sm120 filter
        ok = ok and cap >= (9, 0) and (cudnn >= (9, 6, 0) or (cudnn >= (9, 1, 0) and params.num_heads == params.num_gqa_groups))
        ok = ok and (cap != (12, 0) or (TE["version"] >= (2, 14) and cudnn >= (9, 18, 1)))
    mask = params.attn_mask_type
    window = tuple(params.window_size or ((-1, 0) if "causal" in mask else (-1, -1)))  # check_set_window_size
    ok = ok and window_backend(mask, window, params.max_seqlen_q, params.max_seqlen_kv,
                               "thd" if params.qkv_layout == "thd_thd_thd" else "sbhd", TE["version"], cudnn, cap)
    if params.deterministic and params.is_training:
        ok = ok and cap >= (9, 0) and cap != (12, 0) and (cap < (10, 0) or cudnn >= (9, 18, 1))
        ok = ok and not params.core_attention_bias_requires_grad
    backend = FusedAttnBackend.F16_arbitrary_seqlen if ok else None
    return False, None, ok, backend, True, [False, ok, True]


def install(monkeypatch, te: Optional[str] = "2.15", flash: Optional[str] = "2.8", fa3: Optional[str] = None) -> None:
    """Put the stand-ins where ``import transformer_engine...`` (``te``: the release, e.g. ``"2.0"``,
    ``"2.10"``, ``"2.15"``: 2.0-2.14's call form below 2.15, the selection module where that release
    has it, its stats layouts) and ``import flash_attn...`` (see ``fake_flash.install``) find them."""
    import fake_flash

    if te:
        version = tuple(int(x) for x in te.split(".")[:2])
        monkeypatch.setitem(TE, "version", version)
        sel = "transformer_engine.pytorch.attention" if version < (2, 2) else \
            "transformer_engine.pytorch.dot_product_attention.utils" if version < (2, 4) else \
            "transformer_engine.pytorch.attention.dot_product_attention.utils"
        mods = {name: types.ModuleType(name) for name in (
            "transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
            "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.cpp_extensions.fused_attn",
            "transformer_engine.pytorch.utils", sel)}
        mods["transformer_engine.pytorch.utils"].get_cudnn_version = lambda: CUDNN["version"]
        fa = mods["transformer_engine.pytorch.cpp_extensions.fused_attn"]
        fa.fused_attn_fwd, fa.fused_attn_bwd = (fused_attn_fwd_2_0, fused_attn_bwd_2_0) if version < (2, 15) else \
            (fused_attn_fwd_2_15, fused_attn_bwd_2_15)
        mods["transformer_engine"].__version__ = f"{te}.0"
        fa.FusedAttnBackend = FusedAttnBackend
        mods["transformer_engine.pytorch.cpp_extensions"].fused_attn = fa
        mods["transformer_engine.pytorch.constants"].TE_DType = TE_DTYPE
        mods[sel].get_attention_backend, mods[sel].AttentionParams = get_attention_backend, AttentionParams
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
    fake_flash.install(monkeypatch, fa2=flash, fa3=fa3)


def pretend_cuda(monkeypatch, capability=(9, 0), **versions) -> None:
    """Install the stand-ins (``install(**versions)``) and make this process look like it has a GPU
    of ``capability`` (the tensors stay on CPU)."""
    install(monkeypatch, **versions)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: tuple(capability))


def assert_exact_through_executor(kern, shape, causal, heads, dtype, m=8, tol=5e-3):
    """Run ``kern`` through the real executor on virtual ranks (mesh ``shape``, 2 m tokens a chunk)
    and compare out, lse, dq, dk, dv with fp64 attention: wiring mistakes show as O(1) errors."""
    from megatron_mesh_cp.reference import reference_attention
    from megatron_mesh_cp.virtual import virtual_mesh_attention

    h, hk = heads
    n = shape[0] * shape[1]
    g = torch.Generator().manual_seed(n + m)
    q, k, v, do = (torch.randn(2, 2 * m * n, x, 16, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=causal)
    ro.backward(do)
    lo = lambda x: x.to(dtype)  # noqa: E731
    res = virtual_mesh_attention(lo(q), lo(k), lo(v), shape, dout=lo(do), causal=causal, kernel=kern)
    for name, ref in (("out", ro), ("lse", rl), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad)):
        got, ref = res[name].double(), ref.detach()
        err = float((got - ref).norm() / ref.norm())
        assert err < tol, f"{name}: relative error {err:.2e}"


def assert_packed_through_executor(kern, shape, heads, dtype, tol=5e-3):
    """Packed sequences (THD, padding, GQA) through the real executor on virtual ranks with ``kern``
    against the float64 block-diagonal reference: wiring mistakes show as O(1) errors."""
    from megatron_mesh_cp.reference import packed_reference, relative_errors
    from megatron_mesh_cp.virtual import virtual_mesh_attention

    h, hk = heads
    n = math.prod(shape)
    m = 2 * n
    cu, real = [0, m, 4 * m, 6 * m, 7 * m], [0, m, 4 * m - 3, 6 * m - 5, 6 * m - 5]  # last document: all padding
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(cu[-1], x, 16, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    ref = packed_reference(q, k, v, do, cu, real)
    lo = lambda x: x.to(dtype)  # noqa: E731
    res = virtual_mesh_attention(lo(q), lo(k), lo(v), shape, dout=lo(do), layout="thd", kernel=kern,
                                 cu_seqlens=torch.tensor(real, dtype=torch.int32),
                                 cu_seqlens_padded=torch.tensor(cu, dtype=torch.int32))
    assert torch.equal(torch.isfinite(res["lse"]), torch.isfinite(ref["lse"]))
    for name, err in relative_errors(res, ref).items():
        assert err < tol, f"{name}: relative error {err:.2e}"
