"""Masks: what a query may see, as values, and the block engines they bind to (base.py explains).

``FULL`` (nothing beyond causal), :class:`Documents` (``cu_seqlens``), :class:`Window`,
:class:`Chunked` (chunked local attention) and their intersections (``a & b``) are span masks;
:class:`PackedDocuments` is Megatron's padded THD split. ``mask.bind(chunks, total, causal)`` gives
the engine the planner, the pruner, the executor and the cost model read.
"""

from .arranged import Arranged, SegmentBlocks, arranged_of
from .base import Mask, Span
from .chunked import Chunked
from .documents import (
    Documents, check_offsets, check_one_sequence, documents_from_eod, documents_of, host_offsets, int_offsets,
)
from .packed import PackedBlocks, PackedDocuments, packed_documents
from .spans import (
    FULL, Full, FullBlocks, Intersection, SpanBlocks, SpanMask, SubBlock, as_mask, band_pairs, band_rectangle, intersect,
)
from .window import Window, check_window

__all__ = [
    "Mask", "SpanMask", "Span", "Full", "FULL", "Intersection", "intersect", "as_mask", "FullBlocks",
    "Documents", "documents_of", "documents_from_eod", "check_offsets", "check_one_sequence", "int_offsets",
    "host_offsets",
    "Window", "check_window", "band_pairs", "band_rectangle",
    "Chunked",
    "PackedDocuments", "packed_documents", "PackedBlocks",
    "SpanBlocks", "SubBlock", "Arranged", "arranged_of", "SegmentBlocks",
]
