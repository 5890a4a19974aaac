"""``python -m megatron_mesh_cp.simulate`` (``mesh-cp-simulate``): compare CP attention algorithms
on a simulated cluster (time, traffic, exposed communication); every figure it prints is simulated.

The engine lives in :mod:`megatron_mesh_cp.planning` (``replay`` for plans, ``baselines`` for the
algorithms we compare with); this module is only the command line.
"""

from __future__ import annotations

import argparse
import sys

from .planning.baselines import ALGORITHMS, compare, format_table, plot_timelines
from .planning.cluster import Workload, load_cluster

__all__ = ["main"]


def _parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    return int(float(t) * mult)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mesh_cp.simulate",
        description="Simulate CP attention algorithms on a cluster: time, traffic, exposed communication.",
    )
    p.add_argument("--cp", type=int, required=True, help="context-parallel size n")
    p.add_argument("--seq", type=_parse_size, required=True, help="global sequence length (e.g. 1048576, 128K, 1M)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cluster", default="h100-ib400", help="preset name or YAML path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CP ranks are TP GPUs apart)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--partial-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="wire dtype of partial O/dQ/dKV (all ring-style algorithms alike)")
    p.add_argument("--algos", default="ring,usp,mesh", help=f"comma list of {','.join(ALGORITHMS)} or mesh:AxB")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw one rank's timeline per algorithm")
    p.add_argument("--max-live", type=int, default=None, help="memory budget (live chunks) for mesh plans")
    args = p.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        kv = args.kv_heads or args.heads
        if args.seq % (2 * args.cp):
            raise ValueError(f"--seq {args.seq} is not divisible by 2*cp = {2 * args.cp}")
        w = Workload(
            seq_local=args.seq // args.cp, heads=args.heads // args.tp, kv_heads=max(1, kv // args.tp),
            head_dim=args.head_dim, batch=args.batch, causal=not args.no_causal,
            bytes_per_element=cluster.bytes_per_element, partial_bytes=4 if args.partial_dtype == "fp32" else 2,
        )
        results = compare([a.strip() for a in args.algos.split(",") if a.strip()], args.cp, cluster, w,
                          tp=args.tp, max_live=args.max_live)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    caption = (
        f"CP={args.cp}  S={args.seq}  heads={args.heads}/{kv} kv  d={args.head_dim}  "
        f"{'causal' if w.causal else 'full'}  cluster={cluster.name}  tp={args.tp}  partials={args.partial_dtype}"
    )
    print(caption)
    print(format_table(results))
    if args.plot:
        plot_timelines(results, args.plot, caption=f"simulated: {caption}")
        print(f"timeline written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
