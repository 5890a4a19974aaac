"""Mesh topology: where each CP rank sits on the a x b mesh and which attention blocks it owns.

Pure integer math (DESIGN.md section 2), shared by the planner, executor, simulator and the
Megatron integration. Rank ``g`` sits at ``(r, c) = (g // a, g % a)``; its *row ring* (Q group)
is the ``a`` consecutive ranks of row ``r`` and its *column ring* (KV group) is the ``b`` ranks
of column ``c`` (stride ``a``). ``a = 1`` is Ring-Attention (pass-KV), ``b = 1`` is pass-Q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["MeshShape", "valid_shapes", "parse_shape"]


def valid_shapes(n: int) -> List[Tuple[int, int]]:
    """Every (a, b) with a * b == n, in increasing a (so (1, n) = Ring first, (n, 1) = pass-Q last)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"CP size must be a positive integer, got {n!r}")
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def parse_shape(text: str) -> Tuple[int, int]:
    """Parse ``"AxB"`` (e.g. ``"4x2"``) into ``(a, b)``; raise ``ValueError`` naming the format."""
    parts = str(text).lower().replace("×", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"mesh shape must look like AxB (e.g. 4x4 or 2x8), got {text!r}")
    a, b = (int(p) for p in parts)
    if a < 1 or b < 1:
        raise ValueError(f"mesh shape factors must be >= 1, got {text!r}")
    return a, b


@dataclass(frozen=True)
class MeshShape:
    """An a x b tile shape for a CP group of n = a * b ranks.

    ``a`` is the row-ring size (Q chunks per tile), ``b`` the column-ring size (KV chunks per tile).
    """

    a: int
    b: int

    def __post_init__(self) -> None:
        for name, v in (("a", self.a), ("b", self.b)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh shape factor {name} must be a positive integer, got {v!r}")

    @classmethod
    def for_size(cls, shape, n: int) -> "MeshShape":
        """Build from ``(a, b)``, ``"AxB"`` or a MeshShape, checking ``a * b == n``."""
        if isinstance(shape, MeshShape):
            a, b = shape.a, shape.b
        elif isinstance(shape, str):
            a, b = parse_shape(shape)
        else:
            try:
                a, b = (int(x) for x in shape)
            except (TypeError, ValueError):
                raise ValueError(f"mesh shape must be (a, b) or 'AxB', got {shape!r}") from None
        if a * b != n:
            raise ValueError(
                f"mesh shape {a}x{b} has {a * b} ranks but the CP group has {n}; "
                f"choose one of {', '.join(f'{x}x{y}' for x, y in valid_shapes(n))}"
            )
        return cls(a, b)

    @property
    def n(self) -> int:
        return self.a * self.b

    def __str__(self) -> str:
        return f"{self.a}x{self.b}"

    # --- coordinates -----------------------------------------------------------------------
    def coords(self, g: int) -> Tuple[int, int]:
        """(r, c) of CP rank g."""
        self._check_rank(g)
        return g // self.a, g % self.a

    def rank(self, r: int, c: int) -> int:
        return (r % self.b) * self.a + (c % self.a)

    def row_ring(self, g: int) -> List[int]:
        """Q group of g: the a ranks of its row, in ring order (position = column)."""
        r, _ = self.coords(g)
        return [r * self.a + c for c in range(self.a)]

    def col_ring(self, g: int) -> List[int]:
        """KV group of g: the b ranks of its column, in ring order (position = row)."""
        _, c = self.coords(g)
        return [r * self.a + c for r in range(self.b)]

    def row_rings(self) -> List[List[int]]:
        """All row rings (what Megatron's hierarchical CP level 0 builds for sizes [a, b])."""
        return [self.row_ring(r * self.a) for r in range(self.b)]

    def col_rings(self) -> List[List[int]]:
        """All column rings (Megatron's hierarchical CP level 1)."""
        return [self.col_ring(c) for c in range(self.a)]

    # --- tiles -----------------------------------------------------------------------------
    def owner(self, i: int, j: int) -> int:
        """AM[i][j]: the rank that computes block (Q_i, KV_j)."""
        self._check_rank(i)
        self._check_rank(j)
        return (i // self.a) * self.a + (j % self.a)

    def assignment_matrix(self) -> List[List[int]]:
        return [[self.owner(i, j) for j in range(self.n)] for i in range(self.n)]

    def tile(self, g: int) -> List[Tuple[int, int]]:
        """The a*b blocks (i, j) rank g computes: its row ring's Q chunks x its column ring's KV."""
        return [(i, j) for i in self.row_ring(g) for j in self.col_ring(g)]

    # --- ring offsets (how plans name chunks SPMD-style) -----------------------------------
    def q_chunk(self, g: int, offset: int) -> int:
        """Q chunk that rank g holds at row-ring offset ``offset`` (offset 0 = its own)."""
        r, c = self.coords(g)
        return self.rank(r, c - offset)

    def kv_chunk(self, g: int, offset: int) -> int:
        """KV chunk that rank g holds at column-ring offset ``offset`` (offset 0 = its own)."""
        r, c = self.coords(g)
        return self.rank(r - offset, c)

    def _check_rank(self, g: int) -> None:
        if not 0 <= g < self.n:
            raise ValueError(f"rank {g} is outside a CP group of {self.n}")
