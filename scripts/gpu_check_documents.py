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

Section (i): what one more kernel call costs. D documents of s tokens as one varlen call against D
dense calls of s tokens (forward + backward, causal, the per-call heads a2a+mesh 8x runs for Llama's
GQA 32/8): the difference per call merged is the fixed cost the simulator charges every call
(``block_overhead`` plus the correction passes), beside the calibrated model's own figures for both.
It is the measurement that decides whether merging a block's document calls into one varlen call
(the lever left for heavy-tailed document mixes, docs/packing.md) pays on a real GPU.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

__all__ = ["section_h", "section_i", "TABLES"]


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


def _kernel_ms(cluster, w, docs: int, rows: int) -> float:
    """The calibrated model's kernel time (forward + backward) of one call over ``docs`` causal documents
    of ``rows`` tokens each, as the simulator prices a varlen call: its pairs at the call's query rows."""
    pairs, t = docs * rows * (rows + 1) / 2, docs * rows
    return sum(cluster.attention_time(w.pair_flops(pairs, bw), t, bw) for bw in (False, True)) * 1e3


def _fixed_ms(cluster, w, rows: int) -> float:
    """The model's fixed costs (forward + backward) of one call over ``rows`` query rows and keys."""
    return sum(w._call_cost(cluster, rows, bw) + w._keys_cost(cluster, rows, bw) for bw in (False, True)) * 1e3


def _call_cost(name: str, device: str, quick: bool):
    from megatron_mesh_cp.planning import Workload, load_cluster
    from megatron_mesh_cp.runtime.kernels import get_kernel
    from megatron_mesh_cp.runtime.kernels.base import Varlen

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    h, hk, d, s, counts, reps = (2, 1, 16, 16, (1, 4, 8), 3) if quick else (4, 1, 128, 512, (1, 4, 16, 64), 20)
    kern = get_kernel(name, device)
    g = torch.Generator(device="cpu").manual_seed(5)
    top = max(counts) * s
    q0, k0, v0, do0 = (torch.randn(top, 1, x, d, generator=g).to(device=device, dtype=dtype) for x in (h, hk, hk, h))
    scale = d ** -0.5
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cluster = load_cluster("h100-ib400")

    def step(q, k, v, do, varlen):
        out, lse = kern.forward(q, k, v, causal=True, scale=scale, varlen=varlen)
        kern.backward(do, q, k, v, out, kern.lse_for_backward(lse.permute(2, 0, 1), varlen), causal=True,
                      scale=scale, varlen=varlen)

    def timed(fn):
        fn()  # warm: graphs, buffers
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    try:
        kern.check(q0, k0, v0)
        kern.check_varlen(q0, k0, v0)
    except ValueError as exc:
        yield dict(backend=name, docs="-", tokens=s, heads=f"{h}/{hk}", head_dim=d, one_ms=None, many_ms=None,
                   us_per_call=None, model_one_ms=None, model_many_ms=None, model_us_per_call=None,
                   notes=f"skipped: {exc}")
        return
    w = Workload(seq_local=s, heads=h, kv_heads=hk, head_dim=d, bytes_per_element=2)
    for D in counts:
        t = D * s
        q, k, v, do = (x[:t] for x in (q0, k0, v0, do0))
        offs = list(range(0, t + 1, s))
        varlen = Varlen(torch.tensor(offs, dtype=torch.int32, device=device), (s,) * D, s)
        one = timed(lambda: step(q, k, v, do, varlen if D > 1 else None))
        many = timed(lambda: [step(q[a:a + s], k[a:a + s], v[a:a + s], do[a:a + s], None) for a in offs[:-1]])
        # the model: one varlen call = its documents' kernels + one call's fixed costs over all its rows
        m_one = _kernel_ms(cluster, w, D, s) + _fixed_ms(cluster, w, t)
        m_many = D * (_kernel_ms(cluster, w, 1, s) + _fixed_ms(cluster, w, s))
        yield dict(backend=name, docs=D, tokens=s, heads=f"{h}/{hk}", head_dim=d, one_ms=one, many_ms=many,
                   us_per_call=(many - one) / (D - 1) * 1e3 if D > 1 else None, model_one_ms=m_one,
                   model_many_ms=m_many, model_us_per_call=(m_many - m_one) / (D - 1) * 1e3 if D > 1 else None,
                   notes="" if cuda else "CPU: the dense CPU math, not a GPU's fixed costs")


def section_i(device, quick):
    """Rows: per varlen backend and document count, one varlen call against one call per document."""
    from gpu_check import backend_status

    status = backend_status(device)
    names = ("te", "flash") if device == "cuda" else ("torch",)
    for name in names:
        if status.get(name) == "available":
            yield from _call_cost(name, device, quick)


def _f(x, fmt="") -> str:
    return "-" if x is None else format(x, fmt)


#: column heads and row -> cells (gpu_check.render)
TABLES = {
    "h": (("part", "backend", "calls / batches", "sizes", "TE bucket pairs", "slow first calls",
           "median ms first / new", "median ms second / same", "memory growth MiB", "state", "notes", "result"),
          lambda r: (r["part"], r["backend"], r["calls"], r["sizes"], r["buckets"], r["slow_first_calls"],
                     f"{r['median_first_ms']:.2f}", f"{r['median_second_ms']:.2f}", _f(r["memory_growth_mib"], ".1f"),
                     r["state"], r["notes"], r["result"])),
    "i": (("backend", "documents D", "tokens each", "heads", "d", "one varlen call ms", "D calls ms",
           "us per call merged", "model: one call ms", "model: D calls ms", "model: us per call merged", "notes"),
          lambda r: (r["backend"], r["docs"], r["tokens"], r["heads"], r["head_dim"], _f(r["one_ms"], ".3f"),
                     _f(r["many_ms"], ".3f"), _f(r["us_per_call"], ".1f"), _f(r["model_one_ms"], ".3f"),
                     _f(r["model_many_ms"], ".3f"), _f(r["model_us_per_call"], ".1f"), r["notes"])),
}
