"""Lower bounds on a mesh's simulated time: what auto shape and auto layout order their candidates by.

Per phase, the larger of the compute any plan must do (every block's kernel work and the fewest
kernel calls; with a pruned mask the busiest rank's own blocks) and the bytes of its transfers over
the busiest link type; never above what the replay of the greedy plans gives (tested).
"""

from __future__ import annotations

from ..runtime.layout import BlockCase
from ..runtime.plan import BACKWARD, FORWARD, REDUCE_KINDS, RING_OF, payload
from .cluster import Cluster, Workload, workload_dims
from .documents import tile_bound
from .greedy import GROUP_WIDTH, grouping_pays

__all__ = ["mesh_bound", "full_comm_bound"]


def _ring_hops(cluster: Cluster, rings, stride: int) -> str:
    """"intra" or "inter" when every hop of every ring is of that type, else "mixed"."""
    kinds = {cluster.link(r[i], r[(i + 1) % len(r)], stride) for r in rings if len(r) > 1 for i in range(len(r))}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def mesh_bound(a: int, b: int, cluster: Cluster, w: Workload, stride: int = 1) -> float:
    """A lower bound on the a x b mesh's simulated time: per phase, its compute or its busiest link.

    Rings whose hops are all of one link type share that type's egress; a ring with both kinds of
    hop can at best use both links at once. Compute: every block's kernel work, and per Q chunk at
    least one kernel call for the own KV chunk and one per KV slab where grouped plans are made
    (the fewest calls any plan makes), a call per block where they are not. Unpadded documents
    or a window (pruned plans): the busiest rank's own blocks, and one transfer per offset some rank needs.
    """
    dims = workload_dims(w)
    cases = (BlockCase.DIAG, BlockCase.LOWER, BlockCase.UPPER) if w.causal else (BlockCase.FULL,)
    links, bw = _links(a, b, cluster, stride)
    total = 0.0
    for phase in (FORWARD, BACKWARD):
        bwd = phase == BACKWARD
        hops = {k: (a if RING_OF[k] == "row" else b) - 1 for k in ("q", "kv") + REDUCE_KINDS[phase]}
        if w.pruned:  # pruned plans: the busiest rank's blocks, the offsets some rank needs
            compute, hops = tile_bound(w, cluster, a, b, bwd)
        elif grouping_pays(w, cluster, bwd):
            calls = a * (1 + -(-(b - 1) // GROUP_WIDTH))
            compute = (a * b * min(w.kernel_time(cluster, c, bwd) + w.keys_time(cluster, c, bwd) for c in cases)
                       + calls * min(w.call_time(cluster, c, bwd) for c in cases))
        elif w.packing is None:
            compute = a * b * min(w.block_time(cluster, c, bwd) for c in cases)
        else:  # every rank computes a * b blocks, none cheaper than the cheapest packed block
            compute = a * b * float(w.block_times(cluster, bwd, a * b).min())
        total += max(compute, _comm(phase, hops, dims, links, bw))
    return total


def _links(a: int, b: int, cluster: Cluster, stride: int):
    """The row and column rings' link types, and each type's bandwidth."""
    links = {
        "row": _ring_hops(cluster, [[r * a + c for c in range(a)] for r in range(b)], stride),
        "col": _ring_hops(cluster, [[r * a + c for r in range(b)] for c in range(a)], stride),
    }
    return links, {"intra": cluster.intra_bw, "inter": cluster.inter_bw, "mixed": cluster.intra_bw + cluster.inter_bw}


def _comm(phase, hops, dims, links, bw) -> float:
    """Seconds of one phase's transfers (``hops`` per kind) over the busiest link type."""
    wire = {"intra": 0.0, "inter": 0.0}
    comm = 0.0
    for kind in ("q", "kv") + REDUCE_KINDS[phase]:
        ring = RING_OF[kind]
        nbytes = hops[kind] * sum(s.nbytes for s in payload(phase, kind, dims))
        if links[ring] == "mixed":
            comm = max(comm, nbytes / bw["mixed"])
        else:
            wire[links[ring]] += nbytes
    return max([comm] + [v / bw[k] for k, v in wire.items()])


def full_comm_bound(a: int, b: int, cluster: Cluster, w: Workload, stride: int = 1) -> float:
    """The transfer part of :func:`mesh_bound` where every block of the tile is needed (every foreign
    offset sent): a lower bound on mesh_bound of any mask that needs them all -- a split layout's, whose
    first document crosses every piece -- whatever its compute (auto layout skips those candidates'
    searches when a layout already priced is no slower)."""
    dims = workload_dims(w)
    links, bw = _links(a, b, cluster, stride)
    total = 0.0
    for phase in (FORWARD, BACKWARD):
        hops = {k: (a if RING_OF[k] == "row" else b) - 1 for k in ("q", "kv") + REDUCE_KINDS[phase]}
        total += _comm(phase, hops, dims, links, bw)
    return total
