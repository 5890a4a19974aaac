#!/usr/bin/env python
"""Simulated figures for docs/variants.md: sliding-window and MLA layers at n = 256 as each algorithm runs them.

    python scripts/bench_variants.py [--out docs/variants.md] [--plot docs/window_traffic.png]

A gpt-oss-like model (gpt-oss-120b attention: 64 query heads, 8 kv heads, head dim 64, layers
alternating a 128-token sliding window and full attention) and a DeepSeek-V3-like MLA layer (128
heads, q/k head dim 192, v head dim 128) at 128K and 1M tokens on h100-ib400, bf16: the mesh family
(auto) against TE's USP (a2a+p2p), Ring (p2p), all_gather and a2a, each as TE runs (or refuses) the
layer; then the pruned plans' bytes per rank against the window size at 1M tokens, plotted, beside
an ideal halo exchange. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mesh_cp.planning.baselines import simulate_algorithm  # noqa: E402
from megatron_mesh_cp.planning.cluster import Workload, load_cluster  # noqa: E402
from megatron_mesh_cp.planning.window_baselines import te_a2a_refusal  # noqa: E402
from megatron_mesh_cp.runtime.masks import Window  # noqa: E402

N, CLUSTER = 256, "h100-ib400"
SEQS = ((128 * 1024, "128K"), (1 << 20, "1M"))
GPT_OSS = dict(heads=64, kv_heads=8, head_dim=64)  # gpt-oss-120b's attention
WINDOW = (127, 0)  # 128 keys per query: itself and the 127 before (gpt-oss's tril(-inf, diagonal=-128))
DEEPSEEK = dict(heads=128, kv_heads=128, head_dim=192, head_dim_v=128)  # DeepSeek-V3 after up-projection
SWEEP = tuple(1 << k for k in range(7, 19))  # keys per query: 128 .. 256K
OURS = (("ring-pruned", "our Ring 1xn, pruned"), ("mesh", "mesh (auto)"), ("a2a+mesh", "a2a+mesh (auto)"))
CANNOT = "cannot window: full-attention cost, not the model"
HEAD = ("| algorithm | runs it? | shape | step ms | MiB sent per rank | exposed comm ms (share) | compute ms | "
        "peak attention MiB/rank |")


def workload(seq, window=None, **dims):
    return Workload(seq_local=seq // N, partial_bytes=2, mask=None if window is None else Window(*window), **dims)


def sim(algo, w, cluster):
    return simulate_algorithm(algo, N, cluster, w)


def row(label, status, r):
    if r is None:
        return f"| {label} | {status} | - | - | - | - | - | - |"
    return (f"| {label} | {status} | {r.shape} | **{r.time * 1e3:.2f}** | {r.bytes_sent / 2**20:.0f} | "
            f"{r.exposed * 1e3:.2f} ({r.exposed / r.time:.0%}) | {r.compute * 1e3:.2f} | {r.peak_bytes / 2**20:.0f} |")


def shape_of(algo, r):
    """The fixed-shape name of an auto result (mesh:AxB, a2a+mesh:UxAxB)."""
    return f"{algo}:{r.shape}"


def te_rows(w, cluster, windowed):
    """TE's four algorithms on layer ``w``: (label, status, result or None)."""
    out = []
    for algo, label in (("ring", "TE p2p (Ring)"), ("usp", "TE a2a+p2p (USP)")):
        if windowed:
            out.append((label, CANNOT, sim(algo, w.unmasked, cluster)))
        else:
            out.append((label, "runs", sim(algo, w, cluster)))
    out.append(("TE all_gather", "runs the window (gathers all K/V)" if windowed else "runs",
                sim("allgather", w, cluster)))
    why = te_a2a_refusal(N, w)
    out.append(("TE a2a (Ulysses)", f"refused: {why}" if why else "runs", None if why else sim("ulysses", w, cluster)))
    return out


def gpt_oss_section(cluster, seq, name):
    full, win = workload(seq, **GPT_OSS), workload(seq, WINDOW, **GPT_OSS)
    ours = {(algo, kind): sim(algo, w, cluster) for algo, _ in OURS for kind, w in (("full", full), ("win", win))
            if not (algo == "ring-pruned" and kind == "full")}
    ours[("ring-pruned", "full")] = sim("mesh:1x256", full, cluster)  # our Ring 1xn on the full layer
    te_win, te_full = te_rows(win, cluster, True), te_rows(full, cluster, False)
    out = [f"### gpt-oss-like, {name} tokens", "", "Window layers (128 keys per query):", "", HEAD, "|" + "---|" * 8]
    out += [row(label, "runs the window (pruned plans)", ours[(algo, "win")]) for algo, label in OURS]
    out += [row(*x) for x in te_win]
    out += ["", "Full layers:", "", HEAD, "|" + "---|" * 8]
    out += [row(label.replace(", pruned", " (mesh:1x256)"), "runs", ours[(algo, "full")]) for algo, label in OURS]
    out += [row(*x) for x in te_full]
    # one mesh for the whole model: each family's shape is the better of its two layers' auto choices
    pair = ["", "Averaged over the pair (one window layer + one full layer; the runtime runs one mesh shape for "
            "every layer, so each family takes the better of its two layers' auto shapes for both):", "",
            "| stack | shape (both layers) | window layer ms | full layer ms | **mean ms per layer** | vs TE stack |",
            "|---|---|---|---|---|---|"]
    stacks = []
    for algo, label in OURS[1:]:
        best = None
        for kind in ("win", "full"):
            fixed = shape_of(algo, ours[(algo, kind)])
            w_t = ours[(algo, "win")] if kind == "win" else sim(fixed, win, cluster)
            f_t = ours[(algo, "full")] if kind == "full" else sim(fixed, full, cluster)
            if best is None or w_t.time + f_t.time < best[1].time + best[2].time:
                best = (ours[(algo, kind)].shape, w_t, f_t)
        stacks.append((label, *best))
    usp_full, ag_win = te_full[1][2], te_win[2][2]
    te = ("TE: USP on full layers, all_gather on window layers (per-layer cp_comm_type)",
          f"{te_full[1][2].shape} / {ag_win.shape}", ag_win, usp_full)
    stacks.append(te)
    mean = {s[0]: (s[2].time + s[3].time) / 2 for s in stacks}
    for label, shape, w_t, f_t in stacks:
        pair.append(f"| {label} | {shape} | {w_t.time * 1e3:.2f} | {f_t.time * 1e3:.2f} | **{mean[label] * 1e3:.2f}** "
                    f"| {mean[te[0]] / mean[label]:.2f}x |")
    usp_win = te_win[1][2]
    pair.append(f"| reference, not the model: USP on both, window dropped ({CANNOT}) | {usp_full.shape} | "
                f"{usp_win.time * 1e3:.2f} | {usp_full.time * 1e3:.2f} | {(usp_win.time + usp_full.time) / 2e-3:.2f} "
                f"| {mean[te[0]] / ((usp_win.time + usp_full.time) / 2):.2f}x |")
    key = {"seq": name, "stacks": [(s[0], s[1], mean[s[0]]) for s in stacks], "te": mean[te[0]],
           "win": {lab: ours[(a, "win")] for a, lab in OURS}, "ag_win": ag_win, "usp_full": usp_full,
           "full": {lab: ours[(a, "full")] for a, lab in OURS}}
    print(f"gpt-oss {name} done", flush=True)
    return out + pair + [""], key


def deepseek_section(cluster, seq, name):
    w = workload(seq, **DEEPSEEK)
    te = te_rows(w, cluster, False)
    mine = [(label, sim(algo, w, cluster)) for algo, label in OURS[1:]]
    usp = te[1][2]
    out = [f"### DeepSeek-V3-like MLA, {name} tokens", "", HEAD + " vs USP |", "|" + "---|" * 9]
    for label, r in mine:
        out.append(row(label, "runs", r) + f" {usp.time / r.time:.2f}x |")
    for label, status, r in te:
        out.append(row(label, status, r) + (f" {usp.time / r.time:.2f}x |" if r is not None else " - |"))
    print(f"deepseek {name} done", flush=True)
    return out + [""], {"seq": name, "mine": mine, "usp": usp, "ring": te[0][2]}


def halo_bytes(w, keys):
    """Per rank, fwd + bwd, an ideal halo exchange: each of its two pieces receives the keys - 1 K/V
    rows before it (forward, and again in the backward) and returns their dK/dV."""
    rows = 2 * min(keys - 1, w.seq_local * N)
    per_row = w.kv_heads * (w.head_dim + w.dv)
    return rows * per_row * (2 * w.bytes_per_element + w.partial_bytes)


def sweep(cluster):
    seq = 1 << 20
    base = workload(seq, **GPT_OSS)
    full = {algo: sim("mesh:1x256" if algo == "ring-pruned" else algo, base, cluster) for algo, _ in OURS}
    rows = []
    for keys in SWEEP:
        w = replace(base, mask=Window(keys - 1, 0))
        res = {algo: sim(algo, w, cluster) for algo, _ in OURS}
        rows.append((keys, res, halo_bytes(w, keys)))
        print(f"sweep {keys} done", flush=True)
    return base, full, rows


def sweep_section(base, full, rows, plot):
    m = base.seq_local // 2
    out = ["## Window traffic vs window size (gpt-oss-like, 1M tokens, n = 256)", "",
           f"Bytes each rank sends per layer (forward + backward) on the window-pruned plans, against the window "
           f"(keys per query, W - 1 before and the query itself), beside an ideal halo exchange (each of a rank's "
           f"two pieces receives exactly the W - 1 K/V rows before it, forward and again backward, and returns "
           f"their dK/dV) and the full plans (no window). Piece size m = {m} tokens, chunk 2m = {2 * m}.", "",
           f"![window traffic](window_traffic.png)", "",
           "| window (keys) | Ring 1xn pruned MiB | mesh (auto) MiB (shape) | a2a+mesh (auto) MiB (shape) | ideal halo MiB "
           "| Ring / halo | Ring step ms | mesh step ms | a2a+mesh step ms |", "|" + "---|" * 9]
    for keys, res, halo in rows:
        r, me, hy = res["ring-pruned"], res["mesh"], res["a2a+mesh"]
        out.append(f"| {keys} | {r.bytes_sent / 2**20:.1f} | {me.bytes_sent / 2**20:.1f} ({me.shape}) | "
                   f"{hy.bytes_sent / 2**20:.1f} ({hy.shape}) | {halo / 2**20:.1f} | {r.bytes_sent / halo:.1f}x | "
                   f"{r.time * 1e3:.2f} | {me.time * 1e3:.2f} | {hy.time * 1e3:.2f} |")
    out.append(f"| full layer (no window) | {full['ring-pruned'].bytes_sent / 2**20:.0f} | "
               f"{full['mesh'].bytes_sent / 2**20:.0f} ({full['mesh'].shape}) | "
               f"{full['a2a+mesh'].bytes_sent / 2**20:.0f} ({full['a2a+mesh'].shape}) | - | - | "
               f"{full['ring-pruned'].time * 1e3:.2f} | {full['mesh'].time * 1e3:.2f} | "
               f"{full['a2a+mesh'].time * 1e3:.2f} |")
    _plot(base, full, rows, plot)
    return out + ["", halo_sentence(rows)[0].upper() + halo_sentence(rows)[1:], ""]


def _plot(base, full, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [k for k, _, _ in rows]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for algo, label in OURS:
        ax.plot(x, [res[algo].bytes_sent / 2**20 for _, res, _ in rows], marker="o",
                label=f"{label.replace(', pruned', '')}, window-pruned plans")
    ax.plot(x, [h / 2**20 for _, _, h in rows], "k--", label="ideal halo exchange (per CP rank, Ring-style)")
    ax.axhline(full["ring-pruned"].bytes_sent / 2**20, color="grey", linestyle=":", label="Ring 1xn, full layer")
    ax.axvline(base.seq_local // 2, color="grey", linewidth=0.6)
    ax.text(base.seq_local // 2, 0.02, " piece m", fontsize=7, rotation=90, va="bottom", transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sliding window (keys per query)")
    ax.set_ylabel("MiB sent per rank, forward + backward")
    ax.set_title("simulated: window traffic vs window size, n = 256, 1M tokens, 64/8 heads, d 64, bf16", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def halo_sentence(rows):
    """Where the pruned Ring's bytes meet the halo exchange's, in words (from the sweep's own figures)."""
    near = [(keys, res["ring-pruned"].bytes_sent / halo) for keys, res, halo in rows]
    settled = [k for k, ratio in near if ratio <= 2.01]
    narrow = rows[0][1]["ring-pruned"]
    return (f"our Ring 1xn on the window-pruned plans sends {near[0][1]:.0f}x an ideal halo exchange at {near[0][0]} "
            f"keys (below the piece size it still moves its two neighbours' chunks whole: {narrow.bytes_sent / 2**20:.0f} "
            f"MiB per rank however narrow the window) and "
            + (f"settles at {near[-1][1]:.1f}x the halo from {settled[0]} keys (the piece size) up: every chunk on the "
               f"wire carries two zigzag pieces and the receiver needs one of them" if settled else
               "never comes within 2x of it")
            + ". a2a+mesh's inner ring runs over Ulysses groups (u-fold longer chunks, 1/u of the heads per rank), so "
            "at large windows its bytes per rank fall below the Ring-style halo line, all-to-all included.")


def summary(oss, deep, rows):
    out = ["## Key rows", ""]
    for k in oss:
        best = min(k["stacks"][:-1], key=lambda s: s[2])
        out.append(f"* gpt-oss-like, {k['seq']}: per layer pair, {best[0]} ({best[1]}) **{best[2] * 1e3:.2f} ms** vs TE's "
                   f"USP + all_gather {k['te'] * 1e3:.2f} ms (**{k['te'] / best[2]:.2f}x**); window layer: mesh (auto) "
                   f"{k['win']['mesh (auto)'].time * 1e3:.2f} ms ({k['win']['mesh (auto)'].bytes_sent / 2**20:.0f} MiB) vs "
                   f"TE all_gather {k['ag_win'].time * 1e3:.2f} ms ({k['ag_win'].bytes_sent / 2**20:.0f} MiB); full layer: "
                   f"a2a+mesh (auto) {k['full']['a2a+mesh (auto)'].time * 1e3:.2f} ms vs USP {k['usp_full'].time * 1e3:.2f} ms.")
    for k in deep:
        best = min(k["mine"], key=lambda s: s[1].time)
        out.append(f"* DeepSeek-V3-like MLA, {k['seq']}: {best[0]} {best[1].shape} **{best[1].time * 1e3:.2f} ms** "
                   f"({best[1].bytes_sent / 2**20:.0f} MiB/rank) vs USP {k['usp'].shape} {k['usp'].time * 1e3:.2f} ms "
                   f"({k['usp'].bytes_sent / 2**20:.0f} MiB/rank): **{k['usp'].time / best[1].time:.2f}x**; TE Ring "
                   f"{k['ring'].time * 1e3:.2f} ms.")
    out.append(f"* Window traffic: {halo_sentence(rows)}")
    return out + [""]


def page(plot):
    cluster = load_cluster(CLUSTER)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    oss, deep, body = [], [], []
    body += ["## gpt-oss-like alternating model (64/8 heads, d 64; window 128 / full)", ""]
    for seq, name in SEQS:
        sec, key = gpt_oss_section(cluster, seq, name)
        body += sec
        oss.append(key)
    body += ["## DeepSeek-V3-like MLA layer (128 heads, q/k 192, v 128)", ""]
    for seq, name in SEQS:
        sec, key = deepseek_section(cluster, seq, name)
        body += sec
        deep.append(key)
    base, full, rows = sweep(cluster)
    body += sweep_section(base, full, rows, plot)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    head = [
        "# Attention variants under CP: sliding windows and MLA (simulated)",
        "",
        f"Generated by `python scripts/bench_variants.py` on {datetime.date.today()} ({cpu:.0f} CPU seconds, "
        f"{wall:.0f} s wall). **Every figure is the simulator's, on the calibrated cost model of the `{CLUSTER}` preset "
        f"({cluster.description}); nothing here is a GPU measurement.** One attention layer, forward + backward, "
        f"causal, n = {N} CP ranks (TP 1), batch 1, bf16, partials in bf16 for every algorithm. Rows can be "
        "reprinted with e.g.",
        "",
        f"    python -m megatron_mesh_cp.simulate --cp {N} --seq 1M --heads 64 --kv-heads 8 --head-dim 64 "
        f"--window {WINDOW[0]},{WINDOW[1]} --partial-dtype bf16 --algos ring,usp,mesh,a2a+mesh,allgather",
        f"    python -m megatron_mesh_cp.simulate --cp {N} --seq 1M --heads 128 --head-dim 192 --head-dim-v 128 "
        "--partial-dtype bf16 --algos ring,usp,mesh,a2a+mesh,allgather",
        "",
        "## What each row assumes",
        "",
        "* **Ours (our Ring 1xn, mesh, a2a+mesh)** run a window as `mesh_attention(..., window=(L, R))` does: the "
        "cached full plan (chains split both ways) pruned to the tile blocks the window leaves (`runtime/prune.py`), "
        "each block cut piece pair by piece pair into the band's tight rectangles (`SpanBlocks._windowed`). The "
        "simulator prices each of those kernel calls (its exact band pairs at its rows' throughput, its call overhead "
        "and fp32 correction; `planning/windows.py`, tested call for call against the runtime) and replays the pruned "
        "plans; a rank waits only for the chunks of the blocks it runs. Exact pairs flatter narrow windows a little: "
        "a flash kernel computes whole tiles along the band.",
        "* **mesh (auto), a2a+mesh (auto)** are auto's choice per layer, scored on the layer's own (pruned) plans; for "
        "a window alone auto's memory budget (4x TE Ring's) is checked on the pruned plans (the mask is the same for "
        "every batch). The runtime runs one mesh shape for every layer (`window_attn_skip_freq` alternates "
        "window-pruned and full plans on one mesh), so the pair table gives each family the better of its two layers' "
        "auto shapes for both layers.",
        "* **TE p2p (Ring) and a2a+p2p (USP)** refuse sliding windows: TE's `attn_forward_func_with_cp` asserts "
        "`not sliding_window_attn or cp_comm_type in [\"a2a\", \"all_gather\"]`. On window layers their rows show the "
        "cost of the layer *without* its window, marked \"cannot window\": what the layer would cost on them, not the "
        "model's attention. Megatron's window-aware p2p (Megatron-LM PR #5597) was still open when this support "
        "was written.",
        "* **TE all_gather** runs windows: it gathers the whole K/V (forward, again in the backward, and "
        "reduce-scatters dK/dV), then slices each chunk's keys to its window (`get_kv_seq_info_after_all_gather`); "
        "priced so (its busiest rank's band pairs, no overlap of the gather). The TE stack that runs the alternating "
        "model is therefore USP on the full layers and all_gather on the window layers (Megatron's per-layer "
        "`--cp-comm-type` list).",
        "* **TE a2a (Ulysses)** runs windows (and learnable sinks) but asserts `num_heads % cp_size == 0` for Q *and* "
        "K/V (no kv-head replication): 8 kv heads cap it at CP 8 for gpt-oss, 128 heads at CP 128 for the MLA layer, "
        "so at n = 256 it is refused for both.",
        "* **Learnable sinks** (gpt-oss) cost nothing extra in our runtime: a sink is one more partial (output 0, lse "
        "s_h) merged once into each row's final (out, lse) (`merge.merge_sink`), and its gradient comes from each rank's "
        "own rows, with no communication; the simulator charges nothing for it. TE runs learnable sinks only with "
        "`a2a` (`softmax_type == \"vanilla\" or cp_comm_type == \"a2a\"`), so its USP and all_gather rows here price "
        "vanilla softmax: with gpt-oss's sinks no TE CP algorithm runs the model at n = 256.",
        "* **MLA** (DeepSeek-V3): the core attention receives K with the q/k head dim (192) and V with the value head "
        "dim (128), 128 kv heads after the up-projection, and every algorithm moves those (not the compressed latent); "
        "V, O, dO and dV bytes carry 128 and the kernels' FLOPs are QK^T at 192 and PV at 128 (`Workload.head_dim_v`).",
        "",
        *summary(oss, deep, rows),
    ]
    return "\n".join(head + body)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/variants.md")
    p.add_argument("--plot", default="docs/window_traffic.png")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = page(args.plot)
    Path(args.out).write_text(text)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
