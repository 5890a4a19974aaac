"""CPU stand-ins for PyTorch's CUDA SDPA ops (flash and memory-efficient), with the ops' argument rules.

Modelled on ``aten/src/ATen/native/transformers/cuda/attention.cu`` / ``attention_backward.cu`` and
``flash_attn/flash_api.cpp``: the ops take ``[b, h, s, d]`` and transpose to ``[b, s, h, d]``;
the flash backward takes the *varlen* path whenever ``cum_seq_q`` is defined (a Python ``None`` is
undefined; ``torch.empty(0)`` is defined and gives batch size -1, "batch size must be positive");
the flash backward reads the lse through its data pointer as a contiguous ``[b, h, sq]`` array
(so a padded or strided lse is read wrongly, as on the GPU); the efficient ops need equal head
counts, take fp32/fp16/bf16 only ("Only fp32, half & bf16 supported at the moment"), pad the lse to
a multiple of 32 and read it through its batch and head strides. FA2 aligns
a causal mask bottom-right, the efficient op top-left. fp16/bf16 only for flash. Test doubles.
"""

from __future__ import annotations

import types

import torch

from fake_kernels import math_backward, math_forward


def _bshd(*xs):
    return [x.transpose(1, 2) for x in xs]


def _f32(*xs):
    """The kernels accumulate in fp32 (fp64 inputs stay fp64)."""
    return [x if x.dtype == torch.float64 else x.float() for x in xs]


def _flash_rules(q, k, v, *more):
    """mha_fwd / mha_bwd argument checks (on [b, s, h, d] tensors)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for x in (q, k, v) + more:
        if x.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        raise RuntimeError("head_size should be a multiple of 8 and at most 256")
    if q.shape[2] % k.shape[2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _efficient_dtypes(q):
    """The mem-efficient kernels' dispatch (DISPATCH_TYPES): fp32, fp16, bf16."""
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError("Only fp32, half & bf16 supported at the moment")


def _same_heads(q, k, v):
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise RuntimeError("Expected query, key and value to have the same number of heads")


def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    q, k, v = _bshd(query, key, value)
    _flash_rules(q, k, v)
    out, lse = math_forward(*_f32(query, key, value), scale, is_causal, align="bottom-right")
    out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] storage, returned as bhsd
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    return out, lse.float().contiguous(), None, None, q.shape[1], k.shape[1], rng, unused, torch.empty(0, dtype=q.dtype)


#: what the stand-ins saw: whether the op ran under torch.use_deterministic_algorithms(True) (the
#: CUDA backward ops read it to pick their deterministic algorithm, attention_backward.cu)
SEEN = {}


def _deterministic_seen(op):
    SEEN[op] = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    _deterministic_seen("flash_backward")
    do, q, k, v, o = _bshd(grad_out, query, key, value, out)
    if cum_seq_q is not None:  # _flash_attention_backward: defined => mha_varlen_bwd
        if cum_seq_q.numel() - 1 <= 0:
            raise RuntimeError("batch size must be positive")
        if q.dim() != 3:
            raise RuntimeError(f"varlen backward expects [total_q, h, d] tensors, got {tuple(q.shape)}")
    do, o = do.contiguous(), o.contiguous()  # "CUDA code assumes that dout is contiguous"
    _flash_rules(q, k, v, o, do)
    b, sq, h, _ = q.shape
    lse = torch.as_strided(logsumexp, (b, h, sq), (h * sq, sq, 1))  # read through the data pointer
    grads = math_backward(*_f32(grad_out, query, key, value, out, lse), scale, is_causal, align="bottom-right")
    return tuple(g.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2) for g in grads)


def efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    q, k, v = _bshd(query, key, value)
    _efficient_dtypes(q)
    _same_heads(q, k, v)
    assert attn_bias is None and compute_log_sumexp
    out, lse = math_forward(*_f32(query, key, value), scale, is_causal, align="top-left")
    b, h, sq = lse.shape
    padded = torch.full((b, h, -(-sq // 32) * 32), float("inf"))  # kAlignLSE; the padding must never be read
    padded[..., :sq] = lse
    seed = torch.zeros((), dtype=torch.int64)
    return out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2), padded, seed, seed.clone()


def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                       dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    _deterministic_seen("efficient_backward")
    q, k, v = _bshd(query, key, value)
    _efficient_dtypes(q)
    _same_heads(q, k, v)
    assert attn_bias is None and list(grad_input_mask) == [True, True, True, False]
    b, sq, h, _ = q.shape
    if logsumexp.stride(-1) != 1 or logsumexp.dim() != 3:
        raise RuntimeError("logsumexp must be [b, h, >= sq] with a unit last stride")
    lse = torch.as_strided(logsumexp, (b, h, sq), (logsumexp.stride(0), logsumexp.stride(1), 1))
    grads = math_backward(*_f32(grad_out_, query, key, value, out, lse), scale, is_causal, align="top-left")
    return tuple(g.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2) for g in grads) + (None,)


def namespace():
    """An ``aten``-like namespace: the real CPU ops, the CUDA ops replaced by the stand-ins above."""
    real = torch.ops.aten
    return types.SimpleNamespace(
        _scaled_dot_product_flash_attention_for_cpu=real._scaled_dot_product_flash_attention_for_cpu,
        _scaled_dot_product_flash_attention_for_cpu_backward=real._scaled_dot_product_flash_attention_for_cpu_backward,
        _scaled_dot_product_flash_attention=flash_forward,
        _scaled_dot_product_flash_attention_backward=flash_backward,
        _scaled_dot_product_efficient_attention=efficient_forward,
        _scaled_dot_product_efficient_attention_backward=efficient_backward,
    )
