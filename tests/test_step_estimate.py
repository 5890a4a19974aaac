"""The dry run's step estimate (megatron/step_estimate.py): micro-batches sampled as GPTDataset cuts sequences from
weighted document-length sources, each simulated as the launcher runs it, and the lines it prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_mesh_cp.megatron import step_estimate as se  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_sequences_are_cut_from_the_sources_as_gptdataset_cuts_them():
    seq = 4096
    long = se.Source(0.5, np.array([3 * seq, 5 * seq]), "books")
    short = se.Source(0.5, np.array([100, 200, 300]), "web")
    drawn = se.sample_sequences([long, short], seq, 64, seed=1)
    assert all(sum(s) == seq and min(s) >= 1 for s in drawn)
    from_long = [s for s in drawn if len(s) <= 2]  # a window of documents longer than it holds one or two pieces
    from_short = [s for s in drawn if len(s) > 2]
    assert 16 < len(from_long) < 48 and len(from_long) + len(from_short) == 64
    assert all(max(s) <= 300 for s in from_short)
    assert drawn == se.sample_sequences([long, short], seq, 64, seed=1)  # seeded
    assert se.parse_mix("0.5 S-4S, 0.5 1K-16K", seq) == [(0.5, seq, 4 * seq), (0.5, 1024, 16384)]
    for bad in ("0.5 S-4S 0.5", "x 1K-2K", "1 4K-1K", "-1 1K-2K"):
        with pytest.raises(ValueError, match="length mix"):
            se.parse_mix(bad, seq)
    text, warnings = se.describe_sources([long, short], seq)
    assert "books, web (5 documents): 50% of the tokens in documents of at least the sequence length 4096" in text
    assert not warnings
    _, warnings = se.describe_sources([short], seq)
    assert warnings and "the longest document has 300 tokens, under half the sequence length 4096" in warnings[0]


def _resolve(name):
    spec = importlib.util.spec_from_file_location("recipe_step_times", ROOT / "scripts" / "recipe_step_times.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    return steps.resolve(name)


def test_the_estimate_prices_each_micro_batch_as_it_runs_and_prints_the_layout():
    from dataclasses import replace

    from megatron_mesh_cp.megatron import settings
    from megatron_mesh_cp.planning.cluster import load_cluster

    args = _resolve("llama31_8b_cpt_s1_128k")  # a2a+mesh 8x1x4 on CP 32: the documents balanced over 4 chunks
    s, cluster = args.seq_length, load_cluster("h100-ib400")
    whole = se.estimate(args, 8, cluster, [(s,)])
    short = se.estimate(args, 8, cluster, [tuple([s // 64] * 64)])
    mixed = se.estimate(args, 8, cluster, [(s,), tuple([s // 64] * 64)])
    assert short.step_s < mixed.step_s < whole.step_s <= whole.unmasked_step_s * 1.0001
    assert mixed.step_s == pytest.approx((short.step_s + whole.step_s) / 2, rel=1e-9)  # the mean micro-batch
    assert whole.layout.chunks == 4 and whole.algo == "a2a+mesh:8x1x4"
    skewed = [tuple([s // 2] + [s // 512] * 256)]  # one long document among short ones
    resolved = settings.options()
    estimates = {}
    try:
        for layout in ("zigzag", "balanced", "tiled", "tiled-cut", "split", "auto"):
            settings.configure(replace(resolved, layout=layout))
            estimates[layout] = se.estimate(args, 8, cluster, skewed)
        settings.configure(replace(resolved, layout="auto", whole_documents=True))  # auto where pieces cannot run
        whole = se.estimate(args, 8, cluster, skewed)
    finally:
        settings.configure(resolved)
    assert "split" in estimates["auto"].layout.name and "split" not in whole.layout.name, whole.layout.name
    # chosen by its bound among the layouts keeping documents whole (the replay may rank two close ones otherwise)
    assert any(f"{k} 1 of 1" in whole.layout.name for k in ("zigzag", "balanced", "tiled"))
    assert whole.attention_ms < estimates["zigzag"].attention_ms
    given, balanced = estimates["zigzag"], estimates["balanced"]
    assert balanced.layout.busiest_over_mean < given.layout.busiest_over_mean
    assert "balanced 1 of 1" in balanced.layout.name and "zigzag 1 of 1" in given.layout.name
    assert "tiled 1 of 1" in estimates["tiled"].layout.name  # the ranks of the 1x4 inner mesh balanced
    assert "tiled-cut 1 of 1" in estimates["tiled-cut"].layout.name
    # split: the long document cut over the chunks evens them out; auto takes the fastest its model predicts
    split, auto = estimates["split"], estimates["auto"]
    assert split.layout.busiest_over_mean < balanced.layout.busiest_over_mean and "split:1 1 of 1" in split.layout.name
    assert auto.attention_ms <= min(e.attention_ms for e in estimates.values()) * (1 + 1e-9)
    lines = dict((text.split(":")[0], (level, text)) for level, text in se.layout_lines(balanced, save_interval=50))
    assert lines["layout"][1].startswith(f"layout: --mesh-layout balanced (balanced 1 of 1 sampled micro-batches) "
                                         f"over 4 chunks; busiest chunk (rank, where tiled) "
                                         f"{balanced.layout.busiest_over_mean:.2f}x the mean attention work "
                                         "(simulated on the h100-ib400 preset, mean over 1 sampled micro-batches)")
    assert "without document masking" in lines["step time (estimate"][1]
    assert lines["save_interval 50"][1].endswith(f"would be save_interval {balanced.save_every()})")
    unmasked = se.estimate(args, 8, cluster)  # no sequences: the unmasked layer
    assert unmasked.step_s == unmasked.unmasked_step_s == whole.unmasked_step_s
    assert unmasked.layout.busiest_over_mean is None


def test_at_cp_1_the_dry_run_says_megatron_masks_the_documents():
    """CP = 1 with --reset-attention-mask runs Megatron's dense document mask: the layout line says so, not
    "no document masking"."""
    args = _resolve("llama31_8b_cpt_s1_128k")
    args.context_parallel_size, args.hierarchical_context_parallel_sizes = 1, None
    args.reset_attention_mask, args.data_parallel_size = True, 8
    lines = [text for _, text in se.layout_lines(se.dry_run_estimate(args))]
    assert lines[0] == ("layout: one rank over 1 CP ranks (documents masked by Megatron's dense mask "
                        "(--reset-attention-mask, CP = 1))"), lines
    assert lines[1].startswith("step time (estimate: attention at CP = 1 not simulated; GEMMs at 450 TFLOP/s"), lines


def test_the_dry_run_says_a_sliding_window_is_not_priced():
    """The estimate prices attention without --window-size: the dry run warns it is an upper bound."""
    args = _resolve("llama31_8b_cpt_s1_128k")
    args.window_size, args.data_parallel_size = (4095, 0), 8
    warned = [text for level, text in se.layout_lines(se.dry_run_estimate(args)) if level == "warning"]
    assert any("prices attention without the sliding window (--window-size 4095,0)" in w for w in warned), warned
    args.window_size = None
    assert not any("sliding window" in text for _, text in se.layout_lines(se.dry_run_estimate(args)))


@pytest.mark.parametrize("layout", ["auto", "balanced"])
def test_the_dry_run_names_the_asked_layout_where_the_documents_are_not_known(layout):
    """The built-in stdlib corpus (and mock data) is made at launch: the dry run prices the step unmasked, but its
    layout line names the --mesh-layout that runs each micro-batch's documents, not the unmasked zigzag."""
    from megatron_mesh_cp.megatron import settings
    from megatron_mesh_cp.megatron.arguments import apply_mesh_args
    from megatron_mesh_cp.megatron.config import config_to_argv, megatron_parser

    resolved = settings.options()
    argv = config_to_argv(str(ROOT / "configs" / "gpt_tiny_cpu.yaml"), {}) + [
        "--reset-attention-mask", "--micro-batch-size", "1", "--mesh-layout", layout]
    try:
        args = apply_mesh_args(megatron_parser().parse_known_args(argv)[0], argv)
        args.data_parallel_size = 1
        assert settings.options().documents == "eod" and settings.options().layout == layout
        how = "chosen" if layout == "auto" else "laid out"
        stdlib = [text for _, text in se.layout_lines(se.dry_run_estimate(args))][0]
        args.mock_data = True
        mock = [text for _, text in se.layout_lines(se.dry_run_estimate(args))][0]
    finally:
        settings.configure(resolved)
    assert stdlib == (f"layout: --mesh-layout {layout} ({how} per micro-batch from its documents at run time) over 4 "
                      "CP ranks (the built-in stdlib corpus is made at launch, so a dry run knows none of its "
                      "documents: the step is priced without document masking)"), stdlib
    assert mock.startswith(f"layout: --mesh-layout {layout} ({how} per micro-batch") and "mock data is made" in mock
