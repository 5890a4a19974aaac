"""Masks as values: what a query may see beyond the causal flag, and the block engine each binds to.

A mask is an immutable, hashable value that describes attention over the whole sequence -- documents,
a sliding window, chunks, packed (padded) documents, or their intersection (``a & b``). It knows
nothing about ranks or tensors. Bound to a mesh's chunks (:meth:`Mask.bind`) it becomes a block
engine that answers what every consumer asks of a mask, and nothing else:

* the planner and the pruner: whether blocks may be empty (``pruned``) and which tile blocks some rank
  must compute (``needed``);
* the executor: one rank's kernel calls per tile block (``rank_parts``), or None when every block runs
  its whole zigzag case (the unmasked fast path);
* the cost model: every block's calls with their rows, keys and pairs (the planning layer prices the
  span masks from :meth:`Mask.span`, the canonical form below).

Most masks are *span masks*: document boundaries plus a band (window), which compose by cutting
documents finer and narrowing the band. :class:`Span` is that canonical form; a new mask of this
kind is one class whose :meth:`Mask.refine` says how it changes a span (masks/chunked.py). Masks of
another kind bind to an engine of their own (masks/packed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Mask", "Span", "Full", "FULL", "Intersection", "intersect", "as_mask", "tighter"]


@dataclass(frozen=True)
class Span:
    """The canonical form of a span mask over ``total`` tokens: query i sees key j iff both lie in one
    document of ``cu`` (None: one document) and ``i - left <= j <= i + right`` for ``window`` (None:
    no window). ``tile`` is how the cost model counts a call's work (0: exact pairs; t: whole t x t
    tiles per document segment); the runtime ignores it."""

    total: int
    cu: Optional[Tuple[int, ...]] = None
    window: Optional[Tuple[int, int]] = None
    tile: int = 0

    @property
    def offsets(self) -> Tuple[int, ...]:
        """Document offsets, one document when there are none."""
        return self.cu if self.cu is not None else (0, self.total)

    @property
    def unmasked(self) -> bool:
        """Nothing beyond the causal flag: no documents given and no window."""
        return self.cu is None and self.window is None


def tighter(a: int, b: int) -> int:
    """The tighter of two window edges (-1: unbounded)."""
    return b if a < 0 else a if b < 0 else min(a, b)


class Mask:
    """A mask value. Subclasses are frozen dataclasses (hashable: masks are cache keys)."""

    #: what errors and logs call it
    name = "mask"
    #: its value changes with every micro-batch (documents): agreed across the CP group every batch
    per_batch = False
    #: the order in which :func:`intersect` applies span masks (documents cut first, then refinements)
    order = 50

    # --- span masks -------------------------------------------------------------------------------
    #: why this mask composes with no other (None: it is a span mask, it does)
    span_error: Optional[str] = None

    def refine(self, span: Span, causal: bool) -> Span:
        """This mask applied to ``span`` (span masks override it)."""
        raise ValueError(self.span_error or f"the {self.name} mask is not a span mask")

    def span(self, total: int, causal: bool = True) -> Optional[Span]:
        """The canonical form over ``total`` tokens (None for masks that are not spans)."""
        return None if self.span_error else self.refine(Span(total), causal)

    # --- what every mask answers ------------------------------------------------------------------
    def check(self, total: int, chunks: int, causal: bool, batch: int) -> None:
        """``ValueError`` naming the fix unless this mask can run on a sequence of ``total`` tokens
        over ``chunks`` mesh chunks, ``batch`` sequences per call."""

    #: it cuts the sequence into documents (the kernels then take varlen calls)
    cuts_documents = False
    #: it has a sliding window (the kernels then take windowed calls)
    has_window = False
    #: packed THD documents padded per 2*CP (their own layout and engine)
    padded = False

    def kernel_needs(self) -> dict:
        """What the block kernels must support for this mask: ``varlen`` (calls over several documents),
        ``window`` (a sliding window), ``window_documents`` (windowed calls over documents, which can
        have more query rows than keys), ``padded`` (packed THD blocks)."""
        return {"varlen": self.cuts_documents or self.padded, "window": self.has_window,
                "window_documents": self.cuts_documents and self.has_window, "padded": self.padded}

    def agreement(self) -> dict:
        """The fields every rank of the CP group must agree on (per batch when ``per_batch``)."""
        return {"mask": repr(self)}

    def arranged(self, chunks: int, causal: bool) -> "Mask":
        """The mask as it runs on ``chunks`` zigzag chunks (documents reordered where asked)."""
        return self

    def band(self, causal: bool) -> Optional[Tuple[int, int]]:
        """The sliding window this mask leaves, as the kernels take it (None: none)."""
        return None

    def simplified(self, causal: bool) -> "Mask":
        """The same mask without parts that mask nothing (a window (-1, 0) of a causal call: FULL)."""
        return self

    def bind(self, chunks: int, total: int, causal: bool):
        """The block engine of this mask on ``chunks`` mesh chunks of a ``total``-token sequence."""
        span = self.span(total, causal)
        if span is None:
            raise ValueError(f"the {self.name} mask has no block engine")
        from .spans import SpanBlocks

        return FullBlocks(chunks, total, causal) if span.unmasked else SpanBlocks(span, chunks, causal)

    def __and__(self, other: "Mask") -> "Mask":
        return intersect(self, other)


@dataclass(frozen=True)
class Full(Mask):
    """No mask beyond the causal flag."""

    name = "full"
    order = 0

    def refine(self, span: Span, causal: bool) -> Span:
        return span

    def agreement(self) -> dict:
        return {"mask": "full"}


FULL = Full()


class FullBlocks:
    """The engine of an unmasked layer: every block runs its whole zigzag case (DESIGN.md section 3)."""

    pruned = False

    def __init__(self, chunks: int, total: int, causal: bool) -> None:
        self.n, self.total, self.causal = chunks, total, causal

    def needed(self, shape):
        return None  # every block: the full plans as they are

    def rank_parts(self, shape, position: int, device):
        return None  # the executor's unmasked path (prepared calls, grouped computes)


@dataclass(frozen=True)
class Intersection(Mask):
    """Several span masks at once: a query sees a key iff every one of them lets it."""

    parts: Tuple[Mask, ...]

    @property
    def name(self) -> str:  # type: ignore[override]
        return " & ".join(p.name for p in self.parts)

    @property
    def per_batch(self) -> bool:  # type: ignore[override]
        return any(p.per_batch for p in self.parts)

    def refine(self, span: Span, causal: bool) -> Span:
        for p in self.parts:
            span = p.refine(span, causal)
        return span

    @property
    def cuts_documents(self) -> bool:  # type: ignore[override]
        return any(p.cuts_documents for p in self.parts)

    @property
    def has_window(self) -> bool:  # type: ignore[override]
        return any(p.has_window for p in self.parts)

    def check(self, total, chunks, causal, batch) -> None:
        for p in self.parts:
            p.check(total, chunks, causal, batch)

    def agreement(self) -> dict:
        out: dict = {}
        for p in self.parts:
            out.update(p.agreement())
        return out

    def arranged(self, chunks: int, causal: bool) -> Mask:
        return Intersection(tuple(p.arranged(chunks, causal) for p in self.parts))

    def band(self, causal: bool) -> Optional[Tuple[int, int]]:
        out = None
        for p in self.parts:
            w = p.band(causal)
            if w is not None:
                out = w if out is None else (tighter(out[0], w[0]), tighter(out[1], w[1]))
        return out

    def simplified(self, causal: bool) -> Mask:
        return intersect(*(p.simplified(causal) for p in self.parts))


def intersect(*masks: Optional[Mask]) -> Mask:
    """The mask that lets a query see a key iff every given mask does (None and FULL drop out).
    Span masks apply in their ``order`` (documents first, then what refines them); a mask that is not
    a span (packed documents) stands alone."""
    parts = []
    for m in masks:
        if m is None or isinstance(m, Full):
            continue
        parts.extend(m.parts if isinstance(m, Intersection) else (m,))
    if not parts:
        return FULL
    if len(parts) == 1:
        return parts[0]
    for p in parts:
        if p.span_error:  # not a span: it cannot be intersected
            raise ValueError(p.span_error)
    return Intersection(tuple(sorted(parts, key=lambda p: p.order)))


def as_mask(mask) -> Mask:
    """``mask`` as a :class:`Mask` (None: :data:`FULL`); ``ValueError`` for anything else."""
    if mask is None:
        return FULL
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be a megatron_mesh_cp mask (Documents, Window, Chunked, ... or their '&'), "
                         f"got {type(mask).__name__}")
    return mask
