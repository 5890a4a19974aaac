#!/usr/bin/env python
"""GPU checks for the block kernels, the executor on virtual ranks, block times and block-work efficiency.

    python3 scripts/gpu_check.py --out-dir "$OUT"                       # on a CUDA machine (<= 8.7 min, H200)
    python3 scripts/gpu_check.py --device cpu --quick --out-dir x/      # CI run of every section on CPU

Sections, each run in its own subprocess with its own time limit, so a crash, a sticky CUDA error or
a hang in one is reported and the others still run (rows finished before a time-out are kept):
(a) every backend that can run here (te, flash, torch) against a float64 reference: forward and
    backward, the three causal block cases plus a full block, GQA, bf16 / fp16 / fp32;
(b) mesh attention on virtual ranks (all ranks in one process, real kernels), n = 4 and 16,
    against one monolithic call of the same kernel;
(d) block-time sweep for calibration: the torch kernel, bf16, 32 heads (8 kv), d = 128, forward and
    backward for 128..16384 query rows (keys = rows), causal and not, alone and while another CUDA
    stream keeps copying 256 MiB device-to-device (a stand-in for NCCL traffic);
(c) one rank's block work under the plan (S in {128K, 1M}, n in {16, 64}) against one monolithic
    call of the same FLOPs; efficiency = monolithic / tile;
(e) the executor on a transport stand-in with NCCL's streams and delays, bitwise against the
    same-stream run; (f) warm-call hygiene (no host sync, flat memory, pool = peak_live_bytes,
    bitwise); (g) n = 16 at 64K tokens vs one monolithic call, and the host cost per kernel call
    (``scripts/gpu_check_runtime.py``); (h) calls of changing shapes as documents make them: per backend
    the kernels' per-shape state, cuDNN graph builds (slow first calls against TE's token buckets) and
    the allocator's memory, and mesh attention over batches of new documents against one repeated
    (``scripts/gpu_check_documents.py``). Every section also runs on CPU, saying what it cannot check there.
Writes ``gpu_results.md`` and ``gpu_results.json`` (raw numbers) into ``--out-dir`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_documents as document_checks  # noqa: E402
import gpu_check_runtime as runtime_checks  # noqa: E402

SECTIONS = {  # name -> (title, time limit in seconds)
    "a": ("(a) Block kernels against a float64 reference", 50),
    "b": ("(b) Mesh attention on virtual ranks vs monolithic attention", 50),
    "d": ("(d) Block-time sweep (torch kernel, bf16), alone and under concurrent copies", 75),
    "c": ("(c) One rank's block work vs one monolithic call of the same FLOPs", 65),
    "e": ("(e) NCCL-like streams: side streams, event waits and delays vs the same-stream run, bitwise", 60),
    "f": ("(f) Warm-call hygiene: a2a+mesh 2x2x2, bf16 partials, deterministic", 40),
    "g": ("(g) n = 16 at 64K tokens vs one monolithic call: block efficiency and host cost per kernel call", 90),
    "h": ("(h) Calls of changing shapes (documents): kernel caches, cuDNN graph builds, memory", 60),
    "i": ("(i) What one more kernel call costs: D documents in one varlen call vs D calls", 30),
}
TABLES = dict(runtime_checks.TABLES, **document_checks.TABLES)  # per section: (column heads, row -> cells)
LIMITS = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-3}


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def backend_status(device):
    """Per backend: 'available' or why not ('not installed', an import or constructor error)."""
    import megatron_mesh_cp.runtime.kernels as K

    status = {}
    for name in ("te", "flash", "torch"):
        try:
            K.get_kernel(name, device)
            status[name] = "available"
        except ValueError as exc:
            missing = {"te": "transformer_engine", "flash": "flash_attn"}.get(name)
            try:
                __import__(missing) if missing else None
                status[name] = f"unavailable: {exc}"
            except ImportError:
                status[name] = "not installed"
    return status


def _virtual(q, k, v, do, shape):
    """virtual_mesh_attention with the greedy planner; if that needs a module this image lacks (the
    cluster presets are YAML), with in-order plans, and say so."""
    from megatron_mesh_cp import build_plans
    from megatron_mesh_cp.virtual import virtual_mesh_attention

    try:
        return virtual_mesh_attention(q, k, v, shape, dout=do, causal=True), "greedy"
    except ImportError as exc:
        plans = build_plans(*shape, "in-order")
        return virtual_mesh_attention(q, k, v, shape, dout=do, causal=True, plans=plans), f"in-order ({exc.name} missing)"


def section_a(device, quick):
    """Per backend, dtype and block case: relative errors of out/lse/dq/dk/dv."""
    from megatron_mesh_cp.runtime import get_kernel
    from megatron_mesh_cp.runtime import BlockCase, BlockSlices
    from megatron_mesh_cp.reference import reference_attention

    s, b, h, hk, d = (64, 1, 4, 2, 64) if quick else (512, 2, 8, 2, 128)
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if device == "cuda" else (torch.float32, torch.bfloat16)
    names = [n for n, st in backend_status(device).items() if st == "available"]
    for name in names:
        kern = get_kernel(name, device)
        for dtype in dtypes:
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v, do = (torch.randn(s, b, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
            for case in (BlockCase.DIAG, BlockCase.LOWER, BlockCase.UPPER, BlockCase.FULL):
                sl = BlockSlices.of(case, s)
                qs, ks, vs, dos = q[sl.q_rows], k[sl.kv_cols], v[sl.kv_cols], do[sl.q_rows]
                bs = lambda x: x.transpose(0, 1)  # noqa: E731
                qr, kr, vr = (bs(x).clone().requires_grad_(True) for x in (qs, ks, vs))
                ro, rl = reference_attention(qr, kr, vr, causal=sl.causal)
                ro.backward(bs(dos))
                lo = lambda x: x.to(device=device, dtype=dtype).contiguous()  # noqa: E731
                row = dict(backend=name, dtype=str(dtype)[6:], block=case.value)
                try:
                    kern.check(lo(qs), lo(ks))
                except ValueError as exc:
                    yield dict(row, result="n/a", note=str(exc)[:80])
                    continue
                scale = 1 / math.sqrt(d)
                out, lse = kern.forward(lo(qs), lo(ks), lo(vs), causal=sl.causal, scale=scale)
                dq, dk, dv = kern.backward(lo(dos), lo(qs), lo(ks), lo(vs), out, kern.lse_for_backward(lse.permute(2, 0, 1)),
                                           causal=sl.causal, scale=scale)
                errs = {"out": rel(bs(out).cpu(), ro), "lse": rel(lse.cpu(), rl), "dq": rel(bs(dq).cpu(), qr.grad),
                        "dk": rel(bs(dk).cpu(), kr.grad), "dv": rel(bs(dv).cpu(), vr.grad)}
                worst, limit = max(errs.values()), LIMITS[row["dtype"]]
                yield dict(row, errors=errs, worst=worst, result="ok" if worst <= limit else f"FAIL (> {limit:g})")


def section_b(device, quick):
    """Virtual ranks vs one monolithic call of the same kernel on the whole sequence."""
    from megatron_mesh_cp.runtime import select_kernel
    from megatron_mesh_cp.reference import reference_attention

    dtypes = (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for n, shape in ((4, (2, 2)), (16, (4, 4))):
            s = (16 if quick else 256) * n
            g = torch.Generator(device="cpu").manual_seed(n)
            q, k, v, do = (torch.randn(1, s, x, 64, generator=g, dtype=torch.float64) for x in (8, 2, 2, 8))
            qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
            ro, rl = reference_attention(qr, kr, vr, causal=True)
            ro.backward(do)
            lo = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
            res, planner = _virtual(lo(q), lo(k), lo(v), lo(do), shape)
            refs = (("out", ro), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad))
            errs = [rel(res[nm].cpu(), r) for nm, r in refs]
            qs, ks, vs, dos = (lo(x).transpose(0, 1).contiguous() for x in (q, k, v, do))
            mono = select_kernel("auto", qs, ks)
            out, lse = mono.forward(qs, ks, vs, causal=True, scale=1 / 8)
            grads = mono.backward(dos, qs, ks, vs, out, mono.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=1 / 8)
            mono_errs = [rel(x.transpose(0, 1).cpu(), r) for x, (_, r) in zip((out,) + tuple(grads), refs)]
            ratio = max(e / max(m, 1e-12) for e, m in zip(errs, mono_errs))
            ok = ratio <= 2.0 or max(errs) < 1e-5
            yield dict(dtype=str(dtype)[6:], n=n, shape=f"{shape[0]}x{shape[1]}", kernel=mono.name, planner=planner,
                       mesh_err=max(errs), mono_err=max(mono_errs), ratio=ratio, result="ok" if ok else "FAIL")


def _timer(device):
    """fn, reps -> mean ms per call (CUDA events on the current stream, else wall clock)."""
    def run(fn, reps):
        if device != "cuda":
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    return run


def section_d(device, quick):
    """Block times of the torch kernel alone and while a side stream copies 256 MiB back to back."""
    from megatron_mesh_cp.runtime import get_kernel

    timer = _timer(device)
    kern = get_kernel("torch", device)
    h, hk, d = (4, 2, 32) if quick else (32, 8, 128)
    sizes = (64, 128) if quick else (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    dtype = torch.bfloat16
    copy = None
    if device == "cuda":
        nbytes = 256 << 20
        src, dst = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            dst.copy_(src)
            t_copy = timer(lambda: dst.copy_(src), 20)
        torch.cuda.synchronize()
        copy = dict(bytes=nbytes, ms=t_copy, gb_per_s=2 * nbytes / t_copy / 1e6)  # read + write
    yield dict(copy=copy)

    def loaded(fn, reps, t_fn):
        """Back-to-back reps, each enqueueing at least the kernel's time of copies on the side stream
        before the kernel, so the side stream is busy all the time the kernel runs; at most ~600
        copies pending (the launch queue is finite), so long kernels get fewer reps."""
        per = math.ceil(t_fn / copy["ms"]) + 1
        reps = max(1, min(reps, 600 // per))

        def step():
            with torch.cuda.stream(side):
                for _ in range(per):
                    dst.copy_(src)
            fn()
        ms = timer(step, reps)
        torch.cuda.synchronize()
        return ms

    for causal in (False, True):
        for s in sizes:
            torch.manual_seed(s)
            q, k, v, do = (torch.randn(s, 1, x, d, device=device, dtype=dtype) for x in (h, hk, hk, h))
            scale = 1 / math.sqrt(d)
            out, lse = kern.forward(q, k, v, causal=causal, scale=scale)
            lse_b = kern.lse_for_backward(lse.permute(2, 0, 1))
            fwd_flops = 4.0 * h * s * s * d * (0.5 if causal else 1.0)
            for direction, fn, flops in (
                ("fwd", lambda: kern.forward(q, k, v, causal=causal, scale=scale), fwd_flops),
                ("bwd", lambda: kern.backward(do, q, k, v, out, lse_b, causal=causal, scale=scale), 2.5 * fwd_flops),
            ):
                fn()
                _sync(device)
                est = timer(fn, 2)
                reps = max(3, min(50, math.ceil(30.0 / max(est, 1e-3))))
                alone = timer(fn, reps)
                under = loaded(fn, reps, alone) if copy else None
                yield dict(rows=s, keys=s, causal=causal, heads=h, kv_heads=hk, head_dim=d, dir=direction,
                           reps=reps, ms=alone, tflops=flops / alone / 1e9,
                           ms_copies=under, tflops_copies=flops / under / 1e9 if under else None,
                           slowdown=under / alone if under else None)


def section_c(device, quick):
    """One rank's forward+backward block work (kernels + merges) vs one monolithic call."""
    from megatron_mesh_cp.runtime import select_kernel
    from megatron_mesh_cp.runtime import BlockSlices, block_case
    from megatron_mesh_cp.runtime import empty_partial, merge_into
    from megatron_mesh_cp.runtime import MeshShape

    timer = _timer(device)
    h, hk, d = (4, 2, 32) if quick else (32, 8, 128)
    dtype = torch.bfloat16
    sizes = [(2048, 16), (4096, 64)] if quick else [(131072, 16), (131072, 64), (1048576, 64), (1048576, 16)]
    for S, n in sizes:
        s = S // n
        a = int(math.isqrt(n))
        shape = MeshShape(a, n // a)  # square tiles: the shape auto picks for these sizes on one node's presets
        mk = lambda heads, r: torch.randn(r, 1, heads, d, device=device, dtype=dtype)  # noqa: E731
        q, k, v, do = mk(h, s), mk(hk, s), mk(hk, s), mk(h, s)
        kern = select_kernel("auto", q, k)
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

        kk, vv = mk(hk, n * s // 2), mk(hk, n * s // 2)  # the same pairs in one call: s rows x n*s/2 keys

        def mono():
            out, lse = kern.forward(q, kk, vv, causal=False, scale=scale)
            kern.backward(do, q, kk, vv, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=False, scale=scale)

        tile(), mono()
        _sync(device)
        t_tile, t_mono = timer(tile, 1), timer(mono, 1)
        flops = 4.0 * h * d * (n * s * s / 2) * 3.5  # forward + backward (2.5x)
        yield dict(S=S, n=n, shape=f"{shape.a}x{shape.b}", kernel=kern.name, tile_ms=t_tile, mono_ms=t_mono,
                   efficiency=t_mono / t_tile, tile_tflops=flops / t_tile / 1e9)
        del q, k, v, do, kk, vv, acc_o, acc_l


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def render(env, results):
    lines = [f"# GPU check ({env['date']}, {env['device']}, torch {env['torch']}, CUDA {env['cuda']})", "",
             "Generated by `scripts/gpu_check.sh`. Backends: "
             + "; ".join(f"{k}: {v}" for k, v in env["backends"].items()) + ".", ""]
    for key, (title, _) in SECTIONS.items():
        lines += [f"## {title}", ""]
        res = results.get(key)
        if res is None:
            continue
        if "error" in res:
            lines += [f"**ERROR** ({res.get('seconds', 0):.0f} s): `{res['error'].strip().splitlines()[-1][:300]}`", ""]
        data = res.get("data", [])
        if not data:
            continue
        if key == "a":
            lines.append(_table(("backend", "dtype", "block", "worst rel. error (out/lse/dq/dk/dv)", "result"),
                                [(r["backend"], r["dtype"], r["block"], _f(r.get("worst"), ".2e"),
                                  r["result"] + (f": {r['note']}" if "note" in r else "")) for r in data]))
        elif key == "b":
            lines.append(_table(("dtype", "n", "shape", "kernel", "planner", "mesh rel. error", "monolithic rel. error",
                                 "ratio", "result"),
                                [(r["dtype"], r["n"], r["shape"], r["kernel"], r["planner"], f"{r['mesh_err']:.2e}",
                                  f"{r['mono_err']:.2e}", f"{r['ratio']:.2f}", r["result"]) for r in data]))
        elif key == "d":
            c, data = data[0]["copy"], data[1:]
            lines += ["Concurrent load: " + (f"{c['bytes'] >> 20} MiB device-to-device copies, {c['ms']:.3f} ms each "
                      f"alone ({c['gb_per_s']:.0f} GB/s read+write)." if c else "none (not on CUDA)."), "",
                      "TFLOP/s count 4·h·sq·sk·d (x0.5 causal) forward, 2.5x that backward.", ""]
            lines.append(_table(("rows=keys", "causal", "dir", "ms", "TFLOP/s", "ms under copies", "TFLOP/s under copies",
                                 "slowdown"),
                                [(r["rows"], r["causal"], r["dir"], f"{r['ms']:.4f}", f"{r['tflops']:.1f}",
                                  _f(r["ms_copies"], ".4f"), _f(r["tflops_copies"], ".1f"), _f(r["slowdown"], ".2f"))
                                 for r in data]))
        elif key in TABLES:
            head, cells = TABLES[key]
            lines.append(_table(head, [cells(r) for r in data]))
        else:
            lines.append(_table(("S", "n", "shape", "kernel", "tile ms", "monolithic ms", "efficiency", "tile TFLOP/s"),
                                [(r["S"], r["n"], r["shape"], r["kernel"], f"{r['tile_ms']:.1f}", f"{r['mono_ms']:.1f}",
                                  f"{r['efficiency']:.1%}", f"{r['tile_tflops']:.0f}") for r in data]))
        lines += ["", f"({res['seconds']:.0f} s)", ""]
    lines.append(f"Total time {env['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def run_section(args):
    """Child process: run one section, write its JSON."""
    if args.device == "cpu" and args.quick:
        torch.set_num_threads(1)  # tiny tensors: threads only add contention
    fn = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": runtime_checks.section_e,
          "f": runtime_checks.section_f, "g": runtime_checks.section_g, "h": document_checks.section_h,
          "i": document_checks.section_i}[args.section]
    t0 = time.time()
    res = dict(data=[])
    try:
        for row in fn(args.device, args.quick):  # saved after every row, so a time-out keeps them
            res["data"].append(row)
            res["seconds"] = time.time() - t0
            Path(args.part).write_text(json.dumps(res))
    except Exception:  # reported in the table; the other sections still run
        res["error"] = traceback.format_exc()
    res["seconds"] = time.time() - t0
    Path(args.part).write_text(json.dumps(res))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run of this script)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--sections", default="abdcefghi", help="which sections to run, in order")
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.section:
        return run_section(args)
    t0 = time.time()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    env = dict(date=str(datetime.date.today()), torch=torch.__version__, cuda=torch.version.cuda,
               device=torch.cuda.get_device_name() if dev == "cuda" else "CPU",
               capability=list(torch.cuda.get_device_capability()) if dev == "cuda" else None,
               backends=backend_status(dev), quick=args.quick)
    print("backends:", env["backends"], flush=True)
    results = {}
    for key in args.sections:
        title, limit = SECTIONS[key]
        print(title, flush=True)
        part = out / f".part_{key}.json"
        cmd = [sys.executable, __file__, "--section", key, "--part", str(part), "--device", dev] + (["--quick"] if args.quick else [])
        t1 = time.time()
        part.unlink(missing_ok=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit * (4 if args.quick else 1))
            err = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            err = f"timed out after {limit} s; rows finished before are kept"
        results[key] = json.loads(part.read_text()) if part.exists() else dict(data=[])
        if err and "error" not in results[key]:
            results[key].update(error=err, seconds=time.time() - t1)
        part.unlink(missing_ok=True)
        if "error" in results[key]:
            print(results[key]["error"], flush=True)
    env["seconds"] = time.time() - t0
    md = render(env, results)
    (out / "gpu_results.md").write_text(md)
    (out / "gpu_results.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    print(md)
    failed = any("error" in r for r in results.values()) or "FAIL" in md
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
