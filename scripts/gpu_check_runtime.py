"""gpu_check sections on the executor itself: NCCL-like streams, warm-call hygiene, host cost per block.

(e) A transport stand-in that behaves like the NCCL path of ``runtime/comm.py`` on one GPU: every
    rank issues each (ring, direction) from its own side stream (``wait_stream`` on the current
    stream when the send waits for compute, the ``after`` handles waited on that stream otherwise,
    exactly as ``ProcessGroupComm``), the copy that delivers a message runs on the receiver's ring
    stream (one per ring, both directions, as NCCL's one stream per group) after a
    ``torch.cuda._sleep`` delay, and a handle makes the waiting stream wait on the copies' events.
    The same plans (slab plans for 2x2, 4x4, 8x2) must give bitwise the same forward and backward
    as the same-stream virtual transport: a missing stream wait reads a buffer before it arrives.
    On CPU there are no streams: every copy is deferred to the first wait on it instead, so a
    missing wait still reads stale data.
(f) Warm-call hygiene on a2a+mesh (2, 2, 2), bf16 partials, deterministic: a second call under
    ``torch.cuda.set_sync_debug_mode("error")`` (no host sync), ``max_memory_allocated`` flat over 10
    calls, every rank's pool holding exactly its plans' ``peak_live_bytes``, two calls bitwise equal.
    On CPU only the pool bytes and the bitwise check are meaningful (said so in the output).
(g) n = 16 at 64K tokens (h 32, kv 8, d 128, bf16) on virtual ranks against one monolithic call of
    the same kernel: block efficiency (kernel time summed over every rank's calls / monolithic) and
    the executor's wall and host CPU time against its kernel time: the host cost per kernel call on
    this machine (the simulator's ``host_per_call_us``). ``--quick``: 2K tokens, h 4, kv 2, d 32.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Tuple

import torch

from megatron_mesh_cp.planning.cluster import Workload
from megatron_mesh_cp.planning.schedule import build_plans, default_cluster
from megatron_mesh_cp.runtime.buffers import BufferPool
from megatron_mesh_cp.runtime.comm import RingComm, Traffic, VirtualHub
from megatron_mesh_cp.runtime.execute import run_virtual
from megatron_mesh_cp.runtime.kernels import BlockKernel, select_kernel
from megatron_mesh_cp.runtime.layout import zigzag_shard
from megatron_mesh_cp.runtime.memory import peak_live_bytes
from megatron_mesh_cp.runtime.plan import ChunkDims
from megatron_mesh_cp.runtime.topology import MeshShape

__all__ = ["StreamHub", "section_e", "section_f", "section_g", "TABLES"]

#: GPU cycles a delivery sleeps on its ring stream (about 50-150 us on an H200), varied per message
SLEEP_CYCLES = (100_000, 300_000, 200_000)


class _StreamHandle:
    """Completion of one exchange: waits on the copies that fill this rank's receive and take its send.

    CUDA: the current stream waits on their events, once per stream (as ``comm._Handle``). CPU:
    the deferred copies run now (the first wait delivers them)."""

    def __init__(self, hub: "StreamHub", key: Tuple[int, int]) -> None:
        self.hub, self.key, self._waited = hub, key, set()

    def wait(self) -> None:
        if not self.hub.cuda:
            self.hub.deliver_for(self.key)
            return
        stream = torch.cuda.current_stream()
        if stream in self._waited:
            return
        events = self.hub.done.get(self.key, [])
        if len(events) < 2:
            raise RuntimeError("stream stand-in: a handle waited on before both of its copies were issued")
        for event in events:
            stream.wait_event(event)
        self._waited.add(stream)


class StreamComm(RingComm):
    """One rank's endpoint: ``ProcessGroupComm.exchange``'s CUDA stream handling, messages in memory."""

    def __init__(self, hub: "StreamHub", position: int) -> None:
        self.hub, self.position, self.traffic, self._seq = hub, position, Traffic(), 0
        self.buffers = BufferPool()
        self._streams: Dict[Tuple[str, int], object] = {}

    def exchange(self, ring, direction, send, recv, categories, after=()):
        shape = self.hub.shape
        r, c = shape.coords(self.position)
        prv = shape.rank(r, c - direction) if ring == "row" else shape.rank(r - direction, c)
        nxt = shape.rank(r, c + direction) if ring == "row" else shape.rank(r + direction, c)
        key = (self.position, self._seq)
        self._seq += 1
        self._count(send, recv, categories)
        posted = None
        if self.hub.cuda:  # as ProcessGroupComm: the (ring, direction) issue stream, its waits, then "launch"
            stream = self._streams.get((ring, direction))
            if stream is None:
                stream = self._streams[(ring, direction)] = torch.cuda.Stream(device=send[0].device)
            if not after:
                stream.wait_stream(torch.cuda.current_stream(send[0].device))
            with torch.cuda.stream(stream):
                for h in after:
                    h.wait()
                posted = torch.cuda.Event()
                posted.record()
            for t in (*send, *recv):
                t.record_stream(stream)
        else:
            for h in after:
                h.wait()
        self.hub.post(key, ring, list(send), list(recv), posted, (prv, key[1]), (nxt, key[1]))
        return _StreamHandle(self.hub, key)


class StreamHub:
    """All ranks of a mesh on one device, exchanging through streams with delays (CUDA) or late (CPU)."""

    def __init__(self, shape: MeshShape, device) -> None:
        self.shape, self.cuda = shape, torch.device(device).type == "cuda"
        self.ranks = [StreamComm(self, g) for g in range(shape.n)]
        self._posted: Dict[Tuple[int, int], tuple] = {}
        self._pairs: Dict[Tuple[int, int], List[tuple]] = {}  # key -> the (src, dst) copies it waits for
        self._delivered: set = set()
        self.done: Dict[Tuple[int, int], list] = {}
        self._ring_streams: Dict[Tuple[int, str], object] = {}
        self.deliveries = 0
        self.sleep_cycles = 0

    def post(self, key, ring, send, recv, posted, src_key, dst_key) -> None:
        self._posted[key] = (ring, send, recv, posted)
        for pair in ((src_key, key), (key, dst_key)):  # my receive from prv, my send to nxt
            self._pairs.setdefault(key, []).append(pair)
            if pair[0] in self._posted and pair[1] in self._posted and self.cuda:
                self._copy(*pair)

    def deliver_for(self, key) -> None:
        for pair in self._pairs.get(key, []):
            if pair not in self._delivered:
                if pair[0] not in self._posted or pair[1] not in self._posted:
                    raise RuntimeError("stream stand-in: waited on before the peer posted; run ranks op by op")
                self._copy(*pair)

    def _copy(self, src_key, dst_key) -> None:
        if (src_key, dst_key) in self._delivered:
            return
        ring, send, _, src_posted = self._posted[src_key]
        _, _, recv, dst_posted = self._posted[dst_key]
        self._delivered.add((src_key, dst_key))
        self.deliveries += 1
        if not self.cuda:
            for dst, src in zip(recv, send):
                dst.copy_(src)
            return
        key = (dst_key[0], ring)
        stream = self._ring_streams.get(key)
        if stream is None:
            stream = self._ring_streams[key] = torch.cuda.Stream(device=recv[0].device)
        cycles = SLEEP_CYCLES[self.deliveries % len(SLEEP_CYCLES)]
        self.sleep_cycles += cycles
        with torch.cuda.stream(stream):
            stream.wait_event(src_posted)
            stream.wait_event(dst_posted)
            torch.cuda._sleep(cycles)
            for dst, src in zip(recv, send):
                dst.copy_(src)
            event = torch.cuda.Event()
            event.record()
        for t in (*send, *recv):
            t.record_stream(stream)
        self.done.setdefault(dst_key, []).append(event)
        self.done.setdefault(src_key, []).append(event)

    def clear(self) -> None:
        self._posted.clear()
        self._pairs.clear()
        self._delivered.clear()
        self.done.clear()


def _shards(shape: MeshShape, s_total: int, h: int, hk: int, d: int, dtype, device, seed: int):
    n = shape.n
    g = torch.Generator(device="cpu").manual_seed(seed)
    full = [torch.randn(s_total, 1, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk, h)]
    return [[zigzag_shard(t, n, r, dim=0).contiguous() for t in full] for r in range(n)]


def _layer(plans, shape, shards, kern, hub, scale):
    """Forward then backward of every rank through ``hub``: the flat list of results."""
    per = [dict(q=q, k=k, v=v) for q, k, v, _ in shards]
    fwd, _ = run_virtual(plans[0], shape, per, kern, causal=True, scale=scale, hub=hub)
    acc = torch.float32
    bwd = [dict(p, out=o, lse=lse, dout=do, delta=(do.to(acc) * o.to(acc)).sum(-1))
           for p, (o, lse), (_, _, _, do) in zip(per, fwd, shards)]
    grads, _ = run_virtual(plans[1], shape, bwd, kern, causal=True, scale=scale, hub=hub)
    return [t for pair in fwd for t in pair] + [t for trio in grads for t in trio]


def section_e(device, quick):
    """Stream stand-in vs same-stream transport, bitwise, on slab plans."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m, h, hk, d = (2, 4, 2, 16) if quick else (128, 8, 2, 64)
    cluster = default_cluster()
    for a, b in ((2, 2), (4, 4), (8, 2)):
        shape = MeshShape(a, b)
        w = Workload(seq_local=4096, heads=32, kv_heads=8, head_dim=128)
        plans = tuple(dataclasses.replace(p, slabs=p.slabs or ((1, b - 1),))  # a slab of every foreign KV offset
                      for p in build_plans(a, b, "greedy", cluster=cluster, workload=w))
        shards = _shards(shape, 2 * m * shape.n, h, hk, d, dtype, device, seed=a * 10 + b)
        kern = select_kernel("auto", shards[0][0], shards[0][1])
        t0 = time.time()
        same = _layer(plans, shape, shards, kern, VirtualHub(shape), d ** -0.5)
        hub = StreamHub(shape, device)
        streamed = _layer(plans, shape, shards, kern, hub, d ** -0.5)
        if device == "cuda":
            torch.cuda.synchronize()
        equal = all(torch.equal(x, y) for x, y in zip(same, streamed))
        yield dict(shape=f"{a}x{b}", slabs=str(plans[0].slabs), kernel=kern.name, dtype=str(dtype)[6:],
                   deliveries=hub.deliveries, sleep_mcycles=hub.sleep_cycles / 1e6, seconds=time.time() - t0,
                   transport="side streams + _sleep" if device == "cuda" else "CPU: copies deferred to the first wait",
                   result="ok" if equal else "FAIL (not bitwise equal)")


def section_f(device, quick):
    """Warm calls of a2a+mesh (2, 2, 2): no host sync, flat memory, pool = peak_live_bytes, bitwise."""
    from megatron_mesh_cp.virtual import VirtualMesh, virtual_mesh_attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    s, h, hk, d = (64, 4, 2, 16) if quick else (4096, 16, 4, 128)
    g = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, do = (torch.randn(1, s, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk, h))
    mesh = VirtualMesh((2, 2, 2))  # one mesh for every call: its pools stay warm, as a real mesh's do
    kw = dict(dout=do, partial_dtype=torch.bfloat16, deterministic=True)
    # deterministic: the torch kernel runs its CUDA backward under use_deterministic_algorithms (TE, flash:
    # their deterministic flag), so two calls must agree bit for bit
    first = virtual_mesh_attention(q, k, v, mesh, **kw)
    notes = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            second = virtual_mesh_attention(q, k, v, mesh, **kw)
            synced = "none"
        except RuntimeError as exc:
            synced = str(exc).splitlines()[0][:120]
            second = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        peaks = []
        for _ in range(10):
            virtual_mesh_attention(q, k, v, mesh, **kw)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        flat = len(set(peaks)) == 1
    else:
        second = virtual_mesh_attention(q, k, v, mesh, **kw)
        synced, flat, peaks = None, None, []
        notes.append("CPU: no sync debug mode and no CUDA allocator stats; pool bytes and bitwise checked")
    names = ("out", "dq", "dk", "dv")
    bitwise = second is not None and all(torch.equal(first[x], second[x]) for x in names)
    pools = _pool_check(mesh, first["plans"], q, k)
    ok = bitwise and pools["ok"] and synced in (None, "none") and flat in (None, True)
    yield dict(check="a2a+mesh 2x2x2, bf16 partials, deterministic", host_syncs=synced, memory_flat=flat,
               peak_mib=[round(p / 2**20, 1) for p in peaks[:1] + peaks[-1:]], pool_bytes=pools["pool"],
               peak_live_bytes=pools["peak"], bitwise=bitwise, notes="; ".join(notes), result="ok" if ok else "FAIL")


def _pool_check(mesh, plans, q, k) -> dict:
    """Every rank's pool bytes against the larger phase's peak_live_bytes of the plans it ran."""
    u, n = mesh.ulysses, mesh.size
    s_mesh = q.shape[1] // n * u
    mq = torch.empty(s_mesh, q.shape[0], q.shape[2] // u, q.shape[3], dtype=q.dtype, device="meta")
    mk = torch.empty(s_mesh, k.shape[0], k.shape[2] // u, k.shape[3], dtype=k.dtype, device="meta")
    dims = ChunkDims.of(mq, mk, torch.float32, torch.bfloat16)
    peak = max(peak_live_bytes(p, dims) for p in plans)
    pools = {c.buffers.nbytes() for hub in mesh.hubs for c in hub.ranks}
    return dict(pool=sorted(pools), peak=peak, ok=pools == {peak})


class _TimedKernel(BlockKernel):
    """Wraps a kernel: each call's time (CUDA events on the current stream, else wall clock) and count."""

    def __init__(self, inner: BlockKernel, cuda: bool) -> None:
        self.inner, self.cuda, self.name = inner, cuda, inner.name
        self.marks: list = []
        self.seconds = 0.0

    def _timed(self, fn, *args, **kw):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            res = fn(*args, **kw)
            end.record()
            self.marks.append((start, end))
            return res
        t0 = time.perf_counter()
        res = fn(*args, **kw)
        self.seconds += time.perf_counter() - t0
        self.marks.append(None)
        return res

    def forward(self, *args, **kw):
        return self._timed(self.inner.forward, *args, **kw)

    def backward(self, *args, **kw):
        return self._timed(self.inner.backward, *args, **kw)

    def lse_for_backward(self, *args, **kw):
        return self.inner.lse_for_backward(*args, **kw)

    def kernel_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.marks) / 1e3
        return self.seconds

    def reset(self) -> None:
        self.marks, self.seconds = [], 0.0


def section_g(device, quick):
    """n = 16 (4x4) at 64K tokens on virtual ranks vs one monolithic call of the same kernel."""
    cuda = device == "cuda"
    S, h, hk, d = (512, 4, 2, 16) if quick else (65536, 32, 8, 128)
    dtype = torch.bfloat16 if cuda else torch.float32  # the CPU op is slow in bf16
    shape = MeshShape(4, 4)
    n = shape.n
    w = Workload(seq_local=S // n, heads=h, kv_heads=hk, head_dim=d)
    plans = build_plans(4, 4, "greedy", cluster=default_cluster(), workload=w)
    shards = _shards(shape, S, h, hk, d, dtype, device, seed=16)
    inner = select_kernel("auto", shards[0][0], shards[0][1])
    kern = _TimedKernel(inner, cuda)
    hub = VirtualHub(shape)
    scale = d ** -0.5
    _layer(plans, shape, shards, kern, hub, scale)  # warm-up: pools, lse layouts
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    kern.reset()
    t0, c0 = time.perf_counter(), time.thread_time()
    _layer(plans, shape, shards, kern, hub, scale)
    host = time.thread_time() - c0
    sync()
    wall = time.perf_counter() - t0
    calls = len(kern.marks)
    ksec = kern.kernel_seconds()
    del shards
    g = torch.Generator(device="cpu").manual_seed(17)
    q, k, v, do = (torch.randn(S, 1, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk, h))

    def mono():
        out, lse = inner.forward(q, k, v, causal=True, scale=scale)
        inner.backward(do, q, k, v, out, inner.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=scale)

    mono()
    sync()
    t1 = time.perf_counter()
    mono()
    sync()
    mono_s = time.perf_counter() - t1
    yield dict(S=S, n=n, shape="4x4", heads=f"{h}/{hk}", head_dim=d, kernel=inner.name, kernel_calls=calls,
               mono_ms=mono_s * 1e3, kernel_ms=ksec * 1e3, block_efficiency=ksec / mono_s, wall_ms=wall * 1e3,
               host_ms=host * 1e3, host_us_per_call=host / calls * 1e6,
               wall_us_per_call_beyond_kernels=max(0.0, wall - ksec) / calls * 1e6,
               notes="" if cuda else "CPU: kernel and host time share one processor (wall clock, no events)")


def _f(x, fmt="") -> str:
    return "-" if x is None else format(x, fmt)


#: per section: (column heads, row -> cells)
TABLES = {
    "e": (("shape", "slabs", "kernel", "dtype", "transport", "deliveries", "sleep Mcycles", "s", "result"),
          lambda r: (r["shape"], r["slabs"], r["kernel"], r["dtype"], r["transport"], r["deliveries"],
                     f"{r['sleep_mcycles']:.1f}", f"{r['seconds']:.1f}", r["result"])),
    "f": (("check", "host syncs in call 2", "max_memory_allocated flat (10 calls)", "peak MiB first/last", "pool bytes",
           "peak_live_bytes", "bitwise", "notes", "result"),
          lambda r: (r["check"], _f(r["host_syncs"]), _f(r["memory_flat"]), r["peak_mib"], r["pool_bytes"],
                     r["peak_live_bytes"], r["bitwise"], r["notes"], r["result"])),
    "g": (("S", "n", "heads", "d", "kernel", "calls", "monolithic ms", "kernel ms (sum)", "kernel sum / monolithic",
           "executor wall ms", "host CPU ms", "host us / call", "wall beyond kernels us / call", "notes"),
          lambda r: (r["S"], r["n"], r["heads"], r["head_dim"], r["kernel"], r["kernel_calls"], f"{r['mono_ms']:.2f}",
                     f"{r['kernel_ms']:.2f}", f"{r['block_efficiency']:.2f}", f"{r['wall_ms']:.2f}",
                     f"{r['host_ms']:.2f}", f"{r['host_us_per_call']:.0f}",
                     f"{r['wall_us_per_call_beyond_kernels']:.0f}", r["notes"])),
}
