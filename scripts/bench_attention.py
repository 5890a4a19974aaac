#!/usr/bin/env python
"""Benchmark one attention layer (forward + backward) under CP algorithms on real process groups.

    torchrun --nproc_per_node N scripts/bench_attention.py --seq 1048576 --heads 32 --kv-heads 8 \\
        --head-dim 128 --shapes auto,16x16,1x256,8x2x16 --algos mesh,a2a+mesh,p2p,a2a+p2p \\
        --csv bench.csv --markdown bench.md --plot bench.png

``mesh`` runs every listed ``AxB`` shape, ``a2a+mesh`` (Ulysses x mesh) every ``UxAxB`` shape; ``auto``
lets the simulator choose for each of them (``1xN`` is Ring-Attention and ``Ux1xB`` Ulysses x Ring on
our executor). The Megatron/TE algorithms (``p2p``, ``all_gather``, ``a2a``, ``a2a+p2p``, its Ulysses
degree ``--ulysses``) run through Transformer Engine's DotProductAttention when TE is installed, and
are reported as skipped otherwise. Each rank generates only its own zigzag share
(S/n tokens; the full sequence never exists anywhere). Time: ``--repeats`` timed runs of ``--iters``
steps each, the slowest rank per run; reported as the median with the min-max spread. Bytes sent per
rank: measured for mesh, from the algorithm's traffic formula for TE (labelled "formula", hatched in
the plot). Runs on CPU with gloo at small scale too, so the script can be trusted before GPU hours.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp import MeshGroups, mesh_attention  # noqa: E402
from megatron_mesh_cp.planning.cluster import Workload, load_cluster  # noqa: E402
from megatron_mesh_cp.logs import configure as configure_logging  # noqa: E402
from megatron_mesh_cp.runtime.mesh import PlanOptions  # noqa: E402
from megatron_mesh_cp.runtime.topology import MeshShape  # noqa: E402

TE_ALGOS = ("p2p", "all_gather", "a2a", "a2a+p2p")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timed(fn, iters, warmup, repeats, device):
    """Seconds per step for each of ``repeats`` runs of ``iters`` steps (slowest rank per run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
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
        times.append(float(t))
    return times


def _inputs(args, n, rank, device, dtype, seed=1234):
    """q, k, v, dout: this rank's zigzag share only (pieces rank and 2n-1-rank, S/n tokens).

    Piece p of tensor i is drawn from its own seed on the target device, so the shares of all ranks
    together are one well-defined sequence that no rank ever materialises.
    """
    if args.seq % (2 * n):
        raise ValueError(f"--seq {args.seq} must be divisible by 2 * world size = {2 * n}")
    m = args.seq // (2 * n)
    out = []
    for i, hh in enumerate((args.heads, args.kv_heads, args.kv_heads, args.heads)):
        parts = []
        for piece in (rank, 2 * n - 1 - rank):
            g = torch.Generator(device=device).manual_seed(seed + 1_000_003 * i + piece)
            parts.append(torch.randn(m, args.batch, hh, args.head_dim, generator=g, device=device, dtype=torch.float32))
        out.append(torch.cat(parts).to(dtype).requires_grad_(i < 3))
    return out


def bench_mesh(args, shape, device, dtype, cluster, ulysses=1):
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = MeshGroups.create(shape, ulysses=ulysses, plan_options=PlanOptions(cluster=cluster))
    q, k, v, do = _inputs(args, n, rank, device, dtype)

    def step():
        out = mesh_attention(q, k, v, mesh, causal=True, layout="sbhd", kernel=args.kernel)
        out.backward(do)

    step()
    mesh.traffic.reset()
    times = _timed(step, args.iters, args.warmup, args.repeats, device)
    calls = args.iters * args.repeats + args.warmup
    return times, mesh.traffic.total_sent() / calls, "measured"


def bench_te(args, algo, device, dtype):
    import transformer_engine.pytorch as te

    n, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(range(n))
    if algo == "a2a+p2p":
        inner = args.ulysses or math.gcd(args.heads, min(8, n))
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

    times = _timed(step, args.iters, args.warmup, args.repeats, device)
    return times, _formula_bytes(args, algo, n, dtype), "formula"


def _formula_bytes(args, algo, n, dtype):
    """What TE's algorithm sends per rank by its traffic formula (not measured: TE has no counters)."""
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


def _mesh_runs(algos, shapes):
    """(algorithm, shape text) for every mesh-family run: AxB shapes for mesh, UxAxB for a2a+mesh, auto for both."""
    texts = [t.strip().lower().replace("×", "x") for t in shapes.split(",") if t.strip()]
    bad = [t for t in texts if t != "auto" and not (t.count("x") in (1, 2) and all(p.isdigit() for p in t.split("x")))]
    if bad:
        raise SystemExit(f"--shapes: {', '.join(bad)}: each must be AxB (mesh), UxAxB (a2a+mesh) or auto")
    runs = []
    for algo, factors in (("mesh", 1), ("a2a+mesh", 2)):
        if algo in algos:
            runs += [(algo, t) for t in texts if t == "auto" or t.count("x") == factors]
    return runs


def _shape(args, algo, text, n, cluster, dtype):
    """((a, b), u, row label) for one mesh-family run; auto asks the simulator (the same choice as the launcher)."""
    from megatron_mesh_cp.planning.autoshape import choose_hybrid_shape, choose_shape

    if text == "auto":
        w = Workload(seq_local=args.seq // n, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     batch=args.batch, bytes_per_element=torch.empty((), dtype=dtype).element_size())
        if algo == "mesh":
            shape, u = choose_shape(n, cluster, w).shape, 1
        else:
            ch = choose_hybrid_shape(n, cluster, w)
            shape, u = ch.shape, ch.u
        name = f"{shape}" if u == 1 else f"{u}x{shape}"
        return (shape.a, shape.b), u, f"{algo} auto ({name})"
    if algo == "mesh":
        shape = MeshShape.for_size(text, n)
        return (shape.a, shape.b), 1, f"mesh {shape}"
    u, a, b = (int(x) for x in text.split("x"))
    if u * a * b != n or args.heads % u:
        raise SystemExit(f"--shapes {text}: a2a+mesh needs U*A*B = world size {n} and U dividing --heads {args.heads}")
    return (a, b), u, f"a2a+mesh {text}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--shapes", default="auto",
                   help="comma list: AxB (mesh), UxAxB (a2a+mesh), auto (the simulator's choice for each)")
    p.add_argument("--algos", default="mesh,a2a+mesh," + ",".join(TE_ALGOS))
    p.add_argument("--ulysses", type=int, default=None, help="TE a2a+p2p's Ulysses degree (default gcd(heads, 8))")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--cluster", default="h100-ib400", help="what mesh_shape=auto and the planner tune for")
    p.add_argument("--iters", type=int, default=5, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median and min-max are reported")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--csv", default=None)
    p.add_argument("--markdown", default=None, metavar="FILE.md", help="the same table as Markdown (measured)")
    p.add_argument("--plot", default=None)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    n, rank = dist.get_world_size(), dist.get_rank()
    configure_logging(None if rank == 0 else "WARNING")
    if args.seq % (2 * n):
        raise SystemExit(f"--seq {args.seq} must be divisible by 2 * world size = {2 * n}")
    cluster = load_cluster(args.cluster)
    flops = 4.0 * args.batch * args.heads * args.head_dim * (args.seq * args.seq / 2) * 3.5 / n
    rows = []
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    for algo, text in _mesh_runs(algos, args.shapes):
        shape, u, label = _shape(args, algo, text, n, cluster, dtype)
        times, nbytes, how = bench_mesh(args, shape, device, dtype, cluster, ulysses=u)
        rows.append((label, times, nbytes, how))
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
        times, nbytes, how = bench_te(args, algo, device, dtype)
        rows.append((f"te {algo}", times, nbytes, how))
    if rank == 0:
        _report(args, rows, n, dtype, device, flops)
    dist.barrier()
    dist.destroy_process_group()


def _report(args, rows, n, dtype, device, flops):
    """Table, CSV and plot: median ms with min-max over the repeats; bytes measured or by formula."""
    stats = [(label, statistics.median(ts), min(ts), max(ts), nb, how) for label, ts, nb, how in rows]
    print(f"{'algorithm':<24}{'median ms':>10}{'min-max ms':>18}{'TFLOP/s/GPU':>13}{'MiB/rank':>11}  bytes "
          f"({args.repeats} runs x {args.iters} steps)")
    for label, med, lo, hi, nb, how in stats:
        print(f"{label:<24}{med * 1e3:>10.2f}{f'{lo * 1e3:.2f}-{hi * 1e3:.2f}':>18}{flops / med / 1e12:>13.3f}"
              f"{nb / 2**20:>11.2f}  {how}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"Measured: one attention layer forward + backward, CP = {n}, S = {args.seq}, heads {args.heads}/"
                    f"{args.kv_heads}, d = {args.head_dim}, {str(dtype).replace('torch.', '')}, {device.type}; median "
                    f"and min-max of {args.repeats} runs x {args.iters} steps, slowest rank.\n\n")
            f.write("| algorithm | median ms | min-max ms | TFLOP/s/GPU | MiB sent/rank | bytes |\n|---|---|---|---|---|---|\n")
            for label, med, lo, hi, nb, how in stats:
                f.write(f"| {label} | {med * 1e3:.2f} | {lo * 1e3:.2f}-{hi * 1e3:.2f} | {flops / med / 1e12:.3f} | "
                        f"{nb / 2**20:.2f} | {how} |\n")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["algorithm", "world", "seq", "heads", "kv_heads", "head_dim", "dtype", "ms", "ms_min", "ms_max",
                         "repeats", "iters", "tflops_per_gpu", "bytes_per_rank", "bytes_source"])
            for label, med, lo, hi, nb, how in stats:
                wr.writerow([label, n, args.seq, args.heads, args.kv_heads, args.head_dim, str(dtype).replace("torch.", ""),
                             f"{med * 1e3:.4f}", f"{lo * 1e3:.4f}", f"{hi * 1e3:.4f}", args.repeats, args.iters,
                             f"{flops / med / 1e12:.4f}", int(nb) if nb == nb else "", how])
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        labels = [r[0] for r in stats]
        med = [r[1] * 1e3 for r in stats]
        spread = [[m - r[2] * 1e3 for m, r in zip(med, stats)], [r[3] * 1e3 - m for m, r in zip(med, stats)]]
        a1.barh(labels, med, xerr=spread, capsize=3, color="#4c72b0")
        a1.set_xlabel(f"ms per layer (fwd+bwd): median, min-max of {args.repeats} runs")
        for label, _, _, _, nb, how in stats:
            a2.barh(label, nb / 2**20, color="#dd8452" if how == "measured" else "white", edgecolor="#dd8452",
                    hatch=None if how == "measured" else "//")
        from matplotlib.patches import Patch

        a2.legend(handles=[Patch(color="#dd8452", label="measured"),
                           Patch(facecolor="white", edgecolor="#dd8452", hatch="//", label="formula (not measured)")],
                  fontsize=8)
        a2.set_xlabel("MiB sent per rank")
        fig.suptitle(f"CP={n}, S={args.seq}, heads {args.heads}/{args.kv_heads}, d={args.head_dim}, {device.type}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
