"""Cost model: a cluster description and the time of every plan op on it.

A :class:`Cluster` says how many GPUs share a node, the per-GPU bandwidth and latency inside a node
(NVLink, or PCIe) and across nodes (InfiniBand/RoCE), the attention throughput of one GPU and its
memory bandwidth, plus the costs of *hiding* communication that published measurements show
(docs/calibration.md): compute slows down while transfers run beside it, every block call pays a
launch and the fp32 correction of the running output, and nodes without NVSwitch share one host
bridge. The host's own time per kernel call (``host_per_call``) bounds a compute step from below:
the host issues the steps while the GPU runs them, so a step cannot end before it was issued.
Presets are YAML files shipped in the package (``megatron_mesh_cp/configs/clusters/``;
``MESH_CP_CLUSTER_DIR`` adds a directory searched first); ``load_cluster`` takes a preset name or a
path. Rank placement follows Megatron's order (TP innermost, then CP): CP position p of a group
with tensor-parallel size t sits on global rank ``p * t`` (plus the TP rank), so whether a ring hop
crosses a node depends on the mesh shape, t and the GPUs per node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import torch

from ..runtime.layout import BlockCase
from ..runtime.masks import Mask, Span, SpanBlocks, as_mask
from ..runtime.packed import packed_slices
from ..runtime.plan import ChunkDims
from ..runtime.topology import MeshShape
from .documents import arranged_block_calls, block_calls as document_block_calls, price_calls
from .packing import Packing
from .windows import window_block_calls

__all__ = ["Cluster", "Workload", "CALIBRATED", "HOST_PER_CALL_US", "load_cluster", "cluster_presets", "CLUSTER_DIRS",
           "workload_dims"]

#: Where preset names are looked up (``MESH_CP_CLUSTER_DIR`` adds one, first).
CLUSTER_DIRS: List[Path] = [Path(str(resources.files("megatron_mesh_cp") / "configs" / "clusters"))]


#: The overlap costs fitted to published measurements (scripts/calibrate_simulator.py,
#: docs/calibration.md); a cluster YAML without an ``overlap`` section gets these.
CALIBRATED: Dict[str, float] = {
    "slowdown_intra": 0.3,
    "slowdown_inter": 0.025,
    "block_overhead_us": 40.0,
    "correction_passes": 6.0,
}

#: Host (CPU) time the executor spends per block-kernel call, in microseconds: the call's issue, its
#: merge and accumulation and the plan walk around it (transfers, frees), amortised over the calls.
#: Measured with scripts/bench_host.py (docs/performance.md, "Host cost"): the executor's CPU time
#: per kernel call less the kernel's own, on virtual ranks with tiny tensors, on this project's
#: CPUs. A CPU-side figure until a GPU run measures it (scripts/gpu_check.sh, section g); a cluster
#: YAML's ``host: {per_call_us: ...}`` overrides it.
HOST_PER_CALL_US = 100.0


@dataclass(frozen=True)
class Cluster:
    """One cluster's hardware and the fitted costs of overlapping communication with compute."""

    name: str
    gpus_per_node: int
    intra_bw: float  # bytes/s per GPU per direction
    intra_lat: float  # seconds
    inter_bw: float
    inter_lat: float
    fwd_flops: float  # attention FLOP/s at saturation
    bwd_flops: float
    half_tokens: float  # query rows at which a block reaches half the peak throughput
    hbm_bw: float  # bytes/s, for elementwise folds of partials
    bytes_per_element: int = 2
    description: str = ""
    #: Fractional slowdown of the compute stream per transfer in flight beside it inside a node
    #: (NCCL kernels take SMs and HBM bandwidth from the attention kernel while they overlap).
    overlap_slowdown_intra: float = 0.0
    #: The same per network transfer (IB/RoCE: fewer SMs, the NIC does the copy).
    overlap_slowdown_inter: float = 0.0
    #: Fixed cost of every block-kernel call: launch, stream waits, per-step bookkeeping (seconds).
    block_overhead: float = 0.0
    #: Passes over the fp32 output block that the running (out, lse) correction makes per block.
    correction_passes: float = 0.0
    #: Nodes without NVSwitch: bytes/s of the host bridge that an all-to-all's traffic between GPUs
    #: under different PCIe switches shares (``None``: NVSwitch, every GPU has a private link).
    intra_shared_bw: Optional[float] = None
    #: GPUs that share one PCIe switch and talk peer-to-peer at ``intra_bw`` without the bridge.
    p2p_group: int = 0
    #: Host time per block-kernel call (seconds; :data:`HOST_PER_CALL_US`): the host and the GPU run
    #: concurrently, so back-to-back compute steps cost the larger of the two.
    host_per_call: float = HOST_PER_CALL_US * 1e-6

    @classmethod
    def from_dict(cls, d: Dict) -> "Cluster":
        """A cluster from its YAML description; absent overlap/overhead keys take the calibrated defaults,
        an absent ``host`` section :data:`HOST_PER_CALL_US`."""
        try:
            att = d["attention"]
            intra = d["intra_node"]
            ovl = {**CALIBRATED, **(d.get("overlap") or {})}
            c = cls(
                name=str(d["name"]),
                gpus_per_node=int(d["gpus_per_node"]),
                intra_bw=float(intra["bandwidth_GBps"]) * 1e9,
                intra_lat=float(intra["latency_us"]) * 1e-6,
                inter_bw=float(d["inter_node"]["bandwidth_GBps"]) * 1e9,
                inter_lat=float(d["inter_node"]["latency_us"]) * 1e-6,
                fwd_flops=float(att["forward_tflops"]) * 1e12,
                bwd_flops=float(att["backward_tflops"]) * 1e12,
                half_tokens=float(att.get("half_efficiency_tokens", 0)),
                hbm_bw=float(d.get("hbm_GBps", 2000)) * 1e9,
                bytes_per_element=int(d.get("bytes_per_element", 2)),
                description=str(d.get("description", "")),
                overlap_slowdown_intra=float(ovl["slowdown_intra"]),
                overlap_slowdown_inter=float(ovl["slowdown_inter"]),
                block_overhead=float(ovl["block_overhead_us"]) * 1e-6,
                correction_passes=float(ovl["correction_passes"]),
                intra_shared_bw=float(intra["shared_GBps"]) * 1e9 if intra.get("shared_GBps") else None,
                p2p_group=int(intra.get("p2p_group", 0)),
                host_per_call=float((d.get("host") or {}).get("per_call_us", HOST_PER_CALL_US)) * 1e-6,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"cluster description is missing or mistypes {exc}; see "
                "megatron_mesh_cp/configs/clusters/h100-ib400.yaml for the fields"
            ) from None
        if c.gpus_per_node < 1 or min(c.intra_bw, c.inter_bw, c.fwd_flops, c.bwd_flops, c.hbm_bw) <= 0:
            raise ValueError(f"cluster {c.name}: gpus_per_node, bandwidths and throughputs must be positive")
        if min(c.overlap_slowdown_intra, c.overlap_slowdown_inter, c.block_overhead, c.correction_passes,
               c.host_per_call) < 0:
            raise ValueError(f"cluster {c.name}: overlap slowdowns and overheads (host.per_call_us too) must be >= 0")
        return c

    def with_inter_bandwidth(self, gbps: float) -> "Cluster":
        return replace(self, inter_bw=gbps * 1e9, name=f"{self.name}@{gbps:g}GBps")

    # --- placement ----------------------------------------------------------------------------
    def node_of(self, position: int, stride: int = 1) -> int:
        """Node of CP position ``position`` when consecutive CP ranks are ``stride`` GPUs apart."""
        return (position * stride) // self.gpus_per_node

    def link(self, src: int, dst: int, stride: int = 1) -> str:
        return "intra" if self.node_of(src, stride) == self.node_of(dst, stride) else "inter"

    def bandwidth(self, link: str) -> float:
        return self.intra_bw if link == "intra" else self.inter_bw

    def latency(self, link: str) -> float:
        return self.intra_lat if link == "intra" else self.inter_lat

    def transfer_time(self, nbytes: float, link: str) -> float:
        return self.latency(link) + nbytes / self.bandwidth(link)

    # --- compute ------------------------------------------------------------------------------
    def attention_time(self, flops: float, rows: int, backward: bool) -> float:
        peak = self.bwd_flops if backward else self.fwd_flops
        eff = rows / (rows + self.half_tokens) if self.half_tokens else 1.0
        return flops / (peak * eff)

    def elementwise_time(self, nbytes: float) -> float:
        return nbytes / self.hbm_bw

    def slowdown(self, link: str) -> float:
        """Fractional compute slowdown per transfer of this link type in flight beside a kernel."""
        return self.overlap_slowdown_inter if link == "inter" else self.overlap_slowdown_intra

    def p2p_group_of(self, gpu):
        """The PCIe switch a GPU (or an array of GPUs) sits under; one group per node with NVSwitch."""
        return gpu // (self.p2p_group or self.gpus_per_node)


@dataclass(frozen=True)
class Workload:
    """One attention layer's shape per CP rank: what the cost of a block and a chunk depends on.

    ``mask`` (optional) is the layer's one mask value: unpadded documents
    (:class:`~megatron_mesh_cp.planning.documents.UnpaddedDocuments` or the runtime's ``Documents``), a
    sliding window, chunks (``runtime.masks``) or their intersection -- every block is then priced as
    the kernel calls the mask leaves it, an empty block at 0, on pruned plans (:attr:`pruned`) -- or
    packed THD documents (:class:`~megatron_mesh_cp.planning.packing.Packing`): chunk sizes, and so
    every payload, stay the same, but each block only computes the pairs inside each document; each
    of the ``batch`` sequences is packed the same way. ``head_dim_v`` (MLA) is the head dim of V, O
    and their gradients where it differs from Q/K's.
    """

    seq_local: int  # tokens per rank (2m)
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    causal: bool = True
    bytes_per_element: int = 2
    partial_bytes: int = 4  # bytes per element of partial O / dQ / dKV on the wire
    mask: Optional[Mask] = None
    head_dim_v: Optional[int] = None  # None: head_dim
    #: the greedy planner's block time as a fraction of this layer's unmasked block (a power of two;
    #: planning/schedule.py ``plan_scale``): a masked layer's plans are planned for the blocks it keeps
    plan_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.plan_scale, (int, float)) and 0 < self.plan_scale <= 1):
            raise ValueError(f"plan_scale must be in (0, 1], got {self.plan_scale!r}")
        mask = None if self.mask is None else as_mask(self.mask).simplified(self.causal)
        if mask is not None:
            mask.check_batch(self.batch)
        if mask is not None and mask.has_window and mask.cuts_documents and _tile(mask):
            raise ValueError("windowed blocks are priced by their exact pairs; give the documents kernel tile 0")
        object.__setattr__(self, "mask", mask)
        if self.head_dim_v is not None and (int(self.head_dim_v) != self.head_dim_v or self.head_dim_v < 1):
            raise ValueError(f"head_dim_v must be a positive int (the head dim of V), got {self.head_dim_v!r}")
        dv = None if self.head_dim_v in (None, self.head_dim) else int(self.head_dim_v)
        object.__setattr__(self, "head_dim_v", dv)  # equal dims: the same workload (and cache key) as before

    @property
    def packing(self) -> Optional[Packing]:
        """The packed THD documents, if that is the mask."""
        return self.mask if isinstance(self.mask, Packing) else None

    @property
    def window(self) -> Optional[Tuple[int, int]]:
        """The mask's sliding window as the runtime takes it ((left, right); None: none)."""
        return None if self.mask is None else self.mask.band(self.causal)

    @property
    def pruned(self) -> bool:
        """Whether blocks may be empty (documents, chunks or a window): our plans for it are pruned."""
        return self.mask is not None and self.packing is None

    @property
    def unmasked(self) -> "Workload":
        """The same layer without its documents, chunks or window: what the full plans are planned for."""
        return replace(self, mask=None) if self.pruned else self

    def arranged(self, ranks: int):
        """The mask as it runs on ``ranks`` chunks (documents in the order they run there: balanced for
        ``ranks`` if asked), None for none."""
        return None if self.mask is None else self.mask.arranged(ranks, self.causal)

    def _runs_as(self, ranks: int):
        """The mask as it runs on ``ranks`` chunks, its documents checked to fill the sequence."""
        total = self.seq_local * ranks
        mask = self.arranged(ranks)
        docs = None if mask is None else mask_total(mask)
        if docs is not None and docs != total:
            raise ValueError(f"the documents span {docs} tokens but {ranks} CP ranks of {self.seq_local} tokens "
                             f"hold {total}; the documents must fill the global sequence length")
        return mask, total

    def span(self, ranks: int) -> Optional[Span]:
        """The mask's canonical form over the sequence of ``ranks`` chunks, as it runs there (None: a
        mask that is not a span, e.g. documents re-laid in pieces by the split layout)."""
        mask, total = self._runs_as(ranks)
        if mask is None:
            return Span(total)
        return None if mask.span_error else mask.span(total, self.causal)

    def blocks(self, ranks: int):
        """The runtime's block engine of the mask on ``ranks`` chunks (cached)."""
        span = self.span(ranks)
        if span is not None:
            return _span_blocks(span, ranks, self.causal)
        mask, total = self._runs_as(ranks)
        return _bound(mask, ranks, total, self.causal)

    def nonempty(self, ranks: int) -> np.ndarray:
        """Bool [ranks, ranks]: the blocks with any (query, key) pair (the runtime's own mask)."""
        return self.blocks(ranks).nonempty()

    def needed(self, a: int, b: int) -> FrozenSet[Tuple[int, int]]:
        """Tile blocks some rank of the a x b mesh computes: what the pruned plans keep."""
        span = self.span(a * b)
        if span is not None:
            return _needed(span, a, b, self.causal)
        return self.blocks(a * b).needed(MeshShape(a, b))

    def mask_calls(self, ranks: int):
        """Every kernel call of every block on ``ranks`` chunks under the (pruned) mask: vectorised for
        span masks (planning/documents.py, planning/windows.py), from the block engine otherwise."""
        span = self.span(ranks)
        if span is None:  # documents re-laid in pieces (the packed and split layouts)
            return arranged_block_calls(self._runs_as(ranks)[0], ranks, self.causal)
        if span.window is None:
            return document_block_calls(span, ranks, self.causal)
        return window_block_calls(span, ranks, self.causal)

    @property
    def dv(self) -> int:
        """The head dim of V, O, dO and dV."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def pair_flops(self, pairs, backward: bool, heads: Optional[int] = None):
        """Attention FLOPs of ``pairs`` (q, k) pairs over ``heads`` (default: all) and the batch (works on
        arrays): forward QK^T with the q/k head dim and PV with V's (2 FLOPs per multiply-add each);
        backward QK^T again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (2.5x forward at equal dims)."""
        d, dv = self.head_dim, self.dv
        f = 4.0 * self.batch * (self.heads if heads is None else heads) * ((d + dv) / 2) * pairs
        return f * ((3 * d + 2 * dv) / (d + dv)) if backward else f

    def block_flops(self, case: BlockCase, backward: bool) -> float:
        """FLOPs of one block of this case without packing (every block of a case is the same work)."""
        s, m = self.seq_local, self.seq_local // 2
        if case is BlockCase.FULL:
            pairs = s * s
        elif case is BlockCase.DIAG:
            pairs = s * (s + 1) / 2
        else:
            pairs = s * m
        return self.pair_flops(pairs, backward)

    def block_rows(self, case: BlockCase) -> int:
        return self.seq_local // 2 if case is BlockCase.UPPER else self.seq_local

    def block_keys(self, case: BlockCase) -> int:
        return self.seq_local // 2 if case is BlockCase.LOWER else self.seq_local

    def block_time(self, cluster: Cluster, case: BlockCase, backward: bool) -> float:
        """One unpacked block-kernel call: the kernel, its fixed call overhead and the fp32 correction pass."""
        return (self.kernel_time(cluster, case, backward) + self.call_time(cluster, case, backward)
                + self.keys_time(cluster, case, backward))

    def kernel_time(self, cluster: Cluster, case: BlockCase, backward: bool) -> float:
        """The attention kernel's work for one block (additive over the blocks of a grouped call:
        its efficiency depends on the query rows, which the blocks of a call share)."""
        return cluster.attention_time(self.block_flops(case, backward), self.block_rows(case), backward)

    def call_time(self, cluster: Cluster, case: BlockCase, backward: bool) -> float:
        """What every kernel call pays once, however many blocks it covers: the fixed call overhead
        and the correction passes over the Q rows' fp32 accumulator (out and lse, or dQ)."""
        return self._call_cost(cluster, self.block_rows(case), backward)

    def keys_time(self, cluster: Cluster, case: BlockCase, backward: bool) -> float:
        """Per block, beside the kernel: the backward's dK/dV accumulation over the block's keys."""
        return self._keys_cost(cluster, self.block_keys(case), backward)

    def _call_cost(self, cluster: Cluster, rows: int, backward: bool) -> float:
        # forward: the fp32 output (V's head dim) and lse; backward: the dQ accumulator (Q's head dim)
        elements = self.batch * rows * self.heads * (self.head_dim if backward else self.dv + 1)
        return cluster.block_overhead + cluster.elementwise_time(4 * cluster.correction_passes * elements)

    def _keys_cost(self, cluster: Cluster, keys: int, backward: bool) -> float:
        if not backward:
            return 0.0
        elements = self.batch * keys * self.kv_heads * (self.head_dim + self.dv)  # dK and dV
        return cluster.elementwise_time(4 * cluster.correction_passes * elements)

    def packed_call_costs(self, cluster: Cluster, case: BlockCase, backward: bool) -> float:
        """The fixed costs of a packed block: the runtime runs it as its per-document sub-blocks
        (:func:`~megatron_mesh_cp.runtime.packed.packed_slices`: 3 varlen calls on the diagonal, 2
        off it), each paying :meth:`call_time` over its own rows and :meth:`keys_time` over its keys."""
        if case is BlockCase.FULL:  # no causal split: one call over the block
            subs = [(self.seq_local, self.seq_local)]
        else:
            subs = [(sl.q_stop - sl.q_start, sl.kv_stop - sl.kv_start) for sl in packed_slices(case, self.seq_local)]
        return sum(self._call_cost(cluster, rows, backward) + self._keys_cost(cluster, keys, backward)
                   for rows, keys in subs)

    def block_times(self, cluster: Cluster, backward: bool, ranks: int) -> np.ndarray:
        """Seconds of every block (Q chunk of rank i, KV chunk of rank j) on ``ranks`` CP ranks: [ranks, ranks].

        Unpacked, each entry is :meth:`block_time` of its case. Packed, the kernel is charged the
        block's real work (:meth:`Packing.block_work`) at the throughput of its case's row count
        (a varlen call spreads all documents' rows over the GPU at once); the call overhead and the
        correction passes are those of the runtime's varlen calls (:meth:`packed_call_costs`): 2-3 per
        block, whatever the number of documents. Unpadded documents: the block's own calls
        (:func:`~megatron_mesh_cp.planning.documents.block_times`), 0 for an empty block. Read-only, cached.
        """
        return _block_times(self, cluster, backward, ranks)

    def block_calls(self, ranks: int) -> np.ndarray:
        """Kernel calls the executor makes for every block on ``ranks`` CP ranks: one, or (packed) one
        per sub-block of its case (:func:`~megatron_mesh_cp.runtime.packed.packed_slices`), or (documents,
        window) one per call the mask makes, 0 for an empty block. [ranks, ranks]."""
        if self.pruned:
            calls = self.mask_calls(ranks)
            out = np.zeros((ranks, ranks))
            np.add.at(out, (calls.i, calls.j), 1.0)
            return out
        if self.packing is None or not self.causal:
            return np.ones((ranks, ranks))
        i, j = np.indices((ranks, ranks))
        return np.where(i == j, 3.0, 2.0)

    def mean_block_time(self, cluster: Cluster, backward: bool, ranks: int) -> float:
        """What the greedy planner charges per block: unpacked, the time of a below-diagonal block
        (zigzag blocks are all nearly equal work); packed, the same case's mean over the packed blocks
        (their work varies only by padding), so one unpadded document plans exactly as unpacked."""
        if self.packing is None:
            return self.block_time(cluster, BlockCase.LOWER if self.causal else BlockCase.FULL, backward)
        t = self.block_times(cluster, backward, ranks)
        if ranks == 1:
            return float(t[0, 0])
        return float(t[np.tril_indices(ranks, -1)].mean() if self.causal else t.mean())

    def check_packing(self, ranks: int) -> None:
        """ValueError unless the packing fills exactly the ``ranks`` chunks of ``seq_local`` tokens."""
        if self.packing is not None and self.packing.total != self.seq_local * ranks:
            raise ValueError(
                f"the packed documents span {self.packing.total} tokens but {ranks} CP ranks of {self.seq_local} "
                f"tokens hold {self.seq_local * ranks}; pack the documents into the global sequence length"
            )


def masked_block_times(w, cluster, backward: bool, ranks: int) -> np.ndarray:
    """Seconds of every block on ``ranks`` mesh chunks for a workload with a pruned mask (documents,
    chunks, a window): the sum over the block's calls of the kernel (its work at the throughput of its
    rows) and the call's fixed costs (:meth:`Workload._call_cost` over its rows, :meth:`Workload._keys_cost`
    over its keys); 0 for an empty block."""
    return price_calls(w, cluster, backward, ranks, w.mask_calls(ranks))


@lru_cache(maxsize=64)
def _bound(mask, chunks: int, total: int, causal: bool):
    return mask.bind(chunks, total, causal)



@lru_cache(maxsize=64)
def _span_blocks(span: Span, chunks: int, causal: bool) -> SpanBlocks:
    return SpanBlocks(span, chunks, causal)


@lru_cache(maxsize=256)
def _needed(span: Span, a: int, b: int, causal: bool) -> FrozenSet[Tuple[int, int]]:
    return _span_blocks(span, a * b, causal).needed(MeshShape(a, b))


def _tile(mask) -> int:
    """The kernel tile the mask's documents are priced in (0: exact pairs)."""
    parts = getattr(mask, "parts", (mask,))
    return max((getattr(p, "tile", 0) for p in parts), default=0)


def mask_total(mask) -> Optional[int]:
    """The tokens a mask's documents span (None: the mask does not fix it)."""
    parts = getattr(mask, "parts", (mask,))
    for p in parts:
        if getattr(p, "cuts_documents", False):
            cu = getattr(p, "cu", None) or getattr(p, "cuts", None)
            if cu is not None:
                return cu[-1]
    return None


@lru_cache(maxsize=256)
def _block_times(w: Workload, cluster: Cluster, backward: bool, ranks: int) -> np.ndarray:
    if w.pruned:  # each block's own kernel calls; empty blocks 0
        out = masked_block_times(w, cluster, backward, ranks)
        out.setflags(write=False)
        return out
    i, j = np.indices((ranks, ranks))
    if not w.causal:
        cases = np.full((ranks, ranks), BlockCase.FULL, dtype=object)
    else:
        cases = np.where(i == j, BlockCase.DIAG, np.where(j < i, BlockCase.LOWER, BlockCase.UPPER))
    if w.packing is None:
        per_case = {case: w.block_time(cluster, case, backward) for case in BlockCase}
        out = np.vectorize(per_case.__getitem__, otypes=[float])(cases)
    else:
        w.check_packing(ranks)
        work = w.packing.block_work(ranks, w.causal)
        rows = np.vectorize(w.block_rows, otypes=[float])(cases)
        per_case = {case: w.packed_call_costs(cluster, case, backward) for case in BlockCase}
        fixed = np.vectorize(per_case.__getitem__, otypes=[float])(cases)
        out = cluster.attention_time(w.pair_flops(work, backward), rows, backward) + fixed
    out.setflags(write=False)
    return out


def cluster_presets() -> Dict[str, Path]:
    dirs = list(CLUSTER_DIRS)
    extra = os.environ.get("MESH_CP_CLUSTER_DIR")
    if extra:
        dirs.insert(0, Path(extra))
    found: Dict[str, Path] = {}
    for d in dirs:
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return found


def load_cluster(name_or_path) -> Cluster:
    """A preset by name (see :func:`cluster_presets`) or a YAML file by path."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    import yaml

    path = Path(str(name_or_path))
    presets = cluster_presets()
    if not path.suffix and str(name_or_path) in presets:
        path = presets[str(name_or_path)]
    if not path.is_file():
        raise ValueError(
            f"unknown cluster {name_or_path!r}; presets: {', '.join(sorted(presets)) or 'none found'} "
            "(or pass a path to a YAML file like megatron_mesh_cp/configs/clusters/h100-ib400.yaml)"
        )
    with open(path) as f:
        return Cluster.from_dict(yaml.safe_load(f))


_DTYPE_OF_BYTES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def workload_dims(w: Workload) -> ChunkDims:
    """The ChunkDims (dtypes included) whose payloads a workload's transfers carry."""
    return ChunkDims(
        w.batch, w.seq_local, w.heads, w.kv_heads, w.head_dim, _DTYPE_OF_BYTES[w.bytes_per_element],
        torch.float32, _DTYPE_OF_BYTES[w.partial_bytes], w.head_dim_v,
    )
