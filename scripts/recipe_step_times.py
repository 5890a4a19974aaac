#!/usr/bin/env python
"""Estimated step time of shipped configs: simulated attention plus GEMMs at an assumed rate (an estimate).

    python scripts/recipe_step_times.py llama31_8b_cpt_s4_1m llama31_8b_1m_ring [--docs 4K-64K] [--markdown]

Per micro-batch on the slowest pipeline stage: its layers x (attention forward + backward + the forward
again under full recompute), attention simulated by ``megatron_mesh_cp.simulate``'s engine for the config's
CP algorithm and shape on ``--cluster``, plus the stage's GEMM FLOPs (``8 x`` weights per token with full
recompute, ``6 x`` for the output layer) at ``--gemm-tflops`` per GPU; a step is ``(m + PP - 1)`` of them
(1F1B, m micro-batches per data-parallel rank). TP, PP and DP communication and the optimizer step are not
modelled. ``--docs LO-HI`` prices document masking as each algorithm runs it: ours (mesh, a2a+mesh)
unpadded with pruned plans, Megatron/TE's padded to 2 x CP (THD, every chunk sent). The configs' save
intervals come from the figures without document masking (a save about every 30 minutes).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: what the configs' ${VAR}s stand for here: only shapes matter, no file is read
PLACEHOLDERS = {"DATA_PATH": "/data/x_text_document", "TOKENIZER_MODEL": "/models/tokenizer", "RUNS_DIR": "/runs",
                "LLAMA31_8B_CKPT": "/ckpt/8b", "LLAMA31_70B_CKPT": "/ckpt/70b"}


def resolve(name: str):
    """The config's Megatron arguments with the mesh mapping applied (auto shapes chosen), unvalidated."""
    from megatron_mesh_cp.megatron.arguments import apply_mesh_args
    from megatron_mesh_cp.megatron.config import config_to_argv, megatron_parser

    path = ROOT / "configs" / (name if name.endswith(".yaml") else name + ".yaml")
    argv = config_to_argv(str(path), dict(PLACEHOLDERS, **os.environ))
    args, _ = megatron_parser().parse_known_args(argv)
    return apply_mesh_args(args, argv)


def gemm_flops_per_token(args, stage_layers: int) -> float:
    """FLOPs per token of one pipeline stage's weights (fwd + bwd + recompute), the last stage's output layer included."""
    h, kv_dim = args.hidden_size, (args.kv_channels or args.hidden_size // args.num_attention_heads)
    kv = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    attn = h * (args.num_attention_heads * kv_dim + 2 * kv * kv_dim) + args.num_attention_heads * kv_dim * h
    mlp = (3 if args.swiglu else 2) * h * args.ffn_hidden_size
    per_weight = 8 if args.recompute_granularity == "full" else 6  # fwd 2 + bwd 4 (+ the recomputed fwd 2)
    return per_weight * stage_layers * (attn + mlp) + 6 * h * (args.vocab_size or 128256)


def step_time(name: str, cluster_name: str, gemm_tflops: float, docs=None):
    """(row dict) attention ms/layer, seconds per step, the config's layout."""
    from megatron_mesh_cp.megatron.cp_layer import attention_workload, simulator_name
    from megatron_mesh_cp.megatron.settings import SETTINGS
    from megatron_mesh_cp.planning.baselines import simulate_algorithm
    from megatron_mesh_cp.planning.cluster import load_cluster
    from megatron_mesh_cp.planning.doc_baselines import document_sets, runs_unpadded
    from megatron_mesh_cp.planning.packing import parse_doc_range

    args = resolve(name)
    cp, tp, pp = args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = 256 // (cp * tp * pp)
    m = args.global_batch_size // (args.micro_batch_size * dp)
    cluster = load_cluster(cluster_name)
    sim = simulator_name(args)
    w = attention_workload(args)
    if docs:  # the same draws: ours unpadded (pruned plans), TE's padded to 2 x CP
        packing, documents = document_sets(args.seq_length, cp, lo_hi=parse_doc_range(docs))
        # ours as the launcher runs them: unpadded, pruned, reordered (--mesh-document-order balanced)
        w = replace(w, mask=documents.with_balance(True) if runs_unpadded(sim) else packing)
    res = simulate_algorithm(sim, cp, cluster, w, tp=tp, max_live=SETTINGS.max_live)
    layers = args.num_layers // pp
    recompute = res.time_by_phase["forward"] if args.recompute_granularity == "full" else 0.0
    attention = layers * (res.time + recompute)
    gemm = gemm_flops_per_token(args, layers) * args.seq_length * args.micro_batch_size / (tp * cp) / (gemm_tflops * 1e12)
    step = (m + pp - 1) * (attention + gemm)
    return dict(config=name, algo=sim, shape=res.shape, layout=f"TP{tp} PP{pp} CP{cp} DP{dp}, {m} micro-batches",
                attention_ms=res.time * 1e3, step_s=step, save_every=max(1, int(1800 // step)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="config names in configs/")
    p.add_argument("--cluster", default="h100-ib400")
    p.add_argument("--gemm-tflops", type=float, default=450.0, help="assumed dense bf16 GEMM rate per GPU")
    p.add_argument("--docs", default=None, metavar="LO-HI", help="document masking: packed documents of LO..HI tokens")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    rows = [step_time(c, args.cluster, args.gemm_tflops, args.docs) for c in args.configs]
    note = f"documents {args.docs}" if args.docs else "no document masking"
    if args.markdown:
        print(f"| config ({note}) | algorithm | layout | attention ms/layer fwd+bwd | step s | save every |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| `{r['config']}` | {r['algo']} | {r['layout']} | {r['attention_ms']:.0f} | {r['step_s']:.0f} | "
                  f"{r['save_every']} |")
    else:
        for r in rows:
            print(f"{r['config']:<44} {r['algo']:<18} {r['layout']:<36} attention {r['attention_ms']:8.1f} ms/layer  "
                  f"step {r['step_s']:7.1f} s  save every {r['save_every']} ({note}; simulated attention, estimate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
