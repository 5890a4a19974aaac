"""The planning layer: decides what the runtime runs, and predicts how fast it runs.

A cluster cost model (``cluster``), the greedy and in-order planners (``greedy``, ``schedule``), the
plan replayer (``replay``), the algorithms we compare with (``baselines``) and their shared costs
(``costs``), the automatic shape choice (``autoshape``) and the calibration against published
measurements (``calibration``). Imports the runtime's plan language, never the executor's state.
"""

from . import calibration
from .autoshape import BUDGET_X_RING, HybridChoice, ShapeChoice, choose_hybrid_shape, choose_shape, ulysses_degrees
from .baselines import ALGORITHMS, SimResult, check_algorithms, compare, even_sides, format_table, simulate_algorithm
from .bounds import mesh_bound
from .cluster import CALIBRATED, HOST_PER_CALL_US, Cluster, Workload, cluster_presets, load_cluster, workload_dims
from .costs import plan_peak_bytes, te_ring_peak_bytes, ulysses_buffer_bytes, ulysses_inner
from .doc_baselines import compare_documents, document_sets, format_documents_table, runs_unpadded
from .documents import CallSeconds, UnpaddedDocuments, call_seconds, read_documents, sample_documents
from .layouts import LayoutChoice, candidate_layouts, choose_layout, resolve_layout, tile_weights
from .packing import DISTRIBUTIONS, Packing, length_draws, parse_doc_range, parse_tokens, read_packing, sample_packing
from .replay import replay
from .schedule import (
    PLANNERS, build_plans, call_plans, clear_plan_cache, default_cluster, document_plans, in_order_plan, plan_scale,
    masked_pool_bytes, orders_ahead,
)
from .search import SEARCHES, encode_orders, remember_encoded, search_order
from .shape_cache import cache_dir, cached_choice
from .window_baselines import compare_windows, format_window_table, te_a2a_refusal

__all__ = [
    "calibration",
    "BUDGET_X_RING", "HybridChoice", "ShapeChoice", "choose_hybrid_shape", "choose_shape", "ulysses_degrees",
    "ALGORITHMS", "SimResult", "check_algorithms", "compare", "even_sides", "format_table", "simulate_algorithm",
    "mesh_bound",
    "CALIBRATED", "HOST_PER_CALL_US", "Cluster", "Workload", "cluster_presets", "load_cluster", "workload_dims",
    "plan_peak_bytes", "te_ring_peak_bytes", "ulysses_buffer_bytes", "ulysses_inner",
    "compare_documents", "document_sets", "format_documents_table", "runs_unpadded",
    "CallSeconds", "UnpaddedDocuments", "call_seconds", "read_documents", "sample_documents",
    "LayoutChoice", "candidate_layouts", "choose_layout", "resolve_layout", "tile_weights",
    "DISTRIBUTIONS", "Packing", "length_draws", "parse_doc_range", "parse_tokens", "read_packing", "sample_packing",
    "replay", "PLANNERS", "build_plans", "call_plans", "clear_plan_cache", "default_cluster", "document_plans", "plan_scale", "masked_pool_bytes",
    "in_order_plan", "orders_ahead", "SEARCHES", "encode_orders", "remember_encoded", "search_order",
    "cache_dir", "cached_choice", "compare_windows", "format_window_table", "te_a2a_refusal",
]
