"""Cluster simulator: replay a plan for all n ranks and predict its timeline (the plan's 2nd interpreter).

Semantics (GPU-like, what the executor does on NCCL): every rank issues the plan's ops in order.
Block computes and partial folds run in order on one compute stream, each starting once its
chunks have arrived. A transfer runs on its ring's channel, one at a time per ring in plan order
(both directions of a ring are batches on the ring group's one NCCL communicator and stream, so
they serialize: DESIGN.md 6b; the row and column rings overlap); it starts when the payload is ready on the sender
(chunk arrived / partial folded) and the receiver has posted it (its own copy of the same op
started, as with grouped NCCL send/recv). A message occupies the sender's egress and the receiver's
ingress of its link type (NVLink inside a node, the NIC across nodes) for bytes / bandwidth, then
arrives after the link latency; two rings crossing the same NIC queue on it in plan order.

Hiding communication is not free (docs/calibration.md): a block kernel runs slower by the cluster's
``overlap_slowdown_*`` for every transfer in flight beside it, in proportion to their overlap, so
more concurrent channels cost more; every kernel call pays a call overhead and an fp32 correction
pass (:meth:`Workload.call_time`; a grouped compute that runs several blocks in one call pays them
once) beside its blocks' work (:meth:`Workload.block_times`, which prices a packed sequence's blocks
by their work inside documents: ``packing``; unpadded ``documents`` or a ``window``: each block's own
calls, and a rank waits only for the chunks of the blocks it runs). A ring hop uses its own link (on a PCIe node it
crosses each switch uplink once per direction, so rings do not contend on the host bridge; all-to-alls do, see
``baselines``).

The host issues the compute steps while the GPU runs them (launches are asynchronous): it spends
``cluster.host_per_call`` per kernel call, runs ahead of the GPU (it never waits for it: NCCL waits
are stream waits), and a step cannot end before the host has issued it -- back-to-back steps cost
max(host, GPU) each, so a host-bound plan shows as such (``PhaseResult.host_bound``).

All ranks advance together op by op (vectorised over ranks), so n = 256 replays in milliseconds.
Bytes come from :func:`megatron_mesh_cp.runtime.plan.payload`, the same function the executor allocates
its buffers from, so the simulator's bytes equal the executor's byte counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .cluster import Cluster, Workload, workload_dims
from ..runtime.layout import BlockCase, kernel_calls
from ..runtime.layouts import tile_chunks
from ..runtime.plan import (BACKWARD, FORWARD, ChunkDims, Compute, Free, Plan, Transfer, payload, slab_containing,
                            RING_OF)

__all__ = ["PhaseResult", "replay", "replay_costs", "ring_links"]

@dataclass
class PhaseResult:
    """One phase of one plan on every rank."""

    finish: np.ndarray  # per rank, seconds
    busy: np.ndarray  # per rank: compute-stream busy time (blocks + folds)
    sent: Dict[str, np.ndarray]  # link type -> bytes sent per rank
    sent_by_category: Dict[Tuple[str, str], int]  # (phase, category) -> bytes per rank (SPMD: equal)
    timeline: List[Tuple[str, float, float, str]] = field(default_factory=list)  # recorded rank
    arrivals: Dict[Tuple[str, int], float] = field(default_factory=dict)  # recorded rank: chunk -> time
    host: Optional[np.ndarray] = None  # per rank: host time issuing the kernel calls (host_per_call each)

    @property
    def time(self) -> float:
        return float(self.finish.max())

    @property
    def critical(self) -> int:
        return int(self.finish.argmax())

    @property
    def exposed(self) -> float:
        """Time the slowest rank's compute stream was idle (communication not hidden, or the host late)."""
        return self.time - float(self.busy[self.critical])

    @property
    def host_bound(self) -> bool:
        """Whether the slowest rank's host issued kernels longer than its GPU ran them."""
        return self.host is not None and float(self.host[self.critical]) > float(self.busy[self.critical])


#: block cases by code, for the vectorised case arrays below
_CASES = (BlockCase.FULL, BlockCase.DIAG, BlockCase.LOWER, BlockCase.UPPER)


@lru_cache(maxsize=65536)
def _calls_by_case(kvs: Tuple[int, ...], pattern: Tuple[int, ...], slabs) -> Tuple[int, ...]:
    """Case codes of the kernel calls a compute of ``kvs`` makes on ranks of one (cases..., split)
    pattern (replays of many plans and configurations meet the same patterns again)."""
    cases = {kv: _CASES[x] for kv, x in zip(kvs, pattern)}
    calls = kernel_calls(kvs, cases, partial(slab_containing, slabs), pattern[-1])
    return tuple(_CASES.index(k.case) for k in calls)


@lru_cache(maxsize=64)  # keyed by the mesh shape
def _tile_index(a: int, b: int):
    """([a, 1, n], [1, b, n]) index arrays: on every rank of the a x b mesh, the Q chunk at each Q offset and the KV
    chunk at each KV offset (runtime.layouts.tile_chunks, offset-major; a [rank, rank] array indexed by both gives
    [q offset, kv offset, rank])."""
    qi, kj = tile_chunks(a, b)
    return qi.T[:, None, :], kj.T[None, :, :]


def _block_durations(plan: Plan, w: Workload, cluster: Cluster, backward: bool):
    """Per compute op, its compute-stream seconds on every rank (Q rank i, KV ranks j of its blocks),
    and its kernel calls on every rank (what the host spends ``host_per_call`` on): two dicts.

    A single block: the block's time (equal per causal case unpacked, its real work when the
    workload is packed), which includes one kernel call's overhead and output correction.
    A grouped compute (unpacked; packed ones run block by block): its blocks' times less that
    per-block call cost, plus one call cost per kernel call the executor makes (:func:`~megatron_mesh_cp.runtime.layout.kernel_calls`: blocks
    in one KV slab and of one case share a call per run of consecutive KV offsets)."""
    a, b = plan.a, plan.b
    pos = np.arange(a * b)
    r, c = pos // a, pos % a
    t = w.block_times(cluster, backward, a * b)
    per_block = w.block_calls(a * b)
    call = np.array([w.call_time(cluster, k, backward) for k in _CASES])
    qi, kj = _tile_index(a, b)
    tt, pb = t[qi, kj], per_block[qi, kj]  # [q offset, kv offset, rank]: each rank's block of that tile cell
    out, calls = {}, {}
    for op in plan.computes:
        if len(op.kvs) == 1:  # one block is one call, in its own buffer or alone in a slab
            out[op], calls[op] = tt[op.q, op.kvs[0]], pb[op.q, op.kvs[0]]
            continue
        if w.packing is not None or w.pruned:  # masked: the executor runs it block by block
            out[op], calls[op] = sum(tt[op.q, kv] for kv in op.kvs), sum(pb[op.q, kv] for kv in op.kvs)
            continue
        i = r * a + (c - op.q) % a
        js = [((r - kv) % b) * a + c for kv in op.kvs]
        if w.causal:
            codes = np.stack([np.where(i == j, 1, np.where(j < i, 2, 3)) for j in js])
        else:
            codes = np.zeros((len(js), a * b), dtype=int)
        dur = sum(t[i, j] for j in js) - call[codes].sum(axis=0)
        # the ranks fall into a few (cases, row) patterns; count each pattern's calls once
        split = r if w.causal else np.zeros(a * b, dtype=int)  # runtime.layout.slab_piece
        patterns, which = np.unique(np.vstack([codes, split]), axis=1, return_inverse=True)
        made = [list(_calls_by_case(op.kvs, tuple(col), plan.slabs)) for col in patterns.T]
        cost = np.array([call[m].sum() for m in made])
        out[op] = dur + cost[np.asarray(which).reshape(-1)]
        calls[op] = np.array([float(len(m)) for m in made])[np.asarray(which).reshape(-1)]
    return out, calls


def ring_links(a: int, b: int, cluster: Cluster, stride: int = 1):
    """Per (ring, direction): every rank's neighbour, and whether its hop crosses nodes, with that
    hop's bandwidth, latency and overlap slowdown (arrays over the a x b ranks)."""
    pos = np.arange(a * b)
    r, c = pos // a, pos % a
    nxt = {
        ("row", 1): r * a + (c + 1) % a, ("row", -1): r * a + (c - 1) % a,
        ("col", 1): ((r + 1) % b) * a + c, ("col", -1): ((r - 1) % b) * a + c,
    }
    node = (pos * stride) // cluster.gpus_per_node
    inter = {k: node != node[v] for k, v in nxt.items()}
    bw = {k: np.where(v, cluster.inter_bw, cluster.intra_bw) for k, v in inter.items()}
    lat = {k: np.where(v, cluster.inter_lat, cluster.intra_lat) for k, v in inter.items()}
    slow = {k: np.where(v, cluster.overlap_slowdown_inter, cluster.overlap_slowdown_intra) for k, v in inter.items()}
    return nxt, inter, bw, lat, slow


def replay_costs(plan: Plan, cluster: Cluster, w: Workload, stride: int = 1) -> tuple:
    """What a replay of ``plan`` prices its ops with, independent of their order: :func:`ring_links`,
    the payload dims, every compute's seconds and kernel calls per rank, and (documents or a window)
    which blocks each rank runs -- it waits only for the chunks of those (none for an empty one): per
    compute, whether each rank waits for its Q chunk and for each of its KV chunks (computed once here
    for every re-ordering of one plan that shares these costs)."""
    n = plan.a * plan.b
    blocks, calls = _block_durations(plan, w, cluster, plan.phase == BACKWARD)
    runs = w.nonempty(n) if w.pruned else None
    waits = None
    if runs is not None:
        qi, kj = _tile_index(plan.a, plan.b)
        ran = runs[qi, kj]  # [q offset, kv offset, rank]: whether the rank runs that block
        every, some = ran.all(axis=2), ran.any(axis=2)
        cell = {}

        def of(q, kv):
            if (q, kv) not in cell:
                cell[(q, kv)] = True if every[q, kv] else False if not some[q, kv] else ran[q, kv]
            return cell[(q, kv)]

        waits = {}
        for op in plan.computes:
            kvs = tuple((kv, of(op.q, kv)) for kv in op.kvs)
            waits[op] = (kvs[0][1] if len(kvs) == 1 else _waits(np.any(ran[op.q, list(op.kvs)], axis=0)), kvs)
    return ring_links(plan.a, plan.b, cluster, stride) + (workload_dims(w), blocks, calls, waits)


def _still_to_run(plan: Plan, blocks, n: int, wire, backward: bool) -> Dict[int, np.ndarray]:
    """For replay's ``floor``: before each compute and each reduction transfer (op index), the seconds its
    compute stream surely still spends -- per rank, the blocks of this and every later compute; for every
    rank, every fold of an arrived partial from then on (each transfer forwarding a partial first folds those
    that arrived into it; the owner folds its own at the end) -- each of which starts no earlier than now."""
    folds, arrived = [0.0] * len(plan.ops), {}
    for k, op in enumerate(plan.ops):
        if isinstance(op, Transfer) and op.kind not in ("q", "kv"):
            folds[k] = arrived.pop((op.kind, op.src), 0) * wire(op.kind)[2]
            key = (op.kind, plan.dst(op))
            arrived[key] = arrived.get(key, 0) + 1
    later = sum(arrived.get((kind, 0), 0) * wire(kind)[2] for kind in (("dq", "dkv") if backward else ("o",)))
    comps = [k for k, op in enumerate(plan.ops) if isinstance(op, Compute)]
    runs = np.zeros((len(comps) + 1, n))  # row j: the blocks of computes j, j + 1, ... (in plan order)
    if comps:
        runs[:-1] = np.cumsum(np.array([per_rank(blocks[plan.ops[k]], n) for k in comps])[::-1], axis=0)[::-1]
    out, j = {}, len(comps)
    for k in range(len(plan.ops) - 1, -1, -1):
        later += folds[k]
        if j and comps[j - 1] == k:
            j -= 1
            out[k] = (runs[j], later)
        elif folds[k]:
            out[k] = (runs[j], later)
    return out


def per_rank(x, n: int) -> np.ndarray:
    """``x`` (a compute's seconds: per rank, or one for all) as an array over the ``n`` ranks (as it is, where it
    is one already: np.broadcast_to costs tens of microseconds a call)."""
    return x if isinstance(x, np.ndarray) and x.shape == (n,) else np.broadcast_to(x, (n,))


def _waits(ran: np.ndarray):
    """Which ranks wait for a chunk: True (all), False (none) or the boolean array."""
    return True if ran.all() else False if not ran.any() else ran


def replay(
    plan: Plan,
    cluster: Cluster,
    w: Workload,
    *,
    stride: int = 1,
    record: Optional[int] = 0,
    costs: Optional[tuple] = None,
    bound: Optional[float] = None,
    floor: Optional[float] = None,
) -> PhaseResult:
    """Replay ``plan`` on all ranks of its mesh; CP position p sits on GPU ``p * stride``. ``costs``:
    :func:`replay_costs` of a plan with the same ops (scoring re-orderings of one plan computes them once).
    ``bound``: stop once a rank's compute stream passes it (the phase cannot end sooner); the result's
    ``finish`` is then infinite (a candidate that cannot beat the best so far costs less to score).
    ``floor``: stop, likewise, once a rank's compute stream plus the seconds of the computes still to
    run on it is past ``floor`` (by more than rounding): then the phase surely ends after ``floor``,
    and it is never stopped where it would end at or before it."""
    n = plan.a * plan.b
    nxt, inter, bw, lat, slow, dims, blocks, calls, waits = costs or replay_costs(plan, cluster, w, stride)
    backward = plan.phase == BACKWARD

    compute_free = np.zeros(n)
    host_free = np.zeros(n)  # when the host has issued everything so far (it runs ahead of the GPU)
    busy = np.zeros(n)
    chan_free = {"row": np.zeros(n), "col": np.zeros(n)}
    egress = {False: np.zeros(n), True: np.zeros(n)}
    ingress = {False: np.zeros(n), True: np.zeros(n)}
    arrival: Dict[Tuple[str, int], np.ndarray] = {("q", 0): np.zeros(n), ("kv", 0): np.zeros(n)}
    incoming: Dict[Tuple[str, int], List[np.ndarray]] = {}
    timeline: List[Tuple[str, float, float, str]] = []
    arrivals: Dict[Tuple[str, int], float] = {("q", 0): 0.0, ("kv", 0): 0.0}
    rec = record is not None and 0 <= record < n
    in_flight: Dict[Tuple[str, int], List[Tuple[np.ndarray, np.ndarray]]] = {k: [] for k in nxt}
    last_compute = (np.zeros(n), np.zeros(n))
    host_per_call = cluster.host_per_call
    zero = np.zeros(n)
    sends: Dict[Tuple[Tuple[str, int], str], int] = {}  # (ring key, kind) -> transfers issued (bytes summed after)

    wires: Dict[str, tuple] = {}

    def wire(kind: str):
        """(payload specs, bytes, fold seconds) of one transfer of ``kind`` (looked up once per kind)."""
        if kind not in wires:
            specs = payload(plan.phase, kind, dims)
            nbytes = sum(x.nbytes for x in specs)
            wires[kind] = (specs, nbytes, cluster.elementwise_time(3 * nbytes))
        return wires[kind]

    links: Dict[Tuple[str, int], tuple] = {}

    def link(key):
        """A ring direction's per-rank arrays that every transfer on it reads (built once per replay)."""
        if key not in links:
            to, x = nxt[key], inter[key]
            back = np.empty(n, dtype=np.intp)
            back[to] = np.arange(n)  # arr[to] = v is v[back]
            links[key] = (to, x, x.any(), (~x).any(), to[x], to[~x], ~x, back)
        return links[key]

    def fold(kind: str, off: int) -> None:
        nonlocal compute_free
        dur = wire(kind)[2]
        for arr in incoming.pop((kind, off), []):
            start = np.maximum(compute_free, arr)
            compute_free = start + dur
            busy[:] += dur
            if rec:
                timeline.append(("compute", float(start[record]), float(compute_free[record]), f"fold {kind}[{off}]"))

    def result(finish):
        sent = {"intra": np.zeros(n), "inter": np.zeros(n)}
        by_cat: Dict[Tuple[str, str], int] = {}
        per_key: Dict[Tuple[str, int], int] = {}  # bytes per ring direction (whole numbers: exact in any order)
        for (key, kind), count in sends.items():
            specs, nbytes, _ = wire(kind)
            for s in specs:
                by_cat[(plan.phase, s.category)] = by_cat.get((plan.phase, s.category), 0) + count * s.nbytes
            per_key[key] = per_key.get(key, 0) + count * nbytes
        for key, nbytes in per_key.items():
            sent["inter"] += np.where(inter[key], nbytes, 0)
            sent["intra"] += np.where(inter[key], 0, nbytes)
        return PhaseResult(finish, busy, sent, by_cat, timeline, arrivals, host_free)

    todo = _still_to_run(plan, blocks, n, wire, backward) if floor is not None else None
    limit = None if floor is None else floor * (1.0 + 1e-9)  # sums in another order: far more than their rounding
    last = plan.ops[-1] if plan.ops else None
    for k, op in enumerate(plan.ops):
        # the compute stream never goes back, so it is past the bound before some op iff before the last:
        # looked at before each compute (to stop early) and the last op (the same stop as before every op)
        if bound is not None and (op is last or isinstance(op, Compute)) and compute_free.max() > bound:
            return result(np.full(n, np.inf))
        if todo is not None and k in todo and (compute_free + todo[k][0]).max() + todo[k][1] > limit:
            return result(np.full(n, np.inf))
        if isinstance(op, Compute):
            if waits is None:
                start = np.maximum(compute_free, arrival[("q", op.q)])
                for kv in op.kvs:
                    start = np.maximum(start, arrival[("kv", kv)])
            else:  # a rank waits only for the chunks of the blocks it runs (an arrival is never negative)
                wq, wkv = waits[op]
                start = (np.maximum(compute_free, arrival[("q", op.q)]) if wq is True else compute_free if wq is False
                         else np.maximum(compute_free, np.where(wq, arrival[("q", op.q)], 0.0)))
                for kv, x in wkv:
                    if x is True:
                        start = np.maximum(start, arrival[("kv", kv)])
                    elif x is not False:
                        start = np.maximum(start, np.where(x, arrival[("kv", kv)], 0.0))
            end = start + blocks[op]
            stretch = zero
            for key, spans in in_flight.items():
                if not spans:
                    continue
                for t0, t1 in spans:
                    stretch = stretch + slow[key] * np.maximum(np.minimum(t1, end) - np.maximum(t0, start), 0.0)
                in_flight[key] = [(t0, t1) for t0, t1 in spans if (t1 > end).any()]
            host_free = host_free + host_per_call * calls[op]
            compute_free = np.maximum(end + stretch, host_free)  # not before the host issued it
            busy += end + stretch - start  # the GPU's work; waiting for the host is not
            last_compute = (start, compute_free)
            if rec:
                timeline.append(("compute", float(start[record]), float(compute_free[record]), f"blk {op.q},{'+'.join(map(str, op.kvs))}"))
        elif isinstance(op, Free):  # the executor's Free waits for the chunk on the compute stream (a
            # no-op unless no block on this rank read it, as under a pruned plan)
            compute_free = np.maximum(compute_free, arrival[(op.kind, op.offset)])
        elif isinstance(op, Transfer):
            key = (op.ring, op.direction)
            dst = plan.dst(op)
            gather = op.kind in ("q", "kv")
            if gather:
                ready = arrival[(op.kind, op.src)]
            else:
                fold(op.kind, op.src)
                ready = compute_free
            _, nbytes, _ = wire(op.kind)
            sends[(key, op.kind)] = sends.get((key, op.kind), 0) + 1
            to, x, some, other, to_x, to_o, not_x, back = link(key)
            ustart = np.maximum(chan_free[op.ring], ready)
            eg = np.where(x, egress[True], egress[False])
            ing = np.where(x, ingress[True][to], ingress[False][to])
            start = np.maximum(np.maximum(ustart, ustart[to]), np.maximum(eg, ing))
            fin = start + nbytes / bw[key]
            if some:
                egress[True][x] = fin[x]
                ingress[True][to_x] = fin[x]
            if other:
                egress[False][not_x] = fin[not_x]
                ingress[False][to_o] = fin[not_x]
            # the kernel already running beside this transfer slows down for the overlap
            lag = slow[key] * np.maximum(np.minimum(fin, last_compute[1]) - np.maximum(start, last_compute[0]), 0.0)
            if lag.any():
                busy += lag
                compute_free = compute_free + lag
                last_compute = (last_compute[0], last_compute[1] + lag)
            in_flight[key].append((start, fin))
            arr = (fin + lat[key])[back]
            chan_free[op.ring] = np.maximum(fin, arr)
            if gather:
                arrival[(op.kind, dst)] = arr
                if rec:
                    arrivals[(op.kind, dst)] = float(arr[record])
            else:
                incoming.setdefault((op.kind, dst), []).append(arr)
            if rec:
                lane = f"{op.ring}{'+' if op.direction > 0 else '-'}"
                timeline.append((lane, float(start[record]), float(fin[record]), f"{op.kind}[{op.src}]"))
    for kind in ("o",) if not backward else ("dq", "dkv"):
        fold(kind, 0)
    finish = compute_free.copy()
    for v in chan_free.values():
        finish = np.maximum(finish, v)
    return result(finish)
