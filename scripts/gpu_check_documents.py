"""gpu_check section (h): calls of changing shapes, as documents make them -- memory, kernel caches, graph builds.

With documents every batch brings block sub-calls of new sizes, different per rank. Two things must
stay bounded there: the kernels' own per-shape state (the flash kernel's dq/dk/dv buffers, at most
``flash.GRAD_SHAPES`` shapes) and Transformer Engine's cuDNN graphs (one per distinct key, never
freed; the te kernel issues batch-1 sub-calls as THD of one sequence, whose keys TE buckets).

* shapes: per backend that runs here, forward + backward of dense rectangles of many distinct
  (rows, keys) sizes, each size twice: the first call of a size against the second (a first call
  that is far slower built a cuDNN graph), the backend's per-shape state, and the caching
  allocator's memory over the second half (flat). TE: slow first calls should number about the
  distinct TE token-bucket pairs, not the distinct sizes. On CPU: the torch kernel, small sizes
  (no allocator, no graphs: said so).
* documents: mesh attention on virtual ranks over batches of new documents against the same batch
  repeated: ms per batch (new / repeated near 1: no per-batch graph builds) and peak memory over
  the batches (flat). Needs a kernel with varlen calls (te, flash; torch on CPU).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

__all__ = ["section_h", "TABLES"]


def _sizes(quick: bool, seed: int = 0):
    rng = random.Random(seed)
    lo, hi, count = (16, 200, 12) if quick else (300, 9000, 48)
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(count)]


def _bucket(t: int) -> int:
    from megatron_mesh_cp.runtime.kernels.te import _te_bucket

    return _te_bucket(t)


def _state(kern) -> str:
    if kern.name == "flash":
        from megatron_mesh_cp.runtime.kernels import flash

        return f"{len(kern._grads)} grad-buffer shapes (bound {flash.GRAD_SHAPES})"
    if kern.name == "te":
        return f"{sum(kern._routes.values())} THD route configs"
    return "-"


def _shapes(name: str, device: str, quick: bool):
    from megatron_mesh_cp.runtime.kernels import get_kernel

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    h, hk, d = (2, 1, 16) if quick else (16, 4, 128)
    kern = get_kernel(name, device)
    sizes = _sizes(quick)
    g = torch.Generator(device="cpu").manual_seed(1)
    big = max(max(s) for s in sizes)
    q0, k0, v0 = (torch.randn(big, 1, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk))
    first, second, mem = [], [], []

    def call(sq, sk):
        q, k, v = q0[:sq].contiguous(), k0[:sk].contiguous(), v0[:sk].contiguous()
        kern.check(q, k, v)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse = kern.forward(q, k, v, causal=False, scale=d ** -0.5)
        kern.backward(q, q, k, v, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=False, scale=d ** -0.5)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for i, (sq, sk) in enumerate(sizes):
        first.append(call(sq, sk))
        second.append(call(sq, sk))
        mem.append(torch.cuda.memory_allocated() if cuda else 0)
    half = len(sizes) // 2
    growth = (max(mem[half:]) - mem[half]) / 2**20 if cuda else None
    slow = sum(f > 3 * max(s, 1e-3) for f, s in zip(first, second))
    buckets = len({(_bucket(a), _bucket(b)) for a, b in sizes})
    ok = growth is None or growth <= 64
    if name == "flash":
        from megatron_mesh_cp.runtime.kernels import flash

        ok = ok and len(kern._grads) <= flash.GRAD_SHAPES
    if name == "te":
        ok = ok and slow <= buckets + 2
    return dict(part="shapes", backend=name, calls=2 * len(sizes), sizes=len(sizes), buckets=buckets,
                slow_first_calls=slow, median_first_ms=statistics.median(first),
                median_second_ms=statistics.median(second), memory_growth_mib=growth, state=_state(kern),
                notes="" if cuda else "CPU: no caching allocator, no cuDNN graphs", result="ok" if ok else "FAIL")


def _documents(device: str, quick: bool):
    from megatron_mesh_cp.runtime import kernels as K
    from megatron_mesh_cp.virtual import virtual_mesh_attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq, shape, h, hk, d, batches = (256, (1, 2), 2, 1, 16, 4) if quick else (32768, (2, 4), 16, 4, 128, 8)
    spec = K.input_spec((seq // 8, 1, h, d), dtype, device)
    kern = K.select_kernel("auto", spec, K.input_spec((seq // 8, 1, hk, d), dtype, device), packed=True)
    g = torch.Generator(device="cpu").manual_seed(2)
    q, k, v = (torch.randn(1, seq, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk))
    rng = random.Random(3)

    def docs():
        cut = sorted(rng.sample(range(1, seq), 24 if not quick else 4))
        return torch.tensor([0] + cut + [seq], dtype=torch.int32)

    def batch(cu):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        virtual_mesh_attention(q, k, v, shape, dout=q, causal=True, cu_seqlens=cu, kernel=kern)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    fixed = docs()
    batch(fixed)
    new, peaks = [], []
    for _ in range(batches):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        new.append(batch(docs()))
        peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
    same = [batch(fixed) for _ in range(3)]
    growth = (max(peaks[1:]) - peaks[1]) / 2**20 if cuda else None
    ratio = statistics.median(new) / statistics.median(same)
    ok = (growth is None or growth <= 256) and (not cuda or ratio <= 2.0)
    return dict(part="documents", backend=kern.name, calls=batches, sizes=f"{seq} tokens, mesh {shape[0]}x{shape[1]}",
                buckets="-", slow_first_calls="-", median_first_ms=statistics.median(new),
                median_second_ms=statistics.median(same), memory_growth_mib=growth, state=f"new/same {ratio:.2f}",
                notes="" if cuda else "CPU: ms include the dense CPU math; no allocator", result="ok" if ok else "FAIL")


def section_h(device, quick):
    """Rows: per backend, calls of changing shapes; then documents over changing batches."""
    from gpu_check import backend_status

    status = backend_status(device)
    for name in ("te", "flash", "torch"):
        if status.get(name) == "available":
            yield _shapes(name, device, quick)
    varlen = device != "cuda" or any(status.get(n) == "available" for n in ("te", "flash"))
    if varlen:
        yield _documents(device, quick)


def _f(x, fmt="") -> str:
    return "-" if x is None else format(x, fmt)


#: column heads and row -> cells (gpu_check.render)
TABLES = {
    "h": (("part", "backend", "calls / batches", "sizes", "TE bucket pairs", "slow first calls",
           "median ms first / new", "median ms second / same", "memory growth MiB", "state", "notes", "result"),
          lambda r: (r["part"], r["backend"], r["calls"], r["sizes"], r["buckets"], r["slow_first_calls"],
                     f"{r['median_first_ms']:.2f}", f"{r['median_second_ms']:.2f}", _f(r["memory_growth_mib"], ".1f"),
                     r["state"], r["notes"], r["result"])),
}
