#!/usr/bin/env python
"""GPU checks for the block kernels, the executor on virtual ranks, and block-work efficiency.

    python scripts/gpu_check.py [--out docs/gpu_results.md]          # on a CUDA machine (< 8 min, H200)
    python scripts/gpu_check.py --device cpu --quick --out x.md       # CI smoke run of this script

(a) every available backend (te, flash, torch) against a float64 reference: forward and backward,
    the three causal block cases plus a full block, GQA, bf16 and fp16;
(b) mesh attention on virtual ranks (all ranks in one process, real kernels) for n = 4 and 16
    against one monolithic attention call;
(c) timing, for S in {128K, 1M}, n in {16, 64}, 32 heads (8 kv), d = 128, causal: one rank's block
    work under the plan (every block of its tile plus the merges, no communication) against one
    monolithic flash call doing the same FLOPs; efficiency = monolithic / tile (target >= 90%).
Writes a markdown table with the date and device.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp import MeshShape, build_plans  # noqa: E402
from megatron_mesh_cp.autoshape import choose_shape  # noqa: E402
from megatron_mesh_cp.cluster import Workload, load_cluster  # noqa: E402
from megatron_mesh_cp.execute import Executor  # noqa: E402
from megatron_mesh_cp.kernels import available_kernels, get_kernel  # noqa: E402
from megatron_mesh_cp.layout import BlockCase, BlockSlices, block_case  # noqa: E402
from megatron_mesh_cp.merge import empty_partial, merge_into  # noqa: E402
from megatron_mesh_cp.reference import reference_attention  # noqa: E402
from megatron_mesh_cp.virtual import virtual_mesh_attention  # noqa: E402


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_kernels(device, dtypes, quick):
    """(a): per backend, per dtype, per block case: max relative error of out/lse/dq/dk/dv."""
    rows = []
    s, b, h, hk, d = (64, 1, 4, 2, 64) if quick else (512, 2, 8, 2, 128)
    names = [n for n in available_kernels() if device == "cuda" or n == "torch"]
    for name in names:
        kern = get_kernel(name, device)
        for dtype in dtypes:
            g = torch.Generator(device="cpu").manual_seed(0)
            mk = lambda heads: torch.randn(s, b, heads, d, generator=g, dtype=torch.float64)  # noqa: E731
            q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
            for case in (BlockCase.DIAG, BlockCase.LOWER, BlockCase.UPPER, BlockCase.FULL):
                sl = BlockSlices.of(case, s)
                qs, ks, vs, dos = q[sl.q_rows], k[sl.kv_cols], v[sl.kv_cols], do[sl.q_rows]
                bs = lambda x: x.transpose(0, 1)  # noqa: E731
                qr, kr, vr = (bs(x).clone().requires_grad_(True) for x in (qs, ks, vs))
                ro, rl = reference_attention(qr, kr, vr, causal=sl.causal)
                ro.backward(bs(dos))
                lo = lambda x: x.to(device=device, dtype=dtype).contiguous()  # noqa: E731
                try:
                    kern.check(lo(qs), lo(ks))
                except ValueError as exc:
                    rows.append((name, str(dtype).replace("torch.", ""), case.value, "n/a", str(exc)[:60]))
                    continue
                scale = 1 / math.sqrt(d)
                out, lse = kern.forward(lo(qs), lo(ks), lo(vs), causal=sl.causal, scale=scale)
                dq, dk, dv = kern.backward(lo(dos), lo(qs), lo(ks), lo(vs), out, kern.lse_for_backward(lse.permute(2, 0, 1)),
                                           causal=sl.causal, scale=scale)
                errs = {"out": rel(bs(out).cpu(), ro), "lse": rel(lse.cpu(), rl), "dq": rel(bs(dq).cpu(), qr.grad),
                        "dk": rel(bs(dk).cpu(), kr.grad), "dv": rel(bs(dv).cpu(), vr.grad)}
                worst = max(errs.values())
                limit = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
                rows.append((name, str(dtype).replace("torch.", ""), case.value, f"{worst:.2e}",
                             "ok" if worst <= limit else f"FAIL (> {limit:g})"))
    return rows


def check_virtual(device, dtype, quick):
    """(b): virtual ranks vs one monolithic call of the same kernel on the whole sequence."""
    rows = []
    for n, shape in ((4, (2, 2)), (16, (4, 4))):
        s = (16 if quick else 256) * n
        g = torch.Generator(device="cpu").manual_seed(n)
        q, k, v, do = (torch.randn(1, s, hh, 64, generator=g, dtype=torch.float64) for hh in (8, 2, 2, 8))
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ro, rl = reference_attention(qr, kr, vr, causal=True)
        ro.backward(do)
        lo = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
        res = virtual_mesh_attention(lo(q), lo(k), lo(v), shape, dout=lo(do), causal=True)
        errs = [rel(res[nm].cpu(), r) for nm, r in (("out", ro), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad))]
        # the monolithic single-device error of the same dtype is the yardstick
        mono = get_kernel("auto", device)
        qs, ks, vs, dos = (lo(x).transpose(0, 1).contiguous() for x in (q, k, v, do))
        out, lse = mono.forward(qs, ks, vs, causal=True, scale=1 / 8)
        dq, dk, dv = mono.backward(dos, qs, ks, vs, out, mono.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=1 / 8)
        mono_errs = [rel(x.transpose(0, 1).cpu(), r) for x, r in ((out, ro), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad))]
        ratio = max(e / max(m, 1e-12) for e, m in zip(errs, mono_errs))
        rows.append((n, f"{shape[0]}x{shape[1]}", f"{max(errs):.2e}", f"{max(mono_errs):.2e}", f"{ratio:.2f}",
                     "ok" if ratio <= 2.0 or max(errs) < 1e-5 else "FAIL"))
    return rows


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_tile(device, dtype, S, n, quick, reps=2):
    """(c): one rank's forward+backward block work (kernels + merges) vs one monolithic call."""
    h, hk, d = 32, 8, 128
    if quick:
        h, hk, d = 4, 2, 32
    s = S // n
    w = Workload(seq_local=s, heads=h, kv_heads=hk, head_dim=d, bytes_per_element=2)
    shape = choose_shape(n, load_cluster("h100-ib400"), w).shape
    kern = get_kernel("auto", device)
    mk = lambda heads, rows: torch.randn(rows, 1, heads, d, device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(h, s), mk(hk, s), mk(hk, s), mk(h, s)
    scale = 1 / math.sqrt(d)
    blocks = [block_case(shape.q_chunk(0, i), shape.kv_chunk(0, j), True) for i in range(shape.a) for j in range(shape.b)]
    acc_o, acc_l = empty_partial(q, torch.float32)

    def tile():
        for case in blocks:
            sl = BlockSlices.of(case, s)
            out, lse = kern.forward(q[sl.q_rows], k[sl.kv_cols], v[sl.kv_cols], causal=sl.causal, scale=scale)
            merge_into(acc_o[sl.q_rows], acc_l[sl.q_rows], out, lse.permute(2, 0, 1))
            kern.backward(do[sl.q_rows], q[sl.q_rows], k[sl.kv_cols], v[sl.kv_cols], out,
                          kern.lse_for_backward(lse.permute(2, 0, 1)), causal=sl.causal, scale=scale)

    # the same pairs in one call: s query rows against n*s/2 keys, no mask
    kk, vv = mk(hk, n * s // 2), mk(hk, n * s // 2)

    def mono():
        out, lse = kern.forward(q, kk, vv, causal=False, scale=scale)
        kern.backward(do, q, kk, vv, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=False, scale=scale)

    def best(fn):
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    t_tile, t_mono = best(tile), best(mono)
    flops = 4.0 * h * d * (n * s * s / 2) * 3.5  # forward + backward (2.5x)
    return (S, n, f"{shape.a}x{shape.b}", kern.name, f"{t_tile * 1e3:.1f}", f"{t_mono * 1e3:.1f}",
            f"{t_mono / t_tile:.1%}", f"{flops / t_tile / 1e12:.0f}")


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run of this script)")
    p.add_argument("--out", default="docs/gpu_results.md")
    args = p.parse_args()
    t0 = time.time()
    dev = args.device
    dtypes = (torch.bfloat16, torch.float16) if dev == "cuda" else (torch.float32, torch.bfloat16)
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    lines = [f"# GPU check ({datetime.date.today()}, {name}, torch {torch.__version__})", "",
             f"Generated by `scripts/gpu_check.sh` (`python scripts/gpu_check.py{' --quick' if args.quick else ''}`). "
             f"Backends available: {', '.join(available_kernels())}.", ""]
    print("(a) block kernels vs float64", flush=True)
    ka = check_kernels(dev, dtypes, args.quick)
    lines += ["## (a) Block kernels against a float64 reference (worst of out/lse/dq/dk/dv)", "",
              table(("backend", "dtype", "block", "rel. error", "result"), ka), ""]
    print("(b) virtual ranks", flush=True)
    kb = check_virtual(dev, dtypes[0], args.quick)
    lines += ["## (b) Mesh attention on virtual ranks vs monolithic attention", "",
              table(("n", "shape", "mesh rel. error", "monolithic rel. error", "ratio", "result"), kb), ""]
    print("(c) timing", flush=True)
    sizes = [(2048, 16), (4096, 64)] if args.quick else [(131072, 16), (131072, 64), (1048576, 16), (1048576, 64)]
    kc = [time_tile(dev, dtypes[0], S, n, args.quick) for S, n in sizes]
    lines += ["## (c) One rank's block work vs one monolithic call of the same FLOPs (forward + backward)", "",
              table(("S", "n", "shape", "kernel", "tile ms", "monolithic ms", "efficiency", "tile TFLOP/s"), kc), "",
              f"Total time {time.time() - t0:.0f} s."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = any("FAIL" in str(r[-1]) for r in ka + kb)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
