#!/usr/bin/env python
"""Quality guard of auto's token layout choice: its predicted seconds over fresh draws, against another checkout's.

    python scripts/layout_quality.py --out mine.json                   # this checkout's choices
    python scripts/layout_quality.py --against base.json [--out mine.json]

For each document set of docs/packing.md (log-uniform 4K-64K; the heavy-tailed power law on 384-512K)
and ``--draws`` fresh draws of it (seeds 1000.. past the page's), n = 256, 1M tokens, h100-ib400, it
runs ``choose_layout`` on a2a+mesh's inner meshes 8x2x16 (GQA 32/8) and 8x4x8, 8x8x4 (MHA 32/32), the
inner workload built as bench_documents.py's host_time builds it, and records the chosen
``LayoutChoice.seconds``. With ``--against`` (a JSON another checkout wrote with ``--out``, e.g. main's
before a change to the searches) it prints per set and shape the mean and worst ratio (this / that)
and exits 1 if a mean exceeds 1.01 or any draw 1.03. Every figure is the cost model's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp.planning import Workload, choose_layout, load_cluster, sample_documents  # noqa: E402
from megatron_mesh_cp.planning import ulysses_inner  # noqa: E402

N, SEQ, CLUSTER = 256, 1 << 20, "h100-ib400"
SETS = (("4K-64K", dict(lo=4096, hi=65536)), ("heavy", dict(lo=384, hi=512 * 1024, dist="powerlaw")))
#: (u, a, b, kv heads): a2a+mesh's inner meshes for GQA 32/8 and MHA 32/32
SHAPES = ((8, 2, 16, 8), (8, 4, 8, 32), (8, 8, 4, 32))
MEAN_LIMIT, WORST_LIMIT = 1.01, 1.03


def choices(draws: int) -> dict:
    """{"set shape": [(seed, chosen label, seconds), ...]} over ``draws`` fresh draws per set."""
    cluster = load_cluster(CLUSTER)
    out = {}
    for name, kw in SETS:
        lengths = [(seed, sample_documents(SEQ, seed=seed, **kw).lengths) for seed in range(1000, 1000 + draws)]
        for u, a, b, kv in SHAPES:
            w = Workload(seq_local=SEQ // N, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
            inner = ulysses_inner(u, w)
            rows = []
            for seed, lens in lengths:
                c = choose_layout(lens, a, b, cluster, inner, stride=u)
                rows.append((seed, c.describe().split(" (")[0].replace("layout ", ""), c.seconds))
            out[f"{name} {u}x{a}x{b}"] = rows
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=8, help="fresh draws per set")
    p.add_argument("--out", help="write this checkout's choices here (JSON)")
    p.add_argument("--against", help="compare with the choices another checkout wrote (JSON)")
    args = p.parse_args(argv)
    mine = choices(args.draws)
    if args.out:
        Path(args.out).write_text(json.dumps(mine, indent=1))
    if not args.against:
        for key, rows in mine.items():
            print(f"{key}: " + ", ".join(f"{lab} {s * 1e3:.3f}" for _, lab, s in rows))
        return 0
    base = json.loads(Path(args.against).read_text())
    ok = True
    for key, rows in mine.items():
        ref = {seed: (lab, s) for seed, lab, s in base[key]}
        ratios = [s / ref[seed][1] for seed, _, s in rows]
        mean, worst = sum(ratios) / len(ratios), max(ratios)
        ok &= mean <= MEAN_LIMIT and worst <= WORST_LIMIT
        changed = sum(lab != ref[seed][0] for seed, lab, _ in rows)
        print(f"{key}: mean ratio {mean:.4f}, worst {worst:.4f}, best {min(ratios):.4f} over {len(ratios)} draws "
              f"({changed} chose another layout)")
    print("quality guard:", "pass" if ok else f"FAIL (mean <= {MEAN_LIMIT}, worst <= {WORST_LIMIT})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
