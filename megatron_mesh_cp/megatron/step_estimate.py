"""Simulated step time of a resolved config on the documents it trains on, and the layout that runs them.

Under document masking a step's attention depends on the documents in each micro-batch: a sequence
of short documents leaves a few percent of the unmasked work, one cut from a document longer than
the sequence most of it. So the estimate samples micro-batches as Megatron's GPTDataset makes them
(documents back to back, cut into sequences; a blend picks each sequence's dataset by weight) from
the document lengths of the configured data (each prefix's ``.idx``, read through megatron-core's
index reader; no token is read) or from a length mix (:func:`mix_sources`, the recipe's assumed
one), runs each through the simulator as the launcher runs it (mesh / a2a+mesh: unpadded, pruned
plans, each micro-batch in the token layout ``--mesh-layout`` gives it, megatron/layout.py)
and adds the GEMMs at an assumed rate. Per micro-batch on the slowest pipeline stage: its layers x
(attention forward + backward + the forward again under full recompute) plus ``8 x`` weights per
token (``6 x`` without recompute; ``6 x`` for the output layer) at ``gemm_tflops``; a step is
``(m + PP - 1)`` mean micro-batches (1F1B). TP, PP and DP communication and the optimizer step are
not modelled. Simulated attention, an estimate: labelled so wherever it is printed.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Source", "Layout", "StepEstimate", "data_sources", "mix_sources", "parse_mix", "sample_sequences",
           "describe_sources", "estimate", "dry_run_estimate", "layout_lines", "gemm_flops_per_token", "GEMM_TFLOPS",
           "SAVE_MINUTES"]

GEMM_TFLOPS = 450.0  # assumed dense bf16 GEMM rate per H100
SAVE_MINUTES = 30  # the recipe saves about this often


@dataclass(frozen=True)
class Source:
    """One dataset of a blend: its weight and its documents' token counts."""

    weight: float
    lengths: np.ndarray
    label: str


@dataclass(frozen=True)
class Layout:
    """How the CP ranks split a micro-batch's sequence, as the launcher runs it."""

    name: str
    chunks: int
    #: predicted busiest / mean chunk attention work over the sampled micro-batches (None: no documents)
    busiest_over_mean: Optional[float] = None


@dataclass(frozen=True)
class StepEstimate:
    algo: str
    shape: str
    layout: Layout
    data: str
    sequences: int
    micro_batches: int
    attention_ms: float  # per layer, forward + backward, mean over the sampled micro-batches
    step_s: float
    unmasked_step_s: float
    cluster: str
    gemm_tflops: float
    warnings: Tuple[str, ...] = ()

    def save_every(self, minutes: float = SAVE_MINUTES) -> int:
        """Steps between saves for a save about every ``minutes``."""
        return max(1, int(minutes * 60 // self.step_s))


def _document_lengths(prefix: str) -> np.ndarray:
    """Token count of every document of a Megatron indexed dataset (its ``.idx`` only)."""
    from megatron.core.datasets import indexed_dataset

    reader = getattr(indexed_dataset, "_IndexReader", None)
    if reader is None:
        raise RuntimeError("megatron.core.datasets.indexed_dataset._IndexReader is gone; this estimate supports "
                           "megatron-core 0.19.x and 0.20")
    index = reader(prefix + ".idx", False)
    seqs = np.asarray(index.sequence_lengths, dtype=np.int64)
    docs = np.asarray(index.document_indices, dtype=np.int64)
    if len(seqs) == 0:
        raise ValueError(f"{prefix}.idx lists no documents")
    lengths = np.add.reduceat(seqs, docs[:-1][docs[:-1] < len(seqs)])
    return lengths[lengths > 0]


def data_sources(args) -> List[Source]:
    """The configured data (``--data-path``, or ``--train-data-path``) as weighted document-length sources."""
    from megatron.core.datasets.utils import get_blend_from_list

    paths = args.data_path or args.train_data_path
    prefixes, weights = get_blend_from_list(paths)
    weights = weights or [1.0] * len(prefixes)
    total = float(sum(weights))
    return [Source(w / total, _document_lengths(p), os.path.basename(p)) for p, w in zip(prefixes, weights)]


def parse_mix(spec: str, seq: int) -> List[Tuple[float, int, int]]:
    """``"0.5 S-4S 0.5 1K-16K"`` -> [(weight, shortest, longest)]: a blend of document length ranges, in token
    counts (``4K``, ``1M``) or multiples of the sequence length ``S`` (``S``, ``4S``)."""
    from ..planning import parse_tokens

    words = spec.replace(",", " ").split()
    if not words or len(words) % 2:
        raise ValueError(f"length mix {spec!r} must be pairs WEIGHT LO-HI, e.g. '0.5 S-4S 0.5 1K-16K'")

    def tokens(text: str) -> int:
        t = text.strip().upper()
        if t.endswith("S"):
            return int(float(t[:-1] or 1) * seq)
        return parse_tokens(t)

    out = []
    for weight, span in zip(words[::2], words[1::2]):
        lo, _, hi = span.partition("-")
        try:
            w, a, b = float(weight), tokens(lo), tokens(hi or lo)
        except ValueError as exc:
            raise ValueError(f"length mix {spec!r}: {exc}") from None
        if w <= 0 or a < 1 or b < a:
            raise ValueError(f"length mix {spec!r}: {weight} {span} needs a positive weight and 1 <= LO <= HI")
        out.append((w, a, b))
    return out


def mix_sources(spec: str, seq: int, seed: int = 0, pool: int = 4096) -> List[Source]:
    """A length mix as sources: ``pool`` log-uniform draws per range
    (:func:`~megatron_mesh_cp.planning.packing.length_draws`)."""
    from ..planning import length_draws

    parts = parse_mix(spec, seq)
    total = sum(w for w, _, _ in parts)
    out = []
    for k, (w, lo, hi) in enumerate(parts):
        draws = length_draws(lo, hi, "loguniform", seed + k)
        out.append(Source(w / total, np.array([next(draws) for _ in range(pool)], dtype=np.int64), f"{lo}-{hi}"))
    return out


def sample_sequences(sources: Sequence[Source], seq: int, count: int, seed: int = 0) -> List[Tuple[int, ...]]:
    """``count`` sequences of ``seq`` tokens as GPTDataset cuts them: each from one source (by weight), documents
    back to back from a random token on (the first one cut there, the last one cut at ``seq``)."""
    rng = np.random.default_rng(seed)
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    cums = [np.cumsum(s.lengths) for s in sources]
    out = []
    for _ in range(count):
        k = int(rng.choice(len(sources), p=weights / weights.sum()))
        lengths, cu = sources[k].lengths, cums[k]
        t = int(rng.integers(int(cu[-1])))
        d = int(np.searchsorted(cu, t, side="right"))
        pieces, filled = [int(cu[d]) - t], int(cu[d]) - t
        while filled < seq:
            x = int(lengths[rng.integers(len(lengths))])
            pieces.append(x)
            filled += x
        pieces[-1] -= filled - seq
        out.append(tuple(p for p in pieces if p > 0))
    return out


def describe_sources(sources: Sequence[Source], seq: int) -> Tuple[str, List[str]]:
    """(the data in words, warnings): the share of tokens in documents at least the sequence length, the longest."""
    long_share = sum(s.weight * float(s.lengths[s.lengths >= seq].sum()) / float(s.lengths.sum()) for s in sources)
    longest = max(int(s.lengths.max()) for s in sources)
    docs = sum(len(s.lengths) for s in sources)
    text = (f"{', '.join(s.label for s in sources)} ({docs} documents): {long_share:.0%} of the tokens in documents "
            f"of at least the sequence length {seq}, the longest {longest}")
    warn = []
    if longest < seq // 2:
        warn.append(f"the longest document has {longest} tokens, under half the sequence length {seq}: under document "
                    "masking no token attends further than that, so this stage trains nothing a shorter one would not "
                    "(add long documents: books, code repositories concatenated per repository)")
    return text, warn


def gemm_flops_per_token(args, stage_layers: int) -> float:
    """FLOPs per token of one pipeline stage's weights (fwd + bwd + recompute), the output layer included."""
    h, kv_dim = args.hidden_size, (args.kv_channels or args.hidden_size // args.num_attention_heads)
    kv = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    attn = h * (args.num_attention_heads * kv_dim + 2 * kv * kv_dim) + args.num_attention_heads * kv_dim * h
    mlp = (3 if args.swiglu else 2) * h * args.ffn_hidden_size
    per_weight = 8 if args.recompute_granularity == "full" else 6  # fwd 2 + bwd 4 (+ the recomputed fwd 2)
    return per_weight * stage_layers * (attn + mlp) + 6 * h * (args.vocab_size or 128256)


def _chunks(args) -> int:
    """The zigzag chunks the documents are balanced over (the launcher's _balanced: a2a+mesh's a*b)."""
    sizes = list(args.hierarchical_context_parallel_sizes or [args.context_parallel_size])
    return sizes[-2] * sizes[-1] if len(sizes) >= 2 else sizes[0]


def estimate(args, dp: int, cluster, sequences: Optional[Sequence[Tuple[int, ...]]] = None, data: str = "",
             gemm_tflops: float = GEMM_TFLOPS, warnings: Sequence[str] = ()) -> StepEstimate:
    """The step of a resolved config (after ``apply_mesh_args``) at ``dp`` data-parallel ranks, on the sampled
    ``sequences`` (document lengths) under document masking, else unmasked."""
    from ..planning import simulate_algorithm
    from ..planning import UnpaddedDocuments
    from .layout import choose as choose_layout
    from .cp_layer import attention_workload, simulator_name
    from .settings import options

    cp, tp, pp = args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    m = args.global_batch_size // (args.micro_batch_size * dp)
    sim, w = (simulator_name(args), attention_workload(args)) if cp > 1 else ("none", attention_workload(args))
    layers = args.num_layers // pp
    tokens = args.seq_length * args.micro_batch_size / (tp * cp)
    gemm = gemm_flops_per_token(args, layers) * tokens / (gemm_tflops * 1e12)
    full = args.recompute_granularity == "full"

    def micro_batch(workload):
        if cp <= 1:
            return 0.0, gemm, "-"
        res = simulate_algorithm(sim, cp, cluster, workload, tp=tp, max_live=options().max_live)
        recompute = res.time_by_phase["forward"] if full else 0.0
        return res.time, layers * (res.time + recompute) + gemm, res.shape

    attn0, t0, shape = micro_batch(w)
    unmasked = (m + pp - 1) * t0
    documents = sequences is not None and options().documents == "eod" and cp > 1
    if not documents:
        layout = Layout("zigzag" if cp > 1 else "one rank", cp)
        return StepEstimate(sim, shape, layout, data or "no document masking", 0, m, attn0 * 1e3, unmasked, unmasked,
                            cluster.name, gemm_tflops, tuple(warnings))
    chunks = _chunks(args)
    attn, times, ratios, chosen = [], [], [], Counter()
    for lengths in sequences:
        arr, _ = choose_layout(lengths, args)  # what the launcher's get_batch runs for this micro-batch
        name = arr.label
        chosen[name] += 1
        ratios.append(arr.balance)
        a, t, _ = micro_batch(replace(w, mask=UnpaddedDocuments(tuple(lengths)).with_layout(name)))
        attn.append(a)
        times.append(t)
    picks = ", ".join(f"{k} {v}" for k, v in sorted(chosen.items(), key=lambda kv: -kv[1]))
    layout = Layout(f"--mesh-layout {options().layout} ({picks} of {len(sequences)} sampled micro-batches)", chunks,
                    float(np.mean(ratios)))
    return StepEstimate(sim, shape, layout, data, len(sequences), m, float(np.mean(attn)) * 1e3,
                        (m + pp - 1) * float(np.mean(times)), unmasked, cluster.name, gemm_tflops, tuple(warnings))


def layout_lines(e: StepEstimate, save_interval: Optional[int] = None) -> List[Tuple[str, str]]:
    """(level, line) pairs the dry run prints about the layout and the step (simulated): one place, whatever
    the layout."""
    sim = f"simulated on the {e.cluster} preset"
    lines = []
    if e.layout.busiest_over_mean is not None:
        lines.append(f"layout: {e.layout.name} over {e.layout.chunks} chunks; busiest chunk (rank, where tiled) "
                     f"{e.layout.busiest_over_mean:.2f}x the mean attention work ({sim}, mean over {e.sequences} "
                     f"sampled micro-batches)")
        lines.append(f"documents: {e.data}")
    else:
        lines.append(f"layout: {e.layout.name} over {e.layout.chunks} CP ranks ({e.data})")
    masked = e.sequences > 0
    attention = (f"attention {sim}, {e.attention_ms:.1f} ms per layer fwd+bwd, +" if e.algo != "none" else
                 "attention at CP = 1 not simulated;")
    lines.append(f"step time (estimate: {attention} GEMMs at "
                 f"{e.gemm_tflops:.0f} TFLOP/s; TP/PP/DP communication not modelled): {e.step_s:.1f} s per step of "
                 f"{e.micro_batches} micro-batch{'es' if e.micro_batches != 1 else ''}" + (f"; {e.unmasked_step_s:.1f} s without document masking"
                                                      if masked else ""))
    if save_interval:
        minutes = save_interval * e.step_s / 60
        shown = f"{minutes:.1f}" if minutes < 10 else f"{minutes:.0f}"
        lines.append(f"save_interval {save_interval}: a save every {shown} min at this step time "
                     f"(about every {SAVE_MINUTES} min would be save_interval {e.save_every()})")
    return [("info", line) for line in lines] + [("warning", w) for w in e.warnings]


def dry_run_estimate(args, sequences: int = 8, seed: int = 0) -> StepEstimate:
    """:func:`_dry_run_estimate`, saying what it leaves out: a sliding window is not priced (an upper bound)."""
    e = _dry_run_estimate(args, sequences, seed)
    if getattr(args, "window_size", None) and args.context_parallel_size > 1:
        e = replace(e, warnings=e.warnings + (
            f"the step estimate prices attention without the sliding window (--window-size "
            f"{','.join(str(x) for x in args.window_size)}){_auto_too(args)}: an upper bound on the windowed "
            "step",))
    return e


def _auto_too(args) -> str:
    """', as is auto's choice ...' where --mesh-layout auto chooses the documents' layout."""
    from .settings import options

    if getattr(args, "reset_attention_mask", False) and options().layout == "auto":
        return ", as does --mesh-layout auto when it chooses among the layouts that keep documents whole"
    return ""


def _documents_unknown(args, e: StepEstimate) -> StepEstimate:
    """``e`` (priced unmasked) with the layout that will run under document masking: ``--mesh-layout``'s, applied to
    each micro-batch's documents at run time (not the unmasked estimate's zigzag)."""
    from .settings import options

    how = "chosen" if options().layout == "auto" else "laid out"
    return replace(e, layout=replace(e.layout, name=f"--mesh-layout {options().layout} ({how} per micro-batch from "
                                                    "its documents at run time)"))


def _dry_run_estimate(args, sequences: int = 8, seed: int = 0) -> StepEstimate:
    """The launcher's ``--dry-run`` estimate: under document masking on ``sequences`` micro-batches sampled from the
    configured data's documents (``--data-path`` / ``--train-data-path``; a dry run builds no stdlib corpus),
    else unmasked."""
    from ..planning import load_cluster
    from ..planning import default_cluster
    from .settings import options

    name = getattr(args, "mesh_cluster", None)
    cluster = options().cluster or (load_cluster(name) if name else default_cluster())
    dp = int(args.data_parallel_size)
    if args.context_parallel_size <= 1 and getattr(args, "reset_attention_mask", False):
        return estimate(args, dp, cluster, data="documents masked by Megatron's dense mask (--reset-attention-mask, "
                                                "CP = 1)")
    if options().documents != "eod" or args.context_parallel_size <= 1:
        return estimate(args, dp, cluster)
    if not (args.data_path or args.train_data_path) or args.mock_data:
        what = "mock data" if args.mock_data else "the built-in stdlib corpus"
        return _documents_unknown(args, estimate(
            args, dp, cluster, data=f"{what} is made at launch, so a dry run knows none of its documents: the step is "
                                    "priced without document masking"))
    try:
        sources = data_sources(args)
    except (OSError, ValueError, RuntimeError) as exc:
        return _documents_unknown(args, estimate(
            args, dp, cluster, data="the data's document lengths could not be read: the step is priced without "
                                    "document masking",
            warnings=(f"the data's document lengths could not be read ({type(exc).__name__}: {exc}); the step time is "
                      "the unmasked one",)))
    text, warnings = describe_sources(sources, args.seq_length)
    drawn = sample_sequences(sources, args.seq_length, sequences, seed)
    return estimate(args, dp, cluster, drawn, data=text, warnings=warnings)
