"""Documents as a mask: a token sees its own document only (Megatron's ``--reset-attention-mask``).

A batch's documents are global offsets ``cu`` (0 = cu[0] < cu[1] < ... < cu[-1] = S) of any length,
over one sequence in the usual CP layout, unpadded: ``mesh_attention(..., cu_seqlens=cu)``. The
value changes with every micro-batch, so the CP group agrees on it every batch. The offsets are
read to the host once per tensor; :func:`documents_from_eod` finds them in a token row the way
Megatron's ``GPTDataset`` masks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Tuple

import torch

from .base import Span
from .spans import SpanMask

__all__ = ["Documents", "documents_of", "documents_from_eod", "check_offsets", "check_one_sequence", "int_offsets",
           "host_offsets"]


def int_offsets(cu, name: str) -> Tuple[int, ...]:
    """Offsets as host ints from a 1-D integer tensor (or Megatron's ``(1, D + 1)``) or a sequence."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() == 2 and cu.shape[0] == 1:  # Megatron's batch dim (1, D + 1)
            cu = cu[0]
        if cu.dim() != 1 or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor [documents + 1], got {cu.dtype} {tuple(cu.shape)}")
        return tuple(int(x) for x in cu.tolist())
    try:
        return tuple(int(x) for x in cu)
    except TypeError:
        raise ValueError(f"{name} must be a 1-D integer tensor or sequence, got {type(cu).__name__}") from None


#: host copies of recently seen offset tensors: one device-to-host copy per batch, not per layer
_HOST: "OrderedDict[tuple, Tuple[torch.Tensor, Tuple[int, ...]]]" = OrderedDict()


def host_offsets(cu, name: str) -> Tuple[int, ...]:
    """:func:`int_offsets`, read once per tensor object and in-place version (the last 16 kept)."""
    if not isinstance(cu, torch.Tensor):
        return int_offsets(cu, name)
    key = (id(cu), cu._version, cu.data_ptr())
    hit = _HOST.get(key)
    if hit is None or hit[0] is not cu:
        hit = _HOST[key] = (cu, int_offsets(cu, name))
        while len(_HOST) > 16:
            _HOST.popitem(last=False)
    return hit[1]


def check_one_sequence(batch: int) -> None:
    """Documents are offsets into one sequence: a call takes one (batch 1)."""
    if batch != 1:
        raise ValueError(f"document masking (cu_seqlens) takes one sequence per call, got batch {batch}; run one "
                         "sequence per micro-batch (Megatron: --micro-batch-size 1)")


def check_offsets(cu: Tuple[int, ...], total: int, name: str = "cu_seqlens") -> None:
    """``ValueError`` naming the fix unless ``cu`` splits a sequence of ``total`` tokens."""
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold documents + 1 offsets, got {list(cu)[:8]}")
    if cu[-1] != total:
        raise ValueError(f"{name} ends at {cu[-1]} but the sequence has {total} tokens (CP x local); "
                         f"its last offset must be {total}")
    for i in range(len(cu) - 1):
        if cu[i + 1] <= cu[i]:
            raise ValueError(f"{name} must be strictly increasing; document {i} has length "
                             f"{cu[i + 1] - cu[i]} (drop empty documents)")


@dataclass(frozen=True)
class Documents(SpanMask):
    """One batch's document offsets as host ints."""

    cu: Tuple[int, ...]

    name = "documents"
    per_batch = True
    order = 10
    cuts_documents = True

    @property
    def count(self) -> int:
        return len(self.cu) - 1

    @property
    def lengths(self) -> Tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cu, self.cu[1:]))

    def refine(self, span: Span, causal: bool) -> Span:
        check_offsets(self.cu, span.total)
        cuts = self.cu if span.cu is None else tuple(sorted(set(span.cu) | set(self.cu)))
        return Span(span.total, cuts, span.window, span.tile)

    def check(self, total, chunks, causal, batch) -> None:
        check_offsets(self.cu, total)
        self.check_batch(batch)

    def check_batch(self, batch: int) -> None:
        check_one_sequence(batch)

    def agreement(self) -> dict:
        return {"documents": self.cu}


def documents_of(cu_seqlens) -> Documents:
    """:class:`Documents` from a 1-D int tensor (read to the host once per tensor) or a sequence."""
    return Documents(host_offsets(cu_seqlens, "cu_seqlens"))


def documents_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Megatron's document boundaries of a ``[s]`` token row: a document ends with (and includes)
    each EOD token, as ``GPTDataset``'s ``reset_attention_mask`` masks (``_get_ltor_masks_and_position_ids``);
    returns int32 offsets ``[documents + 1]`` on the tokens' device."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one [s] row, got shape {tuple(tokens.shape)}")
    s = tokens.numel()
    ends = torch.nonzero(tokens[:-1] == eod).flatten() + 1
    edge = torch.tensor([0, s], dtype=ends.dtype, device=tokens.device)
    return torch.cat([edge[:1], ends, edge[1:]]).to(torch.int32)
