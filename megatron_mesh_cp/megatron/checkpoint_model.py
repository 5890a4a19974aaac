"""The model a Megatron checkpoint holds, read from its tensors' global shapes, against a config's model flags.

A ``torch_dist`` checkpoint (what the launcher saves and what Megatron-Bridge's import writes) lists
every tensor's global shape in ``iter_*/.metadata``; reading it loads no weights. The GPT keys are
megatron-core's own (the TE spec's names, which the local spec maps to): layer weights are stacked
over the layers (first dimension = ``num_layers``), so the layers, hidden size, heads x head dim,
query groups, FFN width, untied output layer and padded vocabulary are all visible. A checkpoint of
another model (a 2-layer test model passed as the 8B one) is caught here, before a job is queued,
instead of as a shape error after 256 ranks have built the model.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

__all__ = ["iteration_dir", "stored_shapes", "expected_shapes", "compare", "padded_vocab", "describe"]

Shape = Tuple[int, ...]


def iteration_dir(path: str) -> str:
    """The directory of a checkpoint's latest iteration (``latest_checkpointed_iteration.txt``)."""
    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(path, "release")
    if not text.isdigit():
        raise ValueError(f"{path}/latest_checkpointed_iteration.txt holds {text!r}, not an iteration number")
    return os.path.join(path, f"iter_{int(text):07d}")


def stored_shapes(directory: str) -> Dict[str, Shape]:
    """Global shape of every tensor in one ``torch_dist`` iteration directory (its ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{directory} has no .metadata: not a torch_dist checkpoint (ckpt_format torch_dist, "
                                "as the launcher and Megatron-Bridge write)")
    meta = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {k: tuple(int(x) for x in v.size) for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def padded_vocab(vocab: int, args) -> int:
    """Megatron's padded vocabulary (``vocab_size_with_padding``: a multiple of divisible-by x TP)."""
    multiple = int(args.make_vocab_size_divisible_by) * int(args.tensor_model_parallel_size or 1)
    return int(math.ceil(vocab / multiple) * multiple)


def expected_shapes(args, vocab: Optional[int] = None) -> Dict[str, Optional[Shape]]:
    """The GPT tensors the config's model flags make (None: the tensor must be absent)."""
    layers, hidden = int(args.num_layers), int(args.hidden_size)
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if args.group_query_attention else heads
    head_dim = int(args.kv_channels or hidden // heads)
    ffn = int(args.ffn_hidden_size or 4 * hidden)
    out: Dict[str, Optional[Shape]] = {"decoder.final_layernorm.weight": (hidden,)}
    if not getattr(args, "multi_latent_attention", False):
        out["decoder.layers.self_attention.linear_qkv.weight"] = (layers, (heads + 2 * groups) * head_dim, hidden)
        out["decoder.layers.self_attention.linear_proj.weight"] = (layers, hidden, heads * head_dim)
    if not getattr(args, "num_experts", None):
        out["decoder.layers.mlp.linear_fc1.weight"] = (layers, ffn * (2 if args.swiglu else 1), hidden)
        out["decoder.layers.mlp.linear_fc2.weight"] = (layers, hidden, ffn)
    rows = padded_vocab(vocab, args) if vocab else None
    out["embedding.word_embeddings.weight"] = (rows, hidden)
    out["output_layer.weight"] = (rows, hidden) if args.untie_embeddings_and_output_weights else None
    return out


def _matches(want: Tuple, got: Shape) -> bool:
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


def compare(args, stored: Dict[str, Shape], vocab: Optional[int] = None) -> List[str]:
    """What differs between the config's model and the checkpoint's tensors (empty: they agree)."""
    problems = []
    for key, want in expected_shapes(args, vocab).items():
        got = stored.get(key)
        if want is None:
            if got is not None:
                problems.append(f"{key} {list(got)} is in the checkpoint but the config ties the output layer to the "
                                "embedding (set untie_embeddings_and_output_weights)")
        elif got is None:
            problems.append(f"{key} is missing (a {'' if key.startswith('output') else 'non-GPT or '}different model)")
        elif not _matches(want, got):
            shown = ["*" if w is None else w for w in want]
            problems.append(f"{key}: checkpoint {list(got)}, config {shown}")
    return problems


def describe(stored: Dict[str, Shape]) -> str:
    """The checkpoint's model in a few numbers (layers, hidden, vocabulary), for the report."""
    emb = stored.get("embedding.word_embeddings.weight")
    qkv = stored.get("decoder.layers.self_attention.linear_qkv.weight")
    parts = []
    if qkv:
        parts.append(f"{qkv[0]} layers")
    if emb:
        parts += [f"hidden {emb[1]}", f"vocabulary {emb[0]}"]
    return ", ".join(parts) or f"{len(stored)} tensors"
