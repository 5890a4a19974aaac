"""The runtime: what runs on every rank during training.

Mesh topology and token layout, the plan language (ops a schedule is made of) and its validator,
the liveness layout of a plan's buffers, the executor and its communicators, the per-block kernels,
the (out, lse) merge, the Ulysses all-to-all of ``a2a+mesh``, the cross-rank agreement check and
the process groups. Nothing here imports the planning layer or Megatron.
"""

from .agree import agree, any_rank, plan_digest
from .balance import balance_documents, balance_order, chunk_work, token_order
from .buffers import BufferPool
from .comm import ProcessGroupComm, RingComm, Traffic, VirtualComm, VirtualHub
from .execute import Executor, delta_stand_in, run_virtual
from .groups import MeshGroups
from .hybrid import UlyssesIn, UlyssesOut
from .kernels import (
    KERNELS, BlockKernel, FlashKernel, KernelNeeds, TEKernel, TorchKernel, Varlen, available_kernels, get_kernel,
    input_spec, lse_dtype, select_kernel,
)
from .layout import LAYOUTS, BlockCase, BlockSlices, block_case, seq_dim, zigzag_gather, zigzag_positions, zigzag_shard
from .layouts import (TOKEN_LAYOUTS, Arrangement, arrange, decode as decode_layout, encode as encode_layout,
                      positions_of, tile_sums)
from .masks import (
    FULL, Arranged, Chunked, Documents, Mask, PackedDocuments, Span, Window, as_mask, check_window, documents_from_eod,
    documents_of, intersect, packed_documents,
)
from .memory import buffer_lives, peak_live_bytes
from .memory import layout as memory_layout
from .merge import empty_partial, merge_into, merge_sink, sink_grad
from .mesh import DEFAULT_PLAN_OPTIONS, MAX_SEARCH_BUDGET, CallCache, MeshLike, PlanOptions, search_budget_error
from .packed import PackedLayout, packed_slices, padding_rows, thd_gather, thd_partition_indices, thd_shard
from .plan import (
    BACKWARD, CATEGORIES, FORWARD, GATHER_KINDS, REDUCE_KINDS, RING_OF, ChunkDims, Compute, Free, Plan, PlanError,
    Transfer, payload, plan_traffic, validate,
)
from .prune import prune
from .tile_balance import tile_order, tile_work
from .topology import MeshShape, parse_shape, valid_shapes
from .ulysses import A2A_CATEGORIES, check_ulysses_heads, kv_repeats, ulysses_traffic, valid_ulysses

__all__ = [
    "agree", "any_rank", "plan_digest",
    "balance_documents", "balance_order", "chunk_work", "token_order",
    "BufferPool", "ProcessGroupComm", "RingComm", "Traffic", "VirtualComm", "VirtualHub",
    "Executor", "delta_stand_in", "run_virtual", "MeshGroups", "UlyssesIn", "UlyssesOut",
    "KERNELS", "BlockKernel", "FlashKernel", "KernelNeeds", "TEKernel", "TorchKernel", "Varlen", "available_kernels",
    "get_kernel", "input_spec", "lse_dtype", "select_kernel",
    "LAYOUTS", "BlockCase", "BlockSlices", "block_case", "seq_dim", "zigzag_gather", "zigzag_positions", "zigzag_shard",
    "TOKEN_LAYOUTS", "Arrangement", "arrange", "positions_of", "encode_layout", "decode_layout", "tile_sums",
    "FULL", "Arranged", "Chunked", "Documents", "Mask", "PackedDocuments", "Span", "Window", "as_mask", "check_window",
    "documents_from_eod", "documents_of", "intersect", "packed_documents",
    "buffer_lives", "peak_live_bytes", "memory_layout", "empty_partial", "merge_into", "merge_sink", "sink_grad",
    "DEFAULT_PLAN_OPTIONS", "CallCache", "MeshLike", "PlanOptions", "MAX_SEARCH_BUDGET", "search_budget_error",
    "PackedLayout", "packed_slices", "padding_rows", "thd_gather", "thd_partition_indices", "thd_shard",
    "BACKWARD", "CATEGORIES", "FORWARD", "GATHER_KINDS", "REDUCE_KINDS", "RING_OF", "ChunkDims", "Compute", "Free",
    "Plan", "PlanError", "Transfer", "payload", "plan_traffic", "validate", "prune", "tile_order", "tile_work",
    "MeshShape", "parse_shape", "valid_shapes",
    "A2A_CATEGORIES", "check_ulysses_heads", "kv_repeats", "ulysses_traffic", "valid_ulysses",
]
