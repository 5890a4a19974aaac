"""Where the executor's receive buffers, accumulators and scratch live between calls.

One arena per layer shape; inside it, tensors sit where the plan's liveness layout
(:func:`~megatron_mesh_cp.runtime.memory.layout`) puts them, so a shape holds its plans' peak live
bytes. The pool lives with the communicator and is shared by every layer of the same shape.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .memory import Layout, layout
from .plan import ChunkDims, Plan

__all__ = ["BufferPool"]


class BufferPool:
    """Receive buffers, accumulators and scratch kept across calls: one arena per layer shape.

    Inside an arena, tensors sit where :func:`~megatron_mesh_cp.runtime.memory.layout` puts them, so the
    bytes a layer shape holds are its plans' peak live bytes (the larger of forward and backward:
    the phases share the arena, as runs never overlap on one rank). The pool is bounded: it keeps
    the arenas of the ``max_shapes`` most recently used layer shapes (default 4) and, with
    ``max_bytes``, evicts least recently used ones until it fits (never the one in use). A new
    sequence length every step therefore never grows memory beyond the cap.
    """

    def __init__(self, max_shapes: int = 4, max_bytes: Optional[int] = None) -> None:
        if not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes must be a positive int, got {max_shapes!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self.max_shapes, self.max_bytes = max_shapes, max_bytes
        self._arenas: "OrderedDict[tuple, _Arena]" = OrderedDict()
        self._layouts: Dict[tuple, tuple] = {}

    def arena(self, plan: Plan, dims: ChunkDims, device: torch.device) -> "_Bound":
        """The views of ``plan``'s pool tensors on chunks of ``dims`` (arena grown to fit if needed)."""
        key = (dims, str(device))
        arena = self._arenas.get(key)
        if arena is None:
            arena = self._arenas[key] = _Arena(device)
        self._arenas.move_to_end(key)
        bound = arena.bind(self._layout(plan, dims))
        while len(self._arenas) > 1 and (len(self._arenas) > self.max_shapes or
                                         (self.max_bytes is not None and self.nbytes() > self.max_bytes)):
            self._arenas.popitem(last=False)
        return bound

    def _layout(self, plan: Plan, dims: ChunkDims) -> Layout:
        """``layout(plan, dims)``, looked up by the plan's identity (hashing a plan walks its ops)."""
        key = (id(plan), dims)
        hit = self._layouts.get(key)
        if hit is None or hit[0] is not plan:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            hit = self._layouts[key] = (plan, layout(plan, dims))
        return hit[1]

    def nbytes(self) -> int:
        """Bytes the pool holds now (all layer shapes)."""
        return sum(a.nbytes for a in self._arenas.values())

    def __len__(self) -> int:
        """Number of layer shapes held."""
        return len(self._arenas)


class _Arena:
    """One layer shape's bytes, and the views every plan run on it binds to them."""

    def __init__(self, device) -> None:
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)
        self._bound: Dict[int, "_Bound"] = {}

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def bind(self, lay: Layout) -> "_Bound":
        if lay.nbytes > self.buf.numel():  # a phase needing more: grow once (old views die with it)
            self.buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
            self._bound.clear()
        bound = self._bound.get(id(lay))
        if bound is None or bound.layout is not lay:
            bound = self._bound[id(lay)] = _Bound(self.buf, lay)
        return bound


class _Bound:
    """A layout's tensors as views of one arena: ``tensor(role)`` and its byte ``span(role)``."""

    def __init__(self, buf: torch.Tensor, lay: Layout) -> None:
        self.layout, self.buf = lay, buf
        self._views: Dict[tuple, torch.Tensor] = {}
        self._spans: Dict[tuple, Tuple[int, int]] = {}
        self._near: Dict[tuple, Tuple[tuple, ...]] = {}
        self._roles, self._bounds = list(lay.offsets), None  # every role, and its [lo, hi) bytes once asked

    def span(self, role: tuple) -> Tuple[int, int]:
        hit = self._spans.get(role)
        if hit is None:
            off = self.layout.offsets[role]
            hit = self._spans[role] = (off, off + self.layout.specs[role].nbytes)
        return hit

    def overlapping(self, role: tuple) -> Tuple[tuple, ...]:
        """The roles whose bytes overlap those of ``role`` (itself included), found once per role."""
        hit = self._near.get(role)
        if hit is None:
            if self._bounds is None:
                self._bounds = np.array([self.span(r) for r in self._roles], dtype=np.int64).reshape(-1, 2)
            lo, hi = self.span(role)
            near = np.nonzero((self._bounds[:, 0] < hi) & (self._bounds[:, 1] > lo))[0]
            hit = self._near[role] = tuple(self._roles[i] for i in near)
        return hit

    def rows(self, role: tuple, rows: Optional[slice]) -> torch.Tensor:
        """``tensor(role)[rows]`` (None: the whole tensor), the view made once and kept."""
        if rows is None:
            return self.tensor(role)
        key = (role, rows.start, rows.stop)
        t = self._views.get(key)
        if t is None:
            t = self._views[key] = self.tensor(role)[rows]
        return t

    def tensor(self, role: tuple) -> torch.Tensor:
        t = self._views.get(role)
        if t is None:
            if role not in self.layout.offsets:
                raise KeyError(f"the executor asked for {role}, which the plan's buffer layout does not have")
            lo, hi = self.span(role)
            spec = self.layout.specs[role]
            t = self._views[role] = self.buf[lo:hi].view(spec.dtype).view(spec.shape)
        return t
