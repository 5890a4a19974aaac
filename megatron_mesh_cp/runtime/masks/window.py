"""The sliding window as a mask: query i sees key j iff ``i - left <= j <= i + right`` (-1: unbounded).

This is flash-attn's ``window_size``; under the causal mask ``right`` is 0. A window composes with
documents (the band inside each document) and with the other span masks. The band geometry the
block engine needs lives with it (spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .base import Mask, Span, tighter
from .spans import FULL, SpanMask

__all__ = ["Window", "check_window"]


def check_window(window, causal: bool) -> Optional[Tuple[int, int]]:
    """``window`` as (left, right) ints >= -1 (-1: unbounded), None for none; ``ValueError`` otherwise.
    Causal attention sees no key to the right: ``right`` must be 0 or -1 and becomes 0."""
    if window is None:
        return None
    try:
        left, right = window
        ok = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= -1 for x in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window must be a pair of ints >= -1 (left, right; -1 = unbounded), got {window!r}")
    left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(f"window={window!r} with causal=True: a causal query sees no key to its right; pass "
                             f"window=({left}, 0), or causal=False for keys on both sides")
        right = 0
    if left == -1 and right == -1 or (causal and left == -1):
        return None  # no window beyond what the mask already is
    return left, right


@dataclass(frozen=True)
class Window(SpanMask):
    """A sliding window (left, right) as ``mesh_attention(window=...)`` takes it."""

    left: int
    right: int

    name = "window"
    order = 30

    def __post_init__(self) -> None:
        check_window((self.left, self.right), False)  # ints >= -1; the causal rule is checked per call

    def refine(self, span: Span, causal: bool) -> Span:
        mine = check_window((self.left, self.right), causal)
        if mine is None:
            return span
        if span.window is not None:
            mine = (tighter(span.window[0], mine[0]), tighter(span.window[1], mine[1]))
        return Span(span.total, span.cu, mine, span.tile)

    def check(self, total, chunks, causal, batch) -> None:
        check_window((self.left, self.right), causal)

    @property
    def has_window(self) -> bool:  # type: ignore[override]
        return not (self.left == -1 and self.right == -1)

    def agreement(self) -> dict:
        return {"window": (self.left, self.right)}

    def band(self, causal: bool) -> Optional[Tuple[int, int]]:
        return check_window((self.left, self.right), causal)

    def simplified(self, causal: bool) -> Mask:
        return self if self.band(causal) is not None else FULL
