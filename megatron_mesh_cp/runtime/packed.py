"""Packed sequences (THD, document masking): Megatron's per-document zigzag and its block cases.

With packed data every document, padded to a multiple of 2·CP (``cu_seqlens_padded``), is cut into
2·CP pieces and CP rank g keeps pieces g and 2·CP−1−g of *every* document, in document order
(TE's ``thd_get_partitioned_indices``, which Megatron's ``get_batch_on_this_cp_rank`` calls);
:func:`thd_partition_indices` is the same partition in pure torch. All ranks therefore hold
congruent chunks (document i takes 2·p_i rows everywhere, p_i = L_i / 2·CP), so one row
permutation, computed once per batch, puts every chunk into a *half-major* order: the first
pieces of all documents, then the second pieces. In that order the zigzag block cases become
sub-blocks that are contiguous row/column halves and square per document (:func:`packed_slices`),
so one ``cu_seqlens`` per batch (:attr:`PackedLayout.varlen`) serves every varlen kernel call.

Padding tokens sit at the end of their document, so under the causal mask no real token ever sees
one; the kernels compute them like real tokens (no row is ever empty, so nothing is NaN) and the
caller zeroes their output rows (lse = -inf, gradient 0).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .kernels.base import Varlen
from .layout import BlockCase, BlockSlices
from .masks.documents import int_offsets

__all__ = [
    "thd_partition_indices",
    "thd_shard",
    "thd_gather",
    "PackedLayout",
    "packed_slices",
    "padding_rows",
]


def check_padded(cu: Sequence[int], total: int, n: int, name: str = "cu_seqlens_padded") -> None:
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold documents + 1 offsets, got {list(cu)[:8]}")
    if cu[-1] != total:
        raise ValueError(
            f"{name} ends at {cu[-1]} but the packed sequence has {total} tokens (CP x local); "
            f"let the last offset be {total} (count trailing padding as a document of its own)"
        )
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length < 0:
            raise ValueError(f"{name} must be non-decreasing; document {i} has length {length}")
        if length % (2 * n):
            raise ValueError(
                f"document {i} has padded length {length}, not a multiple of 2*CP = {2 * n}; pad every document "
                f"to a multiple of {2 * n} (cu_seqlens_padded), as Megatron's per-document CP split requires"
            )


def thd_partition_indices(cu_seqlens_padded, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The token indices CP rank ``cp_rank`` keeps of a packed sequence (int64, on the device of
    ``cu_seqlens_padded`` when it is a tensor): pieces rank and 2·CP−1−rank of every document, in
    document order -- what TE's ``thd_get_partitioned_indices`` returns for the same arguments."""
    cu = int_offsets(cu_seqlens_padded, "cu_seqlens_padded")
    check_padded(cu, total_tokens, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    device = cu_seqlens_padded.device if isinstance(cu_seqlens_padded, torch.Tensor) else None
    start = torch.tensor(cu[:-1], dtype=torch.long, device=device)
    piece = (torch.tensor(cu[1:], dtype=torch.long, device=device) - start) // (2 * cp_size)
    doc = torch.repeat_interleave(torch.arange(len(piece), device=device), 2 * piece)
    local_start = torch.cumsum(2 * piece, 0) - 2 * piece
    o = torch.arange(int(doc.numel()), device=device) - local_start[doc]
    p = piece[doc]
    which = torch.where(o < p, torch.full_like(o, cp_rank), torch.full_like(o, 2 * cp_size - 1 - cp_rank))
    return start[doc] + which * p + o % torch.clamp(p, min=1)


def thd_shard(x: torch.Tensor, cu_seqlens_padded, n: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s per-document zigzag share of a packed sequence ``x`` along ``dim``."""
    index = thd_partition_indices(cu_seqlens_padded, x.shape[dim], n, rank).to(x.device)
    return x.index_select(dim, index)


def thd_gather(shards: List[torch.Tensor], cu_seqlens_padded, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`thd_shard`: the packed sequence from every rank's share."""
    n = len(shards)
    total = sum(s.shape[dim] for s in shards)
    out = shards[0].new_empty(shards[0].shape[:dim] + (total,) + shards[0].shape[dim + 1:])
    for g, s in enumerate(shards):
        out.index_copy_(dim, thd_partition_indices(cu_seqlens_padded, total, n, g).to(s.device), s)
    return out


def padding_rows(spec, n: int, rank: int, device=None) -> Optional[torch.Tensor]:
    """Bool ``[local tokens]``: which of rank ``rank``'s rows are padding (None: none are)."""
    if spec.cu_real is None:
        return None
    total = spec.cu_padded[-1]  # built on the host from host offsets, then copied: no device sync
    pos = thd_partition_indices(spec.cu_padded, total, n, rank)
    start = torch.tensor(spec.cu_padded[:-1], dtype=torch.long)
    real = torch.tensor(spec.cu_real, dtype=torch.long)
    doc = torch.searchsorted(torch.tensor(spec.cu_padded[1:], dtype=torch.long), pos, right=True)
    pad = (pos - start[doc]) >= (real[1:] - real[:-1])[doc]
    return pad.to(device) if bool(pad.any()) else None


class PackedLayout:
    """One batch's row permutation into the mesh's half-major order, and its varlen lengths.

    ``u`` = 1: rows of a rank's local chunk. ``u`` > 1 (``a2a+mesh``): the rows of the u members'
    chunks stacked in member order (what the all-to-all delivers); the result is the super-rank's
    chunk (pieces Gu..Gu+u-1 and 2n-u-Gu..2n-1-Gu of every document), half-major.
    """

    def __init__(self, spec, n: int, u: int, device) -> None:
        cu = spec.cu_padded
        piece = torch.tensor([(cu[i + 1] - cu[i]) // (2 * n) for i in range(len(cu) - 1)], dtype=torch.long)
        local = 2 * int(piece.sum())  # one member's chunk
        half = u * piece  # a document's rows in one half of the mesh chunk
        doc = torch.repeat_interleave(torch.arange(len(piece)), half)
        o = torch.arange(int(doc.numel())) - (torch.cumsum(half, 0) - half)[doc]
        p = torch.clamp(piece[doc], min=1)
        j, rest = o // p, o % p
        base = 2 * (torch.cumsum(piece, 0) - piece)[doc] + rest  # the piece's row in a member's chunk
        first = j * local + base
        second = (u - 1 - j) * local + base + piece[doc]  # later pieces come from earlier members
        self.to_mesh = torch.cat([first, second]).to(device)
        self.from_mesh = torch.empty_like(self.to_mesh)
        self.from_mesh[self.to_mesh] = torch.arange(self.to_mesh.numel(), device=self.to_mesh.device)
        lens = tuple(int(x) for x in half.tolist())
        self.varlen = Varlen(torch.tensor((0,) + tuple(torch.cumsum(half, 0).tolist()), dtype=torch.int32,
                                          device=device), lens, max(lens, default=0))
        self.spec, self.n, self.u = spec, n, u

    def into_mesh(self, x: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) in source order -> half-major mesh order (autograd-aware)."""
        return x.index_select(0, self.to_mesh)

    def out_of_mesh(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`into_mesh`."""
        return y.index_select(0, self.from_mesh)


def packed_slices(case: BlockCase, chunk_len: int) -> Tuple[BlockSlices, ...]:
    """The sub-blocks of a causal block case on a half-major packed chunk: (rows, cols, causal),
    each a contiguous half and square per document, so they all share the batch's ``cu_seqlens``.

    diag = first x first (causal), second x first, second x second (causal); lower (j < i) = every
    Q row x the first KV pieces; upper (j > i) = the second Q pieces x every KV row.
    """
    h, t = chunk_len // 2, chunk_len
    if case is BlockCase.DIAG:
        return (BlockSlices(0, h, 0, h, True), BlockSlices(h, t, 0, h, False), BlockSlices(h, t, h, t, True))
    if case is BlockCase.LOWER:
        return (BlockSlices(0, h, 0, h, False), BlockSlices(h, t, 0, h, False))
    if case is BlockCase.UPPER:
        return (BlockSlices(h, t, 0, h, False), BlockSlices(h, t, h, t, False))
    raise ValueError("packed sequences (THD) need the causal mask; per-document non-causal attention is not built")
