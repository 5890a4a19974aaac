"""Packed THD documents as a mask: Megatron's per-document split, every document padded per 2*CP.

``mesh_attention(..., layout="thd", cu_seqlens=, cu_seqlens_padded=)``: every document, padded to a
multiple of 2*CP, is cut into 2*CP pieces and CP rank g keeps pieces g and 2*CP-1-g of every
document (runtime/packed.py). All chunks are congruent, so the full plans run unchanged and every
block runs as the 2-3 per-document sub-blocks of its causal case (``packed_slices``), all sharing
one set of varlen lengths; padding rows are computed and zeroed by the caller. This mask is not a
span: it does not compose with windows or other documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import packed as thd
from ..kernels.base import Varlen
from ..layout import block_case
from .base import Mask
from .documents import host_offsets

__all__ = ["PackedDocuments", "packed_documents", "PackedBlocks"]


@dataclass(frozen=True)
class PackedDocuments(Mask):
    """One batch's packed documents as host ints: padded offsets and (None: no padding) real ones."""

    cu_padded: Tuple[int, ...]
    cu_real: Optional[Tuple[int, ...]] = None

    name = "packed documents"
    per_batch = True
    padded = True
    span_error = ("a sliding window with packed THD (padded) documents is not built; pass the documents as "
                  "cu_seqlens on the ordinary layout (layout 'bshd'/'sbhd'), which takes windows")

    def check(self, total: int, cp: int, causal: bool = True, batch: int = 1) -> None:
        """``ValueError`` naming the fix unless the documents can be split over ``cp`` CP ranks."""
        thd.check_padded(self.cu_padded, total, cp)
        if not causal:
            raise ValueError("packed sequences (THD) need causal=True (Megatron's padding_causal mask); "
                             "per-document non-causal attention is not supported")
        if self.cu_real is None:
            return
        real = self.cu_real
        if len(real) != len(self.cu_padded) or real[0] != 0:
            raise ValueError(
                f"cu_seqlens has {len(real)} offsets but cu_seqlens_padded has {len(self.cu_padded)}; both list "
                "the same documents from 0 (real lengths, and lengths padded to a multiple of 2*CP)"
            )
        for i in range(len(real) - 1):
            length, padded = real[i + 1] - real[i], self.cu_padded[i + 1] - self.cu_padded[i]
            if not 0 <= length <= padded:
                raise ValueError(f"document {i} has real length {length} but padded length {padded}; "
                                 "cu_seqlens must not exceed cu_seqlens_padded per document")

    def agreement(self) -> dict:
        return {"cu_seqlens_padded": self.cu_padded, "cu_seqlens": self.cu_real}

    def bind(self, chunks: int, total: int, causal: bool) -> "PackedBlocks":
        return PackedBlocks(self, chunks, total, causal)


def packed_documents(cu_seqlens=None, cu_seqlens_padded=None) -> Optional[PackedDocuments]:
    """The batch's :class:`PackedDocuments` (None when neither is given); ``cu_seqlens_padded``
    defaults to ``cu_seqlens`` (documents already padded). Reads each offset tensor to the host once."""
    if cu_seqlens is None and cu_seqlens_padded is None:
        return None
    padded = host_offsets(cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens, "cu_seqlens_padded")
    real = host_offsets(cu_seqlens, "cu_seqlens") if cu_seqlens is not None else None
    return PackedDocuments(padded, None if real == padded else real)


class PackedBlocks:
    """The engine of packed documents on ``chunks`` mesh chunks: the full plans (every block has work
    on every rank), each block as its case's per-document sub-blocks in half-major order."""

    pruned = False

    def __init__(self, docs: PackedDocuments, chunks: int, total: int, causal: bool) -> None:
        self.docs, self.n, self.total, self.causal = docs, chunks, total, causal
        cu = docs.cu_padded
        # a document's rows in one half of a mesh chunk (u members' pieces under a2a+mesh)
        self.lens = tuple((cu[i + 1] - cu[i]) // (2 * chunks) for i in range(len(cu) - 1))

    def needed(self, shape):
        return None

    def varlen(self, device) -> Varlen:
        """The batch's one set of varlen lengths (every sub-block is square per document)."""
        offs = [0]
        for x in self.lens:
            offs.append(offs[-1] + x)
        return Varlen(torch.tensor(offs, dtype=torch.int32, device=device), self.lens, max(self.lens, default=0))

    def rank_parts(self, shape, position: int, device) -> Dict[Tuple[int, int], tuple]:
        """Rank ``position``'s kernel calls per tile block: its case's sub-blocks, one varlen each."""
        seq = self.total // self.n
        vl = self.varlen(device)
        out = {}
        for qo in range(shape.a):
            i = shape.q_chunk(position, qo)
            for ko in range(shape.b):
                case = block_case(i, shape.kv_chunk(position, ko), self.causal)
                out[(qo, ko)] = tuple((s.q_rows, s.kv_cols, s.causal, vl, None) for s in thd.packed_slices(case, seq))
        return out
