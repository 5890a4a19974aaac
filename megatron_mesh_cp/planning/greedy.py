"""The greedy planner (the paper's schedule): list-schedule one representative rank on a cost model.

Every rank runs the same plan, so the planner reasons about one rank whose neighbours behave like
itself. It keeps a clock per resource -- the compute stream, one channel per ring (both directions
of a ring share its NCCL communicator and stream, so they serialize: DESIGN.md 6b),
the rank's egress per link type (rings on the same link type share it) -- and repeatedly emits the
op that can start earliest:

* a transfer is chosen over a compute that could start at the same moment, so communication is
  always in flight; among transfers, a ready reduction goes first (it gates the step's tail), then
  the gather that *unlocks the most blocks per second of transfer time*;
* among blocks whose chunks are present, the one feeding the partial that must leave first wins;
  blocks of the rank's own partials (offset 0) are held back to fill the reduction tail, where
  nothing else is left to overlap the waits;
* at most ``max_inflight`` transfers per ring are outstanding, only ring neighbours talk, and live
  chunks (gathered chunks + partials) never exceed ``max_live``; chunks are freed once used and
  forwarded;
* with ``group`` (grouped calls), the foreign KV chunks are received into slabs of consecutive
  offsets (plan.py) and a chosen block takes along the other blocks of its Q chunk whose KV chunks
  are already in its slab: one Compute op, which the executor runs as one kernel call per run of
  keys (at most two per slab) instead of one per block. Nothing waits to make a group bigger:
  groups form when chunks arrive faster than blocks finish, which is when the per-call cost is on
  the critical path. Reductions are then ranked by when their fold can run (a partial passed over
  by a compute would wait a whole group), the longest chain first.

Which direction each gather and reduction chain runs (one way round, or split both ways), and
whether blocks are grouped, is a small enumeration around the greedy: each variant is planned and
replayed on the cluster by the simulator, and the fastest valid one is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..runtime.layout import BlockCase
from ..runtime.plan import (BACKWARD, FORWARD, REDUCE_KINDS, RING_OF, Compute, Free, Op, Plan, PlanError, Transfer,
                            feeding_blocks, partial_offset, payload, validate)
from .cluster import Cluster, Workload, workload_dims

__all__ = ["ChainConfig", "PlanCost", "greedy_plan", "grouping_pays", "CONFIGS", "GROUP_WIDTH", "GROUP_MIN_SHARE"]

INF = float("inf")


@dataclass(frozen=True)
class ChainConfig:
    """Directions of the gather and reduction chains, and the planner's limits."""

    split_gathers: bool = False  # gather half the offsets each way round the ring
    split_reductions: bool = False  # reduce half the partials each way round
    max_inflight: int = 2  # outstanding transfers per ring
    max_live: Optional[int] = None  # memory budget in live chunks
    group: int = 0  # > 1: foreign KV chunks in slabs of this many offsets, blocks grouped per slab

    def label(self) -> str:
        g = "split" if self.split_gathers else "one-way"
        r = "split" if self.split_reductions else "one-way"
        return f"gathers {g}, reductions {r}" + (f", grouped calls (slabs of {self.group})" if self.group > 1 else "")


#: Offsets per KV slab in the grouped variants. A slab is held whole from its first chunk to its
#: last, so narrower slabs keep memory nearer the ungrouped plans' (about two slabs live, not all
#: b - 1 chunks) at the price of more calls: replayed at 2x16 (128K GQA, n = 256, a2a+mesh 8x2x16),
#: forward + backward 6.93 ms with slabs of 8, 6.86 with one slab of 15, 7.08 with 4, 8.54 ungrouped.
GROUP_WIDTH = 8

#: Grouped variants are planned only where a kernel call's fixed cost (overhead, output correction)
#: is at least this share of a block's time: grouping saves at most that share of the compute, and
#: planning them doubles the planner's work (large blocks, e.g. 1M tokens on 256 ranks, skip them).
GROUP_MIN_SHARE = 0.1


def grouping_pays(w: Workload, cluster: Cluster, backward: bool) -> bool:
    """Whether the grouped variants are worth planning for this layer and phase (dense layers only:
    a varlen call cannot take a packed document's keys from several chunks)."""
    if w.packing is not None:
        return False
    case = BlockCase.LOWER if w.causal else BlockCase.FULL
    return w.call_time(cluster, case, backward) >= GROUP_MIN_SHARE * w.block_time(cluster, case, backward)


CONFIGS = tuple(ChainConfig(g, r, group=k) for k in (0, GROUP_WIDTH) for g in (False, True) for r in (False, True))


@dataclass(frozen=True)
class PlanCost:
    """What the planner needs to know about time, for one phase on one shape."""

    block: float  # seconds per block (zigzag blocks are all the same work; packed: their mean, see Workload)
    call: float  # of which every kernel call pays once (overhead, output correction)
    fold: Dict[str, float]  # elementwise fold of an arriving partial, per reduce kind
    transfer: Dict[str, float]  # bytes / bandwidth, per payload kind
    latency: Dict[str, float]  # per ring
    link: Dict[str, str]  # ring -> link type ("intra"/"inter"); equal types share egress

    @classmethod
    def of(cls, a: int, b: int, phase: str, cluster: Cluster, w: Workload, stride: int = 1) -> "PlanCost":
        backward = phase == BACKWARD
        dims = workload_dims(w)
        n = a * b
        link = {
            "row": _ring_link(cluster, [[r * a + c for c in range(a)] for r in range(b)], stride),
            "col": _ring_link(cluster, [[r * a + c for r in range(b)] for c in range(a)], stride),
        }
        assert n == a * b
        transfer, fold = {}, {}
        for kind in ("q", "kv") + REDUCE_KINDS[phase]:
            nbytes = sum(s.nbytes for s in payload(phase, kind, dims))
            transfer[kind] = nbytes / cluster.bandwidth(link[RING_OF[kind]])
            if kind not in ("q", "kv"):
                fold[kind] = cluster.elementwise_time(3 * nbytes)
        latency = {ring: cluster.latency(lt) for ring, lt in link.items()}
        case = BlockCase.LOWER if w.causal else BlockCase.FULL
        call = w.call_time(cluster, case, backward)
        block = max(w.mean_block_time(cluster, backward, n) * w.plan_scale, call)  # a masked layer's kept blocks
        return cls(block, call, fold, transfer, latency, link)


def _ring_link(cluster: Cluster, rings: List[List[int]], stride: int) -> str:
    for ring in rings:
        if len(ring) > 1 and len({cluster.node_of(p, stride) for p in ring}) > 1:
            return "inter"
    return "intra"


def _gather_chain(size: int, split: bool) -> Dict[int, List[Tuple[int, int]]]:
    """direction -> [(src, dst), ...] in chain order; together they deliver every offset once."""
    if size < 2:
        return {}
    plus = (size - 1 + 1) // 2 if split else size - 1
    chains = {1: [(o, o + 1) for o in range(plus)]}
    minus = [((size - o) % size, size - o - 1) for o in range(size - 1 - plus)]
    if minus:
        chains[-1] = minus
    return chains


def _reduce_chain(size: int, split: bool) -> Dict[int, List[int]]:
    """direction -> offsets in the order their partials are sent (each after its inbound)."""
    if size < 2:
        return {}
    k = (size + 1) // 2 if split else 1
    chains = {1: list(range(k, size))}
    if k > 1:
        chains[-1] = list(range(k - 1, 0, -1))
    return chains


class _Greedy:
    def __init__(self, a: int, b: int, phase: str, cost: PlanCost, cfg: ChainConfig) -> None:
        self.a, self.b, self.phase, self.cost, self.cfg = a, b, phase, cost, cfg
        self.size = {"q": a, "kv": b, "o": a, "dq": a, "dkv": b}
        self.reduce_kinds = REDUCE_KINDS[phase]
        self.ops: List[Op] = []
        self.t_comp = 0.0
        self.chan: Dict[str, float] = {}
        self.egress: Dict[str, float] = {}
        self.active: Dict[str, List[float]] = {"row": [], "col": []}  # finish times of transfers
        self.arr: Dict[Tuple[str, int], float] = {("q", 0): 0.0, ("kv", 0): 0.0}
        self.inbound: Dict[Tuple[str, int], List[float]] = {}
        self.gathers = {k: _gather_chain(self.size[k], cfg.split_gathers) for k in ("q", "kv")}
        self.reductions = {k: _reduce_chain(self.size[k], cfg.split_reductions) for k in self.reduce_kinds}
        self.g_next = {(k, d): 0 for k in self.gathers for d in self.gathers[k]}
        self.r_next = {(k, d): 0 for k in self.reductions for d in self.reductions[k]}
        # position of each partial in its chain: lower = must leave sooner; own offset last
        self.rank_of: Dict[str, Dict[int, int]] = {}
        for k, chains in self.reductions.items():
            pos = {0: 10**9}
            for d, offs in chains.items():
                for i, o in enumerate(offs):
                    pos[o] = i
            self.rank_of[k] = pos
        self.todo = {(i, j) for i in range(a) for j in range(b)}
        self.ready = {(0, 0)}  # blocks to do whose Q and KV chunks both have a (planned) arrival
        # per block, the partials it feeds and its static rank (which must leave first, then i, j)
        self.partials = {(i, j): tuple((k, partial_offset(k, i, j)) for k in self.reduce_kinds) for i, j in self.todo}
        self.ranking = {blk: tuple(sorted(self.rank_of[k][off] for k, off in self.partials[blk])) + blk
                        for blk in self.todo}
        self.remaining = {("q", i): b for i in range(a)}
        self.remaining.update({("kv", j): a for j in range(b)})
        self.forwards = {(k, src) for k, chains in self.gathers.items() for ch in chains.values() for src, _ in ch}
        self.freed = set()
        self.started_partials = set()
        self.live = 2
        width = min(cfg.group, b - 1)
        self.slabs = tuple((lo, min(lo + width - 1, b - 1)) for lo in range(1, b, width)) if width > 1 else ()
        self.slab_at = {o: sl for sl in self.slabs for o in range(sl[0], sl[1] + 1)}
        self.slab_received = {sl: 0 for sl in self.slabs}
        self.slab_freed = {sl: 0 for sl in self.slabs}

    # --- helpers ----------------------------------------------------------------------------
    def _partials_of(self, i: int, j: int) -> Tuple[Tuple[str, int], ...]:
        return self.partials[(i, j)]

    def _priority(self, i: int, j: int) -> Tuple:
        if self.cfg.max_live is not None:
            # under a memory budget, finish chunks first so they can be freed
            left = min(self.remaining[("q", i)] if i else 10**9, self.remaining[("kv", j)] if j else 10**9)
            return (left,) + self.ranking[(i, j)]
        return self.ranking[(i, j)]

    def _slot(self, ring: str, t: float) -> float:
        """Earliest time >= t at which the ring has fewer than max_inflight transfers outstanding."""
        busy = sorted(f for f in self.active[ring] if f > t)
        over = len(busy) - self.cfg.max_inflight + 1
        return t if over <= 0 else busy[over - 1]

    def _room(self, extra: int) -> bool:
        return self.cfg.max_live is None or self.live + extra <= self.cfg.max_live

    def _slab(self, kind: str, off: int):
        return self.slab_at.get(off) if kind == "kv" else None

    def _arrival_cost(self, kind: str, dst: int) -> int:
        """Live chunks a gather into ``dst`` adds: one, or the whole slab with its first chunk."""
        slab = self._slab(kind, dst)
        if slab is None:
            return 1
        return slab[1] - slab[0] + 1 if self.slab_received[slab] == 0 else 0

    def _group(self, i: int, j: int, start: float) -> List[int]:
        """KV offsets of the compute that runs block (i, j) at ``start``: with grouping, the other
        blocks of Q chunk i whose KV chunk sits in the slab by then, in priority order, within the
        memory budget -- but at most one block per reduction chain that *closes* a dK/dV partial
        (is the last block it waits for). A dK/dV partial leaves after the one before it in its
        chain arrived and was folded, and folds run between computes: a group closing g partials
        lets the chain advance one hop where it needs g, and the hops it falls behind come back
        exposed at the end of the backward (replayed, 2x16 at 128K GQA: backward 5.04 ms with one
        closing block per chain and group, 5.15 ms with any number)."""
        kvs = [j]
        slab = self._slab("kv", j)
        if slab is None:
            return kvs
        starting = {p for p in self._partials_of(i, j) if p not in self.started_partials}
        closing = self._closes(i, j)
        cands = [o for (q, o) in self.ready if q == i and o != j and self._slab("kv", o) == slab]
        for o in sorted(cands, key=lambda o: self._priority(i, o)):
            if self.arr.get(("kv", o), INF) > start:
                continue
            closes = self._closes(i, o)
            if closes & closing:
                continue
            new = {p for p in self._partials_of(i, o) if p not in self.started_partials} - starting
            if not self._room(len(starting) + len(new)):
                continue
            starting |= new
            closing |= closes
            kvs.append(o)
        return kvs

    def _closes(self, i: int, o: int) -> set:
        """The reduction chain (direction) whose dK/dV partial block (i, o) closes -- as the last
        block that partial waits for -- or the empty set."""
        if "dkv" not in self.reduce_kinds or o == 0 or self.remaining[("kv", o)] != 1:
            return set()
        return {d for d, offs in self.reductions["dkv"].items() if o in offs}

    def _compute_time(self, kvs: List[int]) -> float:
        """A compute's time on the representative rank: the blocks' work plus a call cost per kernel
        call, one per case group of a grouped compute (below and above the rank's Q chunks: two at
        most, for consecutive offsets)."""
        calls = 1 if len(kvs) == 1 else 2
        return len(kvs) * (self.cost.block - self.cost.call) + calls * self.cost.call

    # --- candidates -------------------------------------------------------------------------
    def _transfer_start(self, kind: str, d: int, ready: float) -> float:
        ring = RING_OF[kind]
        t = max(ready, self.chan.get(ring, 0.0), self.egress.get(self.cost.link[ring], 0.0))
        return self._slot(ring, t)

    def _candidates(self):
        out = []  # (start, class, tie, payload)
        for (k, d), idx in self.g_next.items():
            chain = self.gathers[k][d]
            if idx >= len(chain):
                continue
            src, dst = chain[idx]
            if (k, src) not in self.arr or not self._room(self._arrival_cost(k, dst)):
                continue
            start = self._transfer_start(k, d, self.arr[(k, src)])
            other = "kv" if k == "q" else "q"
            unlocked = sum(1 for o in range(self.size[other]) if (other, o) in self.arr)
            score = unlocked / max(self.cost.transfer[k], 1e-12)
            out.append((start, 1, (-score, k, d), ("gather", k, d, src)))
        for (k, d), idx in self.r_next.items():
            chain = self.reductions[k][d]
            if idx >= len(chain):
                continue
            off = chain[idx]
            if any(blk in self.todo for blk in feeding_blocks(k, off, self.a, self.b)):
                continue
            # the inbound partial of this offset (if its chain has one) must have been sent
            up = off - d
            if up % self.size[k] != 0 and up in chain and (k, off) not in self.inbound:
                continue
            # decided as soon as the fold can start on the compute stream; the wire waits for it
            ready = max([self.t_comp] + self.inbound.get((k, off), []))
            start = self._transfer_start(k, d, ready)
            # grouped: ranked by when its fold can run, so it is not passed over by a compute that
            # starts before the ring is free (a grouped compute is long: a partial passed over waits
            # a whole group), and between chains ready together the longer one first (the critical
            # path); ungrouped plans keep the per-block rule Ring and USP are calibrated on
            if self.slabs:
                out.append((ready, 0, (idx - len(chain), k, d), ("reduce", k, d, off)))
            else:
                out.append((start, 0, (k, d), ("reduce", k, d, off)))
        # computes all rank (start, 2, priority), priorities unique: only the first of them can win
        best, budget, arr = None, self.cfg.max_live is not None, self.arr
        for i, j in self.ready:
            aq, ak = arr[("q", i)], arr[("kv", j)]
            if budget and not self._room(sum(1 for p in self.partials[(i, j)] if p not in self.started_partials)):
                continue
            key = (max(self.t_comp, aq, ak), self._priority(i, j))
            if best is None or key < best[0]:
                best = (key, i, j)
        if best is not None:
            out.append((best[0][0], 2, best[0][1], ("compute", best[1], best[2])))
        return out

    # --- emit -------------------------------------------------------------------------------
    def _emit_transfer(self, kind: str, d: int, src: int, start: float) -> float:
        ring = RING_OF[kind]
        fin = start + self.cost.transfer[kind]
        self.egress[self.cost.link[ring]] = fin
        self.chan[ring] = fin + self.cost.latency[ring]
        self.active[ring].append(fin)
        self.ops.append(Transfer(kind, d, src))
        return fin + self.cost.latency[ring]

    def _maybe_free(self, kind: str, off: int) -> None:
        if off == 0 or (kind, off) in self.freed or self.remaining[(kind, off)] > 0:
            return
        if (kind, off) in self.forwards:
            return
        self.freed.add((kind, off))
        slab = self._slab(kind, off)
        if slab is not None:  # the slab's bytes go with its last chunk
            self.slab_freed[slab] += 1
            if self.slab_freed[slab] == slab[1] - slab[0] + 1:
                self.live -= slab[1] - slab[0] + 1
        else:
            self.live -= 1
        self.ops.append(Free(kind, off))

    def run(self) -> Plan:
        while True:
            cands = self._candidates()
            if not cands:
                break
            start, _, _, what = min(cands, key=lambda c: (c[0], c[1], c[2]))
            if what[0] == "gather":
                _, k, d, src = what
                dst = self.gathers[k][d][self.g_next[(k, d)]][1]
                self.g_next[(k, d)] += 1
                self.live += self._arrival_cost(k, dst)
                if self._slab(k, dst) is not None:
                    self.slab_received[self._slab(k, dst)] += 1
                self.arr[(k, dst)] = self._emit_transfer(k, d, src, start)
                other = "kv" if k == "q" else "q"
                for o in range(self.size[other]):
                    blk = (dst, o) if k == "q" else (o, dst)
                    if (other, o) in self.arr and blk in self.todo:
                        self.ready.add(blk)
                self.forwards.discard((k, src))
                self._maybe_free(k, src)
            elif what[0] == "reduce":
                _, k, d, off = what
                inbound = self.inbound.pop((k, off), [])
                t = self.t_comp
                for arrival in inbound:
                    t = max(t, arrival) + self.cost.fold[k]
                self.t_comp = t
                self.r_next[(k, d)] += 1
                dst = (off + d) % self.size[k]
                arrival = self._emit_transfer(k, d, off, self._transfer_start(k, d, t))
                self.inbound.setdefault((k, dst), []).append(arrival)
                self.live += 1 - 1 - len(inbound)
            else:
                _, i, j = what
                kvs = self._group(i, j, start)
                for o in kvs:
                    self.todo.discard((i, o))
                    self.ready.discard((i, o))
                    for p in self._partials_of(i, o):
                        if p not in self.started_partials:
                            self.started_partials.add(p)
                            self.live += 1
                self.t_comp = start + self._compute_time(kvs)
                self.ops.append(Compute(i, tuple(kvs)))
                for o in kvs:
                    for key in (("q", i), ("kv", o)):
                        self.remaining[key] -= 1
                        self._maybe_free(*key)
        done = not self.todo and all(
            self.r_next[key] >= len(self.reductions[key[0]][key[1]]) for key in self.r_next
        ) and all(self.g_next[key] >= len(self.gathers[key[0]][key[1]]) for key in self.g_next)
        if not done:
            raise PlanError(
                f"no {self.phase} plan for {self.a}x{self.b} fits in {self.cfg.max_live} live chunks"
            )
        return Plan(self.phase, self.a, self.b, tuple(self.ops), name="greedy",
                    meta=(("config", self.cfg.label()),), slabs=self.slabs)


def greedy_plan(a: int, b: int, phase: str, cost: PlanCost, cfg: ChainConfig = ChainConfig()) -> Plan:
    """One greedy plan for fixed chain directions; validated before it is returned."""
    plan = _Greedy(a, b, phase, cost, cfg).run()
    validate(plan, max_live=cfg.max_live)
    return plan
