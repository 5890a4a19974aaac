"""The mesh protocol: what an attention call reads of a mesh, and the state a mesh owns.

Two meshes implement it: :class:`~megatron_mesh_cp.runtime.groups.MeshGroups` (one rank's view of
process groups) and :class:`~megatron_mesh_cp.virtual.VirtualMesh` (every rank in one process). A
call reads the tile shape over the super-ranks (``shape``), the Ulysses degree, the options plans
are tuned with (:class:`PlanOptions`, given when the mesh is made) and the mesh's own call cache
(:class:`CallCache`), which holds the calls the CP group agreed on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Protocol, runtime_checkable

__all__ = ["MeshLike", "PlanOptions", "CallCache", "DEFAULT_PLAN_OPTIONS", "MAX_SEARCH_BUDGET", "search_budget_error"]

#: the most replays per phase an order search may be given (``PlanOptions.search``, the launcher's
#: --mesh-plan-search): about 100 s of host time per phase at 32 mesh ranks (more at larger meshes), every
#: micro-batch; a larger budget is a typo, refused rather than run for hours
MAX_SEARCH_BUDGET = 100_000


def search_budget_error(budget) -> str:
    """Why ``budget`` is no order-search budget ('' where it is one: an int in 0 .. MAX_SEARCH_BUDGET)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        return f"give N >= 0, got {budget!r}"
    if budget > MAX_SEARCH_BUDGET:
        return (f"{budget} replays per phase is over the cap of {MAX_SEARCH_BUDGET} (about 1 ms of host time each at 32 "
                "mesh ranks, every micro-batch); 800 takes most of the gain")
    return ""


@dataclass(frozen=True)
class PlanOptions:
    """What greedy plans are tuned for: a cluster (a ``planning.Cluster``; None: ``$MESH_CP_CLUSTER``
    or h100-ib400), the GPU distance between consecutive CP ranks (Megatron: the TP size) and the
    live-chunk limit plans keep to (None: none; ``--mesh-shape auto`` sets what fits its budget).
    ``reorder``: whether pruned plans (documents, chunks, a window) run re-ordered by when their
    chunks are ready (planning/ready.py): None where the simulator says it is faster, True always
    (tests run re-ordered plans this way), False never. ``search``: replays per phase the order search
    (planning/search.py) may spend improving those plans, every micro-batch (0: none; about 1 ms of host
    time each at 32 ranks)."""

    cluster: Any = None
    stride: int = 1
    max_live: Optional[int] = None
    reorder: Optional[bool] = None
    search: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"stride must be a positive int (GPUs between consecutive CP ranks), got {self.stride!r}")
        if self.max_live is not None and (not isinstance(self.max_live, int) or self.max_live < 2):
            raise ValueError(f"max_live must be an int >= 2 (live chunks) or None, got {self.max_live!r}")
        if self.reorder not in (None, True, False):
            raise ValueError(f"reorder must be None (where faster), True or False, got {self.reorder!r}")
        why = search_budget_error(self.search)
        if why:
            raise ValueError(f"search (replays per phase of the order search): {why}")
        if self.search and self.reorder is False:
            raise ValueError("search re-orders pruned plans, which reorder=False forbids: set search=0 or reorder=None")


DEFAULT_PLAN_OPTIONS = PlanOptions()


class CallCache:
    """The calls a mesh's CP group agreed on, most recent last; at most ``size`` kept (a new sequence
    length or a new batch's documents every step must not grow memory).

    ``agreed_batch`` is the per-batch mask value the CP group agreed on for the current micro-batch
    (set collectively by :func:`~megatron_mesh_cp.attention.agree_batch`): calls with exactly that mask
    skip their per-call agreement."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._calls: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.agreed_batch: Any = None

    def get(self, key: Hashable) -> Any:
        if key is None:
            return None
        hit = self._calls.get(key)
        if hit is not None:
            self._calls.move_to_end(key)
        return hit

    def put(self, key: Hashable, value: Any) -> None:
        if key is None:
            return
        self._calls[key] = value
        self._calls.move_to_end(key)
        while len(self._calls) > self.size:
            self._calls.popitem(last=False)

    def last(self) -> Any:
        """The most recently used call (None: none yet)."""
        return next(reversed(self._calls.values()), None)

    def clear(self) -> None:
        self._calls.clear()
        self.agreed_batch = None

    def __len__(self) -> int:
        return len(self._calls)


@runtime_checkable
class MeshLike(Protocol):
    """What a mesh attention call reads of its mesh."""

    shape: Any  # MeshShape over the super-ranks (the ranks themselves unless ulysses > 1)
    ulysses: int  # Ulysses degree u (a2a+mesh), 1 for pure mesh
    plan_options: PlanOptions
    calls: CallCache
