#!/usr/bin/env python
"""CPU tile efficiency: one block-kernel call over k*L keys vs k calls over L keys (plus merges).

    OMP_NUM_THREADS=1 python scripts/bench_grouped_calls.py [--rows 1024] [--keys 256,512] \\
        [--groups 1,2,4,8] [--heads 4] [--kv-heads 4] [--dtype fp32] [--repeats 3] [--backward]

Why: a grouped Compute op (several blocks that share a Q chunk, their KV pieces contiguous in the
receive slab) runs one kernel call where the plan used to run k. The simulator prices that as one
call overhead plus the summed work; this measures, on the CPU flash op the torch backend uses
(``_scaled_dot_product_flash_attention_for_cpu``), whether a long call is as efficient per key as
short ones and what the k - 1 merges of the partial (out, lse) cost. Forward: ``one`` = one call
over k*L keys merged once into the running accumulator (what the executor does per call),
``split`` = k calls over L keys, each merged. Backward (``--backward``): one call vs k calls, each
adding its dq into the accumulator. Prints seconds per call shape and the ratio split / one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp.runtime import TorchKernel  # noqa: E402
from megatron_mesh_cp.runtime import merge_into  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, op dispatch)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def measure(rows: int, keys: int, k: int, heads: int, kv_heads: int, d: int, dtype, repeats: int,
            backward: bool) -> tuple:
    """(seconds for one call over k*keys, seconds for k calls over keys) incl. merges / dq adds."""
    g = torch.Generator().manual_seed(0)
    kern = TorchKernel()
    scale = d ** -0.5
    q = torch.randn(rows, 1, heads, d, generator=g).to(dtype)
    kk = torch.randn(k * keys, 1, kv_heads, d, generator=g).to(dtype)
    vv = torch.randn(k * keys, 1, kv_heads, d, generator=g).to(dtype)
    acc_dt = torch.float64 if dtype == torch.float64 else torch.float32
    acc_out = torch.zeros(rows, 1, heads, d, dtype=acc_dt)
    acc_lse = torch.full((rows, 1, heads), float("-inf"), dtype=acc_dt)
    if not backward:
        def run(parts):
            acc_out.zero_()
            acc_lse.fill_(float("-inf"))
            step = (k * keys) // parts
            for p in range(parts):
                sl = slice(p * step, (p + 1) * step)
                out, lse = kern.forward(q, kk[sl], vv[sl], causal=False, scale=scale)
                merge_into(acc_out, acc_lse, out, lse.permute(2, 0, 1))
        return _time(lambda: run(1), repeats), _time(lambda: run(k), repeats)
    out, lse = kern.forward(q, kk, vv, causal=False, scale=scale)
    dout = torch.randn(rows, 1, heads, d, generator=g).to(dtype)
    lse_b = kern.lse_for_backward(lse.permute(2, 0, 1))
    acc_dq = torch.zeros(rows, 1, heads, d, dtype=acc_dt)
    acc_dk = torch.zeros(k * keys, 1, kv_heads, d, dtype=acc_dt)
    acc_dv = torch.zeros_like(acc_dk)

    def run_b(parts):
        acc_dq.zero_()
        step = (k * keys) // parts
        for p in range(parts):
            sl = slice(p * step, (p + 1) * step)
            dq, dk, dv = kern.backward(dout, q, kk[sl], vv[sl], out, lse_b, causal=False, scale=scale)
            acc_dq.add_(dq)
            acc_dk[sl].add_(dk)
            acc_dv[sl].add_(dv)
    return _time(lambda: run_b(1), repeats), _time(lambda: run_b(k), repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024, help="query rows of the Q chunk (all rows of a lower block)")
    p.add_argument("--keys", default="256,512", help="keys per block L (a zigzag piece), comma list")
    p.add_argument("--groups", default="1,2,4,8", help="blocks per grouped call k, comma list")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="time the backward kernel instead")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.dtype}, rows {args.rows}, "
          f"heads {args.heads}/{args.kv_heads} kv, d {args.head_dim}, {'backward' if args.backward else 'forward'}")
    print(f"{'L':>6}{'k':>4}{'one call s':>13}{'k calls s':>12}{'k calls / one':>15}{'one: us per 1k keys':>21}")
    for keys in (int(x) for x in args.keys.split(",")):
        for k in (int(x) for x in args.groups.split(",")):
            one, split = measure(args.rows, keys, k, args.heads, args.kv_heads, args.head_dim, dtype,
                                 args.repeats, args.backward)
            print(f"{keys:>6}{k:>4}{one:>13.4f}{split:>12.4f}{split / one:>15.3f}{one / (k * keys) * 1e9:>21.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
