"""``a2a+mesh`` on process groups: Ulysses all-to-all over heads around the unchanged mesh.

Forward: Q, K, V go through an all-to-all over the Ulysses group (u ranks; each member keeps h/u
query heads and its share of the KV heads for the whole group's tokens), are reordered into the
super-rank's zigzag share (:mod:`megatron_mesh_cp.runtime.ulysses`), the mesh runs over the N = a*b
super-ranks, and O (and lse) go back the same way. Backward is the mirror image: dO in; dQ, dK, dV
out. Each direction is one autograd node, so every rank issues the collectives in the same order.
With packed sequences the reorder is the batch's per-document one (``packed.PackedLayout``).
The all-to-all bytes land in the mesh's :class:`~megatron_mesh_cp.runtime.comm.Traffic` under
:data:`~megatron_mesh_cp.runtime.ulysses.A2A_CATEGORIES` and equal :func:`~megatron_mesh_cp.runtime.ulysses.ulysses_traffic`.
"""

from __future__ import annotations

import torch

from .plan import BACKWARD, FORWARD
from .ulysses import (
    a2a_bytes, fold_replicas, heads_to_members, members_to_heads, members_to_super, replicate_kv,
    super_to_members,
)

__all__ = ["exchange", "to_super", "from_super", "super_of_members", "members_of_super", "UlyssesIn", "UlyssesOut"]


def exchange(mesh, send: torch.Tensor, phase: str, category: str) -> torch.Tensor:
    """All-to-all of a packed ``[u, ...]`` buffer over ``mesh.ulysses_group``; counts the bytes."""
    import torch.distributed as dist

    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=mesh.ulysses_group)
    nbytes = a2a_bytes(send)
    mesh.traffic.add(phase, category, nbytes, nbytes)
    return recv


def super_of_members(recv: torch.Tensor, u: int, packed=None) -> torch.Tensor:
    """What the all-to-all delivered (``[u, s, b, h/u, ...]``: every member's tokens of this head
    group) -> the super-rank's chunk in the mesh's order (``packed``: a PackedLayout, whose
    per-document reorder replaces the zigzag one)."""
    if packed is not None:
        return packed.into_mesh(recv.reshape(-1, *recv.shape[2:]))
    return members_to_super(recv, u)


def members_of_super(y: torch.Tensor, u: int, packed=None) -> torch.Tensor:
    """Inverse of :func:`super_of_members`: the super-rank's chunk -> the ``[u, ...]`` send buffer."""
    return super_to_members(y, u) if packed is None else packed.out_of_mesh(y).reshape(u, -1, *y.shape[1:])


def to_super(mesh, x: torch.Tensor, phase: str, category: str, packed=None) -> torch.Tensor:
    """Local ``[s, b, H, ...]`` -> this member's head group over the super-rank's tokens."""
    u = mesh.ulysses
    return super_of_members(exchange(mesh, heads_to_members(x, u), phase, category), u, packed)


def from_super(mesh, y: torch.Tensor, phase: str, category: str, packed=None) -> torch.Tensor:
    """Inverse of :func:`to_super`: super-rank tokens of one head group -> local tokens, all heads."""
    u = mesh.ulysses
    return members_to_heads(exchange(mesh, members_of_super(y, u, packed), phase, category), u)


class UlyssesIn(torch.autograd.Function):
    """(q, k, v) local, sequence-major -> super layout on h/u heads; KV replicated ``r`` times first."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, r, packed=None):
        ctx.mesh, ctx.r, ctx.packed = mesh, r, packed
        qs = to_super(mesh, q, FORWARD, "a2a-Q", packed)
        ks = to_super(mesh, replicate_kv(k, r), FORWARD, "a2a-KV", packed)
        vs = to_super(mesh, replicate_kv(v, r), FORWARD, "a2a-KV", packed)
        return qs, ks, vs

    @staticmethod
    def backward(ctx, dqs, dks, dvs):
        mesh, r, packed = ctx.mesh, ctx.r, ctx.packed
        dq = from_super(mesh, dqs, BACKWARD, "a2a-dQ", packed)
        dk = fold_replicas(from_super(mesh, dks, BACKWARD, "a2a-dKV", packed), r)
        dv = fold_replicas(from_super(mesh, dvs, BACKWARD, "a2a-dKV", packed), r)
        return dq, dk, dv, None, None, None


class UlyssesOut(torch.autograd.Function):
    """(out, lse ``[b, h/u, S]``) in super layout -> local out (and lse ``[b, h, s]`` if asked)."""

    @staticmethod
    def forward(ctx, out_s, lse_s, mesh, with_lse, packed=None):
        ctx.mesh, ctx.packed = mesh, packed
        out = from_super(mesh, out_s, FORWARD, "a2a-O", packed)
        if with_lse:
            lse = from_super(mesh, lse_s.permute(2, 0, 1), FORWARD, "a2a-LSE", packed).permute(1, 2, 0).contiguous()
        else:
            lse = lse_s.new_empty(0)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return to_super(ctx.mesh, dout, BACKWARD, "a2a-dO", ctx.packed), None, None, None, None
