"""CPU stand-ins for Transformer Engine's and flash-attn's private attention entry points.

They have the real call signatures (TE main: ``fused_attn_fwd``/``fused_attn_bwd``; flash-attn
2.6+: ``_flash_attn_forward``/``_flash_attn_backward``), enforce the real layout rules (TE: packed
``sbhd`` tensors; flash-attn: unit last stride, caller-owned dq/dk/dv) and compute with plain math
from the lse and out they are given -- so our adapters' argument passing, layouts, lse handling and
the delta stand-in are checked on CPU. They are test doubles, not kernels.
"""

from __future__ import annotations

import enum
import sys
import types

import torch


def _math_forward(q, k, v, scale, causal):
    """q [b, h, sq, d], k/v [b, hk, sk, d] -> out [b, h, sq, d], lse [b, h, sq]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _math_backward(do, q, k, v, o, lse, scale, causal):
    """The flash backward: P from the given lse, D = rowsum(dO * O) from the given O."""
    hk = k.shape[1]
    g = q.shape[1] // hk
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, kx.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vx.transpose(-1, -2))
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    b, h, sk, d = dk.shape
    return dq, dk.reshape(b, hk, g, sk, d).sum(2), dv.reshape(b, hk, g, sk, d).sum(2)


# --- Transformer Engine -------------------------------------------------------------------------

class FusedAttnBackend(enum.Enum):
    F16_max512_seqlen = 0
    F16_arbitrary_seqlen = 1
    FP8 = 2


def _from_sbhd(x):
    assert x.is_contiguous(), "TE needs packed sbhd tensors"
    return x.permute(1, 2, 0, 3)


def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                   fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                   page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                   dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", qkv_scale_inv_format=None,
                   attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                   bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False):
    assert qkv_layout == "sbhd_sbhd_sbhd" and o_format == "sbhd" and fused_attention_backend == FusedAttnBackend.F16_arbitrary_seqlen
    assert attn_mask_type in ("causal", "no_mask") and dropout == 0.0 and fake_dtype == q.dtype
    b = q.shape[1]
    assert max_seqlen_q == q.shape[0] and cu_seqlens_q.tolist() == list(range(0, (b + 1) * q.shape[0], q.shape[0]))
    out, lse = _math_forward(_from_sbhd(q), _from_sbhd(k), _from_sbhd(v), attn_scale, attn_mask_type == "causal")
    rng_state = torch.zeros(2, dtype=torch.int64)
    return out.permute(2, 0, 1, 3).contiguous(), [lse.unsqueeze(-1).float(), rng_state]


def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                   aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                   s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                   fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd", dqkv_layout="sbh3d",
                   qkv_scale_inv_format=None, do_scale_inv_format=None, attn_bias_type="no_bias",
                   attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
                   deterministic=False, cuda_graph=False):
    assert qkv_layout == dqkv_layout == "sbhd_sbhd_sbhd" and do_format == o_format == "sbhd"
    stats = aux_ctx_tensors[0]
    assert stats.is_contiguous() and stats.shape == (q.shape[1], q.shape[2], q.shape[0], 1)
    dq, dk, dv = _math_backward(_from_sbhd(d_o).to(q.dtype), _from_sbhd(q), _from_sbhd(k), _from_sbhd(v),
                                _from_sbhd(o), stats.squeeze(-1).to(q.dtype), attn_scale, attn_mask_type == "causal")
    return [x.permute(2, 0, 1, 3).contiguous() for x in (dq, dk, dv)]


# --- flash-attn 2.6+ ------------------------------------------------------------------------------

def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax):
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and dropout_p == 0.0 and window_size_left == -1
    out, lse = _math_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal)
    return out.transpose(1, 2).contiguous(), lse.float().contiguous(), None, torch.zeros(2, dtype=torch.int64)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softmax_lse.is_contiguous() and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert dq.is_contiguous() and dq.shape == q.shape and dk.shape == k.shape
    g = _math_backward(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       out.transpose(1, 2), softmax_lse.to(q.dtype), softmax_scale, causal)
    for buf, x in zip((dq, dk, dv), g):
        buf.copy_(x.transpose(1, 2))
    return torch.zeros(1)


def install(monkeypatch, te: bool = True, flash: bool = True) -> None:
    """Put the fakes where ``import transformer_engine...`` / ``import flash_attn...`` find them."""
    if te:
        mods = {name: types.ModuleType(name) for name in (
            "transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
            "transformer_engine.pytorch.cpp_extensions", "transformer_engine.pytorch.cpp_extensions.fused_attn")}
        fa = mods["transformer_engine.pytorch.cpp_extensions.fused_attn"]
        fa.fused_attn_fwd, fa.fused_attn_bwd, fa.FusedAttnBackend = fused_attn_fwd, fused_attn_bwd, FusedAttnBackend
        mods["transformer_engine.pytorch.cpp_extensions"].fused_attn = fa
        mods["transformer_engine.pytorch.constants"].TE_DType = {torch.float16: 5, torch.bfloat16: 6, torch.float32: 4, torch.float64: 4}
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
    if flash:
        pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
        iface._flash_attn_forward, iface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
        pkg.flash_attn_interface = iface
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no FA3 build
