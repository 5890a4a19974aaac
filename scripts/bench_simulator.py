#!/usr/bin/env python
"""Simulated figures for docs/performance.md: Ring, USP, mesh and a2a+mesh on the calibrated model.

    python scripts/bench_simulator.py [--out docs/performance.md] [--quick]
    python scripts/bench_simulator.py --packed [--out docs/packing.md]   # only the documents page

For n in {16, 64, 128, 256}, S in {128K, 1M}, MHA (32/32) and GQA (32/8), d = 128, causal, on every
cluster preset: time of each algorithm, the chosen shapes, speed of the best mesh-family algorithm
vs USP and Ring, bytes vs Ring, exposed communication, peak attention memory per rank, how the
calibration and the host term (per kernel call) move the n = 256 rows, and the auto choices'
planner time at n = 256. The measured
"Host cost" section (scripts/bench_host.py, CPU) is carried over from the page it replaces.
Partials travel in bf16 for every algorithm here, as Megatron/TE's Ring sends dK/dV; a second
table repeats n = 256 with fp32 partials (the library's exact default).
``--packed`` writes only docs/packing.md (scripts/bench_documents.py): documents at n = 256, 1M tokens,
TE's Ring and USP padded (THD), ours unpadded with pruned plans.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp.planning.autoshape import choose_hybrid_shape, choose_shape  # noqa: E402
from megatron_mesh_cp.planning.baselines import simulate_algorithm  # noqa: E402
from megatron_mesh_cp.planning.cluster import Workload, cluster_presets, load_cluster  # noqa: E402
from megatron_mesh_cp.planning.schedule import _greedy_plans  # noqa: E402

PAPER = (
    "Paper (Mesh-Attention, arXiv 2512.20968, abstract; 256 GPUs vs Ring-Attention): up to 3.4x faster "
    "(2.9x on average), up to 85.4% less communication volume (79.0% on average). A secondary write-up of "
    "the paper (not its text, which we could not read) adds that Ring-Attention waits on communication "
    "91.5% of the time at 128 GPUs and 1M tokens."
)


ALGOS = ("ring", "usp", "mesh", "a2a+mesh")


def row(cluster, n, seq, kv, partial_bytes):
    w = Workload(seq_local=seq // n, heads=32, kv_heads=kv, head_dim=128, causal=True, partial_bytes=partial_bytes)
    res = {a: simulate_algorithm(a, n, cluster, w) for a in ALGOS}
    naive = simulate_algorithm("mesh-naive", n, cluster, w)
    ring, usp, mesh, hyb = (res[a] for a in ALGOS)
    best = min(mesh, hyb, key=lambda r: r.time)
    return {
        "n": n, "seq": seq, "kv": kv, "res": res, "best": best,
        "cut": 1 - mesh.bytes_sent / ring.bytes_sent, "cut_hyb": 1 - hyb.bytes_sent / ring.bytes_sent,
        "exp_ratio": mesh.exposed / naive.exposed if naive.exposed else 0.0,
    }


def fmt_seq(s):
    return f"{s // (1 << 20)}M" if s >= 1 << 20 else f"{s // 1024}K"


def table(rows):
    head = ("| n | S | heads/kv | time ms: Ring / USP / mesh / a2a+mesh | shapes: USP / mesh / a2a+mesh "
            "| best mesh-family vs USP / vs Ring | bytes of Ring's: mesh / a2a+mesh | exposed comm Ring / USP / best "
            "| peak attention MiB/rank: Ring (TE) / USP / mesh / a2a+mesh | greedy exposed / naive |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        x, b = r["res"], r["best"]
        t = " / ".join(f"{x[a].time * 1e3:.1f}" for a in ALGOS)
        mem = " / ".join(f"{x[a].peak_bytes / 2**20:.0f}" for a in ALGOS)
        lines.append(
            f"| {r['n']} | {fmt_seq(r['seq'])} | 32/{r['kv']} | {t} | {x['usp'].shape} / {x['mesh'].shape} / "
            f"{x['a2a+mesh'].shape} | **{x['usp'].time / b.time:.2f}x** / {x['ring'].time / b.time:.2f}x | "
            f"{1 - r['cut']:.1%} / {1 - r['cut_hyb']:.1%} | {x['ring'].exposed / x['ring'].time:.0%} / "
            f"{x['usp'].exposed / x['usp'].time:.0%} / {b.exposed / b.time:.0%} | {mem} | {r['exp_ratio']:.0%} |"
        )
    return "\n".join(lines)


def summary(rows, label):
    at = [r for r in rows if r["n"] == max(x["n"] for x in rows)]
    cuts = [r["cut"] for r in at]
    sp = [r["res"]["ring"].time / r["res"]["mesh"].time for r in at]
    vs_usp = [r["res"]["usp"].time / r["best"].time for r in at]
    return (f"{label}: at n = {at[0]['n']}, mesh traffic cut vs Ring max {max(cuts):.1%} / mean "
            f"{sum(cuts) / len(cuts):.1%}; mesh speedup vs Ring max {max(sp):.2f}x / mean {sum(sp) / len(sp):.2f}x; "
            f"best of mesh and a2a+mesh vs USP min {min(vs_usp):.2f}x / max {max(vs_usp):.2f}x")


def before_after(cluster, n):
    """The same rows with the overlap costs switched off (the model before calibration) and on."""
    zero = replace(cluster, overlap_slowdown_intra=0.0, overlap_slowdown_inter=0.0, block_overhead=0.0,
                   correction_passes=0.0, name=f"{cluster.name}-uncalibrated")
    lines = ["| S | heads/kv | " + " | ".join(f"{a} ms before -> after" for a in ALGOS) + " |",
             "|" + "---|" * (2 + len(ALGOS))]
    for seq in (128 * 1024, 1 << 20):
        for kv in (32, 8):
            w = Workload(seq_local=seq // n, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
            cells = []
            for a in ALGOS:
                t0, t1 = (simulate_algorithm(a, n, c, w).time * 1e3 for c in (zero, cluster))
                cells.append(f"{t0:.1f} -> {t1:.1f} ({t1 / t0:.2f}x)")
            lines.append(f"| {fmt_seq(seq)} | 32/{kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_term(cluster, n):
    """The same rows with the host term off and on (HOST_PER_CALL_US per kernel call), naming the
    phases the host paced (PhaseResult.host_bound)."""
    free = replace(cluster, host_per_call=0.0, name=f"{cluster.name}-no-host")
    lines = ["| S | heads/kv | " + " | ".join(f"{a} ms without -> with" for a in ALGOS) + " |",
             "|" + "---|" * (2 + len(ALGOS))]
    for seq in (128 * 1024, 1 << 20):
        for kv in (32, 8):
            w = Workload(seq_local=seq // n, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
            cells = []
            for a in ALGOS:
                r0, r1 = (simulate_algorithm(a, n, c, w) for c in (free, cluster))
                cell = f"{r0.time * 1e3:.1f} -> {r1.time * 1e3:.1f} ({r1.time / r0.time:.2f}x)"
                if r1.shape != r0.shape:
                    cell += f", {r0.shape} -> {r1.shape}"
                if r1.host_bound:
                    cell += f", **host-bound** ({' + '.join(r1.host_bound)})"
                cells.append(cell)
            lines.append(f"| {fmt_seq(seq)} | 32/{kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default: docs/performance.md (docs/packing.md with --packed)")
    p.add_argument("--quick", action="store_true", help="n in {16, 64} only (a smoke run)")
    p.add_argument("--packed", action="store_true", help="write only the documents page (docs/packing.md)")
    args = p.parse_args()
    if args.packed:  # the documents page lives in its own script
        from bench_documents import documents_page

        out = args.out or "docs/packing.md"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(documents_page())
        print(f"wrote {out}")
        return
    args.out = args.out or "docs/performance.md"
    ns = (16, 64) if args.quick else (16, 64, 128, 256)
    sections, summaries = [], []
    t0 = time.perf_counter()
    for name in sorted(cluster_presets()):
        cluster = load_cluster(name)
        rows = [row(cluster, n, seq, kv, 2) for n in ns for seq in (128 * 1024, 1 << 20) for kv in (32, 8)]
        sections.append(f"### {name}: {cluster.description}\n\n{table(rows)}\n")
        summaries.append(summary(rows, name))
        print(f"{name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    h100 = load_cluster("h100-ib400")
    exact = [row(h100, ns[-1], seq, kv, 4) for seq in (128 * 1024, 1 << 20) for kv in (32, 8)]
    moved = before_after(h100, ns[-1])
    hosted = host_term(h100, ns[-1])
    # planner time at the largest n, cold caches (CPU seconds of this process)
    w = Workload(seq_local=(1 << 20) // ns[-1], heads=32, kv_heads=8, head_dim=128)
    timings = {}
    for label, fn in (("mesh", choose_shape), ("a2a+mesh", choose_hybrid_shape)):
        choose_shape.cache_clear()
        choose_hybrid_shape.cache_clear()
        _greedy_plans.cache_clear()
        t = time.process_time()
        choice = fn(ns[-1], h100, w)
        timings[label] = (time.process_time() - t, choice)

    out = [
        "# Performance (simulated)",
        "",
        f"Generated by `python scripts/bench_simulator.py` on {datetime.date.today()}; the cluster presets are "
        "in `megatron_mesh_cp/configs/clusters/`. Every figure is the simulator's (`megatron_mesh_cp/planning/replay.py`), "
        "which replays the same plan objects the executor runs; the bytes are exactly the executor's byte "
        "counters (tested). Nothing here is a GPU measurement. Packed sequences (THD documents) are in "
        "docs/packing.md (`python scripts/bench_simulator.py --packed`).",
        "",
        "**Calibrated model.** The simulator charges what hiding communication costs: compute slows by "
        "`slowdown_intra` (0.3) per NVLink transfer and `slowdown_inter` (0.025) per network transfer in flight "
        "beside it, every block-kernel call pays 40 us and six fp32 passes of output correction, and PCIe nodes "
        "share one host bridge among all-to-all traffic. These values are fitted to published Ring / Ulysses / "
        "USP measurements (docs/calibration.md: 18 of 22 ratios within 10%, worst 15%); before calibration, the "
        "model hid communication for free and overstated every ring-style algorithm, mesh included, by 10-30% "
        "against all-to-all ones. The same costs apply to every "
        "algorithm here, and so does the host term: the host issues each kernel call in "
        f"{h100.host_per_call * 1e6:.0f} us beside the GPU, a step costing the larger of the two (section "
        "\"How the host term moves\" below).",
        "",
        "Setup: one attention layer, forward + backward, causal, d = 128, 32 query heads (MHA: 32 kv heads, "
        "GQA: 8), batch 1, bf16. *Ring* is Megatron/TE's `p2p` schedule (one-way ring, overlapped hop by hop). "
        "*USP* is Ulysses inside a node x Ring across nodes (TE `a2a+p2p`), best Ulysses degree. *mesh* is the "
        "auto-chosen tile with the greedy plan. *a2a+mesh* is Ulysses inside a node x mesh across nodes, the "
        "auto-chosen (u, a, b). Partial results (O, dQ, dK/dV) travel in bf16 for every algorithm, as TE's "
        "Ring sends dK/dV. Peak attention memory per rank: for mesh and a2a+mesh the pool's arena laid out by "
        "the plan's liveness (what the executor allocates); for Ring what TE holds (double-buffered KV and "
        "dKV, fp32 accumulators); USP and a2a+mesh add the all-to-all buffers.",
        "",
        "## Against the paper",
        "",
        PAPER,
        "",
        *[f"* {s}" for s in summaries],
        "",
        "Traffic: the byte counts are exact. The square 16x16 tile cuts Ring's bytes by ~89% at n = 256 MHA "
        "(DESIGN.md's formula, just above the paper's 85.4% maximum), but its plans hold ~13x the attention "
        "memory TE's Ring holds; within auto's default budget (4x TE Ring's peak) the pure mesh takes narrower "
        "tiles (e.g. 4x64, 2x128) that cut less. a2a+mesh needs no such trade: its Ulysses groups shrink the "
        "mesh 8x, so it moves 4-8% of Ring's bytes within the budget.",
        "",
        "Speed: the calibrated mesh-vs-Ring speedups at n = 256 now sit at or below the paper's (up to 3.4x, "
        "2.9x mean) instead of above them. USP remains the baseline to beat: its all-to-all stays on NVLink and its "
        "ring moves large blocks. a2a+mesh beats it where traffic matters (MHA, short sequences, slow "
        "networks) and ties it where both are compute-bound (1M GQA). At 128K tokens per 256 ranks the blocks "
        "are small and the fixed per-call overhead dominates; the grouped plans run the blocks that share a Q chunk "
        "and whose KV chunks sit side by side in a receive slab as one kernel call (DESIGN.md, grouped computes).",
        "",
        "## Tables (bf16 partials, TE's convention)",
        "",
        *sections,
        f"## How calibration moved the n = {ns[-1]} rows (h100-ib400)",
        "",
        "Simulated time of one layer before (no overlap costs, private PCIe links) and after calibration:",
        "",
        moved,
        "",
        f"## How the host term moves the n = {ns[-1]} rows (h100-ib400)",
        "",
        f"The host issues every block-kernel call in `host_per_call` ({h100.host_per_call * 1e6:.0f} us: "
        "`HOST_PER_CALL_US`, the executor's CPU time per kernel call less the kernel's own, measured by "
        "scripts/bench_host.py, \"Host cost\" below) while the GPU runs the steps it already issued, so "
        "back-to-back steps cost the larger of the two. Simulated time of one layer without and with it; "
        "host-bound: the slowest rank's host issued longer than its GPU computed in that phase; a shape "
        "change is auto's choice moving:",
        "",
        hosted,
        "",
        f"## Exact mode: fp32 partials for every algorithm (h100-ib400, n = {ns[-1]})",
        "",
        "The library's default sends partials in fp32 (exact to accumulation precision). Ring then also "
        "sends dK/dV in fp32, so the cut is computed like for like.",
        "",
        table(exact),
        "",
        f"## Planner time (n = {ns[-1]}, S = 1M, GQA, h100-ib400, cold caches, CPU seconds)",
        "",
        *[f"* `{k}` auto ({len(c.table)} candidates, pruned by a lower bound): {t:.2f} s; it logs: `{c.explanation}`"
          for k, (t, c) in timings.items()],
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + kept_sections(args.out))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


#: measured (not simulated) sections of docs/performance.md, carried over when it is regenerated
KEPT = ("## Host cost",)


def kept_sections(path) -> str:
    """The measured sections (:data:`KEPT`) of the page at ``path`` as it is now, to append again."""
    old = Path(path).read_text() if Path(path).exists() else ""
    out = []
    for head in KEPT:
        at = old.find("\n" + head)
        if at >= 0:
            end = old.find("\n## ", at + 1)
            out.append(old[at: end if end >= 0 else len(old)].rstrip("\n") + "\n")
    return "".join(out)


if __name__ == "__main__":
    main()
