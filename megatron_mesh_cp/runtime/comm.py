"""Ring transport: one asynchronous neighbour exchange per plan transfer, with byte counters.

The executor only ever asks for :meth:`RingComm.exchange`: send tensors to the next rank of a ring
(in a direction) and receive the same shapes from the previous one. Two transports implement it:

* :class:`ProcessGroupComm` -- batched ``isend``/``irecv`` on the row or column process group
  (gloo on CPU, NCCL on GPU); each ring has its own group, so the rings progress concurrently.
* :class:`VirtualComm` -- all ranks of a mesh in one process (``VirtualHub``), exchanging through
  memory; used to check the executor with many ranks on one device.

Both count the bytes they actually move in a :class:`Traffic` counter.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import torch

from .buffers import BufferPool

__all__ = ["Traffic", "RingComm", "ProcessGroupComm", "VirtualHub", "VirtualComm"]


class Traffic:
    """Bytes sent and received, keyed by (phase, category); accumulates across calls."""

    def __init__(self) -> None:
        self.sent: Dict[Tuple[str, str], int] = {}
        self.received: Dict[Tuple[str, str], int] = {}

    def add(self, phase: str, category: str, sent: int, received: int) -> None:
        key = (phase, category)
        self.sent[key] = self.sent.get(key, 0) + sent
        self.received[key] = self.received.get(key, 0) + received

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()

    def total_sent(self, phase: str = None) -> int:
        return sum(v for (p, _), v in self.sent.items() if phase in (None, p))

    def total_received(self, phase: str = None) -> int:
        return sum(v for (p, _), v in self.received.items() if phase in (None, p))

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        """``{"forward/Q": {"sent": .., "received": ..}, ...}`` for logs and JSON."""
        keys = sorted(set(self.sent) | set(self.received))
        return {
            f"{p}/{c}": {"sent": self.sent.get((p, c), 0), "received": self.received.get((p, c), 0)}
            for p, c in keys
        }

    def __repr__(self) -> str:
        return f"Traffic(sent={self.total_sent()}, received={self.total_received()})"


class _Handle:
    """Completion of one exchange; every consumer calls ``wait()``.

    On gloo the first wait blocks the host and later ones return at once (a gloo work must not be
    waited twice). On NCCL a wait makes the *current CUDA stream* wait, without a host sync, once
    per stream that consumes the data. A failed wait (a peer stalled past the rings' timeout, or
    died) raises a ``RuntimeError`` naming the phase, the ring and the peers it waited for.
    """

    def __init__(self, works, cuda: bool = False, where: tuple = None) -> None:
        self._works = works
        self._cuda = cuda
        self._waited = set()
        self._where = where  # (phase, ring, next rank, previous rank, timeout, issued at)

    def wait(self) -> None:
        key = torch.cuda.current_stream() if self._cuda else "host"
        if key in self._waited:
            return
        try:
            for w in self._works:
                w.wait()
        except RuntimeError as exc:
            if self._where is None:
                raise
            raise RuntimeError(_stall_message(self._where, exc)) from None
        self._waited.add(key)


def _stall_message(where: tuple, exc: BaseException) -> str:
    phase, ring, nxt, prv, timeout, issued = where
    group = "Q / partial-O and dQ" if ring == "row" else "KV / dKV"
    cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"mesh attention {phase}: waiting in the {ring} ring ({group} exchanges: sending to rank {nxt}, "
        f"receiving from rank {prv}) failed after {time.monotonic() - issued:.1f} s (ring timeout "
        f"{timeout.total_seconds() if timeout else 'default'} s): a rank of the CP group stalled, raised or "
        f"runs a different op. Cause: {cause}"
    )


class RingComm:
    """Neighbour exchanges on the row ring (Q group) and the column ring (KV group)."""

    position: int  # CP rank (mesh position) of this endpoint
    traffic: Traffic
    phase: str = "forward"

    def exchange(
        self, ring: str, direction: int, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor],
        categories: Sequence[str], after: Sequence = (),
    ):
        """Start sending ``send`` to the ``direction`` neighbour on ``ring`` and receiving ``recv``
        from the opposite one; return a handle whose ``wait()`` completes both.

        ``after``: handles of the exchanges that delivered ``send`` (a forwarded chunk). The send
        waits for exactly those; without them it waits for everything issued so far on the
        current stream (a partial the compute stream just produced).
        """
        raise NotImplementedError

    def _count(self, send, recv, categories) -> None:
        for s, r, c in zip(send, recv, categories):
            self.traffic.add(self.phase, c, s.numel() * s.element_size(), r.numel() * r.element_size())


class ProcessGroupComm(RingComm):
    """Exchanges over torch.distributed point-to-point ops on a :class:`MeshGroups`' rings."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.position = mesh.mesh_position  # on the a x b mesh (a2a+mesh: the super-rank)
        self.traffic = mesh.traffic
        self._seq = 0
        self._streams: Dict[Tuple[str, int], "torch.cuda.Stream"] = {}

    def exchange(self, ring, direction, send, recv, categories, after=()):
        import torch.distributed as dist

        group, peers = self.mesh.ring(ring)
        nxt, prv = peers[direction], peers[-direction]
        # distinct tags keep two messages between the same pair apart (ring of 2, several tensors)
        base = (self._seq % 4096) * 16 + (0 if direction > 0 else 8)
        self._seq += 1
        ops = [dist.P2POp(dist.isend, t, nxt, group=group, tag=base + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, prv, group=group, tag=base + i) for i, t in enumerate(recv)]
        self._count(send, recv, categories)
        if not send[0].is_cuda:
            for h in after:
                h.wait()
            where = (self.phase, ring, nxt, prv, getattr(self.mesh, "timeout", None), time.monotonic())
            return _Handle(dist.batch_isend_irecv(ops), where=where)
        # GPU: each ring direction issues from its own stream, so transfers overlap compute and
        # each other; dependencies are stream waits, never host synchronisation
        stream = self._streams.get((ring, direction))
        if stream is None:
            stream = self._streams[(ring, direction)] = torch.cuda.Stream(device=send[0].device)
        if not after:
            stream.wait_stream(torch.cuda.current_stream(send[0].device))
        with torch.cuda.stream(stream):
            for h in after:
                h.wait()
            works = dist.batch_isend_irecv(ops)
        for t in (*send, *recv):
            t.record_stream(stream)
        return _Handle(works, cuda=True)


class VirtualHub:
    """Shared state of ``n`` in-process ranks; ranks must issue exchanges in the same order (SPMD).

    A message is copied as soon as both its sender and its receiver have posted the exchange, as
    a real transfer completes once both sides posted: after that the sender may reuse its buffer.
    Each delivery is one multi-tensor copy, as a transfer on NCCL is one grouped launch.
    """

    def __init__(self, shape) -> None:
        self.shape = shape
        self._posted: Dict[Tuple[int, int], Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        self._delivered: set = set()
        self.ranks = [VirtualComm(self, g) for g in range(shape.n)]

    def _deliver(self, src_key: Tuple[int, int], dst_key: Tuple[int, int]) -> None:
        if src_key in self._posted and dst_key in self._posted and dst_key not in self._delivered:
            send, _ = self._posted[src_key]
            _, recv = self._posted[dst_key]
            torch._foreach_copy_(recv, send)
            self._delivered.add(dst_key)

    def clear(self) -> None:
        self._posted.clear()
        self._delivered.clear()


class _VirtualHandle:
    def __init__(self, hub: VirtualHub, key: Tuple[int, int]) -> None:
        self.hub, self.key = hub, key

    def wait(self) -> None:
        if self.key not in self.hub._delivered:
            raise RuntimeError(
                "virtual exchange waited on before its sender posted; run ranks op by op (SPMD)"
            )


class VirtualComm(RingComm):
    """One rank's endpoint of a :class:`VirtualHub`."""

    def __init__(self, hub: VirtualHub, position: int) -> None:
        self.hub = hub
        self.position = position
        self.traffic = Traffic()
        self._seq = 0
        self.buffers = BufferPool()

    def exchange(self, ring, direction, send, recv, categories, after=()):
        for h in after:  # a forwarded chunk must have landed here before it is read downstream
            h.wait()
        shape = self.hub.shape
        r, c = shape.coords(self.position)
        prv = shape.rank(r, c - direction) if ring == "row" else shape.rank(r - direction, c)
        nxt = shape.rank(r, c + direction) if ring == "row" else shape.rank(r + direction, c)
        key = (self.position, self._seq)
        self.hub._posted[key] = (list(send), list(recv))
        self.hub._deliver((prv, key[1]), key)
        self.hub._deliver(key, (nxt, key[1]))
        self._seq += 1
        self._count(send, recv, categories)
        return _VirtualHandle(self.hub, key)
