#!/usr/bin/env python
"""Benchmark one attention layer (forward + backward) under CP algorithms on real process groups.

    torchrun --nproc_per_node N scripts/bench_attention.py --seq 1048576 --heads 32 --kv-heads 8 \\
        --head-dim 128 --shapes auto,16x16,8x32 --algos mesh,p2p,all_gather,a2a,a2a+p2p \\
        --csv bench.csv --plot bench.png

Mesh runs every listed shape (``auto`` asks the simulator); the Megatron/TE algorithms (``p2p``,
``all_gather``, ``a2a``, ``a2a+p2p``) run through Transformer Engine's DotProductAttention when TE
is installed, and are reported as skipped otherwise. Reports time (slowest rank), TFLOP/s per GPU
and bytes sent per rank: measured for mesh, from the algorithm's traffic formula for TE (marked
"model"). Runs on CPU with gloo at small scale too, so the script can be trusted before GPU hours.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp import MeshGroups, mesh_attention, valid_shapes, zigzag_shard  # noqa: E402
from megatron_mesh_cp.cluster import Workload, load_cluster  # noqa: E402
from megatron_mesh_cp.topology import MeshShape  # noqa: E402

TE_ALGOS = ("p2p", "all_gather", "a2a", "a2a+p2p")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timed(fn, iters, warmup, device):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
    return float(t)


def _inputs(args, n, rank, device, dtype):
    g = torch.Generator().manual_seed(1234)
    s = args.seq
    full = [torch.randn(s, args.batch, hh, args.head_dim, generator=g) for hh in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    return [zigzag_shard(x, n, rank, dim=0).to(device=device, dtype=dtype).requires_grad_(i < 3) for i, x in enumerate(full)]


def bench_mesh(args, shape, device, dtype, cluster):
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = MeshGroups.create(shape)
    mesh.cluster = cluster
    q, k, v, do = _inputs(args, n, rank, device, dtype)

    def step():
        out = mesh_attention(q, k, v, mesh, causal=True, layout="sbhd", kernel=args.kernel)
        out.backward(do)

    step()
    mesh.traffic.reset()
    t = _timed(step, args.iters, args.warmup, device)
    calls = args.iters + args.warmup
    return t, mesh.traffic.total_sent() / calls, "measured"


def bench_te(args, algo, device, dtype):
    import transformer_engine.pytorch as te

    n, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(range(n))
    if algo == "a2a+p2p":
        inner = math.gcd(args.heads, min(8, n))
        groups = [dist.new_group([r0 + i for i in range(inner)]) for r0 in range(0, n, inner)]
        rings = [dist.new_group(list(range(i, n, inner))) for i in range(inner)]
        cp_group = [groups[rank // inner], rings[rank % inner]]
    else:
        cp_group = dist.group.WORLD
    attn = te.DotProductAttention(args.heads, args.head_dim, num_gqa_groups=args.kv_heads, attention_dropout=0.0,
                                  qkv_format="sbhd", attn_mask_type="causal")
    attn.set_context_parallel_group(cp_group, ranks, torch.cuda.Stream(), algo)
    q, k, v, do = _inputs(args, n, rank, device, dtype)

    def step():
        out = attn(q, k, v)
        out.backward(do.reshape(out.shape))

    t = _timed(step, args.iters, args.warmup, device)
    return t, _model_bytes(args, algo, n, dtype), "model"


def _model_bytes(args, algo, n, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    u = args.seq // n * args.batch * args.heads * args.head_dim * e
    gamma = args.kv_heads / args.heads
    if algo == "p2p":
        return 6 * gamma * u * (n - 1)
    if algo == "all_gather":
        return 6 * gamma * u * (n - 1)
    frac = (n - 1) / n
    if algo == "a2a":
        return frac * (u + 2 * max(gamma, 1 / args.heads * n) * u) * 2 + frac * 2 * u
    return float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--shapes", default="auto", help="comma list of mesh shapes AxB and/or auto")
    p.add_argument("--algos", default="mesh," + ",".join(TE_ALGOS))
    p.add_argument("--kernel", default="auto")
    p.add_argument("--cluster", default="h100-ib400", help="what mesh_shape=auto and the planner tune for")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    n, rank = dist.get_world_size(), dist.get_rank()
    if args.seq % (2 * n):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2 * world size = {2 * n}")
    cluster = load_cluster(args.cluster)
    flops = 4.0 * args.batch * args.heads * args.head_dim * (args.seq * args.seq / 2) * 3.5 / n
    rows = []
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if "mesh" in algos:
        for text in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            if text == "auto":
                from megatron_mesh_cp.autoshape import choose_shape

                w = Workload(seq_local=args.seq // n, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                             batch=args.batch, bytes_per_element=torch.empty((), dtype=dtype).element_size())
                shape = choose_shape(n, cluster, w).shape
                label = f"mesh auto ({shape})"
            else:
                shape = MeshShape.for_size(text, n)
                label = f"mesh {shape}"
            t, nbytes, how = bench_mesh(args, (shape.a, shape.b), device, dtype, cluster)
            rows.append((label, t, flops / t / 1e12, nbytes, how))
    te_ok = True
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        te_ok = False
    for algo in [a for a in algos if a in TE_ALGOS]:
        if not (te_ok and cuda):
            if rank == 0:
                print(f"skip {algo}: needs Transformer Engine on CUDA", flush=True)
            continue
        t, nbytes, how = bench_te(args, algo, device, dtype)
        rows.append((f"te {algo}", t, flops / t / 1e12, nbytes, how))
    if rank == 0:
        print(f"{'algorithm':<24}{'ms':>10}{'TFLOP/s/GPU':>14}{'MiB/rank':>12}  bytes")
        for label, t, tf, nb, how in rows:
            print(f"{label:<24}{t * 1e3:>10.2f}{tf:>14.3f}{nb / 2**20:>12.2f}  {how}")
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                wr = csv.writer(f)
                wr.writerow(["algorithm", "world", "seq", "heads", "kv_heads", "head_dim", "dtype", "ms", "tflops_per_gpu",
                             "bytes_per_rank", "bytes_source"])
                for label, t, tf, nb, how in rows:
                    wr.writerow([label, n, args.seq, args.heads, args.kv_heads, args.head_dim, str(dtype).replace("torch.", ""),
                                 f"{t * 1e3:.4f}", f"{tf:.4f}", int(nb) if nb == nb else "", how])
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
            labels = [r[0] for r in rows]
            a1.barh(labels, [r[1] * 1e3 for r in rows], color="#4c72b0")
            a1.set_xlabel("ms per layer (fwd+bwd)")
            a2.barh(labels, [r[3] / 2**20 for r in rows], color="#dd8452")
            a2.set_xlabel("MiB sent per rank")
            fig.suptitle(f"CP={n}, S={args.seq}, heads {args.heads}/{args.kv_heads}, d={args.head_dim}, {device.type}")
            fig.tight_layout()
            fig.savefig(args.plot, dpi=110)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
