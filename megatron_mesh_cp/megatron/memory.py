"""Per-GPU memory estimate for a resolved Megatron configuration with mesh CP (the launcher's dry run).

Weights and optimizer: the parameter count of the most loaded model shard from Megatron's own
``theoretical_memory_usage`` (GQA, SwiGLU, MoE, untied output layer), at bf16 parameters, fp32 main
gradients and fp32 Adam state + master weights, the last sharded over DP x CP by the distributed
optimizer (Megatron's estimator shards over DP only, which overstates CP runs). Activations: Megatron's
per-layer term (flash attention, no score matrix) on this rank's sequence share; with full recompute
only each layer's input is kept plus one layer being recomputed. Attention: the buffers the CP algorithm
holds per rank beyond q, k, v and the output (:func:`.cp_layer.attention_peak_bytes`: for mesh and
a2a+mesh the arena of the plans that will run -- the figure ``mesh_shape=auto`` logs -- plus the
all-to-all's tensors; Ring's and Ulysses x Ring's K/V and accumulator buffers for TE's algorithms).
An estimate, not a measurement.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

__all__ = ["estimate", "report", "tokenizer_vocab", "parameter_count"]

GIB = 2**30
ASSUMED_VOCAB = 128256  # Llama-3's, when the tokenizer (not loaded by a dry run) gives no size


def _params_on_most_loaded_shard(args, vocab: int) -> float:
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    a = copy.copy(args)
    a.padded_vocab_size = vocab
    a.use_distributed_optimizer, a.data_parallel_size = True, 1  # 18 bytes per parameter, so count = bytes / 18
    return compute_weight_and_optimizer_memory(a) / 18


def estimate(args) -> dict:
    """Bytes per GPU by component (and the assumptions made), for the most loaded rank."""
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or ASSUMED_VOCAB
    params = _params_on_most_loaded_shard(args, vocab)
    cp, tp, dp = args.context_parallel_size, args.tensor_model_parallel_size, args.data_parallel_size
    shards = dp * cp if args.use_distributed_optimizer else 1
    bytes_el = 2 if (args.bf16 or args.fp16) else 4
    s_local, mb, h = args.seq_length // cp, args.micro_batch_size, args.hidden_size
    layers = args.num_layers // args.pipeline_model_parallel_size
    per_layer = s_local * mb * h * (10 + 24 / tp)  # Megatron's flash-attention layer term (bytes, 16-bit)
    full = getattr(args, "recompute_granularity", None) == "full"
    kept = s_local * mb * h * bytes_el / (tp if args.sequence_parallel else 1)  # a layer's input
    activations = layers * kept + per_layer if full else layers * per_layer
    logits = s_local * mb * vocab / tp * (bytes_el + 4)  # logits and their fp32 softmax/gradient
    from .cp_layer import attention_peak_bytes, cp_algorithm

    attention = attention_peak_bytes(args)
    parts = {
        "parameters": params * bytes_el,
        "gradients": params * 4,
        "optimizer": params * 12 / shards,
        "activations": activations,
        "logits": logits,
        "attention": attention,
    }
    return {"parts": parts, "total": sum(parts.values()), "params": params, "vocab_assumed": vocab == ASSUMED_VOCAB
            and not (getattr(args, "padded_vocab_size", None) or args.vocab_size), "recompute": full,
            "optimizer_shards": shards, "algorithm": cp_algorithm(args)[0] if cp > 1 else None}


def tokenizer_vocab(args) -> Tuple[Optional[int], str]:
    """(vocabulary, why not) of the config's Hugging Face tokenizer, read here for the estimate (a dry run
    builds no tokenizer); None and the reason, naming how to give it, when it does not load on this machine."""
    if getattr(args, "tokenizer_type", None) != "HuggingFaceTokenizer" or args.vocab_size:
        return None, ""
    path = args.tokenizer_model
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(path, local_files_only=True)), ""
    except Exception as exc:  # any failure: the estimate assumes Llama-3's and says how to do better
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
        return None, (f"the tokenizer {path} did not load here ({why}); make it readable on this machine "
                      "(TOKENIZER_MODEL: a local directory) or pass --vocab-size N to the dry run")


def parameter_count(n: float) -> str:
    """A parameter count in the unit that fits it: ``1.20 B``, ``12.3 M``, ``103.5 K``, ``640``."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if round(n / scale, digits) >= 1:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f}"


def report(args, gpu_gib: float, vocab_hint: str = "") -> List[Tuple[str, str]]:
    """(level, line) pairs: the breakdown, and a warning when the total exceeds ``gpu_gib``."""
    e = estimate(args)
    p = e["parts"]
    lines = [("info", f"memory per GPU (estimate): {e['total'] / GIB:.1f} GiB = parameters {p['parameters'] / GIB:.1f} "
              f"+ gradients {p['gradients'] / GIB:.1f} + optimizer {p['optimizer'] / GIB:.1f} (over {e['optimizer_shards']} "
              f"shard{'s' if e['optimizer_shards'] != 1 else ''}) + activations {p['activations'] / GIB:.1f} ({'full recompute' if e['recompute'] else 'no recompute'}) "
              f"+ logits {p['logits'] / GIB:.1f} + attention {p['attention'] / GIB:.2f}"
              + (f" ({e['algorithm']} buffers at their peak)" if e["algorithm"] else "")
              + f"; {parameter_count(e['params'])} parameters on this shard"
              + (f"; vocabulary assumed {ASSUMED_VOCAB} (Llama-3's: {vocab_hint or 'pass --vocab-size N'})"
                 if e["vocab_assumed"] else ""))]
    if e["total"] > gpu_gib * GIB:
        lines.append(("warning", f"the estimate ({e['total'] / GIB:.1f} GiB) exceeds the GPU's {gpu_gib:.0f} GiB: "
                      "raise TP/CP, enable full recompute, or use the distributed optimizer"))
    return lines
