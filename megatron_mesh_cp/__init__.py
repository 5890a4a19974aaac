"""megatron-mesh-cp: Mesh-Attention context parallelism for Megatron-LM (arXiv 2512.20968).

Public API:

* :func:`mesh_attention` -- exact CP attention over an a x b mesh of ranks (autograd-aware).
* :func:`virtual_mesh_attention` -- the same algorithm on one process (every rank emulated).
* :class:`MeshGroups` -- the CP group with its row (Q) and column (KV) rings (and Ulysses group).
* :class:`MeshShape`, :func:`valid_shapes` -- tile shapes and mesh coordinates.
* :func:`zigzag_shard`, :func:`zigzag_gather` -- Megatron's CP token layout.
* :func:`thd_shard`, :func:`thd_gather` -- its packed (THD) form: each document split per 2·CP.
* :func:`build_plans`, :func:`plan_traffic`, :class:`ChunkDims` -- the schedule as data and the
  bytes it moves, computed without running.
"""

from .attention import mesh_attention
from .planning.schedule import build_plans
from .runtime.groups import MeshGroups
from .runtime.layout import zigzag_gather, zigzag_shard
from .runtime.packed import thd_gather, thd_shard
from .runtime.plan import ChunkDims, Plan, plan_traffic, validate
from .runtime.topology import MeshShape, valid_shapes
from .virtual import virtual_mesh_attention

__version__ = "0.1.0"

__all__ = [
    "mesh_attention",
    "virtual_mesh_attention",
    "MeshGroups",
    "MeshShape",
    "valid_shapes",
    "zigzag_shard",
    "zigzag_gather",
    "thd_shard",
    "thd_gather",
    "build_plans",
    "plan_traffic",
    "validate",
    "ChunkDims",
    "Plan",
    "__version__",
]
