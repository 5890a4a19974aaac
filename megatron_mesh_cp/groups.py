"""Process groups of a mesh: the CP group plus its row (Q) and column (KV) rings.

``MeshGroups.create`` builds the rings collectively; ``MeshGroups.from_groups`` adopts existing
groups (Megatron's hierarchical CP groups for sizes [a, b] are exactly these, DESIGN.md section 2)
after checking their membership locally, so a wrong group fails on every rank before any message.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .comm import ProcessGroupComm, Traffic
from .execute import BufferPool
from .topology import MeshShape

__all__ = ["MeshGroups"]


def _ranks(group) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


class MeshGroups:
    """This rank's view of an a x b mesh over real process groups.

    Attributes: ``shape`` (MeshShape), ``position`` (CP rank), ``cp_group``, ``row_group``,
    ``col_group``, ``cp_ranks`` (global ranks in CP order) and ``traffic`` (bytes this rank moved).
    """

    def __init__(self, shape: MeshShape, cp_group, row_group, col_group, cp_ranks: List[int]) -> None:
        self.shape = shape
        self.cp_group, self.row_group, self.col_group = cp_group, row_group, col_group
        self.cp_ranks = cp_ranks
        me = dist.get_rank()
        if me not in cp_ranks:
            raise ValueError(f"rank {me} is not a member of the CP group {cp_ranks}")
        self.position = cp_ranks.index(me)
        r, c = shape.coords(self.position)
        g = lambda rr, cc: cp_ranks[shape.rank(rr, cc)]  # noqa: E731
        # neighbours by direction: +1 = next on the ring, -1 = previous
        self._peers: Dict[str, Dict[int, int]] = {
            "row": {1: g(r, c + 1), -1: g(r, c - 1)},
            "col": {1: g(r + 1, c), -1: g(r - 1, c)},
        }
        self.traffic = Traffic()
        self.buffers = BufferPool()  # receive buffers and accumulators, reused by every layer
        self._comm: Optional[ProcessGroupComm] = None
        # what greedy plans are tuned for: a Cluster (None = $MESH_CP_CLUSTER or h100-ib400) and
        # the GPU distance between consecutive CP ranks (Megatron: the TP size)
        self.cluster = None
        self.stride = 1

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, shape, group=None) -> "MeshGroups":
        """Build the row and column groups of ``shape`` over the CP ``group`` (None = world).

        A world collective (like ``dist.new_group``): call it on every rank, in the same order.
        With several CP groups (data parallel), each rank passes its own; all rings of all of them
        are created on every rank.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        cp_ranks = _ranks(group)
        mesh_shape = MeshShape.for_size(shape, len(cp_ranks))
        if group is None or group is dist.group.WORLD:
            all_cp = [cp_ranks]
        else:
            gathered: List[Optional[List[int]]] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, cp_ranks)
            all_cp = sorted({tuple(x) for x in gathered})  # type: ignore[arg-type]
            if any(len(x) != len(cp_ranks) for x in all_cp):
                raise ValueError("CP groups of different sizes passed to MeshGroups.create")
        me = dist.get_rank()
        row_group = col_group = None
        for ranks in all_cp:
            for ring in mesh_shape.row_rings():
                pg = dist.new_group([ranks[i] for i in ring])
                if me in (ranks[i] for i in ring):
                    row_group = pg
            for ring in mesh_shape.col_rings():
                pg = dist.new_group([ranks[i] for i in ring])
                if me in (ranks[i] for i in ring):
                    col_group = pg
        cp_group = group if group is not None else dist.group.WORLD
        return cls(mesh_shape, cp_group, row_group, col_group, cp_ranks)

    @classmethod
    def from_groups(cls, cp_group, row_group, col_group) -> "MeshGroups":
        """Adopt existing groups; the shape is (size of row group, size of column group).

        Checks, without communicating, that the rings are the consecutive-a / stride-a subsets of
        the CP group that the mesh needs (Megatron: ``hierarchical_context_parallel_sizes=[a, b]``).
        """
        cp_ranks = _ranks(cp_group)
        row, col = _ranks(row_group), _ranks(col_group)
        a, b = len(row), len(col)
        if a * b != len(cp_ranks):
            raise ValueError(
                f"row group ({a} ranks) x column group ({b} ranks) = {a * b} ranks, but the CP group "
                f"has {len(cp_ranks)}; build the groups for a mesh shape whose product is the CP size "
                "(Megatron: hierarchical_context_parallel_sizes=[a, b] with a*b = context_parallel_size)"
            )
        shape = MeshShape(a, b)
        me = dist.get_rank()
        if me not in cp_ranks:
            raise ValueError(f"rank {me} is not a member of the CP group {cp_ranks}")
        pos = cp_ranks.index(me)
        want_row = [cp_ranks[i] for i in shape.row_ring(pos)]
        want_col = [cp_ranks[i] for i in shape.col_ring(pos)]
        if sorted(row) != sorted(want_row) or sorted(col) != sorted(want_col):
            raise ValueError(
                f"rank {me}: row group {row} / column group {col} are not the {shape} mesh rings "
                f"{want_row} / {want_col} of CP group {cp_ranks}; the row group must hold "
                f"{a} consecutive CP ranks and the column group {b} CP ranks of stride {a} "
                "(Megatron: hierarchical_context_parallel_sizes=[a, b], in that order)"
            )
        return cls(shape, cp_group, row_group, col_group, cp_ranks)

    # --- transport ---------------------------------------------------------------------------
    def ring(self, name: str) -> Tuple[object, Dict[int, int]]:
        """(process group, {+1: next global rank, -1: previous global rank}) of a ring."""
        return (self.row_group if name == "row" else self.col_group), self._peers[name]

    def comm(self) -> ProcessGroupComm:
        if self._comm is None:
            self._comm = ProcessGroupComm(self)
        return self._comm

    @property
    def size(self) -> int:
        return self.shape.n

    def __repr__(self) -> str:
        return f"MeshGroups({self.shape}, position={self.position}, cp_ranks={self.cp_ranks})"
