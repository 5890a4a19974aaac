"""The executor: runs one rank's share of a :class:`~megatron_mesh_cp.runtime.plan.Plan`.

It knows nothing about scheduling: it walks the plan's ops in order, starts each transfer
asynchronously, waits for a chunk only when an op reads it, computes blocks with a block kernel
and folds partial results in a fixed order (so two runs are bitwise identical). Partials are
accumulated in fp32 (fp64 for fp64 inputs).

Tensors are sequence-major (``[s, b, h, d]``, Megatron's layout), so every block's row or column
range is a contiguous view and no block copies its inputs. A KV chunk travels as its two zigzag
pieces where a KV slab (plan.py) keeps it on either side, so that each lands where the receiver
keeps it -- apart, in the slab, where the keys of a grouped compute's blocks lie side by side and
one kernel call covers them (layout.kernel_calls) -- and whole (k, v) otherwise. Receive buffers, accumulators and merge
scratch come from a :class:`BufferPool` that lives with the communicator and is reused by every
layer of the same shape; inside it, bytes are reused as the plan's liveness allows (memory.py, buffers.py),
and a tensor placed where a dead one was first waits for that one's send to finish (and, on GPU,
for the compute that read it). Nothing the executor hands back aliases the pool.

Masked blocks: with ``parts`` (a mask engine's ``rank_parts``, masks/: documents, windows, chunks
on the ordinary layout, or packed THD chunks in packed.py's half-major order) each block runs as
the rank's own list of kernel calls for it, none for an empty block; every block is its own call
(no grouping), and the plan says what moves.

Host work per call (scripts/bench_host.py counts it): what each op does on this rank is
worked out once per plan, rank and chunk length (steps.py); an accumulator's first unmasked call
is copied in rather than merged into a cleared one, block merges skip the NaN guard no unmasked
call needs, fresh gradient partials are cleared together, and views of pool tensors are kept.

Forward inputs per rank: local q, k, v. Backward inputs: local q, k, v, the final out, its lse
([s, b, h]), dout and ``delta = rowsum(dout * out)``; only those are kept between the passes,
never a gathered chunk (DESIGN.md section 4).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .buffers import BufferPool
from .comm import RingComm, VirtualHub
from .kernels import BlockKernel, lse_dtype
from .merge import merge_into, merge_sink
from .plan import FORWARD, ChunkDims, Compute, Free, Plan, Transfer, payload
from .steps import Call, Part, compute_calls, prepared
from .topology import MeshShape

__all__ = ["Executor", "delta_stand_in", "run_virtual"]


def delta_stand_in(dout: torch.Tensor, delta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A tensor ``x`` like ``dout`` with ``rowsum(dout * x) == delta`` (to rounding), written into
    ``out`` (``dout``'s shape and dtype) when given.

    Block-kernel backwards read ``out`` only through ``delta = rowsum(dout * out)``; sending the
    tiny ``delta`` instead of a foreign Q row's ``out`` saves one chunk per hop. ``x`` is parallel
    to ``dout`` and scaled by its largest element, so nothing under- or overflows (``u * u`` sums to
    at least 1); rows with ``dout == 0`` have ``delta == 0`` and get ``x = 0`` (their 0 / 0 is NaN,
    mapped to 0 at the end). Seven ops for fp32, eight for bf16 (every one a launch on a GPU).
    """
    acc = lse_dtype(dout.dtype)
    g = dout.to(acc)
    scale = torch.linalg.vector_norm(g, float("inf"), dim=-1, keepdim=True)  # max |dout| per row
    u = g / scale
    coef = ((delta.to(acc) / scale[..., 0]) / torch.linalg.vecdot(u, u)).unsqueeze(-1)
    if out is None:
        out = torch.empty_like(dout)
    return torch.mul(u, coef, out=out).nan_to_num_(nan=0.0)  # computed in `acc`, rounded once into out


def _recorded_event():
    event = torch.cuda.Event()
    event.record()
    return event


class _EventWait:
    """Makes the stream that waits on it wait for a recorded CUDA event."""

    def __init__(self, event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class Executor:
    """One rank running one plan; ``step`` each op in order (or ``run`` all), then ``finish``."""

    def __init__(
        self,
        plan: Plan,
        comm: RingComm,
        kernel: BlockKernel,
        *,
        causal: bool,
        scale: float,
        tensors: Dict[str, torch.Tensor],
        partial_dtype: Optional[torch.dtype] = None,
        buffers: Optional[BufferPool] = None,
        parts: Optional[Dict[Tuple[int, int], tuple]] = None,
        sink: Optional[torch.Tensor] = None,
        max_logit: bool = False,
    ) -> None:
        self.plan, self.comm, self.kernel = plan, comm, kernel
        self.sink = sink  # forward: [h] sink logits, merged into the final partial (merge.merge_sink)
        # forward: the largest scale * q.k of every head over the pairs this rank computed
        self.max_logit = torch.full((tensors["q"].shape[2],), float("-inf"), dtype=torch.float32,
                                    device=tensors["q"].device) if max_logit else None
        # masked: (q offset, kv offset) -> this rank's calls ((rows, cols, causal, varlen, window), ...)
        self.parts = parts
        self.causal, self.scale = causal, scale
        self.shape = MeshShape(plan.a, plan.b)
        self.position = comm.position
        self.t = tensors
        self.pool = buffers if buffers is not None else BufferPool()
        q, k = tensors["q"], tensors["k"]
        self.device = q.device
        self.acc_dtype = lse_dtype(q.dtype)
        self.dims = ChunkDims.of(q, k, self.acc_dtype, partial_dtype, tensors["v"])
        self.bufs = self.pool.arena(plan, self.dims, self.device)
        self._pending: Dict[tuple, list] = {}  # role -> handles of sends still reading its pool bytes
        self._deaths: Dict[tuple, object] = {}  # role -> CUDA event: the compute stream's last read of it
        self.seq = q.shape[0]
        fwd = plan.phase == FORWARD
        q_payload = [q] if fwd else [q, tensors["dout"], tensors["delta"], tensors["lse"]]
        self.chunks: Dict[str, Dict[int, List[torch.Tensor]]] = {
            "q": {0: q_payload},
            "kv": {0: None},  # KV as [k piece 0, k piece 1, v piece 0, v piece 1]; None: not made yet
        }
        self.kv_whole: Dict[int, List[torch.Tensor]] = {0: [k, tensors["v"]]}  # chunks outside slabs
        self.slab_left = {sl: sl[1] - sl[0] + 1 for sl in plan.slabs}  # chunks not yet freed
        self.arrivals: Dict[Tuple[str, int], object] = {}  # handle that delivered a gathered chunk
        self.acc: Dict[str, Dict[int, List[torch.Tensor]]] = {"o": {}, "dq": {}, "dkv": {}}
        self.incoming: Dict[str, Dict[int, list]] = {"o": {}, "dq": {}, "dkv": {}}
        self.sends: Dict[Tuple[str, int], list] = {}  # (kind, offset) -> [(handle, tensors)]
        self.stand_ins: Dict[int, torch.Tensor] = {0: tensors["out"]} if not fwd else {}
        self.kernel_lse: Dict[tuple, object] = {}
        self._specs: Dict[str, list] = {}  # per kind: payload(phase, kind, dims), made once
        self._fresh: set = set()  # (kind, offset) of accumulators taken from the pool, not yet written
        # every transfer's (and, unmasked, every compute's) work on this rank, made once per plan,
        # rank and chunk length (steps.py)
        self.exact = parts is None  # unmasked: every query row of a call sees a key
        self._steps = prepared(plan, self.position, causal, self.seq, masked=not self.exact)
        self.comm.phase = plan.phase

    def _payload(self, kind: str) -> list:
        specs = self._specs.get(kind)
        if specs is None:
            specs = self._specs[kind] = payload(self.plan.phase, kind, self.dims)
        return specs

    # --- public driving ----------------------------------------------------------------------
    def run(self):
        for op in self.plan.ops:
            self.step(op)
        return self.finish()

    def step(self, op) -> None:
        if isinstance(op, Compute):
            block = self._forward_call if self.plan.phase == FORWARD else self._backward_call
            calls = self._steps.calls[op] if self.exact else compute_calls(
                op, self.shape, self.position, self.causal, self.seq, self.plan.slab_of, self.parts)
            for call in calls:
                block(op.q, call)
        elif isinstance(op, Transfer):
            self._transfer(op)
        elif isinstance(op, Free):
            self._free(op.kind, op.offset)
        else:
            raise TypeError(f"unknown plan op {op!r}")

    def finish(self):
        """Fold the last partials into the rank's own chunk; wait for outstanding sends.

        Returns fresh tensors (never pool buffers): forward ``(out, lse [s, b, h])`` (the sink merged
        in, if any; plus the max logit ``[h]`` when asked), backward ``(dq, dk, dv)``.
        """
        dt = self.t["q"].dtype
        if self.plan.phase == FORWARD:
            out, lse = self._folded("o", 0)
            if self.sink is not None:
                merge_sink(out, lse, self.sink)
            result = (out.to(dt, copy=True), lse.clone())
            if self.max_logit is not None:
                result += (self.max_logit,)
        else:
            (dq,) = self._folded("dq", 0)
            dk, dv = self._folded("dkv", 0)
            result = (dq.to(dt, copy=True), dk.to(dt, copy=True), dv.to(dt, copy=True))
        for handles in self.sends.values():
            for h, _ in handles:
                h.wait()
        self.sends.clear()
        return result

    # --- buffers -----------------------------------------------------------------------------
    def _take(self, role: tuple, after: list = None) -> torch.Tensor:
        """The pool tensor of ``role``, safe to overwrite: sends still reading its bytes are waited
        for; with ``after`` (a transfer writes it, on GPU), the marks of the compute that read the
        bytes' previous tensors are appended for the transfer's stream to wait on. Only the roles
        whose bytes overlap (``bufs.overlapping``, fixed by the layout) are looked at."""
        near = self.bufs.overlapping(role)
        waited = False
        for r in near:
            for h in self._pending.pop(r, ()):
                h.wait()
                waited = True
        if waited and after is not None and self.device.type == "cuda":  # the writer waits for those waits
            self._deaths[role] = _recorded_event()
        if after is not None and self._deaths:
            # the newest mark per role: marks are recorded on the compute stream, so it covers older ones
            after.extend(_EventWait(self._deaths[r]) for r in near if r in self._deaths)
        return self.bufs.tensor(role)

    def _sending(self, tensor: torch.Tensor, role: tuple, handle) -> None:
        if tensor.data_ptr() == self.bufs.tensor(role).data_ptr():
            self._pending.setdefault(role, []).append(handle)

    def _died(self, roles) -> None:
        """On GPU, mark where the compute stream stopped reading these tensors (for later writers)."""
        if self.device.type != "cuda":
            return
        event = _recorded_event()
        for r in roles:
            self._deaths[r] = event

    # --- ops ---------------------------------------------------------------------------------
    def _chunk(self, kind: str, off: int) -> List[torch.Tensor]:
        """A gathered chunk, ready for the compute stream (repeat waits on a handle are free)."""
        handle = self.arrivals.get((kind, off))
        if handle is not None:
            handle.wait()
        return self.chunks[kind][off]

    def _transfer(self, op: Transfer) -> None:
        mv = self._steps.moves[op]
        kind, dst = op.kind, mv.dst
        after = ()
        if kind in ("q", "kv"):
            key = (kind, op.src)
            after = (self.arrivals[key],) if key in self.arrivals else ()  # forwarding waits for its arrival only
            if mv.whole:  # k and v, half the messages of the four pieces
                send = self.kv_whole[op.src]
            else:  # the chunk as it is kept (q), or as its pieces (kv: views made on first use)
                send = self.chunks[kind][op.src]
                if send is None:
                    send = self.chunks[kind][op.src] = _pieces(self.kv_whole[op.src])
        else:
            specs = self._payload(kind)
            folded = self._folded(kind, op.src)
            send = [t if t.dtype == s.dtype else t.to(s.dtype) for t, s in zip(folded, specs)]
            key = (kind, -op.src)  # partials: never freed by a Free op
            del self.acc[kind][op.src]
        marks: list = []
        recv = [self._take(r, marks) for r in mv.roles]
        chunk = recv
        if kind == "kv":
            m = self.seq // 2
            at = (0, m) if mv.at is None else mv.at  # where its two pieces lie: its own buffer, or the slab
            pieces = None if mv.whole else [self.bufs.rows(r, slice(x, x + m)) for r in mv.roles for x in at]
            if mv.at is None:
                self.kv_whole[dst] = recv
                chunk, recv = pieces, recv if mv.whole else pieces  # whole: pieces made if forwarded as pieces
            else:
                recv = chunk = pieces
        if after:  # without `after` the transfer's stream waits for all compute so far anyway
            after = tuple(after) + tuple(marks)
        handle = self.comm.exchange(op.ring, op.direction, send, recv, mv.categories, after=after)
        self.sends.setdefault(key, []).append((handle, send))  # keep what is sent alive until done
        if kind in ("q", "kv"):
            self.chunks[kind][dst] = chunk
            self.arrivals[(kind, dst)] = handle
        else:
            acc_roles = [("acc", kind, op.src, i) for i in range(len(send))]
            for t, r in zip(send, acc_roles):
                self._sending(t, r, handle)
            self._died(acc_roles)
            self.incoming[kind].setdefault(dst, []).append((handle, recv))

    def _free(self, kind: str, off: int) -> None:
        self._chunk(kind, off)
        for h, _ in self.sends.pop((kind, off), []):
            h.wait()
        del self.chunks[kind][off]
        slab = self.plan.slab_of(off) if kind == "kv" else None
        if slab is None:
            roles = [("recv", kind, off, i) for i in range(len(self._payload(kind)))]
            if kind == "kv":
                del self.kv_whole[off]
        else:  # the slab's bytes die with its last chunk
            self.slab_left[slab] -= 1
            roles = [("slab", "kv", slab[0], i) for i in range(2)] if not self.slab_left[slab] else []
        if kind == "q" and self.stand_ins.pop(off, None) is not None:
            roles.append(("stand_in", off))
        self._died(roles)
        if kind == "q":
            for key in [k for k in self.kernel_lse if k[0] == off]:
                del self.kernel_lse[key]

    def _acc(self, kind: str, off: int) -> List[torch.Tensor]:
        """The accumulator of partial ``kind`` at ``off``, taken from the pool on first use and then
        *fresh* (unwritten) until a kernel call's result is copied in or it is initialised."""
        bufs = self.acc[kind].get(off)
        if bufs is None:
            bufs = self.acc[kind][off] = [self._take(("acc", kind, off, i)) for i in range(len(self._payload(kind)))]
            self._fresh.add((kind, off))
        return bufs

    def _partial(self, kind: str, off: int) -> List[torch.Tensor]:
        """The accumulator, initialised if fresh: untouched rows (out = 0, lse = -inf; gradients 0)."""
        bufs = self._acc(kind, off)
        if (kind, off) in self._fresh:
            self._fresh.discard((kind, off))
            if kind == "o":
                bufs[0].zero_()
                bufs[1].fill_(float("-inf"))
            else:  # dq, or dk and dv: one multi-tensor zero
                torch._foreach_zero_(bufs)
        return bufs

    def _folded(self, kind: str, off: int) -> List[torch.Tensor]:
        """The partial of ``off`` with every partial received for it folded in (plan order)."""
        mine = self._partial(kind, off)
        incoming = self.incoming[kind].pop(off, [])
        for handle, theirs in incoming:
            handle.wait()
            if kind == "o":
                merge_into(mine[0], mine[1], theirs[0], theirs[1], scratch=self._scratch)
            else:  # dq, or dk and dv: one multi-tensor add
                torch._foreach_add_(mine, theirs)
        if incoming and self.device.type == "cuda":
            n = len(self._payload(kind))
            self._died([r for d in (1, -1) for i in range(n) if (r := ("in", kind, off, d, i)) in self.bufs.layout.offsets])
        return mine

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A reusable scratch view shaped like ``like`` (rows are leading, so a prefix view fits)."""
        role = ("scratch", like.dim())
        self._take(role)
        return self.bufs.rows(role, slice(0, like.shape[0]))

    def _keys(self, call: Call):
        """``(k, v)`` a call reads: the chunk's own buffer, or its rows of the slab. Waits for the chunks."""
        for ko in call.kvs:
            self._chunk("kv", ko)
        if call.slab is None:
            return self.kv_whole[call.kvs[0]]
        return tuple(self.bufs.rows(("slab", "kv", call.slab[0], i), call.keys) for i in range(2))

    def _forward_call(self, qo: int, call: Call) -> None:
        (q,) = self._chunk("q", qo)
        k, v = self._keys(call)
        exact = self.exact
        for p in call.parts:
            vl = _masked(p.varlen, p.window)
            qq, kk, vv = _rows(q, p.rows), _rows(k, p.cols), _rows(v, p.cols)
            if self.max_logit is not None:
                vl["return_max_logit"] = True
                out, lse, top = self.kernel.forward(qq, kk, vv, causal=p.causal, scale=self.scale, **vl)
                torch.maximum(self.max_logit, top, out=self.max_logit)
            else:
                out, lse = self.kernel.forward(qq, kk, vv, causal=p.causal, scale=self.scale, **vl)
            self._fold_block(qo, p.rows, out, lse.permute(2, 0, 1), exact)

    def _fold_block(self, qo: int, rows, out: torch.Tensor, lse: torch.Tensor, exact: bool) -> None:
        """Merge one call's ``(out, lse [s, b, h])`` into Q offset ``qo``'s partial. The first
        unmasked call into a fresh partial is copied in (bitwise what merging it into out = 0,
        lse = -inf gives), the rows it does not cover set untouched; masked calls, which may leave
        rows with no key, merge into an initialised partial."""
        key = ("o", qo)
        acc_out, acc_lse = self._acc("o", qo)
        if exact and key in self._fresh:
            self._fresh.discard(key)
            for sl in _outside(rows, self.seq):
                acc_out[sl].zero_()
                acc_lse[sl].fill_(float("-inf"))
            self.bufs.rows(("acc", "o", qo, 0), rows).copy_(out)
            self.bufs.rows(("acc", "o", qo, 1), rows).copy_(lse)
            return
        self._partial("o", qo)
        merge_into(self.bufs.rows(("acc", "o", qo, 0), rows), self.bufs.rows(("acc", "o", qo, 1), rows), out, lse,
                   scratch=self._scratch, finite=exact)

    def _backward_call(self, qo: int, call: Call) -> None:
        q, dout, delta, lse = self._chunk("q", qo)
        k, v = self._keys(call)
        if qo not in self.stand_ins:  # a foreign chunk's stand-in lives in the pool until its Free
            self.stand_ins[qo] = delta_stand_in(dout, delta, out=self._take(("stand_in", qo)))
        out = self.stand_ins[qo]
        exact = self.exact
        for p in call.parts:
            vl = _masked(p.varlen, p.window)
            lkey = (qo, None if p.rows is None else (p.rows.start, p.rows.stop), p.varlen is not None)
            if lkey not in self.kernel_lse:  # once per chunk and row range, not per block
                self.kernel_lse[lkey] = self.kernel.lse_for_backward(_rows(lse, p.rows), **_masked(p.varlen, None))
            dq, dk, dv = self.kernel.backward(
                _rows(dout, p.rows), _rows(q, p.rows), _rows(k, p.cols), _rows(v, p.cols), _rows(out, p.rows),
                self.kernel_lse[lkey], causal=p.causal, scale=self.scale, **vl,
            )
            self._add_grads(qo, p, dq, dk, dv, exact)

    def _add_grads(self, qo: int, p: Part, dq, dk, dv, exact: bool) -> None:
        """Add one call's gradients into the dQ partial of ``qo`` and the dK/dV partials of
        ``p.grads``. A fresh partial the (unmasked) call covers whole is copied into instead (0 + x
        is x); the other fresh ones it touches are zeroed first, all in one multi-tensor op."""
        self._acc("dq", qo)
        writes = [(("dq", qo), ("acc", "dq", qo, 0), p.rows, dq, None)]
        for ko, acc_rows, g_rows in p.grads:
            self._acc("dkv", ko)
            writes += [(("dkv", ko), ("acc", "dkv", ko, 0), acc_rows, dk, g_rows),
                       (("dkv", ko), ("acc", "dkv", ko, 1), acc_rows, dv, g_rows)]
        copied = ()
        fresh = [key for key in dict.fromkeys(w[0] for w in writes) if key in self._fresh]
        if fresh:
            copied = {key for key in fresh if exact and _covers(key, qo, p, self.seq)}
            zero = [t for key in fresh if key not in copied for t in self.acc[key[0]][key[1]]]
            if zero:
                torch._foreach_zero_(zero)
            self._fresh.difference_update(fresh)
        for key, role, acc_rows, g, g_rows in writes:
            dst, src = self.bufs.rows(role, acc_rows), _rows(g, g_rows)
            if key in copied:
                dst.copy_(src)
            else:
                dst.add_(src)


def _rows(t: torch.Tensor, rows) -> torch.Tensor:
    """``t[rows]``; ``t`` itself for ``None`` (every row: no view taken)."""
    return t if rows is None else t[rows]


def _outside(rows, seq: int) -> List[slice]:
    """The row ranges of a chunk of ``seq`` rows outside ``rows`` (None: every row)."""
    if rows is None:
        return []
    return [sl for sl in (slice(0, rows.start or 0), slice(rows.stop, seq)) if sl.start < sl.stop]


def _covers(key: tuple, qo: int, p: Part, seq: int) -> bool:
    """Whether part ``p`` writes every row of the partial ``key`` (its pieces are disjoint)."""
    if key[0] == "dq":
        return p.rows is None
    return sum(seq if r is None else r.stop - (r.start or 0) for ko, r, _ in p.grads if ko == key[1]) == seq


def _masked(varlen, window) -> dict:
    """The mask arguments a kernel call gets only when it has them (kernels without them keep working)."""
    out = {}
    if varlen is not None:
        out["varlen"] = varlen
    if window is not None:
        out["window"] = window
    return out


def _pieces(chunk: List[torch.Tensor]) -> List[torch.Tensor]:
    """A KV chunk's [k, v] as its zigzag pieces [k0, k1, v0, v1] (views), the way it travels."""
    m = chunk[0].shape[0] // 2
    return [t[x: x + m] for t in chunk for x in (0, m)]


def run_virtual(
    plan: Plan,
    shape: MeshShape,
    per_rank: Sequence[Dict[str, torch.Tensor]],
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
    hub: VirtualHub = None,
    partial_dtype: Optional[torch.dtype] = None,
    parts: Optional[Sequence[Dict[Tuple[int, int], tuple]]] = None,
    sinks: Optional[Sequence[torch.Tensor]] = None,
    max_logit: bool = False,
):
    """Run ``plan`` for all ranks of ``shape`` in this process, op by op in lockstep.

    ``per_rank[g]`` holds rank g's executor tensors (sequence-major), ``parts[g]`` its masked
    blocks' calls (a mask engine's ``rank_parts``), ``sinks[g]`` its heads' sink logits. Returns
    ``(results, traffic)``.
    """
    hub = hub or VirtualHub(shape)
    execs = [
        Executor(plan, hub.ranks[g], kernel, causal=causal, scale=scale, tensors=per_rank[g],
                 partial_dtype=partial_dtype, buffers=hub.ranks[g].buffers,
                 parts=None if parts is None else parts[g], sink=None if sinks is None else sinks[g],
                 max_logit=max_logit)
        for g in range(shape.n)
    ]
    for op in plan.ops:
        for ex in execs:
            ex.step(op)
    results = [ex.finish() for ex in execs]
    hub.clear()
    return results, [c.traffic for c in hub.ranks]
