"""Costs shared by the simulated algorithms and the auto shape: one monolithic kernel call, a
collective on the cluster's links, a Ulysses group's all-to-all steps, and per-rank peak memory
(the executor's arena for a plan, TE Ring's buffers, the all-to-all's tensors).

Collectives use the usual bus-bandwidth rule: bytes each rank receives divided by the slowest link
the collective crosses (the NIC once the group spans nodes).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from typing import Optional

from ..runtime.memory import layout
from ..runtime.plan import BACKWARD, FORWARD
from ..runtime.ulysses import kv_repeats, ulysses_traffic
from .cluster import Cluster, Workload, workload_dims
from .documents import span_sequence_work
from .windows import sequence_pairs

__all__ = ["plan_peak_bytes", "te_ring_peak_bytes", "ulysses_buffer_bytes", "monolithic_time", "whole_sequence_pairs",
           "collective_time",
           "ulysses_a2a_steps", "ulysses_inner"]


def plan_peak_bytes(fwd, bwd, w: Workload) -> int:
    """Bytes the executor's pool holds for these plans: the larger phase's arena (memory.layout)."""
    dims = workload_dims(w)
    return max(layout(fwd, dims).nbytes, layout(bwd, dims).nbytes)


def te_ring_peak_bytes(w: Workload) -> int:
    """What TE's p2p Ring holds beyond q, k, v, out per rank (an estimate from its buffers): forward,
    double-buffered K/V and the fp32 output and lse accumulators; backward, double-buffered K/V and
    dK/dV, the fp32 dQ accumulator and one block's dQ, dK, dV."""
    e, p = w.bytes_per_element, w.partial_bytes
    tok = w.batch * w.seq_local * w.head_dim
    kv = w.batch * w.seq_local * w.kv_heads * (w.head_dim + w.dv)  # K and V (MLA: V's head dim)
    fwd = 2 * kv * e + w.batch * w.seq_local * w.dv * w.heads * 4 + w.batch * w.seq_local * w.heads * 4
    bwd = 2 * kv * e + 2 * kv * p + tok * w.heads * 4 + (tok * w.heads + kv) * e
    return max(fwd, bwd)


def ulysses_buffer_bytes(u: int, w: Workload) -> int:
    """The all-to-all's own tensors held across the inner attention: q, k, v (replicas included), out."""
    if u <= 1:
        return 0
    iw = ulysses_inner(u, w)
    return w.bytes_per_element * iw.batch * iw.seq_local * (iw.head_dim + iw.dv) * (iw.heads + iw.kv_heads)


def monolithic_time(cluster: Cluster, w: Workload, rows: int, keys: int, heads: int, backward: bool,
                    pairs: Optional[float] = None) -> float:
    """One monolithic kernel call (no running correction: nothing to merge it with); ``pairs``: the
    (q, k) pairs it computes when not rows x keys (halved if causal), e.g. a packed sequence's."""
    if pairs is None:
        pairs = rows * keys * (0.5 if w.causal else 1.0)
    return cluster.attention_time(w.pair_flops(pairs, backward, heads), rows, backward) + cluster.block_overhead


def whole_sequence_pairs(w: Workload, ranks: int) -> Optional[float]:
    """Pairs of attention over the whole packed sequence of ``ranks`` chunks in one call (each document's
    own triangle, cut by the window if any); None when the workload is neither packed nor windowed."""
    if w.pruned:  # documents, chunks, a window: each document's own triangle, cut by the window
        span = w.span(ranks)
        if span is None:  # re-laid documents: the same documents, so the same pairs
            lengths = np.bincount(np.asarray(w.arranged(ranks).docs), weights=np.diff(w.arranged(ranks).cuts))
            x = lengths[lengths > 0]
            return float((x * (x + 1) / 2).sum() if w.causal else (x * x).sum())
        return float(sequence_pairs(span, w.causal) if span.window is not None else span_sequence_work(span, w.causal))
    if w.packing is None:
        return None
    w.check_packing(ranks)
    return float(w.packing.sequence_work(w.causal))


def collective_time(cluster: Cluster, group: int, stride: int, recv_bytes: float, all_to_all: bool = False) -> float:
    """Time to move ``recv_bytes`` into each rank of a group of ``group`` ranks ``stride`` GPUs apart."""
    if group <= 1 or recv_bytes <= 0:
        return 0.0
    per_node = max(1, cluster.gpus_per_node // stride)
    if group <= per_node:
        t = recv_bytes / cluster.intra_bw
        if cluster.intra_shared_bw:  # PCIe: bytes from peers under other switches cross the host bridge
            switch = max(1, (cluster.p2p_group or cluster.gpus_per_node) // stride)
            off = max(0, group - switch) / (group - 1)
            t = max(t, group * recv_bytes * off / cluster.intra_shared_bw)
        return cluster.intra_lat * (group - 1 if all_to_all else 1) + t
    if all_to_all:
        off = (group - per_node) / (group - 1)  # share of peers on other nodes
        return cluster.inter_lat + max(recv_bytes * off / cluster.inter_bw, recv_bytes * (1 - off) / cluster.intra_bw)
    return cluster.inter_lat * 2 + recv_bytes / cluster.inter_bw


def ulysses_a2a_steps(u: int, cluster: Cluster, w: Workload, stride: int):
    """The all-to-all steps of a Ulysses group of u ranks; bytes from the runtime's own byte model
    (:func:`megatron_mesh_cp.runtime.ulysses.ulysses_traffic`, K/V heads replicated as the runtime does)."""
    dims = workload_dims(w)
    f, b = ulysses_traffic(u, dims, FORWARD), ulysses_traffic(u, dims, BACKWARD)
    kv_heads = w.kv_heads * kv_repeats(w.heads, w.kv_heads, u)
    per_node = max(1, cluster.gpus_per_node // stride)
    off = 0.0 if u <= per_node else (u - per_node) / (u - 1)

    def step(phase: str, nbytes: float):
        return (phase, "all-to-all", collective_time(cluster, u, stride, nbytes, all_to_all=True), nbytes, nbytes * off)

    if u == 1:
        return [], [], [], [], kv_heads
    before = [step(FORWARD, f[(FORWARD, "a2a-Q")] + f[(FORWARD, "a2a-KV")])]
    after_fwd = [step(FORWARD, f[(FORWARD, "a2a-O")])]
    before_bwd = [step(BACKWARD, b[(BACKWARD, "a2a-dO")])]
    after_bwd = [step(BACKWARD, b[(BACKWARD, "a2a-dQ")] + b[(BACKWARD, "a2a-dKV")])]
    return before, after_fwd, before_bwd, after_bwd, kv_heads


def ulysses_inner(u: int, w: Workload) -> Workload:
    """What each rank of a Ulysses group of u ranks holds after the all-to-all: u times the tokens,
    1/u of the heads (K/V heads replicated first until u divides them, as the runtime does)."""
    kv = w.kv_heads * kv_repeats(w.heads, w.kv_heads, u)
    return replace(w, seq_local=w.seq_local * u, heads=w.heads // u, kv_heads=kv // u)
