"""The executor: runs one rank's share of a :class:`~megatron_mesh_cp.plan.Plan`.

It knows nothing about scheduling: it walks the plan's ops in order, starts each transfer
asynchronously, waits for a chunk only when an op reads it, computes blocks with a block kernel
and folds partial results in a fixed order (so two runs are bitwise identical). Partials are
accumulated in fp32 (fp64 for fp64 inputs).

Tensors are sequence-major (``[s, b, h, d]``, Megatron's layout), so every block's row or column
range is a contiguous view and no block copies its inputs. Receive buffers, accumulators and merge
scratch come from a :class:`BufferPool` that lives with the communicator and is reused by every
layer of the same shape; nothing the executor hands back aliases it.

Forward inputs per rank: local q, k, v. Backward inputs: local q, k, v, the final out, its lse
([s, b, h]), dout and ``delta = rowsum(dout * out)``; only those are kept between the passes,
never a gathered chunk (DESIGN.md section 4).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .comm import RingComm, VirtualHub
from .kernels import BlockKernel, lse_dtype
from .layout import BlockSlices, block_case
from .merge import merge_into
from .plan import BACKWARD, FORWARD, ChunkDims, Compute, Free, Plan, TensorSpec, Transfer, payload
from .topology import MeshShape

__all__ = ["Executor", "BufferPool", "delta_stand_in", "run_virtual"]


def delta_stand_in(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor ``x`` like ``dout`` with ``rowsum(dout * x) == delta`` (to rounding).

    Block-kernel backwards read ``out`` only through ``delta = rowsum(dout * out)``; sending the
    tiny ``delta`` instead of a foreign Q row's ``out`` saves one chunk per hop. ``x`` is parallel
    to ``dout`` and scaled by its largest element, so nothing under- or overflows; rows with
    ``dout == 0`` have ``delta == 0`` and get ``x = 0``.
    """
    acc = lse_dtype(dout.dtype)
    g = dout.to(acc)
    scale = g.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = g / safe
    x = u * ((delta.to(acc).unsqueeze(-1) / safe) / (u * u).sum(dim=-1, keepdim=True).clamp_min(1.0))
    return torch.where(scale > 0, x, torch.zeros_like(x)).to(dout.dtype)


class BufferPool:
    """Tensors kept across calls, keyed by role and shape: allocated once per layer shape.

    A buffer is only reused by a later executor run (runs never overlap on one rank); the
    executor copies anything it returns, so reuse never clobbers a saved tensor.
    """

    def __init__(self) -> None:
        self._buffers: Dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        full = (key, tuple(shape), dtype, str(device))
        t = self._buffers.get(full)
        if t is None:
            t = self._buffers[full] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


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
    ) -> None:
        self.plan, self.comm, self.kernel = plan, comm, kernel
        self.causal, self.scale = causal, scale
        self.shape = MeshShape(plan.a, plan.b)
        self.position = comm.position
        self.t = tensors
        self.pool = buffers if buffers is not None else BufferPool()
        q, k = tensors["q"], tensors["k"]
        self.device = q.device
        self.acc_dtype = lse_dtype(q.dtype)
        self.dims = ChunkDims.of(q, k, self.acc_dtype, partial_dtype)
        self.seq = q.shape[0]
        fwd = plan.phase == FORWARD
        q_payload = [q] if fwd else [q, tensors["dout"], tensors["delta"], tensors["lse"]]
        self.chunks: Dict[str, Dict[int, List[torch.Tensor]]] = {
            "q": {0: q_payload},
            "kv": {0: [k, tensors["v"]]},
        }
        self.arrivals: Dict[Tuple[str, int], object] = {}  # handle that delivered a gathered chunk
        self.acc: Dict[str, Dict[int, List[torch.Tensor]]] = {"o": {}, "dq": {}, "dkv": {}}
        self.incoming: Dict[str, Dict[int, list]] = {"o": {}, "dq": {}, "dkv": {}}
        self.sends: Dict[Tuple[str, int], list] = {}  # (kind, offset) -> [(handle, tensors)]
        self.stand_ins: Dict[int, torch.Tensor] = {0: tensors["out"]} if not fwd else {}
        self.kernel_lse: Dict[Tuple[int, int, int], object] = {}
        self.comm.phase = plan.phase

    # --- public driving ----------------------------------------------------------------------
    def run(self):
        for op in self.plan.ops:
            self.step(op)
        return self.finish()

    def step(self, op) -> None:
        if isinstance(op, Compute):
            (self._forward_block if self.plan.phase == FORWARD else self._backward_block)(op.q, op.kv)
        elif isinstance(op, Transfer):
            self._transfer(op)
        elif isinstance(op, Free):
            self._free(op.kind, op.offset)
        else:
            raise TypeError(f"unknown plan op {op!r}")

    def finish(self):
        """Fold the last partials into the rank's own chunk; wait for outstanding sends.

        Returns fresh tensors (never pool buffers): forward ``(out, lse [s, b, h])``, backward
        ``(dq, dk, dv)``.
        """
        dt = self.t["q"].dtype
        if self.plan.phase == FORWARD:
            out, lse = self._folded("o", 0)
            result = (out.to(dt, copy=True), lse.clone())
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
    def _buf(self, role: tuple, spec: TensorSpec) -> torch.Tensor:
        return self.pool.get((self.plan.phase,) + role, spec.shape, spec.dtype, self.device)

    # --- ops ---------------------------------------------------------------------------------
    def _chunk(self, kind: str, off: int) -> List[torch.Tensor]:
        """A gathered chunk, ready for the compute stream (repeat waits on a handle are free)."""
        handle = self.arrivals.get((kind, off))
        if handle is not None:
            handle.wait()
        return self.chunks[kind][off]

    def _transfer(self, op: Transfer) -> None:
        dst = self.plan.dst(op)
        specs = payload(self.plan.phase, op.kind, self.dims)
        after = ()
        if op.kind in ("q", "kv"):
            send = self.chunks[op.kind][op.src]  # forwarding waits for its arrival, not for compute
            after = (self.arrivals[(op.kind, op.src)],) if (op.kind, op.src) in self.arrivals else ()
            key = (op.kind, op.src)
            recv = [self._buf(("recv", op.kind, dst, i), s) for i, s in enumerate(specs)]
        else:
            folded = self._folded(op.kind, op.src)
            send = [t if t.dtype == s.dtype else t.to(s.dtype) for t, s in zip(folded, specs)]
            key = (op.kind, -op.src)  # partials: never freed by a Free op
            del self.acc[op.kind][op.src]
            # an offset receives at most one partial per direction; the direction keeps them apart
            recv = [self._buf(("in", op.kind, dst, op.direction, i), s) for i, s in enumerate(specs)]
        handle = self.comm.exchange(op.ring, op.direction, send, recv, [s.category for s in specs], after=after)
        self.sends.setdefault(key, []).append((handle, send))  # keep what is sent alive until done
        if op.kind in ("q", "kv"):
            self.chunks[op.kind][dst] = recv
            self.arrivals[(op.kind, dst)] = handle
        else:
            self.incoming[op.kind].setdefault(dst, []).append((handle, recv))

    def _free(self, kind: str, off: int) -> None:
        self._chunk(kind, off)
        for h, _ in self.sends.pop((kind, off), []):
            h.wait()
        del self.chunks[kind][off]
        if kind == "q":
            self.stand_ins.pop(off, None)
            for key in [k for k in self.kernel_lse if k[0] == off]:
                del self.kernel_lse[key]

    def _partial(self, kind: str, off: int) -> List[torch.Tensor]:
        acc = self.acc[kind]
        if off not in acc:
            specs = payload(self.plan.phase, kind, self.dims)
            bufs = [self._buf(("acc", kind, off, i), TensorSpec(s.category, s.shape, self.acc_dtype))
                    for i, s in enumerate(specs)]
            if kind == "o":  # untouched rows: out = 0, lse = -inf
                bufs[0].zero_()
                bufs[1].fill_(float("-inf"))
            else:
                for b in bufs:
                    b.zero_()
            acc[off] = bufs
        return acc[off]

    def _folded(self, kind: str, off: int) -> List[torch.Tensor]:
        """The partial of ``off`` with every partial received for it folded in (plan order)."""
        mine = self._partial(kind, off)
        for handle, theirs in self.incoming[kind].pop(off, []):
            handle.wait()
            if kind == "o":
                merge_into(mine[0], mine[1], theirs[0], theirs[1], scratch=self._scratch)
            else:
                for m, t in zip(mine, theirs):
                    m.add_(t)
        return mine

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A reusable scratch view shaped like ``like`` (rows are leading, so a prefix view fits)."""
        full = self._buf(("scratch", like.dim()), TensorSpec("", (self.seq,) + tuple(like.shape[1:]), like.dtype))
        return full[: like.shape[0]]

    def _slices(self, qo: int, ko: int) -> BlockSlices:
        i = self.shape.q_chunk(self.position, qo)
        j = self.shape.kv_chunk(self.position, ko)
        return BlockSlices.of(block_case(i, j, self.causal), self.seq)

    def _forward_block(self, qo: int, ko: int) -> None:
        sl = self._slices(qo, ko)
        (q,) = self._chunk("q", qo)
        k, v = self._chunk("kv", ko)
        rows, cols = sl.q_rows, sl.kv_cols
        out, lse = self.kernel.forward(q[rows], k[cols], v[cols], causal=sl.causal, scale=self.scale)
        acc_out, acc_lse = self._partial("o", qo)
        merge_into(acc_out[rows], acc_lse[rows], out, lse.permute(2, 0, 1), scratch=self._scratch)

    def _backward_block(self, qo: int, ko: int) -> None:
        sl = self._slices(qo, ko)
        q, dout, delta, lse = self._chunk("q", qo)
        k, v = self._chunk("kv", ko)
        if qo not in self.stand_ins:
            self.stand_ins[qo] = delta_stand_in(dout, delta)
        out = self.stand_ins[qo]
        rows, cols = sl.q_rows, sl.kv_cols
        lkey = (qo, sl.q_start, sl.q_stop)
        if lkey not in self.kernel_lse:  # once per chunk and row range, not per block
            self.kernel_lse[lkey] = self.kernel.lse_for_backward(lse[rows])
        dq, dk, dv = self.kernel.backward(
            dout[rows], q[rows], k[cols], v[cols], out[rows], self.kernel_lse[lkey],
            causal=sl.causal, scale=self.scale,
        )
        self._partial("dq", qo)[0][rows].add_(dq)
        acc_k, acc_v = self._partial("dkv", ko)
        acc_k[cols].add_(dk)
        acc_v[cols].add_(dv)


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
):
    """Run ``plan`` for all ranks of ``shape`` in this process, op by op in lockstep.

    ``per_rank[g]`` holds rank g's executor tensors (sequence-major). Returns ``(results, traffic)``.
    """
    hub = hub or VirtualHub(shape)
    execs = [
        Executor(plan, hub.ranks[g], kernel, causal=causal, scale=scale, tensors=per_rank[g],
                 partial_dtype=partial_dtype, buffers=hub.ranks[g].buffers)
        for g in range(shape.n)
    ]
    for op in plan.ops:
        for ex in execs:
            ex.step(op)
    results = [ex.finish() for ex in execs]
    hub._posted.clear()
    return results, [c.traffic for c in hub.ranks]
