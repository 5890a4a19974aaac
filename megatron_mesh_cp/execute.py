"""The executor: runs one rank's share of a :class:`~megatron_mesh_cp.plan.Plan`.

It knows nothing about scheduling: it walks the plan's ops in order, starts each transfer
asynchronously, waits for a chunk only when an op reads it, computes blocks with a block kernel
and folds partial results in a fixed order (so two runs are bitwise identical). Partials are
accumulated in fp32 (fp64 for fp64 inputs).

Forward inputs per rank: local q, k, v (bshd). Backward inputs: local q, k, v, the final out, its
lse, dout and ``delta = rowsum(dout * out)``; only those are kept between the passes, never a
gathered chunk (DESIGN.md section 4).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .comm import RingComm, VirtualHub
from .kernels import BlockKernel, lse_dtype
from .layout import BlockSlices, block_case
from .merge import empty_partial, merge_into
from .plan import BACKWARD, FORWARD, ChunkDims, Compute, Free, Plan, Transfer, payload
from .topology import MeshShape

__all__ = ["Executor", "delta_stand_in", "run_virtual"]


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
    ) -> None:
        self.plan, self.comm, self.kernel = plan, comm, kernel
        self.causal, self.scale = causal, scale
        self.shape = MeshShape(plan.a, plan.b)
        self.position = comm.position
        self.t = tensors
        q, k = tensors["q"], tensors["k"]
        self.acc_dtype = lse_dtype(q.dtype)
        self.dims = ChunkDims.of(q, k, self.acc_dtype, partial_dtype)
        self.seq = q.shape[1]
        fwd = plan.phase == FORWARD
        q_payload = [q] if fwd else [q, tensors["dout"], tensors["delta"], tensors["lse"]]
        self.chunks: Dict[str, Dict[int, List[torch.Tensor]]] = {
            "q": {0: q_payload},
            "kv": {0: [k, tensors["v"]]},
        }
        self.pending: Dict[Tuple[str, int], object] = {}
        self.acc: Dict[str, Dict[int, List[torch.Tensor]]] = {"o": {}, "dq": {}, "dkv": {}}
        self.incoming: Dict[str, Dict[int, list]] = {"o": {}, "dq": {}, "dkv": {}}
        self.sends: Dict[Tuple[str, int], list] = {}  # (kind, offset) -> [(handle, tensors)]
        self.stand_ins: Dict[int, torch.Tensor] = {0: tensors["out"]} if not fwd else {}
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
        """Fold the last partials into the rank's own chunk; wait for outstanding sends."""
        if self.plan.phase == FORWARD:
            out, lse = self._folded("o", 0)
            result = (out.to(self.t["q"].dtype), lse)
        else:
            (dq,) = self._folded("dq", 0)
            dk, dv = self._folded("dkv", 0)
            dt = self.t["q"].dtype
            result = (dq.to(dt), dk.to(dt), dv.to(dt))
        for handles in self.sends.values():
            for h, _ in handles:
                h.wait()
        self.sends.clear()
        return result

    # --- ops ---------------------------------------------------------------------------------
    def _chunk(self, kind: str, off: int) -> List[torch.Tensor]:
        h = self.pending.pop((kind, off), None)
        if h is not None:
            h.wait()
        return self.chunks[kind][off]

    def _transfer(self, op: Transfer) -> None:
        dst = self.plan.dst(op)
        specs = payload(self.plan.phase, op.kind, self.dims)
        if op.kind in ("q", "kv"):
            send = self._chunk(op.kind, op.src)
            key = (op.kind, op.src)
        else:
            folded = self._folded(op.kind, op.src)
            send = [t.to(s.dtype).contiguous() for t, s in zip(folded, specs)]
            key = (op.kind, -op.src)  # partials: never freed by a Free op
            del self.acc[op.kind][op.src]
        recv = [torch.empty(s.shape, dtype=s.dtype, device=send[0].device) for s in specs]
        handle = self.comm.exchange(op.ring, op.direction, send, recv, [s.category for s in specs])
        self.sends.setdefault(key, []).append((handle, send))  # keep what is sent alive until done
        if op.kind in ("q", "kv"):
            self.chunks[op.kind][dst] = recv
            self.pending[(op.kind, dst)] = handle
        else:
            self.incoming[op.kind].setdefault(dst, []).append((handle, recv))

    def _free(self, kind: str, off: int) -> None:
        self._chunk(kind, off)
        for h, _ in self.sends.pop((kind, off), []):
            h.wait()
        del self.chunks[kind][off]
        if kind == "q":
            self.stand_ins.pop(off, None)

    def _partial(self, kind: str, off: int) -> List[torch.Tensor]:
        acc = self.acc[kind]
        if off not in acc:
            like = self.t["q"] if kind in ("o", "dq") else self.t["k"]
            if kind == "o":
                acc[off] = list(empty_partial(like, self.acc_dtype))
            else:
                n = 1 if kind == "dq" else 2
                acc[off] = [torch.zeros(like.shape, dtype=self.acc_dtype, device=like.device) for _ in range(n)]
        return acc[off]

    def _folded(self, kind: str, off: int) -> List[torch.Tensor]:
        """The partial of ``off`` with every partial received for it folded in (plan order)."""
        mine = self._partial(kind, off)
        for handle, theirs in self.incoming[kind].pop(off, []):
            handle.wait()
            if kind == "o":
                merge_into(mine[0], mine[1], theirs[0], theirs[1])
            else:
                for m, t in zip(mine, theirs):
                    m.add_(t)
        return mine

    def _slices(self, qo: int, ko: int) -> BlockSlices:
        i = self.shape.q_chunk(self.position, qo)
        j = self.shape.kv_chunk(self.position, ko)
        return BlockSlices.of(block_case(i, j, self.causal), self.seq)

    def _forward_block(self, qo: int, ko: int) -> None:
        sl = self._slices(qo, ko)
        (q,) = self._chunk("q", qo)
        k, v = self._chunk("kv", ko)
        rows, cols = sl.q_rows, sl.kv_cols
        out, lse = self.kernel.forward(q[:, rows], k[:, cols], v[:, cols], causal=sl.causal, scale=self.scale)
        acc_out, acc_lse = self._partial("o", qo)
        merge_into(acc_out[:, rows], acc_lse[:, rows], out, lse.transpose(1, 2))

    def _backward_block(self, qo: int, ko: int) -> None:
        sl = self._slices(qo, ko)
        q, dout, delta, lse = self._chunk("q", qo)
        k, v = self._chunk("kv", ko)
        if qo not in self.stand_ins:
            self.stand_ins[qo] = delta_stand_in(dout, delta)
        out = self.stand_ins[qo]
        rows, cols = sl.q_rows, sl.kv_cols
        dq, dk, dv = self.kernel.backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
            lse[:, rows].transpose(1, 2), causal=sl.causal, scale=self.scale,
        )
        self._partial("dq", qo)[0][:, rows].add_(dq)
        acc_k, acc_v = self._partial("dkv", ko)
        acc_k[:, cols].add_(dk)
        acc_v[:, cols].add_(dv)


def run_virtual(
    plan: Plan,
    shape: MeshShape,
    per_rank: Sequence[Dict[str, torch.Tensor]],
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
    hub: VirtualHub = None,
):
    """Run ``plan`` for all ranks of ``shape`` in this process, op by op in lockstep.

    ``per_rank[g]`` holds rank g's executor tensors. Returns ``(results, traffic)`` per rank.
    """
    hub = hub or VirtualHub(shape)
    execs = [
        Executor(plan, hub.ranks[g], kernel, causal=causal, scale=scale, tensors=per_rank[g])
        for g in range(shape.n)
    ]
    for op in plan.ops:
        for ex in execs:
            ex.step(op)
    results = [ex.finish() for ex in execs]
    hub._posted.clear()
    return results, [c.traffic for c in hub.ranks]
