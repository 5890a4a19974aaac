"""The Ulysses all-to-all of ``a2a+mesh`` as pure tensor and integer math (docs/hybrid.md).

A Ulysses group is u consecutive CP ranks; rank ``G*u + j`` holds zigzag pieces ``G*u + j`` and
``2n-1-G*u-j``. The all-to-all over heads gives member j head group j of the whole group's tokens;
reordered, those tokens are super-rank G's zigzag share over N = n/u super-ranks, so the existing
mesh runs on them unchanged. This module packs and reorders (shared by the process-group and the
virtual transports), checks and replicates heads, and prices the all-to-all in bytes with
:func:`ulysses_traffic`, which the executor's counters and the simulator both use. It imports
neither torch.distributed nor the executor.
"""

from __future__ import annotations

from math import gcd
from typing import Dict, List, Tuple

import torch

from .plan import BACKWARD, FORWARD, ChunkDims

__all__ = [
    "A2A_CATEGORIES",
    "valid_ulysses",
    "check_ulysses_heads",
    "kv_repeats",
    "replicate_kv",
    "fold_replicas",
    "heads_to_members",
    "members_to_super",
    "super_to_members",
    "members_to_heads",
    "a2a_bytes",
    "ulysses_traffic",
]

#: Byte-counter categories of the all-to-all (intra-Ulysses-group traffic), in display order.
A2A_CATEGORIES = ("a2a-Q", "a2a-KV", "a2a-O", "a2a-LSE", "a2a-dO", "a2a-dQ", "a2a-dKV")


def valid_ulysses(heads: int, n: int) -> List[int]:
    """Every Ulysses degree u that divides both the per-rank query heads and the CP size."""
    return [u for u in range(1, n + 1) if n % u == 0 and heads % u == 0]


def check_ulysses_heads(heads: int, kv_heads: int, u: int, n: int = None) -> None:
    """``ValueError`` naming the valid u unless u divides the per-rank query heads.

    KV heads need not be divisible: :func:`kv_repeats` replicates them (the extra bytes are
    counted by :func:`ulysses_traffic`).
    """
    if not isinstance(u, int) or u < 1:
        raise ValueError(f"the Ulysses degree must be a positive integer, got {u!r}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if heads % u:
        valid = valid_ulysses(heads, n) if n else [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"Ulysses degree u={u} does not divide the {heads} query heads per rank (after tensor "
            f"parallelism); use u in {valid}"
        )


def kv_repeats(heads: int, kv_heads: int, u: int) -> int:
    """How many times each KV head is replicated so that u divides the KV heads (1 = none).

    The smallest r with u | kv_heads * r; kv_heads * r = lcm(kv_heads, u) divides the query heads
    whenever u does, so every query head still meets its own KV head after the split.
    """
    check_ulysses_heads(heads, kv_heads, u)
    return u // gcd(kv_heads, u)


def replicate_kv(x: torch.Tensor, r: int) -> torch.Tensor:
    """``[s, b, h_kv, d]`` -> ``[s, b, h_kv * r, d]``, each head repeated r times in place (GQA order)."""
    return x if r == 1 else x.repeat_interleave(r, dim=2)


def fold_replicas(dx: torch.Tensor, r: int) -> torch.Tensor:
    """Gradient of :func:`replicate_kv`: sum each head's r replicas (accumulated in fp32 for
    half-precision gradients, so bf16 pays one rounding, not r)."""
    if r == 1:
        return dx
    s, b, h, *rest = dx.shape
    acc = torch.float32 if dx.element_size() < 4 else dx.dtype
    return dx.reshape(s, b, h // r, r, *rest).to(acc).sum(dim=3).to(dx.dtype)


def heads_to_members(x: torch.Tensor, u: int) -> torch.Tensor:
    """``[s, b, H, ...]`` -> send buffer ``[u, s, b, H/u, ...]``: entry i (head group i) goes to member i."""
    s, b, h, *rest = x.shape
    return x.reshape(s, b, u, h // u, *rest).movedim(2, 0).contiguous()


def members_to_super(recv: torch.Tensor, u: int) -> torch.Tensor:
    """Received ``[u, s, b, H/u, ...]`` (entry i from member i) -> the super-rank's zigzag share.

    Member i contributes pieces (Gu+i, 2n-1-Gu-i); the super share is pieces Gu .. Gu+u-1 followed
    by 2n-u-Gu .. 2n-1-Gu, i.e. every member's first half in member order, then every member's
    second half in reverse member order. Returns ``[u*s, b, H/u, ...]`` (a new tensor).
    """
    u_, s, *rest = recv.shape
    halves = recv.reshape(u, 2, s // 2, *rest)
    return torch.cat([halves[:, 0].reshape(u * (s // 2), *rest),
                      halves[:, 1].flip(0).reshape(u * (s // 2), *rest)])


def super_to_members(y: torch.Tensor, u: int) -> torch.Tensor:
    """Inverse of :func:`members_to_super`: ``[u*s, b, H/u, ...]`` -> send buffer ``[u, s, b, H/u, ...]``."""
    total, *rest = y.shape
    m = total // (2 * u)
    first, second = y.reshape(2, u, m, *rest).unbind(0)
    return torch.stack([first, second.flip(0)], dim=1).reshape(u, 2 * m, *rest)


def members_to_heads(recv: torch.Tensor, u: int) -> torch.Tensor:
    """Received ``[u, s, b, H/u, ...]`` (entry i = head group i) -> ``[s, b, H, ...]``."""
    _, s, b, hu, *rest = recv.shape
    return recv.movedim(0, 2).reshape(s, b, u * hu, *rest)


def a2a_bytes(send: torch.Tensor) -> int:
    """Bytes a rank sends (= receives) in one all-to-all of the packed buffer ``send`` (its own entry stays)."""
    return (send.shape[0] - 1) * send[0].numel() * send.element_size()


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor: this runs per traffic count


def ulysses_traffic(u: int, dims: ChunkDims, phase: str, return_lse: bool = False) -> Dict[Tuple[str, str], int]:
    """Bytes one rank sends (= receives) in the Ulysses all-to-alls of one ``a2a+mesh`` call.

    ``dims``: the rank's *local* inputs before the all-to-all (``seq`` = local tokens, ``heads`` /
    ``kv_heads`` = heads per rank after TP, ``dtype`` = input dtype). Forward: Q, K, V in and O out
    (plus the fp32 lse when the caller asks for it); backward: dO in and dQ, dK, dV out. KV heads
    count after replication (:func:`kv_repeats`). Keys are ``(phase, category)`` like
    :func:`~megatron_mesh_cp.runtime.plan.plan_traffic`; u = 1 moves nothing.
    """
    if phase not in (FORWARD, BACKWARD):
        raise ValueError(f"phase must be {FORWARD!r} or {BACKWARD!r}, got {phase!r}")
    if u == 1:
        return {}
    r = kv_repeats(dims.heads, dims.kv_heads, u)
    item = _itemsize(dims.dtype)

    def moved(heads: int, itemsize: int, head_dim: int = dims.head_dim) -> int:  # u - 1 of u head groups leave
        return (u - 1) * dims.seq * dims.batch * (heads // u) * head_dim * itemsize

    q, o = moved(dims.heads, item), moved(dims.heads, item, dims.dv)  # O, dO: V's head dim (MLA)
    kv = moved(dims.kv_heads * r, item) + moved(dims.kv_heads * r, item, dims.dv)
    if phase == FORWARD:
        out = {(FORWARD, "a2a-Q"): q, (FORWARD, "a2a-KV"): kv, (FORWARD, "a2a-O"): o}
        if return_lse:
            out[(FORWARD, "a2a-LSE")] = (u - 1) * dims.seq * dims.batch * (dims.heads // u) * _itemsize(dims.acc_dtype)
        return out
    return {(BACKWARD, "a2a-dO"): o, (BACKWARD, "a2a-dQ"): q, (BACKWARD, "a2a-dKV"): kv}
