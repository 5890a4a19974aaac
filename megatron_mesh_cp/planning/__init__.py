"""The planning layer: decides what the runtime runs, and predicts how fast it runs.

A cluster cost model (``cluster``), the greedy and in-order planners (``greedy``, ``schedule``), the
plan replayer (``replay``), the algorithms we compare with (``baselines``) and their shared costs
(``costs``), the automatic shape choice (``autoshape``) and the calibration against published
measurements (``calibration``). Imports the runtime's plan language, never the executor's state.
"""

from .autoshape import choose_hybrid_shape, choose_shape
from .baselines import compare, simulate_algorithm
from .cluster import Cluster, Workload, cluster_presets, load_cluster, workload_dims
from .documents import UnpaddedDocuments, read_documents, sample_documents
from .packing import Packing, read_packing, sample_packing
from .schedule import PLANNERS, build_plans, call_plans, default_cluster, document_plans, in_order_plan

__all__ = [
    "Cluster", "Workload", "load_cluster", "cluster_presets", "workload_dims", "default_cluster",
    "build_plans", "call_plans", "document_plans", "in_order_plan", "PLANNERS",
    "UnpaddedDocuments", "sample_documents", "read_documents", "Packing", "sample_packing", "read_packing",
    "choose_shape", "choose_hybrid_shape", "simulate_algorithm", "compare",
]
