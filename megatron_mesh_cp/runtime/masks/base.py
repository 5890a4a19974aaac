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

__all__ = ["Mask", "Span", "tighter"]


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

    def check_batch(self, batch: int) -> None:
        """``ValueError`` naming the fix unless the mask can run ``batch`` sequences per call."""

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
        raise NotImplementedError

    def __and__(self, other: "Mask") -> "Mask":
        """The intersection of two masks (span masks compose; others stand alone)."""
        raise ValueError(self.span_error or f"the {self.name} mask does not compose with others")
