"""``a2a+mesh`` on process groups: Ulysses all-to-all over heads around the unchanged mesh.

Forward: Q, K, V go through an all-to-all over the Ulysses group (u ranks; each member keeps h/u
query heads and its share of the KV heads for the whole group's tokens), are reordered into the
super-rank's zigzag share (:mod:`megatron_mesh_cp.runtime.ulysses`), the mesh runs over the N = a*b
super-ranks, and O (and lse) go back the same way. Backward is the mirror image: dO in; dQ, dK, dV
out. Each direction is one autograd node, so every rank issues the collectives in the same order.
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

__all__ = ["exchange", "to_super", "from_super", "UlyssesIn", "UlyssesOut"]


def exchange(mesh, send: torch.Tensor, phase: str, category: str) -> torch.Tensor:
    """All-to-all of a packed ``[u, ...]`` buffer over ``mesh.ulysses_group``; counts the bytes."""
    import torch.distributed as dist

    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=mesh.ulysses_group)
    nbytes = a2a_bytes(send)
    mesh.traffic.add(phase, category, nbytes, nbytes)
    return recv


def to_super(mesh, x: torch.Tensor, phase: str, category: str) -> torch.Tensor:
    """Local ``[s, b, H, ...]`` -> this member's head group over the super-rank's tokens."""
    u = mesh.ulysses
    return members_to_super(exchange(mesh, heads_to_members(x, u), phase, category), u)


def from_super(mesh, y: torch.Tensor, phase: str, category: str) -> torch.Tensor:
    """Inverse of :func:`to_super`: super-rank tokens of one head group -> local tokens, all heads."""
    u = mesh.ulysses
    return members_to_heads(exchange(mesh, super_to_members(y, u), phase, category), u)


class UlyssesIn(torch.autograd.Function):
    """(q, k, v) local, sequence-major -> super layout on h/u heads; KV replicated ``r`` times first."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, r):
        ctx.mesh, ctx.r = mesh, r
        qs = to_super(mesh, q, FORWARD, "a2a-Q")
        ks = to_super(mesh, replicate_kv(k, r), FORWARD, "a2a-KV")
        vs = to_super(mesh, replicate_kv(v, r), FORWARD, "a2a-KV")
        return qs, ks, vs

    @staticmethod
    def backward(ctx, dqs, dks, dvs):
        mesh, r = ctx.mesh, ctx.r
        dq = from_super(mesh, dqs, BACKWARD, "a2a-dQ")
        dk = fold_replicas(from_super(mesh, dks, BACKWARD, "a2a-dKV"), r)
        dv = fold_replicas(from_super(mesh, dvs, BACKWARD, "a2a-dKV"), r)
        return dq, dk, dv, None, None


class UlyssesOut(torch.autograd.Function):
    """(out, lse ``[b, h/u, S]``) in super layout -> local out (and lse ``[b, h, s]`` if asked)."""

    @staticmethod
    def forward(ctx, out_s, lse_s, mesh, with_lse):
        ctx.mesh = mesh
        out = from_super(mesh, out_s, FORWARD, "a2a-O")
        if with_lse:
            lse = from_super(mesh, lse_s.permute(2, 0, 1), FORWARD, "a2a-LSE").permute(1, 2, 0).contiguous()
        else:
            lse = lse_s.new_empty(0)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return to_super(ctx.mesh, dout, BACKWARD, "a2a-dO"), None, None, None
