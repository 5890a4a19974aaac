"""Process groups of a mesh: the CP group plus its row (Q) and column (KV) rings.

``MeshGroups.create`` builds the rings collectively, after every rank agreed on the shape;
``MeshGroups.from_groups`` adopts existing groups (Megatron's hierarchical CP groups for sizes
[a, b] are exactly these, DESIGN.md section 2) after checking their membership on every rank and
sharing the verdict over the CP group, so a wrong group on one rank fails on all of them.
The rings' timeout is the default group's (or ``timeout=``); adopted groups keep their own.
``mesh.destroy()`` (or ``with MeshGroups.create(...) as mesh:``) releases the groups ``create``
made (each gloo group holds three threads until released); adopted groups stay their owner's.
With a Ulysses degree u > 1 (``a2a+mesh``, docs/hybrid.md) there is a third level: the Ulysses
group of u consecutive CP ranks, and the rings join the ranks of the same Ulysses slot across
groups (Megatron's hierarchical CP groups for sizes [u, a, b]).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .buffers import BufferPool
from .comm import ProcessGroupComm, Traffic
from .mesh import DEFAULT_PLAN_OPTIONS, CallCache, PlanOptions
from .topology import MeshShape

__all__ = ["MeshGroups"]


def _ranks(group) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def group_timeout(group=None) -> Optional[timedelta]:
    """The timeout a process group's operations run under (None = the default group's; None if unknown)."""
    pg = group if group is not None and group is not dist.group.WORLD else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", []) or [torch.device("cpu")]:
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _shared_verdict(error: Optional[str], group, what: str) -> None:
    """Raise the same ValueError on every rank of ``group`` if any rank found an ``error``."""
    verdicts: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, error, group=group)
    ranks = _ranks(group)
    bad = [(r, e) for r, e in zip(ranks, verdicts) if e is not None]
    if bad:
        others = f" (and on ranks {[r for r, _ in bad[1:]]})" if len(bad) > 1 else ""
        raise ValueError(f"{what}: on rank {bad[0][0]}{others}: {bad[0][1]}")


def _raise_first(gathered: List[tuple]) -> None:
    """MeshGroups.create: the same ValueError on every rank if any rank's shape failed or differs."""
    for rank, (error, _, _) in enumerate(gathered):
        if error is not None:
            raise ValueError(f"MeshGroups.create: on rank {rank}: {error}")
    sizes = {len(x[2]) for x in gathered}
    if len(sizes) > 1:
        raise ValueError(f"MeshGroups.create: CP groups of different sizes {sorted(sizes)}; pass equal-size groups")
    shapes = [x[1] for x in gathered]
    text = lambda s: "x".join(map(str, s if s[0] > 1 else s[1:]))  # noqa: E731  (u, a, b) or (a, b)
    for rank, s in enumerate(shapes):
        if s != shapes[0]:
            raise ValueError(
                f"MeshGroups.create: ranks ask for different mesh shapes: {text(shapes[0])} on rank 0 "
                f"but {text(s)} on rank {rank}; call it with the same shape (and ulysses) on every rank"
            )


def _super_ranks(cp_ranks: List[int], u: int, slot: int) -> List[int]:
    """Global ranks of Ulysses slot ``slot`` in every Ulysses group, in super-rank order."""
    return list(cp_ranks[slot::u])


def _hybrid_shape(shape, n: int, u) -> MeshShape:
    """The a x b mesh over the n/u super-ranks, or ValueError naming the fix."""
    if not isinstance(u, int) or isinstance(u, bool) or u < 1:
        raise ValueError(f"ulysses must be a positive integer (the Ulysses group size), got {u!r}")
    if n % u:
        raise ValueError(f"ulysses={u} does not divide the CP size {n}; use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    try:
        return MeshShape.for_size(shape, n // u)
    except ValueError as exc:
        if u == 1:
            raise
        raise ValueError(
            f"ulysses={u} x mesh {shape} does not fit the CP group of {n} ranks: the mesh spans the "
            f"{n // u} super-ranks ({exc})"
        ) from None


class MeshGroups:
    """This rank's view of an a x b mesh over real process groups (times u for ``a2a+mesh``).

    Attributes: ``shape`` (MeshShape), ``position`` (CP rank), ``cp_group``, ``row_group``,
    ``col_group``, ``cp_ranks`` (global ranks in CP order), ``traffic`` (bytes this rank moved),
    ``plan_options`` (what its plans are tuned for: :class:`~megatron_mesh_cp.runtime.mesh.PlanOptions`)
    and ``calls`` (the calls its CP group agreed on). It implements the mesh protocol (runtime/mesh.py).
    A context manager: ``with MeshGroups.create(shape) as mesh:`` calls :meth:`destroy` when the block
    ends (when it raises, only for gloo groups: NCCL's shutdown may wait for peers that failed).
    """

    def __init__(self, shape: MeshShape, cp_group, row_group, col_group, cp_ranks: List[int],
                 timeout: Optional[timedelta] = None, ulysses_group=None, ulysses: int = 1,
                 plan_options: Optional[PlanOptions] = None) -> None:
        self._shape = shape
        self._owned: List[object] = []  # the groups create() made for this rank (destroy() releases them)
        self.timeout = timeout  # what a stalled peer costs: the rings' process-group timeout
        self.cp_group, self.row_group, self.col_group = cp_group, row_group, col_group
        self.ulysses_group, self.ulysses = ulysses_group, ulysses
        self.cp_ranks = cp_ranks
        me = dist.get_rank()
        if me not in cp_ranks:
            raise ValueError(f"rank {me} is not a member of the CP group {cp_ranks}")
        self.position = cp_ranks.index(me)
        self.mesh_position, slot = divmod(self.position, ulysses)
        r, c = shape.coords(self.mesh_position)
        members = _super_ranks(cp_ranks, ulysses, slot)
        g = lambda rr, cc: members[shape.rank(rr, cc)]  # noqa: E731
        # neighbours by direction: +1 = next on the ring, -1 = previous
        self._peers: Dict[str, Dict[int, int]] = {
            "row": {1: g(r, c + 1), -1: g(r, c - 1)},
            "col": {1: g(r + 1, c), -1: g(r - 1, c)},
        }
        self.traffic = Traffic()
        self.buffers = BufferPool()  # receive buffers and accumulators, reused by every layer
        self.calls = CallCache()  # the calls all CP ranks agreed on (attention.py)
        self._comm: Optional[ProcessGroupComm] = None
        # what greedy plans are tuned for (cluster, TP stride, live-chunk limit)
        self.plan_options = plan_options if plan_options is not None else DEFAULT_PLAN_OPTIONS

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, shape, group=None, *, timeout: Optional[timedelta] = None, ulysses: int = 1,
               plan_options: Optional[PlanOptions] = None) -> "MeshGroups":
        """Build the row and column groups of ``shape`` over the CP ``group`` (None = world).

        ``ulysses=u`` > 1 builds ``a2a+mesh``: ``shape`` = (a, b) with u*a*b = the CP size, the
        Ulysses groups are u consecutive CP ranks and the rings join equal Ulysses slots (the
        layout of Megatron's hierarchical CP groups for sizes [u, a, b]).

        A world collective (like ``dist.new_group``): call it on every rank, in the same order.
        With several CP groups (data parallel), each rank passes its own; all rings of all of them
        are created on every rank. Every rank first shares its shape and CP group (one
        ``all_gather_object`` on the world), so a rank asking for something else makes all raise
        the same ``ValueError`` before any group exists. ``timeout`` (default: the default
        group's, as given to ``init_process_group``) bounds how long a ring waits for a peer.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        timeout = timeout or group_timeout()
        cp_ranks = _ranks(group)
        mesh_shape, error = None, None
        try:
            mesh_shape = _hybrid_shape(shape, len(cp_ranks), ulysses)
        except ValueError as exc:
            error = str(exc)
        gathered: List[Optional[tuple]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (error, None if mesh_shape is None else (ulysses, mesh_shape.a, mesh_shape.b),
                                          tuple(cp_ranks)))
        _raise_first(gathered)
        u = ulysses
        all_cp = sorted({x[2] for x in gathered})
        me = dist.get_rank()
        mine = {}  # level -> this rank's group

        def new_group(level, ranks):
            pg = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                mine[level] = pg

        for ranks in all_cp:
            if u > 1:
                for start in range(0, len(ranks), u):
                    new_group("ulysses", list(ranks[start:start + u]))
            for slot in range(u):  # u = 1: exactly the pure mesh's groups, in the same order
                members = _super_ranks(ranks, u, slot)
                for ring in mesh_shape.row_rings():
                    new_group("row", [members[i] for i in ring])
                for ring in mesh_shape.col_rings():
                    new_group("col", [members[i] for i in ring])
        cp_group = group if group is not None else dist.group.WORLD
        mesh = cls(mesh_shape, cp_group, mine.get("row"), mine.get("col"), cp_ranks, timeout=timeout,
                   ulysses_group=mine.get("ulysses"), ulysses=u, plan_options=plan_options)
        mesh._owned = list(mine.values())
        return mesh

    @classmethod
    def from_groups(cls, cp_group, row_group, col_group, ulysses_group=None, *,
                    plan_options: Optional[PlanOptions] = None) -> "MeshGroups":
        """Adopt existing groups; the shape is (size of row group, size of column group).

        With ``ulysses_group`` (u ranks, ``a2a+mesh``): it must be u consecutive CP ranks, the row
        group a ranks of stride u and the column group b ranks of stride u*a (Megatron's
        hierarchical CP groups for sizes [u, a, b], in that order).

        Checks that the rings are the consecutive-a / stride-a subsets of the CP group that the
        mesh needs (Megatron: ``hierarchical_context_parallel_sizes=[a, b]``) on every rank, then
        shares the verdict over the CP group (one ``all_gather_object``): a wrong group on one rank
        raises the same ``ValueError`` on all. The groups keep their own timeout (Megatron's
        ``--distributed-timeout-minutes``).
        """
        cp_ranks = _ranks(cp_group)
        if dist.get_rank() not in cp_ranks:  # no group to share a verdict on
            raise ValueError(f"rank {dist.get_rank()} is not a member of the CP group {cp_ranks}")
        error, shape = None, None
        ulysses = _ranks(ulysses_group) if ulysses_group is not None else None
        try:
            shape = cls._check_rings(cp_ranks, _ranks(row_group), _ranks(col_group), ulysses)
        except ValueError as exc:
            error = str(exc)
        _shared_verdict(error, cp_group, "MeshGroups.from_groups")
        return cls(shape, cp_group, row_group, col_group, cp_ranks, timeout=group_timeout(row_group),
                   ulysses_group=ulysses_group, ulysses=len(ulysses) if ulysses else 1, plan_options=plan_options)

    @staticmethod
    def _check_rings(cp_ranks: List[int], row: List[int], col: List[int], ulysses: Optional[List[int]] = None) -> MeshShape:
        """The mesh shape the row/column rings (and Ulysses group) form in the CP group, or
        ValueError naming the fix."""
        u = len(ulysses) if ulysses is not None else 1
        a, b = len(row), len(col)
        sizes, fix = (f"[{a}, {b}]", "[a, b] with a*b") if u == 1 else (f"[{u}, {a}, {b}]", "[u, a, b] with u*a*b")
        if u * a * b != len(cp_ranks):
            groups = f"row group ({a} ranks) x column group ({b} ranks)"
            if u > 1:
                groups = f"Ulysses group ({u} ranks) x " + groups
            raise ValueError(
                f"{groups} = {u * a * b} ranks, but the CP group has {len(cp_ranks)}; build the groups "
                f"for a shape whose product is the CP size (Megatron: hierarchical_context_parallel_sizes="
                f"{fix} = context_parallel_size)"
            )
        shape = MeshShape(a, b)
        me = dist.get_rank()
        sup, slot = divmod(cp_ranks.index(me), u)
        members = _super_ranks(cp_ranks, u, slot)
        want_row = [members[i] for i in shape.row_ring(sup)]
        want_col = [members[i] for i in shape.col_ring(sup)]
        want_ulysses = cp_ranks[sup * u:(sup + 1) * u]
        if ulysses is not None and sorted(ulysses) != sorted(want_ulysses):
            raise ValueError(
                f"rank {me}: Ulysses group {ulysses} is not the {u} consecutive CP ranks {want_ulysses} "
                f"of CP group {cp_ranks} (Megatron: hierarchical_context_parallel_sizes={sizes}, in that order)"
            )
        if sorted(row) != sorted(want_row) or sorted(col) != sorted(want_col):
            stride = "" if u == 1 else f" of stride {u}"
            raise ValueError(
                f"rank {me}: row group {row} / column group {col} are not the {shape} mesh rings "
                f"{want_row} / {want_col} of CP group {cp_ranks}; the row group must hold "
                f"{a} consecutive CP ranks{stride} and the column group {b} CP ranks of stride {u * a} "
                f"(Megatron: hierarchical_context_parallel_sizes={sizes}, in that order)"
            )
        return shape

    # --- release -----------------------------------------------------------------------------
    @property
    def shape(self) -> MeshShape:
        if self._shape is None:
            raise ValueError("this MeshGroups was destroyed (mesh.destroy()); build a new one with "
                             "MeshGroups.create(...) or MeshGroups.from_groups(...)")
        return self._shape

    def destroy(self) -> None:
        """Release the process groups :meth:`create` made for this rank (``dist.destroy_process_group``).

        Groups adopted by :meth:`from_groups` (and the CP group passed in) belong to the caller and stay
        untouched. Call it on every rank once it is done with the mesh (gloo does not communicate here;
        NCCL's shutdown of a group may wait for its peers, so every rank of the mesh must call it). Idempotent; a call on the mesh afterwards raises
        ``ValueError`` on every rank, as a bad input does.
        """
        if self._shape is None:
            return
        for pg in self._live_owned():
            dist.destroy_process_group(pg)
        self._owned = []
        self._shape = None
        self.row_group = self.col_group = self.ulysses_group = None
        self._comm = None
        self.calls.clear()
        self.buffers = BufferPool()

    def __enter__(self) -> "MeshGroups":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # on an error only gloo groups are released here: NCCL's shutdown of a group may wait for peers a failed
        # rank never meets again (ProcessGroupNCCL), so those are left to the process's end
        # (groups already destroyed elsewhere, say by a teardown of every group, are skipped: asking their backend
        # would raise and hide the block's own error)
        if exc_type is None or all(dist.get_backend(pg) == "gloo" for pg in self._live_owned()):
            self.destroy()

    def _live_owned(self):
        """The groups :meth:`create` made that are still registered (not destroyed elsewhere)."""
        registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
        return [pg for pg in self._owned if pg in registered]

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
        """CP size: u * a * b."""
        return len(self.cp_ranks)

    def __repr__(self) -> str:
        u = f"ulysses={self.ulysses}, " if self.ulysses > 1 else ""
        shape = self._shape if self._shape is not None else "destroyed"
        return f"MeshGroups({shape}, {u}position={self.position}, cp_ranks={self.cp_ranks})"
