#!/usr/bin/env python
"""Estimated step time of shipped configs: simulated attention plus GEMMs at an assumed rate (an estimate).

    python scripts/recipe_step_times.py llama31_8b_cpt_s4_1m llama31_8b_1m_ring [--mix "0.5 S-4S 0.5 1K-16K"]
        [--docs LO-HI | --no-docs] [--markdown]

The configs' document masking is priced on sampled micro-batches of a document length mix
(``megatron_mesh_cp/megatron/step_estimate.py``, the dry run's estimate): by default the recipe's
assumed mix, ``RECIPE_MIX`` (half the tokens from documents at least the stage's length, half from
1K-16K ones; README, "Long-context recipe"); ``--docs LO-HI`` prices one log-uniform range instead,
``--no-docs`` the unmasked step. Ours (mesh, a2a+mesh) run the documents unpadded with pruned plans in the
token layout ``--mesh-layout`` picks for each micro-batch (auto by default), as the launcher does; configs
without document masking are priced unmasked. The configs' save intervals come from the recipe mix's
figure (a save about every 30 minutes, at most the stage's length).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: what the configs' ${VAR}s stand for here: only shapes matter, no file is read
PLACEHOLDERS = {"DATA_PATH": "/data/x_text_document", "TOKENIZER_MODEL": "/models/tokenizer", "RUNS_DIR": "/runs",
                "LLAMA31_8B_CKPT": "/ckpt/8b", "LLAMA31_70B_CKPT": "/ckpt/70b"}
#: the length mix the recipe assumes (README): long documents (S = the stage's sequence length) among short ones
RECIPE_MIX = "0.5 S-4S 0.5 1K-16K"
WORLD = 256
SEQUENCES = 32  # sampled micro-batches per config


def resolve(name: str):
    """The config's Megatron arguments with the mesh mapping applied (auto shapes chosen), unvalidated."""
    from megatron_mesh_cp.megatron.arguments import apply_mesh_args
    from megatron_mesh_cp.megatron.config import config_to_argv, megatron_parser

    path = ROOT / "configs" / (name if name.endswith(".yaml") else name + ".yaml")
    argv = config_to_argv(str(path), dict(PLACEHOLDERS, **os.environ))
    args, _ = megatron_parser().parse_known_args(argv)
    return apply_mesh_args(args, argv)


def step_time(name: str, cluster_name: str, gemm_tflops: float, docs=None, mix=RECIPE_MIX):
    """(row dict) attention ms/layer, seconds per step, the config's layout; ``mix`` None (and no ``docs``):
    unmasked."""
    from megatron_mesh_cp.megatron import step_estimate as se
    from megatron_mesh_cp.planning import load_cluster

    args = resolve(name)
    cp, tp, pp = args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = WORLD // (cp * tp * pp)
    spec = f"1 {docs}" if docs else mix
    sequences = None
    if spec:
        sequences = se.sample_sequences(se.mix_sources(spec, args.seq_length), args.seq_length, SEQUENCES)
    e = se.estimate(args, dp, load_cluster(cluster_name), sequences, data=spec or "", gemm_tflops=gemm_tflops)
    return dict(config=name, algo=e.algo, shape=e.shape, layout=f"TP{tp} PP{pp} CP{cp} DP{dp}, {e.micro_batches} "
                f"micro-batches", attention_ms=e.attention_ms, step_s=e.step_s, unmasked_s=e.unmasked_step_s,
                save_every=e.save_every(), ratio=e.layout.busiest_over_mean, masked=e.sequences > 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="config names in configs/")
    p.add_argument("--cluster", default="h100-ib400")
    p.add_argument("--gemm-tflops", type=float, default=450.0, help="assumed dense bf16 GEMM rate per GPU")
    p.add_argument("--mix", default=RECIPE_MIX, help=f"document length mix WEIGHT LO-HI ... (default {RECIPE_MIX!r}; "
                   "S = the config's sequence length)")
    p.add_argument("--docs", default=None, metavar="LO-HI", help="document masking: one log-uniform range instead")
    p.add_argument("--no-docs", action="store_true", help="the unmasked step")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    mix = None if args.no_docs else args.mix
    docs = None if args.no_docs else args.docs
    rows = [step_time(c, args.cluster, args.gemm_tflops, docs, mix) for c in args.configs]
    note = "no document masking" if args.no_docs else f"documents {args.docs or mix}"
    if args.markdown:
        print(f"| config ({note}) | algorithm | layout | attention ms/layer fwd+bwd | busiest/mean chunk | step s | "
              "unmasked step s | save every |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
            print(f"| `{r['config']}` | {r['algo']} | {r['layout']} | {r['attention_ms']:.0f} | {ratio} | "
                  f"{r['step_s']:.0f} | {r['unmasked_s']:.0f} | {r['save_every']} |")
    else:
        for r in rows:
            print(f"{r['config']:<44} {r['algo']:<18} {r['layout']:<36} attention {r['attention_ms']:8.1f} ms/layer  "
                  f"step {r['step_s']:7.1f} s (unmasked {r['unmasked_s']:.1f} s)  save every {r['save_every']} "
                  f"({note if r['masked'] else 'no document masking'}; simulated attention, estimate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
