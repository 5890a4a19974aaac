"""Token layout: Megatron's zigzag sharding and the causal block cases it creates (DESIGN.md section 3).

The sequence is cut into 2n pieces of m = S / (2n) tokens and CP rank g holds pieces
(g, 2n-1-g), exactly as ``megatron.core.utils.get_batch_on_this_cp_rank`` does. Under that
layout every block (Q_i, KV_j) of a causal mask is one of three cases of equal work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List

import torch

__all__ = [
    "LAYOUTS",
    "seq_dim",
    "zigzag_shard",
    "zigzag_gather",
    "zigzag_positions",
    "BlockCase",
    "block_case",
    "BlockSlices",
]

LAYOUTS = ("bshd", "sbhd")


def seq_dim(layout: str) -> int:
    """Index of the sequence dimension for a layout string."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "bshd" else 0


def _check_divisible(seq_len: int, n: int) -> None:
    if seq_len % (2 * n):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*CP = {2 * n}; "
            f"pad the sequence to a multiple of {2 * n}"
        )


def zigzag_positions(seq_len: int, n: int, rank: int) -> torch.Tensor:
    """Global token positions held by ``rank`` (pieces rank and 2n-1-rank), in local order."""
    _check_divisible(seq_len, n)
    m = seq_len // (2 * n)
    first = torch.arange(rank * m, (rank + 1) * m)
    second = torch.arange((2 * n - 1 - rank) * m, (2 * n - rank) * m)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, n: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag share of a full sequence ``x`` along ``dim`` (a new contiguous tensor)."""
    _check_divisible(x.shape[dim], n)
    pieces = x.chunk(2 * n, dim=dim)
    return torch.cat([pieces[rank], pieces[2 * n - 1 - rank]], dim=dim).contiguous()


def zigzag_gather(shards: List[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: rebuild the full sequence from all ranks' shards."""
    n = len(shards)
    pieces: List[torch.Tensor] = [None] * (2 * n)  # type: ignore[list-item]
    for g, s in enumerate(shards):
        if s.shape[dim] % 2:
            raise ValueError(f"shard of rank {g} has odd length {s.shape[dim]} along dim {dim}")
        first, second = s.chunk(2, dim=dim)
        pieces[g], pieces[2 * n - 1 - g] = first, second
    return torch.cat(pieces, dim=dim)


class BlockCase(enum.Enum):
    """Which part of block (Q_i, KV_j) a causal mask leaves (DESIGN.md section 3)."""

    FULL = "full"  # non-causal: everything
    DIAG = "diag"  # i == j: both pieces, causal mask on the local pair
    LOWER = "lower"  # j < i: all of Q_i x first piece of KV_j, no mask
    UPPER = "upper"  # j > i: second piece of Q_i x all of KV_j, no mask


def block_case(i: int, j: int, causal: bool) -> BlockCase:
    if not causal:
        return BlockCase.FULL
    if i == j:
        return BlockCase.DIAG
    return BlockCase.LOWER if j < i else BlockCase.UPPER


@dataclass(frozen=True)
class BlockSlices:
    """Row/column ranges (in units of the local chunk of 2m tokens) a block case touches."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool

    @classmethod
    def of(cls, case: BlockCase, chunk_len: int) -> "BlockSlices":
        m = chunk_len // 2
        if case is BlockCase.FULL:
            return cls(0, chunk_len, 0, chunk_len, False)
        if case is BlockCase.DIAG:
            return cls(0, chunk_len, 0, chunk_len, True)
        if case is BlockCase.LOWER:
            return cls(0, chunk_len, 0, m, False)
        return cls(m, chunk_len, 0, chunk_len, False)

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv_cols(self) -> slice:
        return slice(self.kv_start, self.kv_stop)
