"""Token layout: Megatron's zigzag sharding and the causal block cases it creates (DESIGN.md section 3).

The sequence is cut into 2n pieces of m = S / (2n) tokens and CP rank g holds pieces
(g, 2n-1-g), exactly as ``megatron.core.utils.get_batch_on_this_cp_rank`` does. Under that
layout every block (Q_i, KV_j) of a causal mask is one of three cases of equal work.

Grouped computes: a KV *slab* holds the chunks of KV offsets lo..hi in one buffer. On the rank at
row r of an a x b mesh, foreign KV offset o holds chunk ((r - o) mod b) * a + c, which is below
every Q chunk of the rank's tile when o <= r ("lower": only its first piece is seen) and above
them all when o > r ("upper": both pieces, by the second half of the Q rows) -- whatever the Q
offset. Each rank therefore lays its slab out as :func:`slab_piece` says (first pieces of the lower
offsets side by side, then the upper offsets' whole chunks side by side), so the keys of any run of
consecutive offsets of one case are one contiguous range, and :func:`kernel_calls` turns a grouped
compute into one kernel call per such run (the rank's own KV chunk, and the causal diagonal, get a
call each). The layout is per rank; its size, and so the memory plan, is not.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
    "KernelCall",
    "slab_piece",
    "kernel_calls",
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


# --- grouped computes: KV slabs and the kernel calls they allow ---------------------------------

Slab = Tuple[int, int]


def slab_piece(slab: Slab, kv: int, piece: int, split: int) -> int:
    """Position, in pieces of m tokens, of zigzag ``piece`` (0 or 1) of KV offset ``kv`` in ``slab``
    on a rank whose lower offsets are those <= ``split`` (its row r when causal, 0 when not).

    Lower offsets L = lo..min(hi, split) first: their first pieces ascending, then their second
    pieces (which a lower block never reads); then the upper offsets chunk by chunk (first piece,
    second piece). So consecutive lower offsets have adjacent first pieces, and consecutive upper
    (or, unmasked, full) offsets adjacent whole chunks: any run of them is one range of keys.
    """
    lo, hi = slab
    lower = max(0, min(hi, split) - lo + 1)
    if kv - lo < lower:
        return (kv - lo) + piece * lower
    return 2 * lower + 2 * (kv - lo - lower) + piece


def _pieces_read(case: BlockCase) -> Tuple[int, ...]:
    """Zigzag pieces of the KV chunk a block of ``case`` reads: a lower block only the first."""
    return (0,) if case is BlockCase.LOWER else (0, 1)


class KernelCall(NamedTuple):
    """One kernel call of a compute: Q rows and mask of ``case``, keys = ``pieces`` in memory order.

    ``slab`` is None for a chunk in its own buffer (one KV offset; keys as :class:`BlockSlices` say)
    and the slab otherwise, the keys being ``len(pieces)`` pieces from position ``start`` on.
    """

    case: BlockCase
    slab: Optional[Slab]
    start: int
    pieces: Tuple[Tuple[int, int], ...]  # (kv offset, piece)

    @property
    def kvs(self) -> Tuple[int, ...]:
        return tuple(dict.fromkeys(kv for kv, _ in self.pieces))


def kernel_calls(kvs: Sequence[int], cases: Dict[int, BlockCase],
                 slab_of: Callable[[int], Optional[Slab]], split: int) -> List[KernelCall]:
    """The kernel calls that compute the blocks of one Q chunk with KV offsets ``kvs``.

    ``cases[kv]`` is the block's case on this rank, ``slab_of(kv)`` its slab (None: own buffer),
    ``split`` the rank's highest lower offset (:func:`slab_piece`). Blocks outside slabs, and causal
    diagonals, run alone; slab blocks are grouped by (slab, case) and each group runs one call per
    run of consecutive offsets. Calls come in the order their first block appears in ``kvs`` (runs
    by offset), so every rank merges in a fixed order.
    """
    calls: List[KernelCall] = []
    groups: Dict[tuple, List[int]] = {}
    order: List[tuple] = []
    for kv in kvs:
        case, slab = cases[kv], slab_of(kv)
        if slab is None or case is BlockCase.DIAG:
            order.append(("one", kv))
            continue
        if (case is BlockCase.LOWER) != (kv <= split):
            raise ValueError(f"KV offset {kv} is a {case.value} block, but the slab layout has offsets "
                             f"<= {split} as the lower ones")
        key = ("slab", slab, case)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(kv)
    for item in order:
        if item[0] == "one":
            kv = item[1]
            calls.append(KernelCall(cases[kv], None, 0, tuple((kv, p) for p in _pieces_read(cases[kv]))))
            continue
        _, slab, case = item
        offs = sorted(groups[item])
        runs = [[offs[0]]]
        for kv in offs[1:]:
            if kv == runs[-1][-1] + 1:
                runs[-1].append(kv)
            else:
                runs.append([kv])
        for run in runs:
            pieces = sorted(((kv, p) for kv in run for p in _pieces_read(case)),
                            key=lambda x: slab_piece(slab, x[0], x[1], split))
            calls.append(KernelCall(case, slab, slab_piece(slab, *pieces[0], split), tuple(pieces)))
    return calls
