"""A ``torch_dist`` checkpoint holding only its ``.metadata`` (tensor names and global shapes, no data):
what the preflight's model check reads, at any model size (tests build an 8B one in microseconds)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Dict, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata


def gpt_shapes(layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int, head_dim: int = 0,
               swiglu: bool = True, untied: bool = True) -> Dict[str, Tuple[int, ...]]:
    """megatron-core's GPT tensors (TE spec names, layers stacked) for these model dimensions."""
    d = head_dim or hidden // heads
    out = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, (heads + 2 * groups) * d, hidden),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        "decoder.layers.self_attention.linear_proj.weight": (layers, hidden, heads * d),
        "decoder.layers.mlp.linear_fc1.weight": (layers, ffn * (2 if swiglu else 1), hidden),
        "decoder.layers.mlp.linear_fc2.weight": (layers, hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
    }
    if untied:
        out["output_layer.weight"] = (vocab, hidden)
    return out


LLAMA31_8B = gpt_shapes(32, 4096, 14336, 32, 8, 128256)
TINY = gpt_shapes(2, 64, 160, 4, 2, 384)


def write(path: Path, shapes: Dict[str, Tuple[int, ...]], iteration: int = 0) -> Path:
    """``path`` as a checkpoint directory: the tracker file and ``iter_N/.metadata`` with these shapes."""
    it = path / f"iter_{iteration:07d}"
    it.mkdir(parents=True, exist_ok=True)
    props = TensorProperties(dtype=torch.bfloat16)
    meta = Metadata(state_dict_metadata={k: TensorStorageMetadata(props, torch.Size(v), []) for k, v in shapes.items()})
    with open(it / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    (path / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return path
