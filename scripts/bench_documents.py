#!/usr/bin/env python
"""Simulated figures for docs/packing.md: documents at n = 256, 1M tokens, as each algorithm runs them.

    python scripts/bench_documents.py [--out docs/packing.md]   (bench_simulator.py --packed runs it too)

Two document sets (log-uniform 4K-64K; a heavy-tailed power law, most documents under 4K and a few
over 256K), MHA 32/32 and GQA 32/8, d = 128, bf16, h100-ib400: TE's Ring and USP on the padded THD
layout (every chunk sent), our Ring 1xn, mesh (auto) and a2a+mesh (auto) unpadded with pruned
plans, a2a+mesh in each token layout (zigzag, balanced, tiled, tiled-cut, split:K) and auto's per-mesh choice; then
where the mesh family's time goes (kept blocks, bytes vs the full plans, the busiest rank's compute
vs the mean), and the earlier padded-THD-vs-unpacked comparison. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp.planning import choose_hybrid_shape, choose_shape  # noqa: E402
from megatron_mesh_cp.planning import simulate_algorithm  # noqa: E402
from megatron_mesh_cp.planning import call_seconds, even_sides  # noqa: E402
from megatron_mesh_cp.planning import Workload, load_cluster, workload_dims  # noqa: E402
from megatron_mesh_cp.planning import ulysses_inner  # noqa: E402
from megatron_mesh_cp.planning import compare_documents, document_sets  # noqa: E402
from megatron_mesh_cp.planning import sample_documents  # noqa: E402
from megatron_mesh_cp.planning import build_plans, document_plans  # noqa: E402
from megatron_mesh_cp.planning import replay, resolve_layout  # noqa: E402
from megatron_mesh_cp.runtime import plan_traffic, tile_sums  # noqa: E402

N, SEQ, CLUSTER = 256, 1 << 20, "h100-ib400"
#: a2a+mesh is also priced in each fixed token layout (auto: the layout chosen per mesh, the launcher's default)
LAYOUTS = ("zigzag", "balanced", "tiled", "tiled-cut", "split:1", "split:2", "split:3", "split:3:1", "split:3:2",
           "split:3:3")
#: the goals, a2a+mesh (auto layout) vs USP: {set: {kv heads: ratio}}, and busiest / mean block work on every set
TARGET = {"Log": {32: 5.0, 8: 2.5}, "Heavy": {32: 2.0, 8: 1.15}}
BALANCE_GOAL = 1.15
#: the order search's replays per phase on a2a+mesh's auto row (planning/search.py; the launcher's --mesh-plan-search)
SEARCH = 800


def heavy_seed(lo, hi, tries=100):
    """The first seed whose draw has >= 70% of its documents under 4K and >= 2 over 256K."""
    for seed in range(tries):
        x = np.array(sample_documents(SEQ, lo, hi, dist="powerlaw", seed=seed).lengths)
        if (x < 4096).mean() >= 0.7 and (x > 256 * 1024).sum() >= 2:
            return seed
    raise SystemExit("no heavy-tailed draw matched; widen the search")


def _target(v, t):
    """One ratio against its design goal."""
    if t is None:
        return "no goal for this mix: reported"
    return f"goal >= {t:g}x: {'met' if v >= t else 'not met'}"


def _ms(r):
    return f"{r.time * 1e3:.1f}"


def _exp(r):
    return f"{r.exposed * 1e3:.1f} ({r.exposed / r.time:.0%})"


def _mesh_of(algo, res, w, cluster):
    """(u, a, b, max_live) of a mesh-family result as it ran."""
    if algo == "ring-pruned":
        return 1, 1, N, None
    even = even_sides(w, N)  # as simulate_algorithm: split:K:H on even meshes
    if algo == "mesh":  # the same call (and cache entry) as simulate_algorithm's
        ch = choose_shape(N, cluster, w, stride=1, max_live=None, even=even)
        return 1, ch.shape.a, ch.shape.b, ch.max_live
    ch = choose_hybrid_shape(N, cluster, w, stride=1, max_live=None, even=even)
    return ch.u, ch.shape.a, ch.shape.b, ch.max_live


def diagnose(algo, res, w, cluster):
    """Where a pruned mesh-family run's time goes: tile blocks kept, offsets kept, blocks a rank runs,
    bytes vs the full plans, busiest vs mean rank block seconds (fwd + bwd)."""
    u, a, b, live = _mesh_of(algo, res, w, cluster)
    inner = resolve_layout(ulysses_inner(u, w), a, b, cluster, u)  # auto: the layout chosen for this mesh
    pruned = document_plans(a, b, cluster=cluster, workload=inner, stride=u, max_live=live)
    full = build_plans(a, b, cluster=cluster, workload=inner.unmasked, stride=u, max_live=live,
                       chains="both-ways")
    dims = workload_dims(inner)
    share = sum(sum(plan_traffic(p, dims).values()) for p in pruned) / sum(sum(plan_traffic(p, dims).values())
                                                                           for p in full)
    n = a * b
    keep = inner.needed(a, b)  # the documents in the order they run on this mesh (balanced)
    runs = tile_sums(inner.nonempty(n), a, b)
    per = sum(tile_sums(inner.block_times(cluster, bwd, n), a, b) for bwd in (False, True))
    busy = sum(float(replay(p, cluster, inner, stride=u).busy.mean()) for p in pruned)  # blocks, folds, overlap
    a2a = sum(end - start for lane, start, end, _ in res.timeline if lane == "all-to-all")
    return {**_call_parts(inner, cluster, a, b), "busy": busy, "a2a": a2a,
        "shape": res.shape, "kept": f"{len(keep)} of {a * b}", "q": len({q for q, _ in keep}), "a": a,
        "kv": len({k for _, k in keep}), "b": b, "runs": runs.mean(), "share": share,
        "max": per.max(), "mean": per.mean(), "step": res.time,
    }


def _call_parts(inner, cluster, a, b):
    """The mean rank's block seconds (fwd + bwd) in parts: the kernels' work at peak rate, what small calls
    lose to lower throughput, and what every call pays whatever its work; and its calls per phase."""
    n = a * b
    calls = inner.mask_calls(n)

    def mean_rank(v):
        blocks = np.bincount(calls.i * n + calls.j, weights=v, minlength=n * n).reshape(n, n)
        return float(tile_sums(blocks, a, b).mean())

    parts = {"peak": 0.0, "slow": 0.0, "fixed": 0.0}
    for bwd in (False, True):
        sec = call_seconds(inner, cluster, bwd, calls)
        parts["peak"] += mean_rank(sec.peak)
        parts["slow"] += mean_rank(sec.kernel - sec.peak)
        parts["fixed"] += mean_rank(sec.call + sec.keys)
    return {**parts, "calls": mean_rank(np.ones(len(calls.i)))}


def needs(verdicts):
    """What each unmet goal asks of the step, against what auto's layout leaves: the busiest rank's block
    seconds (a floor for its plans) and the mean rank's (every rank at the mean, nothing exposed)."""
    out = []
    for title, verdict in verdicts:
        for heads, v, goal, usp, d, _ in verdict:
            if goal is None or v >= goal:
                continue
            floor = d["busy"] + d["a2a"]  # the mean rank's compute stream and the all-to-alls beside it
            out.append(f"* {title.split(' documents')[0]} {heads}: {goal:g}x needs a step of at most "
                       f"{usp / goal * 1e3:.1f} ms. In auto's layout the busiest rank's blocks alone take "
                       f"{d['max'] * 1e3:.1f} ms and the mean rank's {d['mean'] * 1e3:.1f} ms: with every rank at "
                       f"the mean and no communication exposed, the step would be {usp / d['mean']:.2f}x USP. "
                       f"Of the mean rank's {d['mean'] * 1e3:.1f} ms, {d['peak'] * 1e3:.1f} ms is its kernels' work at "
                       f"peak rate, {d['slow'] * 1e3:.1f} ms what small calls lose to lower throughput, and "
                       f"{d['fixed'] * 1e3:.1f} ms what its {d['calls']:.0f} kernel calls per phase pay whatever "
                       f"their work (call overhead, the correction over their rows, dK/dV over their keys). Its "
                       f"compute stream is busy {d['busy'] * 1e3:.1f} ms (its blocks, the partials' folds, and "
                       f"kernels slowed by the transfers beside them) and the all-to-alls, before and after the mesh, "
                       f"take {d['a2a'] * 1e3:.1f} ms: every rank at the mean and nothing else exposed would still "
                       f"take {floor * 1e3:.1f} ms ({int(usp / floor * 1000) / 1000:.3f}x USP, truncated).")
    return ["What the unmet goals need (a2a+mesh, auto's layout):", "", *out] if out else []


def why(diags):
    """One line per a2a+mesh row in auto's layout: what pruning left and how far the busiest rank is from the mean."""
    out = []
    for title, heads, algo, layout, d in diags:
        if algo != "a2a+mesh" or not layout.startswith("auto"):
            continue
        out.append(f"* {title}, {heads}: a2a+mesh {d['shape']} ({layout}) keeps {d['kept']} tile blocks and sends "
                   f"{d['share']:.0%} of its full plans' bytes; its busiest rank's blocks take "
                   f"{d['max'] * 1e3:.1f} ms of the "
                   f"{d['step'] * 1e3:.1f} ms step, the mean rank's {d['mean'] * 1e3:.1f} ms "
                   f"({d['max'] / d['mean']:.2f}x).")
    return out


def document_section(cluster, packing, docs, title):
    out = [f"## {title}", "", f"* unpadded (ours): {docs.with_layout('zigzag').describe()}",
           f"* padded THD (TE's): {packing.describe()}", ""]
    diags, verdict = [], []
    goals = TARGET[title.split()[0].split("-")[0]]
    for kv in (32, 8):
        w = Workload(seq_local=SEQ // N, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
        base = compare_documents(["usp", "mesh", "a2a+mesh"], N, cluster, w, packing, docs, layouts=["auto"])
        rows = [(r.algo, r, docs.with_layout("auto")) for r in base]
        for layout in LAYOUTS:  # a2a+mesh in each fixed layout, its shape chosen for it
            try:
                rows.append(("a2a+mesh", simulate_algorithm("a2a+mesh", N, cluster,
                                                            replace(w, mask=docs.with_layout(layout))),
                             docs.with_layout(layout)))
            except ValueError as exc:  # the split documents do not fit the pieces
                print(f"{title} kv={kv} {layout}: {exc}", flush=True)
        res = {r.algo: r for r in base}
        usp, ring = res["usp"], res["ring"]
        lines = ["| algorithm | token layout | shape | step ms | vs USP | vs TE Ring | MiB sent per rank "
                 "| exposed comm ms (share) | compute ms (critical rank) | busiest / mean rank block work "
                 "| peak attention MiB/rank |", "|" + "---|" * 11]
        for algo, x, layout_docs in rows:
            ours = algo not in ("ring", "usp")
            d = diagnose(algo, x, replace(w, mask=layout_docs), cluster) if ours else None
            if d is not None:
                diags.append((title, "MHA 32/32" if kv == 32 else "GQA 32/8", algo, x.layout, d))
            lay = x.layout if ours else "padded THD (TE's partition)"
            balance = f"{d['max'] / d['mean']:.2f}" if d else "-"
            lines.append(f"| {algo} | {lay} | {x.shape} | **{_ms(x)}** | {usp.time / x.time:.2f}x "
                         f"| {ring.time / x.time:.2f}x | {x.bytes_sent / 2**20:.0f} | {_exp(x)} | "
                         f"{x.compute * 1e3:.1f} | {balance} | {x.peak_bytes / 2**20:.0f} |")
        hyb = usp.time / res["a2a+mesh"].time
        found = simulate_algorithm("a2a+mesh", N, cluster, replace(w, mask=docs.with_layout("auto")), search=SEARCH)
        lines.append(f"| a2a+mesh | auto: {found.layout}, plans searched ({SEARCH} replays per phase) | {found.shape} "
                     f"| **{_ms(found)}** | {usp.time / found.time:.2f}x | {ring.time / found.time:.2f}x "
                     f"| {found.bytes_sent / 2**20:.0f} | {_exp(found)} | {found.compute * 1e3:.1f} | - "
                     f"| {found.peak_bytes / 2**20:.0f} |")
        heads = "MHA 32/32" if kv == 32 else "GQA 32/8"
        out += [f"### {heads}", "", *lines, ""]
        auto = next(d for _, h, algo, lay, d in diags if h == heads and algo == "a2a+mesh" and lay.startswith("auto"))
        verdict.append((heads, hyb, goals[kv], usp.time, auto, usp.time / found.time))
        print(f"{title} kv={kv} done", flush=True)
    out += ["a2a+mesh (auto layout) vs USP (simulated): " + "; ".join(
        f"{h} **{v:.2f}x** ({_target(v, t)}; plans searched: {x:.2f}x)" for h, v, t, _, _, x in verdict), ""]
    head = ("| heads | algorithm | token layout | shape | tile blocks kept (SPMD) | Q / KV offsets kept "
            "| blocks a rank computes (mean) | bytes vs the full plans | block seconds per rank: busiest / mean "
            "(fwd+bwd, ms) | busiest rank's blocks / step |")
    out += [f"Where the mesh family's time goes ({title}):", "", head, "|" + "---|" * 10]
    for _, heads, algo, layout, d in diags:
        out.append(f"| {heads} | {algo} | {layout} | {d['shape']} | {d['kept']} | {d['q']} of {d['a']} / {d['kv']} "
                   f"of {d['b']} | {d['runs']:.1f} | {d['share']:.1%} | {d['max'] * 1e3:.1f} / {d['mean'] * 1e3:.1f} "
                   f"({d['max'] / d['mean']:.2f}x) | {d['max'] / d['step']:.0%} |")
    return out + [""], verdict, diags


def padded_section(cluster, packing):
    """The earlier comparison: every algorithm on the padded THD layout against the unpacked sequence."""
    out = ["## Padded THD for every algorithm vs the unpacked sequence (`--doc-layout padded`)", "",
           "The same chunks and bytes as unpacked, each block priced by its pairs inside the padded documents "
           "(planning/packing.py); mesh and a2a+mesh here run the THD layout too (`--mesh-packed-data`).", ""]
    for kv in (32, 8):
        w = Workload(seq_local=SEQ // N, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
        lines = ["| algorithm | shape: unpacked / padded | step ms: unpacked / padded | padded: vs USP "
                 "| exposed comm ms (share): unpacked / padded | MiB sent per rank |", "|" + "---|" * 6]
        rows = [(a, simulate_algorithm(a, N, cluster, w), simulate_algorithm(a, N, cluster, replace(w, mask=packing)))
                for a in ("ring", "usp", "mesh", "a2a+mesh")]
        usp = rows[1][2]
        for a, u, p in rows:
            lines.append(f"| {a} | {u.shape} / {p.shape} | {_ms(u)} / **{_ms(p)}** | {usp.time / p.time:.2f}x | "
                         f"{_exp(u)} / {_exp(p)} | {p.bytes_sent / 2**20:.0f} |")
        out += [f"### {'MHA 32/32' if kv == 32 else 'GQA 32/8'}", "", *lines, ""]
    return out


def host_time(docs, cluster, kv: int = 8) -> float:
    """Seconds auto's layout choice takes for these documents on a2a+mesh's shape (GQA), as the launcher
    makes it for a new micro-batch: after a warm-up on other documents (what depends on the mesh alone),
    once, with nothing of these documents cached."""
    from megatron_mesh_cp.planning import choose_layout, sample_documents

    w = Workload(seq_local=SEQ // N, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2)
    ch = choose_hybrid_shape(N, cluster, replace(w, mask=docs.with_layout("auto")), stride=1, max_live=None)
    a, b = ch.shape.a, ch.shape.b
    inner = ulysses_inner(ch.u, w)
    choose_layout(sample_documents(SEQ, 4096, 65536, seed=10_000).lengths, a, b, cluster, inner, stride=ch.u)
    t0 = time.perf_counter()
    choose_layout(docs.lengths, a, b, cluster, inner, stride=ch.u)
    return time.perf_counter() - t0


def documents_page():
    cluster = load_cluster(CLUSTER)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    seed = heavy_seed(384, 512 * 1024)
    sets = [("Log-uniform 4K-64K documents", dict(lo_hi=(4096, 65536), seed=0), "--docs 4K-64K --doc-seed 0"),
            ("Heavy-tailed mix", dict(lo_hi=(384, 512 * 1024), dist="powerlaw", seed=seed),
             f"--docs 384-512K --doc-dist powerlaw --doc-seed {seed}")]
    body, verdicts, all_diags, hosts = [], [], [], []
    for title, kw, _ in sets:
        packing, docs = document_sets(SEQ, N, **kw)
        sec, verdict, diags = document_section(cluster, packing, docs, title)
        body += sec
        verdicts.append((title, verdict))
        all_diags += diags
        if title.startswith("Log"):
            log_packing = packing
        hosts.append((title, host_time(docs, cluster)))
    body += padded_section(cluster, log_packing)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    cmds = [f"    python -m megatron_mesh_cp.simulate --cp {N} --seq 1M --heads 32 --kv-heads KV --partial-dtype bf16 "
            f"--cluster {CLUSTER} {flags} --algos ring,usp,mesh,a2a+mesh --layout auto,{','.join(LAYOUTS)}"
            for _, _, flags in sets]
    balances = [(title, heads, layout, d["max"] / d["mean"]) for title, heads, algo, layout, d in all_diags
                if algo == "a2a+mesh" and layout.startswith("auto")]
    head = [
        "# Documents (attention masked at document boundaries): simulated",
        "",
        f"Generated by `python scripts/bench_documents.py` (or `bench_simulator.py --packed`) on "
        f"{datetime.date.today()} ({cpu:.0f} CPU seconds, {wall:.0f} s wall). **Every figure is the simulator's, on "
        f"the calibrated cost model of the `{CLUSTER}` preset ({cluster.description}); nothing here is a GPU "
        "measurement.** The tables' step, bytes and exposed-communication figures are those the simulator's "
        "command line prints for (KV = 32 or 8; it prints mesh in every layout too; the plans-searched rows are "
        "what it prints with `--plan-search 800` added); the compute, busiest / mean and peak-memory columns and "
        "the per-rank tables come from the same simulation in `scripts/bench_documents.py`, which the command "
        "line does not print:",
        "",
        *cmds,
        "",
        "## How each algorithm runs documents",
        "",
        "* **TE's Ring (`p2p`) and USP (`a2a+p2p`)** run documents only as THD: every document padded to a multiple "
        "of 2·CP (512 tokens here), partitioned per document (each rank holds two pieces of every document), and "
        "every chunk sent around the ring, whatever the mask. Priced as before (`planning/packing.py`): each block "
        "by its pairs inside the padded documents, 2-3 varlen calls per block.",
        "* **Ours (mesh, a2a+mesh, and our Ring 1×n)** run them unpadded on Megatron's ordinary zigzag layout "
        "(`mesh_attention(..., cu_seqlens=cu)`, `--reset-attention-mask`): a block runs the sub-blocks its "
        "documents leave (`runtime/masks/spans.py`), an empty block no call at all, and the plan is the cached full "
        "plan (chains split both ways) pruned to the tile blocks some rank needs (`runtime/prune.py`): a chunk "
        "nobody needs is not sent; a mask that keeps every tile block (the split layouts) runs the full plan "
        "planned for its blocks' own time (`planning.plan_scale`, within the unscaled plan's memory), and one "
        "that keeps more than half of them that plan pruned where it replays faster than the pruned "
        "unscaled one re-ordered by when its chunks arrive (`planning/ready.py`). The simulator prices each block's own calls (kernel at the call's rows, call "
        "overhead and correction per call; `planning/documents.py`, tested call for call against the runtime) and "
        "replays the pruned plans; a rank waits only for the chunks of the blocks it runs. Their bytes are "
        "`plan_traffic` of the pruned plans, which the executor's counters equal (tested).",
        "* **Token layouts** (`runtime/layouts.py`, the launcher's `--mesh-layout`): which tokens each mesh chunk "
        "holds, built per micro-batch before Megatron's CP split. *zigzag*: the documents as drawn; *balanced*: "
        "whole documents reordered so the zigzag chunks carry near-equal work (`runtime/balance.py`, a seeded "
        "local search); *tiled*: whole documents reordered so the *ranks* of the mesh that runs them carry "
        "near-equal block seconds (`runtime/tile_balance.py`: a rank computes a tile of blocks, its row group's Q "
        "chunks against its column group's KV chunks, and where a document crosses pieces decides which rank does "
        "that work; each order's per-rank calls priced exactly by the cost model's per-call, row, key and pair "
        "seconds); *split:K*: the K longest documents cut the way TE's THD partition cuts every document "
        "(2·N pieces, pieces g and 2N-1-g to chunk g), unpadded, the others whole and balanced around them "
        "(their blocks stay prunable); *split:K:H*: the same, the last H of the K split documents cut over half "
        "of each mesh row's chunks instead of every chunk (rows alternating halves, so every rank still meets "
        "an equal share of each: a rank meets such a document in a quarter of its tile blocks, with four times "
        "the pairs each, so a quarter of the kernel calls), on meshes with a and b even (split:K elsewhere, "
        "and the row says so); *auto* (the launcher's default): per mesh shape the layout the cost "
        "model predicts fastest (`planning/layouts.py`: the busiest rank's block seconds and the bytes some "
        "rank needs, per phase), never one its bound prices slower than the zigzag (the replay can still rank "
        "them otherwise: our Ring 1x256 on 4K-64K GQA replays 76.1 ms balanced against 74.3 ms zigzag); "
        "split:K:H, for the split count priced fastest (and split:k:k for larger counts), is taken only where its "
        "plans also replay faster "
        "than the fastest other candidate's (its tile blocks differ from rank to rank, which the bound does "
        "not see); where tiled-cut is priced fastest but its busiest rank stays above 1.12x the mean, tiled-cut "
        "from a restarted rank search too, taken where it is more balanced and its plans replay faster. Every "
        "layout is exact: each "
        "document keeps its tokens, labels and positions (RoPE rotates each token at its own position). TE's "
        "THD partition balances any order.",
        "* **Our Ring 1×n, pruned** is the row that shows what pruning alone buys over TE's Ring.",
        "* Document sets: log-uniform 4K-64K (seed 0, the set of the earlier page); a heavy-tailed mix drawn from "
        f"a power law on 384-512K tokens (P(length > x) ~ x^-1/2), the first seed ({seed}) whose draw has at "
        "least 70% of its documents under 4K and at least two over 256K.",
        "* Both layouts come from the same draws (same distribution and seed), each filling 1M tokens: TE's "
        "padding leaves it fewer real tokens per step (the last column), so per real token the unpadded rows "
        "gain a little more than the step times say.",
        "* `mesh` and `a2a+mesh` are auto's choice for this document set: every valid (u, a, b) scored on its "
        "pruned plans, in the order of a lower bound that stays a bound for pruned plans (the busiest rank's "
        "blocks, one transfer per needed offset; tested against the exhaustive search), within auto's memory "
        "budget (4x TE Ring's) checked on the *full* plans, since the pool must fit any batch's documents. "
        "When no pure-mesh shape's full plans fit the budget, auto chooses without one (logged).",
        "",
        "Setup: one attention layer, forward + backward, causal, n = 256, S = 1M tokens, 32 query heads, d = 128, "
        "batch 1, bf16, partials in bf16 for every algorithm (as docs/performance.md).",
        "",
        "## a2a+mesh against USP: the design goals",
        "",
        *[f"* {title}: " + "; ".join(f"{h} a2a+mesh **{v:.2f}x** USP ({_target(v, t)}; with its plans searched, "
                                     f"**{x:.2f}x**: {'met' if t is None or x >= t else 'not met'})"
                                     for h, v, t, _, _, x in verdict) for title, verdict in verdicts],
        "",
        f"*Plans searched*: the same plans after the order search (`planning/search.py`, the launcher's "
        f"`--mesh-plan-search {SEARCH}`, `simulate --plan-search {SEARCH}`): each try moves one op of a pruned plan "
        "(seeded, the same on every rank), and a move is kept where the plan stays valid within its memory and "
        "replays faster; the transfers and bytes are the plan's. It costs about 1 ms of host time per replay "
        f"(32 mesh ranks, one CPU thread): {SEARCH} per phase took 1.9-2.1 s per micro-batch (both phases, the heavy-tailed mix). "
        "The launcher spends it where the micro-batch loads, in the data loader's workers beside the layout choice; "
        "the step takes the orders found there (by the digest of the plan, mask, budget and every other input of its search, checked valid) and "
        "searches only a plan nobody searched ahead (the summary counts both). Off by default "
        "(`--mesh-plan-search 0`); the 1M stages of the Llama-3.1 recipe set 800.",
        "",
        *needs(verdicts),
        "",
        *why(all_diags),
        "",
        "Busiest / mean rank block work of a2a+mesh in auto's layout (goal <= "
        f"{BALANCE_GOAL:g} on every set): " + "; ".join(
            f"{title.split(' documents')[0]} {heads}, {layout}: {b:.2f} ({'met' if b <= BALANCE_GOAL else 'not met'})"
            for title, heads, layout, b in balances) + ".",
        "",
        "Host time of auto's choice for a new micro-batch on the machine that generated this page (a2a+mesh, "
        "its shape for the set, GQA; candidates built and priced as the launcher does, `planning/layouts.py`; "
        "goal with the call's preparation <= 50 ms): " + "; ".join(
            f"{title.split(' documents')[0]}: {t * 1e3:.0f} ms" for title, t in hosts) + ". "
        "`python scripts/bench_layout_host.py` gives the median over fresh draws of each set, and the "
        "preparation's share. The launcher makes this choice where the sample loads, in the data loader's "
        "workers ahead of the step (`megatron/layout.py` `LaidOutDataset`); the step only decodes it (under 1 ms) "
        "and prepares the call (its pruned plans re-ordered by `planning/ready.py`; `bench_layout_host.py` measured "
        "a median of 8-10 ms on the 4K-64K draws and 16-18 ms on the heavy-tailed ones, where the split layouts' "
        "plans are replayed against their scaled form, at most 28 ms, on an idle 2-core CPU host; about twice that "
        "on the same host loaded).",
        "",
        "Reading the tables. *Exposed comm* is the critical rank's idle time: with documents it includes waiting "
        "for partials and chunks from busier ranks, i.e. load imbalance, not only the wire. Megatron's ordinary "
        "zigzag (pieces g and 2n-1-g) balances one causal sequence, not documents: a chunk holding the tail of a "
        "long document attends to all of it, one holding document starts attends to little, so the busiest rank's "
        "blocks take about twice the mean rank's in the dataset's order. Reordering the documents brings the "
        "busiest chunk near what its heaviest piece alone costs (the tail of the longest document: no order "
        "can split a piece), which is the remaining gap to the mean. TE's THD partition balances exactly (every "
        "rank holds two pieces of every document) but pays the padding, every chunk on the wire and 2-3 varlen "
        "calls on every block. SPMD pruning keeps a tile block when any rank's block there is non-empty: mesh "
        "tiles keep every Q offset of a banded mask and the 1×n Ring only its neighbours' KV offsets, and a few "
        "documents spanning most chunks (the heavy-tailed mix) leave nothing to prune. The split layouts close "
        "most of the imbalance (the busiest rank within a few percent of the mean), and pay for it in kernel "
        "calls: every split document adds one call to every block it reaches, and each call pays its fixed "
        "cost and its output correction (the table's compute column against the zigzag's); split:K:H cuts "
        "those calls to a quarter for the documents it lays over half rows, at the price of tile blocks that "
        "differ from rank to rank (the exposed column: ranks of one SPMD plan wait on each other). What is left "
        "against USP where a2a+mesh is compute-bound is that per-call cost and the all-to-all's exposed time; "
        "the cost model was not tuned to these figures (tests/test_calibration.py pins it to published "
        "measurements).",
        "",
    ]
    return "\n".join(head + body)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/packing.md")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(documents_page())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
