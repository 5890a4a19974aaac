"""The schedule as data (DESIGN.md section 5): one plan, run by the executor, replayed by the simulator.

A :class:`Plan` is the op sequence every rank of an a x b mesh runs (SPMD). Ops name chunks by
*ring offset*, so the same sequence means the right thing on every rank: Q offset ``o`` on the row
ring is the Q chunk of the rank ``o`` places behind (offset 0 = the rank's own chunk); KV offsets
likewise on the column ring. Three op types:

* :class:`Transfer` -- every rank sends payload ``kind`` at offset ``src`` to its ring neighbour in
  ``direction`` and receives the same kind from the opposite neighbour; what arrives is offset
  ``src + direction`` (mod ring size) from the receiver's point of view. Gathers (``q``, ``kv``)
  forward chunks; reductions (``o``, ``dq``, ``dkv``) send a rank's partial result, which the
  receiver folds into its own partial of that offset before sending it on.
* :class:`Compute` -- the tile blocks of one Q offset and one or more KV offsets. Several KV offsets
  make a *grouped* compute: the executor runs the blocks whose keys sit contiguously in memory as
  one kernel call (see *slabs* below and :func:`megatron_mesh_cp.layout.kernel_calls`).
* :class:`Free` -- drop a gathered chunk (the memory budget is counted in live chunks).

A plan may declare KV *slabs*: ranges ``(lo, hi)`` of foreign KV offsets whose chunks are received
into one buffer laid out piece-major (first zigzag pieces of offsets lo..hi ascending, then the
second pieces descending). Under the zigzag layout that puts the keys of every case group of a
grouped compute (the "lower" blocks' first pieces, the "upper" blocks' whole chunks) side by side,
so one kernel call covers them without copying anything. A slab is live, as a whole, from the first
chunk it receives to the ``Free`` of its last one.

Sends and receives pair up by construction (every rank runs the same transfer). :func:`validate`
checks the rest: each block once, inputs present when used, reductions reaching their owner once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "Transfer",
    "Compute",
    "Free",
    "Plan",
    "PlanError",
    "ChunkDims",
    "TensorSpec",
    "payload",
    "plan_traffic",
    "validate",
    "GATHER_KINDS",
    "REDUCE_KINDS",
    "RING_OF",
    "CATEGORIES",
]

FORWARD, BACKWARD = "forward", "backward"
GATHER_KINDS = ("q", "kv")
REDUCE_KINDS = {FORWARD: ("o",), BACKWARD: ("dq", "dkv")}
RING_OF = {"q": "row", "o": "row", "dq": "row", "kv": "col", "dkv": "col"}
#: Byte-counter categories (what the wire carries), in display order.
CATEGORIES = ("Q", "KV", "O", "dO", "dQ", "dKV")


class PlanError(ValueError):
    """A plan that breaks one of the rules in :func:`validate`."""


@dataclass(frozen=True)
class Transfer:
    kind: str
    direction: int
    src: int

    @property
    def ring(self) -> str:
        return RING_OF[self.kind]


@dataclass(frozen=True)
class Compute:
    """Blocks (q, kv) for every KV offset in ``kvs`` (an int is one block); in that order."""

    q: int
    kvs: Tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.kvs, int):
            object.__setattr__(self, "kvs", (self.kvs,))
        else:
            object.__setattr__(self, "kvs", tuple(self.kvs))

    @property
    def blocks(self) -> Tuple[Tuple[int, int], ...]:
        return tuple((self.q, kv) for kv in self.kvs)


@dataclass(frozen=True)
class Free:
    kind: str
    offset: int


Op = Union[Transfer, Compute, Free]


def slab_containing(slabs: Sequence[Tuple[int, int]], kv: int) -> Optional[Tuple[int, int]]:
    """The slab (lo, hi) of ``slabs`` holding KV offset ``kv``, or None."""
    for lo, hi in slabs:
        if lo <= kv <= hi:
            return (lo, hi)
    return None


@dataclass(frozen=True)
class Plan:
    """An SPMD op sequence for one phase (``forward`` or ``backward``) on an a x b mesh."""

    phase: str
    a: int
    b: int
    ops: Tuple[Op, ...]
    name: str = "plan"
    meta: Tuple[Tuple[str, object], ...] = field(default=(), compare=False)
    #: KV slabs: ranges (lo, hi) of foreign KV offsets received into one piece-major buffer
    slabs: Tuple[Tuple[int, int], ...] = ()
    #: the tile blocks (q, kv) the plan computes; None: all a x b (a pruned plan computes fewer)
    tile: Optional[FrozenSet[Tuple[int, int]]] = None

    @property
    def tile_blocks(self) -> FrozenSet[Tuple[int, int]]:
        """Every (q, kv) block the plan must compute: the whole tile unless pruned."""
        if self.tile is not None:
            return self.tile
        return frozenset((i, j) for i in range(self.a) for j in range(self.b))

    def slab_of(self, kv: int) -> Optional[Tuple[int, int]]:
        """The slab KV offset ``kv`` is received into, or None (its own chunk buffer)."""
        return slab_containing(self.slabs, kv)

    def ring_size(self, ring: str) -> int:
        return self.a if ring == "row" else self.b

    def dst(self, t: Transfer) -> int:
        return (t.src + t.direction) % self.ring_size(t.ring)

    @property
    def transfers(self) -> List[Transfer]:
        return [op for op in self.ops if isinstance(op, Transfer)]

    @property
    def computes(self) -> List[Compute]:
        return [op for op in self.ops if isinstance(op, Compute)]

    @property
    def blocks(self) -> List[Tuple[int, int]]:
        """Every (q, kv) block the plan computes, in op order."""
        return [blk for op in self.computes for blk in op.blocks]

    def describe(self) -> str:
        counts: Dict[str, int] = {}
        for t in self.transfers:
            counts[t.kind] = counts.get(t.kind, 0) + 1
        parts = ", ".join(f"{k}:{v}" for k, v in counts.items())
        grouped = f" in {len(self.computes)} computes" if len(self.computes) != len(self.blocks) else ""
        return (f"{self.name} {self.phase} {self.a}x{self.b}: {len(self.blocks)} blocks{grouped}, "
                f"transfers {parts or 'none'}")


# --- payloads: what one transfer puts on the wire --------------------------------------------


class ChunkDims(NamedTuple):
    """Sizes of one rank's local chunk (tensors are sequence-major: [seq, batch, heads, head_dim]);
    ``v_head_dim``: the head dim of V, O and their gradients where it differs from Q/K's (MLA)."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    acc_dtype: torch.dtype = torch.float32
    partial_dtype: Optional[torch.dtype] = None  # partials on the wire; None = acc_dtype
    v_head_dim: Optional[int] = None  # None: head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, acc_dtype: torch.dtype, partial_dtype=None,
           v: Optional[torch.Tensor] = None) -> "ChunkDims":
        """From sequence-major q ``[s, b, h, d]``, k ``[s, b, h_kv, d]`` (and v ``[s, b, h_kv, dv]``)."""
        s, b, h, d = q.shape
        dv = v.shape[3] if v is not None and v.shape[3] != d else None
        return cls(b, s, h, k.shape[2], d, q.dtype, acc_dtype, partial_dtype, dv)


class TensorSpec(NamedTuple):
    category: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (``torch.dtype.itemsize``: a table lookup, no tensor; it runs on every
    buffer-span lookup of the executor)."""
    return dtype.itemsize


def payload(phase: str, kind: str, dims: ChunkDims) -> List[TensorSpec]:
    """The tensors one transfer of ``kind`` sends (and receives), with their byte categories.

    The executor allocates receive buffers from this and the byte model sums it, so the two
    cannot drift apart. (A KV chunk goes on the wire as its two zigzag pieces, so each can land
    where the receiver keeps it -- apart, in a slab; the bytes are these.)
    """
    b, s, h, hk, d, dt, acc, part = dims[:8]
    part = part or acc
    q, o = (s, b, h, d), (s, b, h, dims.dv)  # O, dO: V's head dim
    k, v = (s, b, hk, d), (s, b, hk, dims.dv)
    rows = (s, b, h)
    if kind == "q":
        specs = [TensorSpec("Q", q, dt)]
        if phase == BACKWARD:  # dO, delta = rowsum(dO * O), lse: what the kernel backward needs
            specs += [TensorSpec("dO", o, dt), TensorSpec("dO", rows, acc), TensorSpec("dO", rows, acc)]
        return specs
    if kind == "kv":
        return [TensorSpec("KV", k, dt), TensorSpec("KV", v, dt)]
    if kind == "o":
        return [TensorSpec("O", o, part), TensorSpec("O", rows, acc)]  # lse stays fp32
    if kind == "dq":
        return [TensorSpec("dQ", q, part)]
    if kind == "dkv":
        return [TensorSpec("dKV", k, part), TensorSpec("dKV", v, part)]
    raise PlanError(f"unknown payload kind {kind!r}")


def plan_traffic(plan: Plan, dims: ChunkDims) -> Dict[Tuple[str, str], int]:
    """Bytes one rank sends (= receives) per (phase, category) when it runs ``plan``."""
    out: Dict[Tuple[str, str], int] = {}
    for t in plan.transfers:
        for spec in payload(plan.phase, t.kind, dims):
            key = (plan.phase, spec.category)
            out[key] = out.get(key, 0) + spec.nbytes
    return out


# --- validation ------------------------------------------------------------------------------


def validate(plan: Plan, max_live: Optional[int] = None) -> int:
    """Check every rule a plan must obey; return its peak number of live chunks.

    Rules: ops only use offsets inside their ring; every gathered chunk is received once, before
    it is used, sent or freed, and is never used after it is freed; each tile block is computed
    exactly once; a partial is sent only after every block feeding it was computed and the partial
    it waits for arrived; following the reductions, every rank's partial of every offset reaches
    the owner (offset 0) exactly once. Live chunks (gathered chunks held plus partials held) never
    exceed ``max_live`` when given; a slab counts as all its chunks from the first one it receives
    until its last one is freed. Slabs are disjoint ranges of foreign KV offsets; a compute names
    each of its KV offsets once. A pruned plan (``plan.tile`` set) computes exactly its tile blocks,
    gathers only what they use, and reduces only the partials some block of it feeds (and the
    offsets those partials pass through on their way to the owner).
    """
    if plan.phase not in (FORWARD, BACKWARD):
        raise PlanError(f"unknown phase {plan.phase!r}")
    a, b = plan.a, plan.b
    reduce_kinds = REDUCE_KINDS[plan.phase]
    present = {"q": {0}, "kv": {0}}
    freed = {"q": set(), "kv": set()}
    received = {"q": set(), "kv": set()}
    computed = set()
    sent = {k: set() for k in reduce_kinds}
    inbound = {k: {} for k in reduce_kinds}  # offset -> number of partials received there
    started = {k: set() for k in reduce_kinds}  # offsets whose own partial exists
    _check_slabs(plan)
    tile = plan.tile_blocks
    upstream = _upstreams(plan)
    slab_left = {sl: sl[1] - sl[0] + 1 for sl in plan.slabs}  # chunks of a slab not yet freed
    slab_live = set()
    live = 2  # own Q and KV chunks
    peak = live
    for idx, op in enumerate(plan.ops):
        where = f"op {idx} ({op})"
        if isinstance(op, Transfer):
            size = plan.ring_size(op.ring)
            if op.direction not in (1, -1):
                raise PlanError(f"{where}: direction must be +1 or -1")
            if size < 2:
                raise PlanError(f"{where}: transfer on a ring of size {size}")
            if not 0 <= op.src < size:
                raise PlanError(f"{where}: offset outside the ring")
            dst = plan.dst(op)
            if op.kind in GATHER_KINDS:
                _need(present, freed, op.kind, op.src, where)
                if dst == 0 or dst in received[op.kind]:
                    raise PlanError(f"{where}: offset {dst} of {op.kind} received twice")
                received[op.kind].add(dst)
                present[op.kind].add(dst)
                slab = plan.slab_of(dst) if op.kind == "kv" else None
                if slab is None:
                    live += 1
                elif slab not in slab_live:  # the slab's bytes are held from its first chunk on
                    slab_live.add(slab)
                    live += slab[1] - slab[0] + 1
            elif op.kind in reduce_kinds:
                if op.src == 0:
                    raise PlanError(f"{where}: a rank never sends the partial of its own chunk")
                if op.src in sent[op.kind]:
                    raise PlanError(f"{where}: partial {op.kind}[{op.src}] sent twice")
                missing = [blk for blk in feeding_blocks(op.kind, op.src, a, b) if blk in tile and blk not in computed]
                if missing:
                    raise PlanError(f"{where}: blocks {missing} not computed before the partial is sent")
                if (op.kind, op.src) in upstream and not inbound[op.kind].get(op.src):
                    raise PlanError(f"{where}: sent before the partial it forwards arrived")
                sent[op.kind].add(op.src)
                if op.src not in started[op.kind]:  # a pruned plan's relay: its own partial starts empty here
                    started[op.kind].add(op.src)
                    live += 1
                # the own partial leaves, the partial folded into it is gone, a new one arrives
                live += 1 - 1 - inbound[op.kind].get(op.src, 0)
                inbound[op.kind][dst] = inbound[op.kind].get(dst, 0) + 1
                if dst != 0 and inbound[op.kind][dst] > 1:
                    raise PlanError(f"{where}: two partials meet at offset {dst} (only the owner merges two)")
            else:
                raise PlanError(f"{where}: kind {op.kind!r} does not belong in a {plan.phase} plan")
        elif isinstance(op, Compute):
            if not op.kvs or len(set(op.kvs)) != len(op.kvs):
                raise PlanError(f"{where}: a compute names each KV offset once, and at least one")
            for q_off, kv_off in op.blocks:
                if not (0 <= q_off < a and 0 <= kv_off < b):
                    raise PlanError(f"{where}: block outside the {a}x{b} tile")
                if (q_off, kv_off) in computed:
                    raise PlanError(f"{where}: block computed twice")
                if (q_off, kv_off) not in tile:
                    raise PlanError(f"{where}: block ({q_off}, {kv_off}) is not in the plan's (pruned) tile")
                for kind, off in (("q", q_off), ("kv", kv_off)):
                    _need(present, freed, kind, off, where)
                for kind in reduce_kinds:
                    off = partial_offset(kind, q_off, kv_off)
                    if off in sent[kind]:
                        raise PlanError(f"{where}: block feeds partial {kind} already sent")
                    if off not in started[kind]:
                        started[kind].add(off)
                        live += 1
                computed.add((q_off, kv_off))
        elif isinstance(op, Free):
            if op.kind not in GATHER_KINDS or op.offset == 0:
                raise PlanError(f"{where}: only gathered foreign chunks can be freed")
            _need(present, freed, op.kind, op.offset, where)
            freed[op.kind].add(op.offset)
            slab = plan.slab_of(op.offset) if op.kind == "kv" else None
            if slab is None:
                live -= 1
            else:  # the slab's bytes go when its last chunk does
                slab_left[slab] -= 1
                if not slab_left[slab]:
                    live -= slab[1] - slab[0] + 1
        else:
            raise PlanError(f"{where}: unknown op type")
        peak = max(peak, live)
        if max_live is not None and live > max_live:
            raise PlanError(f"{where}: {live} live chunks exceed the budget of {max_live}")
    if computed != tile:
        missing = sorted(tile - computed)
        raise PlanError(f"blocks never computed: {missing[:8]}{'...' if len(missing) > 8 else ''}")
    if plan.tile is None:
        for kind in GATHER_KINDS:
            size = a if kind == "q" else b
            if len(present[kind]) != size:
                raise PlanError(f"{kind} chunks never gathered: {sorted(set(range(size)) - present[kind])}")
    for kind in reduce_kinds:
        fed = {partial_offset(kind, q, kv) for q, kv in tile} - {0}
        _check_reduction(plan, kind, sent[kind], fed)
    return peak


def _check_slabs(plan: Plan) -> None:
    seen = set()
    for slab in plan.slabs:
        if len(slab) != 2 or not 1 <= slab[0] <= slab[1] < plan.b:
            raise PlanError(f"slab {slab}: must be a range (lo, hi) of foreign KV offsets, 1 <= lo <= hi < {plan.b}")
        span = set(range(slab[0], slab[1] + 1))
        if span & seen:
            raise PlanError(f"slab {slab} overlaps another slab")
        seen |= span


def _need(present, freed, kind, off, where):
    if off not in present[kind]:
        raise PlanError(f"{where}: {kind}[{off}] used before it arrived")
    if off in freed[kind]:
        raise PlanError(f"{where}: {kind}[{off}] used after it was freed")


def partial_offset(kind: str, q: int, kv: int) -> int:
    """Offset of the partial of ``kind`` that block (q, kv) feeds (dK/dV by column, O/dQ by row)."""
    return kv if kind == "dkv" else q


def feeding_blocks(kind: str, offset: int, a: int, b: int) -> List[Tuple[int, int]]:
    """The tile blocks that feed the partial ``kind`` at ``offset`` of an a x b tile."""
    if kind == "dkv":
        return [(i, offset) for i in range(a)]
    return [(offset, j) for j in range(b)]


def _upstreams(plan: Plan) -> Dict[Tuple[str, int], int]:
    """(kind, offset) -> the offset whose partial flows into it (same direction chain); the first
    such transfer in plan order, for every offset some reduction reaches."""
    out: Dict[Tuple[str, int], int] = {}
    for t in plan.transfers:
        out.setdefault((t.kind, plan.dst(t)), t.src)
    return out


def _check_reduction(plan: Plan, kind: str, sent: Iterable[int], fed: Iterable[int]) -> None:
    """Every fed offset's partial must be sent once and flow, hop by hop, to offset 0; the offsets
    it passes through are sent too, and nothing else is (the whole ring unless the plan is pruned)."""
    size = plan.ring_size(RING_OF[kind])
    sent = set(sent)
    direction = {t.src: t.direction for t in plan.transfers if t.kind == kind}
    alive = set()
    for off in sorted(fed):
        if off not in direction:
            raise PlanError(f"partials {kind} never sent: {sorted(set(fed) - sent)}")
        # the chain from `off` must keep its direction until it reaches the owner
        cur, d = off, direction[off]
        alive.add(off)
        for _ in range(size):
            cur = (cur + d) % size
            if cur == 0:
                break
            if direction.get(cur) != d:
                raise PlanError(f"reduction {kind}: the partial from offset {off} turns at offset {cur}")
            alive.add(cur)
        else:  # pragma: no cover - impossible for a ring
            raise PlanError(f"reduction {kind}: the partial from offset {off} never reaches its owner")
    if sent != alive:
        raise PlanError(f"reduction {kind}: partials sent from offsets {sorted(sent - alive)} that nothing feeds")
