"""``python -m megatron_mesh_cp.simulate`` (``mesh-cp-simulate``): compare CP attention algorithms
on a simulated cluster (time, traffic, exposed communication); every figure it prints is simulated.

The engine lives in :mod:`megatron_mesh_cp.planning` (``replay`` for plans, ``baselines`` for the
algorithms we compare with); this module is only the command line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from .planning.baselines import ALGORITHMS, compare, format_packed_table, format_table, plot_timelines, takes_max_live
from .planning.cluster import Workload, load_cluster
from .planning.doc_baselines import compare_documents, document_sets, format_documents_table
from .planning.packing import DISTRIBUTIONS, parse_doc_range, parse_tokens
from .planning.search import budget_error
from .planning.window_baselines import compare_windows, format_window_table
from .runtime.masks import Window

__all__ = ["main"]


def _parse_size(text: str) -> int:
    return parse_tokens(text)


def _parse_window(text: str):
    """``L,R`` (ints >= -1, sizes like 4K allowed; -1 = unbounded) -> (left, right)."""
    parts = [x.strip() for x in str(text).split(",")]
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(-1 if x == "-1" else parse_tokens(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (ints >= -1, e.g. 128,0 or 4K,4K), got {text!r}")


def parse_layouts(text: str) -> list:
    """``--layout``'s comma list, each checked."""
    from .planning import UnpaddedDocuments

    out = []
    for name in (x.strip() for x in str(text).split(",") if x.strip()):
        UnpaddedDocuments((2,)).with_layout(name)  # ValueError naming the choices
        out.append(name)
    if not out:
        raise ValueError("--layout needs at least one of auto, zigzag, balanced, tiled, tiled-cut, split:K, split:K:H")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mesh_cp.simulate",
        description="Simulate CP attention algorithms on a cluster: time, traffic, exposed communication.",
    )
    p.add_argument("--cp", type=int, required=True, help="context-parallel size n")
    p.add_argument("--seq", type=_parse_size, required=True, help="global sequence length (e.g. 1048576, 128K, 1M)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128, help="q/k head dim")
    p.add_argument("--head-dim-v", type=int, default=None,
                   help="V's head dim where it differs (MLA, e.g. --head-dim 192 --head-dim-v 128); default --head-dim")
    p.add_argument("--window", type=_parse_window, default=None, metavar="L,R",
                   help="sliding window: query i sees keys i-L .. i+R (-1: unbounded; causal needs R = 0); ours run "
                        "the window-pruned plans, ulysses (TE a2a) and allgather the band, TE's ring and usp cannot "
                        "(shown at their full-attention cost, marked)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cluster", default="h100-ib400", help="preset name or YAML path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CP ranks are TP GPUs apart)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--partial-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="wire dtype of partial O/dQ/dKV (all ring-style algorithms alike)")
    p.add_argument("--algos", default="ring,usp,mesh", help=f"comma list of {','.join(ALGORITHMS)}, mesh:AxB, usp:U "
                   "or a2a+mesh:UxAxB (ring-pruned: with unpadded documents only)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw one rank's timeline per algorithm")
    p.add_argument("--max-live", type=int, default=None,
                   help="memory budget (live chunks) for the mesh plans: mesh, mesh:AxB, a2a+mesh, a2a+mesh:UxAxB "
                        "(and mesh-naive's shape, chosen as mesh's within it; refused when --algos has none of these)")
    p.add_argument("--plan-search", type=int, default=0, metavar="N",
                   help="unpadded documents or --window: replays per phase the order search may spend improving "
                        "our pruned plans (planning/search.py; the launcher's --mesh-plan-search; 0: none)")
    pk = p.add_argument_group(
        "documents: attention masked at document boundaries (--docs or --doc-lengths); --doc-layout says how they run")
    pk.add_argument(
        "--doc-layout", choices=("unpadded", "padded"), default=None,
        help="unpadded (default with documents): each algorithm as it runs documents -- ours (mesh, mesh:AxB, "
             "mesh-naive, passq, a2a+mesh, a2a+mesh:UxAxB and ring-pruned, our Ring 1xn, always shown) unpadded on the "
             "ordinary layout "
             "with pruned plans (an empty block is not computed, a chunk nobody needs is not sent); TE's ring and "
             "usp (and ulysses, allgather) as THD, every document padded to a multiple of 2*cp and every chunk "
             "sent; both from the same draws, each filling --seq. padded: every algorithm on the padded THD "
             "packing (same bytes as unpacked, less work per block), compared with the unpacked sequence")
    src = pk.add_mutually_exclusive_group()
    src.add_argument("--docs", default=None, metavar="LO-HI",
                     help="draw document lengths in LO..HI tokens (e.g. 4K-64K) and pack them into --seq")
    src.add_argument("--doc-lengths", default=None, metavar="FILE",
                     help="document lengths from a text file (token counts), packed in order into --seq")
    pk.add_argument("--doc-dist", choices=DISTRIBUTIONS, default=None,
                    help="distribution for --docs (default loguniform; powerlaw: heavy-tailed, P(length > x) ~ x^-1/2 "
                         "on LO..HI)")
    pk.add_argument("--doc-seed", type=int, default=None, help="random seed for --docs (default 0)")
    pk.add_argument("--layout", default=None, metavar="LAYOUT[,LAYOUT...]",
                    help="the token layout(s) ours run the documents in, one row each, as the launcher's "
                         "--mesh-layout: auto (default: per mesh the one the cost model picks), zigzag (as drawn or "
                         "read), balanced (whole documents reordered so the zigzag chunks carry near-equal work), "
                         "tiled (whole documents reordered so the mesh's ranks, each a tile of blocks, carry "
                         "near-equal work), tiled-cut (that order with a few documents re-laid to even "
                         "the ranks further), split:K (the K longest documents cut into pieces over every chunk), or "
                         "split:K:H (the last H of those over half of each mesh row's chunks, on meshes with a and b "
                         "even; split:K elsewhere, and the row says so). "
                         "TE's THD partition balances every order")
    pk.add_argument("--kernel-tile", type=int, default=0, metavar="T",
                    help="price document blocks in whole TxT kernel tiles per document segment (flash-style); "
                         "0 (default): exact unmasked pairs")
    pk.add_argument("--no-unpacked", action="store_true", help="with --docs/--doc-lengths or --window: skip the "
                    "comparison with the same layer without documents (or without the window)")
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
            head_dim_v=args.head_dim_v,
        )
        if args.window is not None and (args.docs or args.doc_lengths):
            raise ValueError("--window with --docs/--doc-lengths is not priced by this command (TE's algorithms "
                             "run neither unpadded documents nor windows on p2p); price one windowed sequence, or "
                             "documents without --window")
        windowed = replace(w, mask=Window(*args.window)) if args.window is not None else None
        for flag, value in (("--kernel-tile", args.kernel_tile), ("--doc-layout", args.doc_layout),
                            ("--layout", args.layout)):
            if value and not (args.docs or args.doc_lengths):
                raise ValueError(f"{flag} prices documents; give --docs LO-HI or --doc-lengths FILE with it")
        for flag, value in (("--doc-dist", args.doc_dist), ("--doc-seed", args.doc_seed)):
            if value is not None and not args.docs:
                raise ValueError(f"{flag} draws the lengths of --docs LO-HI; "
                                 + ("--doc-lengths reads them from its file: drop it" if args.doc_lengths
                                    else "give --docs with it or drop it"))
        if args.no_unpacked and not (args.docs or args.doc_lengths or args.window is not None):
            raise ValueError("--no-unpacked skips the comparison with the layer without documents or a window, which "
                             "this command prices only with --docs, --doc-lengths or --window: drop it")
        documents = None
        if args.docs or args.doc_lengths:
            packing, documents = document_sets(args.seq, args.cp, path=args.doc_lengths,
                                               dist=args.doc_dist or "loguniform",
                                               lo_hi=parse_doc_range(args.docs) if args.docs else None,
                                               seed=args.doc_seed or 0, tile=args.kernel_tile)
            layouts = parse_layouts(args.layout or "auto")
            if args.doc_layout == "padded" and args.layout:
                raise ValueError("--layout lays out unpadded documents; --doc-layout padded prices TE's padded THD "
                                 "partition, which has its own: drop one of them")
            if args.doc_layout == "padded":
                documents = None
            elif args.batch != 1:
                raise ValueError(f"unpadded documents take one sequence (--batch 1), got --batch {args.batch}; "
                                 "or price the padded THD layout with --doc-layout padded")
        else:
            packing = None
        algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        bounded = [a for a in algos if takes_max_live(a)]
        if args.max_live is not None and not bounded:
            raise ValueError(f"--max-live bounds the live chunks of the mesh plans (mesh, mesh:AxB, a2a+mesh, "
                             f"a2a+mesh:UxAxB; mesh-naive's shape); none of --algos {','.join(algos)} takes it: add one "
                             "or drop --max-live")
        why = budget_error(args.plan_search)
        if why:
            raise ValueError(f"--plan-search counts replays per phase: {why}")
        if args.plan_search and documents is None and windowed is None:
            raise ValueError("--plan-search re-orders the pruned plans of unpadded documents or a sliding window: give "
                             "--docs or --doc-lengths (with --doc-layout unpadded) or --window, or drop it")
        unpacked, window_rows = None, None
        if windowed is not None and windowed.window is None:
            raise ValueError(f"--window {args.window[0]},{args.window[1]} is no window (-1: unbounded); drop it")
        if windowed is not None:
            window_rows = compare_windows(algos, args.cp, cluster, windowed, tp=args.tp, max_live=args.max_live,
                                          search=args.plan_search)
        masked = packing is not None or windowed is not None
        if not masked or not args.no_unpacked:
            plain = [a for a in algos if a != "ring-pruned"] if masked else algos  # it needs documents or a window
            unpacked = compare(plain, args.cp, cluster, w, tp=args.tp, max_live=args.max_live)
        results = unpacked
        if documents is not None:
            results = compare_documents(algos, args.cp, cluster, w, packing, documents, tp=args.tp,
                                        max_live=args.max_live, layouts=layouts, search=args.plan_search)
        elif packing is not None:
            results = compare(algos, args.cp, cluster, replace(w, mask=packing), tp=args.tp, max_live=args.max_live)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    caption = (
        f"CP={args.cp}  S={args.seq}  heads={args.heads}/{kv} kv  d={args.head_dim}"
        f"{f' (v {w.dv})' if w.dv != w.head_dim else ''}  "
        f"{'causal' if w.causal else 'full'}  cluster={cluster.name}  tp={args.tp}  partials={args.partial_dtype}"
        + (f"  window={windowed.window[0]},{windowed.window[1]}" if windowed is not None else "")
    )
    print(f"{caption}  (every figure simulated on the calibrated cost model, none measured)")
    if args.max_live is not None:
        print(f"--max-live {args.max_live}: bounds {', '.join(bounded)}; the other rows run their own plans' memory")
        caption += f"  max-live {args.max_live} ({', '.join(bounded)})"
    searched = (f"plans searched: our pruned plans (not mesh-naive's, not TE's) re-ordered by the order search, "
                f"{args.plan_search} replays per phase (planning/search.py; --plan-search 0 for the unsearched)")
    if window_rows is not None:
        if args.plan_search:
            print(searched)
            caption += f"  plans searched ({args.plan_search} replays per phase)"
        print(format_window_table(window_rows))
        results = [r.result for r in window_rows if r.result is not None and r.status == "runs the window"]
        if unpacked is not None:
            print("\nthe same layer without the window (full causal attention):" if w.causal else
                  "\nthe same layer without the window:")
            print(format_table(unpacked))
    elif documents is not None:
        print(f"documents, unpadded (mesh family): {documents.with_layout('zigzag').describe()}; token layouts "
              f"{', '.join(layouts)} (the documents column says which ran)")
        if args.plan_search:
            print(searched)
            caption += f"  plans searched ({args.plan_search} replays per phase)"
        print(f"documents, padded THD (TE's ring and usp): {packing.describe()}")
        caption += f"  documents: {len(documents.lengths)} ({documents.label}), unpadded+pruned vs TE padded"
        print(format_documents_table(results, packing, documents))
        if unpacked is not None:
            print("\nthe same layer without documents (one causal sequence):")
            print(format_table(unpacked))
    elif packing is not None:
        print(f"packed: {packing.describe()}")
        caption += f"  packed: {len(packing.lengths)} documents ({packing.label})"
    if documents is None and window_rows is None:
        print(format_table(results))
    if packing is not None and documents is None and unpacked is not None:
        print("\npacked vs unpacked (same chunks and bytes; blocks priced by their work inside documents):")
        print(format_packed_table(unpacked, results))
    if args.plot:
        plot_timelines(results, args.plot, caption=f"simulated: {caption}")
        print(f"timeline written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
