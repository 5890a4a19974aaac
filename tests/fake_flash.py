"""CPU stand-ins for flash-attn's private entry points, one per call surface of the real releases.

* FA2 2.6.x: plain functions, ``window_size`` tuple, forward -> ``(out, q, k, v, out_padded, lse,
  S_dmask, rng_state)``, backward -> ``(dq, dk, dv, softmax_d)``.
* FA2 2.7.0 .. 2.8.3: ``torch.library.custom_op`` objects exactly as those releases declare them
  (``mutates_args=("dq", "dk", "dv")`` for the backward) -- so ``inspect.signature`` of the module
  attribute shows ``(*args, **kwargs)`` as on a real install -- except ``device_types="cpu"``.
* FA3 2024-07 (first release): ``(q, k, v, softmax_scale, causal)`` -> 7-tuple with the lse at 5.
* FA3 2025-03: many required leading arguments, ``causal`` and ``window_size`` in both directions.
* FA3 2025-08+: custom ops with defaults, ``is_causal`` and ``window_size_left/right`` in the
  backward, which returns ``softmax_d`` only; a custom op may not return an input (``out``); as
  hopper/flash_api.cpp since 2025-09-17, no deterministic backward for head dims rounded up to 256.
  A value head dim of its own (MLA) on Hopper only, in the forward's ranges, ``max(d, dv) <= 256`` in
  the backward (builds from 2025-04-24 on; earlier ones had no MLA backward).

All enforce the kernels' rules: fp16/bf16, unit last stride, caller-owned dq/dk/dv of the right
shape, the lse read as a contiguous ``[b, h, s]`` array, a causal mask aligned bottom-right.

Varlen (packed sequences): FA2's ``_flash_attn_varlen_forward/backward`` (2.6: plain functions,
``window_size`` tuple, 8-tuple result; 2.7/2.8: custom ops), and FA3's one entry point taking
``cu_seqlens_q/k`` (2025-03, 2025-08). Rules: ``[total, h, d]`` tensors, int32 ``cu_seqlens`` that
end at the totals, ``max_seqlen`` covering every sequence, lse ``[h, total]`` read contiguously,
causal bottom-right per sequence. The 2024-07 FA3 stand-in has no varlen entry point.
"""

from __future__ import annotations

import sys
import types
from typing import Optional, Tuple

import torch

from fake_kernels import math_backward, math_forward

Tensor = torch.Tensor


def _rules(*xs):
    if xs[0].dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for x in xs:
        if x.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")


def _fwd(q, k, v, scale, causal):
    """[b, s, h, d] in -> out [b, s, h, d] (q dtype, contiguous), lse [b, h, s] fp32."""
    _rules(q, k, v)
    out, lse = math_forward(*(x.transpose(1, 2).float() for x in (q, k, v)), scale, causal, align="bottom-right")
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous()


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, causal):
    """Writes the gradients into the caller's dq/dk/dv ([b, s, h, d], unit last stride)."""
    _rules(q, k, v, out, dout, dq, dk, dv)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, "dq/dk/dv shapes"
    b, s, h, _ = q.shape
    lse = torch.as_strided(lse, (b, h, s), (h * s, s, 1))  # read through the data pointer
    grads = math_backward(*(x.transpose(1, 2).float() for x in (dout, q, k, v, out)), lse.float(), scale, causal,
                          align="bottom-right")
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g.transpose(1, 2))
    return torch.zeros(b, h, s)


def _varlen_rules(q, k, cu_q, cu_k, max_q, max_k):
    assert q.dim() == 3 and k.dim() == 3, "varlen takes [total, h, d] tensors"
    for cu, x, m in ((cu_q, q, max_q), (cu_k, k, max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == x.device, "cu_seqlens: int32 on the device"
        assert int(cu[0]) == 0 and int(cu[-1]) == x.shape[0], "cu_seqlens must end at the total"
        assert int((cu[1:] - cu[:-1]).max()) <= m, "max_seqlen below a sequence's length"
    assert cu_q.numel() == cu_k.numel()


def _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """[t, h, d] in -> out [t, h, d] (q dtype), lse [h, t] fp32 contiguous; per sequence."""
    _rules(q, k, v)
    _varlen_rules(q, k, cu_q, cu_k, max_q, max_k)
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        if b > a:
            o, l = math_forward(*(x.transpose(0, 1).unsqueeze(0).float() for x in (q[a:b], k[c:d], v[c:d])), scale,
                                causal, align="bottom-right")
            out[a:b], lse[:, a:b] = o[0].transpose(0, 1), l[0]
    return out.to(q.dtype), lse.contiguous()


def _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal):
    _rules(q, k, v, out, dout, dq, dk, dv)
    _varlen_rules(q, k, cu_q, cu_k, max_q, max_k)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, "dq/dk/dv shapes"
    t, h, _ = q.shape
    lse = torch.as_strided(lse, (h, t), (t, 1))  # read through the data pointer
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        if b > a:
            grads = math_backward(*(x.transpose(0, 1).unsqueeze(0).float() for x in (dout[a:b], q[a:b], k[c:d], v[c:d],
                                                                                      out[a:b])),
                                  lse[:, a:b].unsqueeze(0).float(), scale, causal, align="bottom-right")
            for buf, g, (lo, hi) in zip((dq, dk, dv), grads, ((a, b), (c, d), (c, d))):
                buf[lo:hi].copy_(g[0].transpose(0, 1))
    return torch.zeros(h, t)


# --- FA2 2.6.x -----------------------------------------------------------------------------------

def fa2_6_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def fa2_6_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   softcap, alibi_slopes, deterministic, rng_state=None):
    assert tuple(window_size) == (-1, -1)
    d = _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


def fa2_6_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, return_softmax, block_table, leftpad_k=None,
                         seqused_k=None):
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and block_table is None and seqused_k is None
    out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def fa2_6_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, rng_state=None):
    assert tuple(window_size) == (-1, -1)
    d = _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale, causal)
    return dq, dk, dv, d


# --- FA2 2.7.0 .. 2.8.3 (custom ops) ---------------------------------------------------------------

@torch.library.custom_op("fake_flash_attn::_flash_attn_forward", mutates_args=(), device_types="cpu")
def fa2_7_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                  window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                  return_softmax: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    assert dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1) and alibi_slopes is None
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("fake_flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def fa2_7_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                   dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor], dropout_p: float,
                   softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor] = None) -> Tensor:
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


@torch.library.custom_op("fake_flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def fa2_7_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                         alibi_slopes: Optional[Tensor] = None, return_softmax: bool = False,
                         block_table: Optional[Tensor] = None, leftpad_k: Optional[Tensor] = None,
                         seqused_k: Optional[Tensor] = None, zero_tensors: bool = False
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    assert dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1) and block_table is None
    out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("fake_flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def fa2_7_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                          dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor], cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                          softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                          softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
                          rng_state: Optional[Tensor] = None, zero_tensors: bool = False) -> Tensor:
    return _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, softmax_scale, causal)


# --- FA3 -------------------------------------------------------------------------------------------

def fa3_2024_forward(q, k, v, softmax_scale, causal):
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None


def fa3_2024_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):
    d = _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


def _fa3_head_dims(q, v, backward: bool) -> None:
    """hopper/flash_api.cpp's head-dim rules for a value head dim of its own (MLA): Hopper only
    (``dprops->major == 9``), the forward's ranges, and ``max(d, dv) <= 256`` in the backward."""
    d, dv = q.shape[-1], v.shape[-1]
    if backward and max(d, dv) > 256:
        raise RuntimeError("FlashAttention backward only supports head dimension at most 256")
    if dv == d:
        return
    if torch.cuda.get_device_capability()[0] != 9:
        raise RuntimeError("Only Hopper supports different V headdim")
    if not (128 < d <= 192 and 96 < dv <= 128 or d <= 64 and dv <= 512):
        raise RuntimeError("If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V "
                           "headdim in (96, 128], or (Q/K <= 64 and V <= 512).")


def fa3_2025_03_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                        seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                        rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                        window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, scheduler_metadata=None,
                        num_splits=1, pack_gqa=None, sm_margin=0):
    assert k_new is None and page_table is None and tuple(window_size) == (-1, -1)
    _fa3_head_dims(q, v, backward=False)
    if cu_seqlens_q is not None:  # varlen through the same entry point
        assert cu_seqlens_k is not None and out is None
        o, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        return o, lse, None, None
    o, lse = _fwd(q, k, v, softmax_scale, causal)
    if out is None:
        out = o
    else:
        assert out.shape == q.shape[:-1] + v.shape[-1:] and out.stride(-1) == 1
        out.copy_(o)
    return out, lse, None, None


def fa3_2025_03_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                         max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                         softcap=0.0, deterministic=False, sm_margin=0):
    assert tuple(window_size) == (-1, -1)
    _fa3_head_dims(q, v, backward=True)
    if cu_seqlens_q is not None:
        d = _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal)
        return dq, dk, dv, d
    d = _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


@torch.library.custom_op("fake_flash_attn_3::_flash_attn_forward", mutates_args=(), device_types="cpu")
def fa3_2025_08_forward(
    q: Tensor, k: Tensor, v: Tensor, k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
    qv: Optional[Tensor] = None, out: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, cu_seqlens_k_new: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None, page_table: Optional[Tensor] = None, kv_batch_idx: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
    seqlens_rotary: Optional[Tensor] = None, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    o, lse = fa3_2025_03_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                                 seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx,
                                 leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale,
                                 softmax_scale, causal)[:2]
    return o, lse, torch.empty(0), torch.empty(0)


@torch.library.custom_op("fake_flash_attn_3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def fa3_2025_08_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None, sequed_q: Optional[Tensor] = None,
    sequed_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    dq: Optional[Tensor] = None, dk: Optional[Tensor] = None, dv: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> Tensor:
    if deterministic and max(q.shape[-1], v.shape[-1]) > 192:  # round_up_headdim(...) == 256
        raise RuntimeError("Deterministic backward not supported for hdim 256.")
    _fa3_head_dims(q, v, backward=True)
    if cu_seqlens_q is not None:
        return _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, is_causal)
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, is_causal)


FA2 = {"2.5": None, "2.6": (fa2_6_forward, fa2_6_backward), "2.7": (fa2_7_forward, fa2_7_backward),
       "2.8": (fa2_7_forward, fa2_7_backward)}  # 2.7.0 .. 2.8.3 share one surface
FA2_VARLEN = {"2.6": (fa2_6_varlen_forward, fa2_6_varlen_backward), "2.7": (fa2_7_varlen_forward, fa2_7_varlen_backward),
              "2.8": (fa2_7_varlen_forward, fa2_7_varlen_backward)}
FA3 = {"2024-07": (fa3_2024_forward, fa3_2024_backward), "2025-03": (fa3_2025_03_forward, fa3_2025_03_backward),
       "2025-08": (fa3_2025_08_forward, fa3_2025_08_backward)}


def _fa2_5_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    raise AssertionError("flash-attn 2.5 is refused before any call")


def install(monkeypatch, fa2: Optional[str] = "2.8", fa3: Optional[str] = None) -> None:
    """Make ``import flash_attn`` (version ``fa2``, e.g. ``"2.6"``) and ``import flash_attn_interface``
    (FA3 form ``fa3``) find these stand-ins; None hides the package."""
    if fa2 is None:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    else:
        pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
        pkg.__version__ = {"2.5": "2.5.9.post1", "2.6": "2.6.3", "2.7": "2.7.4.post1", "2.8": "2.8.3"}[fa2]
        fwd, bwd = FA2[fa2] or (_fa2_5_forward, fa2_6_backward)
        iface._flash_attn_forward, iface._flash_attn_backward = fwd, bwd
        if fa2 in FA2_VARLEN:
            iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = FA2_VARLEN[fa2]
        pkg.flash_attn_interface = iface
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    if fa3 is None:
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    else:
        mod = types.ModuleType("flash_attn_interface")
        mod._flash_attn_forward, mod._flash_attn_backward = FA3[fa3]
        monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
