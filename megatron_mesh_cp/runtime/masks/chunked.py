"""Chunked local attention as a mask: a token sees only the tokens of its own fixed-size chunk.

Llama 4's ``attention_chunk_size``: the sequence -- or, with documents, each document from its own
start (as Megatron-Bridge's ``chunkify_cu_seqlens`` cuts packed documents) -- is cut into chunks of
``size`` tokens, and attention stays inside a chunk (causal within it). That is exactly a finer
document mask, so this mask refines the span's documents and everything else (pruned plans, the
block engine, the kernels' varlen calls, the cost model) follows from the span.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Span
from .spans import SpanMask

__all__ = ["Chunked"]


@dataclass(frozen=True)
class Chunked(SpanMask):
    """Attention inside chunks of ``size`` tokens, counted from each document's start."""

    size: int

    name = "chunked"
    order = 20  # after the documents it cuts
    cuts_documents = True

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"the attention chunk size must be a positive int, got {self.size!r}")

    def refine(self, span: Span, causal: bool) -> Span:
        cuts = []
        for start, stop in zip(span.offsets, span.offsets[1:]):
            cuts.extend(range(start, stop, self.size))
        cuts.append(span.total)
        return Span(span.total, tuple(cuts), span.window, span.tile)

    def agreement(self) -> dict:
        return {"attention chunk size": self.size}
