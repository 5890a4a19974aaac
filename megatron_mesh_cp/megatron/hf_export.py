"""A trained Megatron checkpoint back to Hugging Face format, through Megatron-Bridge's exporter, on CPU.

    python -m megatron_mesh_cp.megatron.hf_export --megatron-path RUN/checkpoints --hf-model meta-llama/Llama-3.1-8B \\
        --out /ckpt/llama31-8b-s1-hf [--iteration N] [--dtype bfloat16]

The inverse of :mod:`.bridge_cpu`. ``--hf-model`` is the model the run started from (the Hugging Face id
or directory converted for stage 1): Bridge builds the Megatron model from its config (local layer
spec, CUDA fusions off, as the import does), the weights of the run's checkpoint are loaded into it
with megatron-core's ``dist_checkpointing`` (the model's own sharded state dict: any TP/PP/CP/DP the
run had, the optimizer state left on disk), and Bridge writes the ``transformers`` checkpoint: its
artifacts (config, tokenizer) and its Megatron -> Hugging Face weight conversion
(``export_hf_weights``) streamed into safetensors, as ``save_hf_pretrained`` does for a model without
quantizers (that method imports nvidia-modelopt, and with it scipy, only to look for them). What the run changed that is not a
weight goes into the config: the RoPE base (``rotary_base``; every stage raises it) and the context
length (``max_position_embeddings``, when the run's is longer than the original's), read from the
checkpoint's saved arguments. The output is
written to a temporary directory beside ``--out`` and moved into place only when complete.

Megatron-Bridge's own ``AutoBridge.export_ckpt`` reads Bridge's ``run_config.yaml``, which Megatron's
training loop does not write; this module needs only the checkpoint's ``.metadata`` and weights.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

__all__ = ["export_hf", "main"]


def _iteration_dir(path: str, iteration: Optional[int]) -> str:
    from .checkpoint_model import iteration_dir

    if iteration is None:
        return iteration_dir(path)
    it = os.path.join(path, f"iter_{iteration:07d}")
    if not os.path.isdir(it):
        raise ValueError(f"--iteration {iteration}: {it} does not exist")
    return it


def _saved_args(directory: str):
    """The Megatron arguments a training checkpoint saved (None for Bridge's own conversions, which keep none)."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(directory)
    except Exception:  # a checkpoint without common.pt (or one this torch cannot unpickle): nothing to carry over
        return None
    return common.get("args") if isinstance(common, dict) else None


def _check(dtype: str) -> None:
    import torch

    if torch.cuda.is_available():
        raise ValueError("the export runs on CPU (Megatron's CPU compatibility layer refuses a visible GPU): run it "
                         "with CUDA_VISIBLE_DEVICES= on any node with the memory for the model")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r}: use float32, bfloat16 or float16")


def check_inputs(megatron_path: str, out: str, iteration: Optional[int] = None) -> str:
    """The iteration directory to export; ``ValueError`` naming the fix before anything is built or written."""
    if not os.path.isfile(os.path.join(megatron_path, "latest_checkpointed_iteration.txt")) and iteration is None:
        raise ValueError(f"--megatron-path {megatron_path} holds no checkpoint (latest_checkpointed_iteration.txt): "
                         "pass the run's checkpoints/ directory (its --save)")
    directory = _iteration_dir(megatron_path, iteration)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(f"{directory} is not a torch_dist checkpoint (no .metadata): the exporter reads ckpt_format "
                         "torch_dist, the launcher's and the recipe's format")
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"--out {out} exists and is not empty: remove it or choose another directory")
    return directory


def export_hf(megatron_path: str, hf_model: str, out: str, iteration: Optional[int] = None,
              dtype: str = "float32") -> str:
    """Export ``megatron_path``'s latest (or ``iteration``) checkpoint to ``out``; returns the iteration directory."""
    import torch

    from .bridge_cpu import CUDA_FUSIONS, _init_single_rank, import_bridge
    from .checkpoint_model import describe, stored_shapes
    from .staging import staged

    _check(dtype)
    directory = check_inputs(megatron_path, out, iteration)
    from . import cpu_compat

    cpu_compat.activate(training=False)
    _init_single_rank()
    bridge_module = import_bridge()
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core import dist_checkpointing

    bridge = bridge_module.AutoBridge.from_hf_pretrained(hf_model, torch_dtype=getattr(torch, dtype))
    provider = bridge.to_megatron_provider(load_weights=False)
    saved = _saved_args(directory)
    if saved is not None:  # what a stage changes that is not a weight
        provider.rotary_base = float(saved.rotary_base)
        provider.seq_length = int(saved.seq_length)
    provider.transformer_layer_spec = local_layer_spec
    for name in CUDA_FUSIONS:
        setattr(provider, name, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    sharded = {"model": model[0].sharded_state_dict()}
    try:
        loaded = dist_checkpointing.load(sharded, directory)
    except Exception as exc:
        raise ValueError(f"{directory} ({describe(stored_shapes(directory))}) does not load into {hf_model}'s model: "
                         f"{type(exc).__name__}: {exc}") from None
    model[0].load_state_dict(loaded["model"])
    config = bridge.hf_pretrained.config
    if saved is not None:
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict):
            rope["rope_theta"] = float(saved.rotary_base)
        else:
            config.rope_theta = float(saved.rotary_base)
        config.max_position_embeddings = max(int(config.max_position_embeddings or 0), int(saved.seq_length))
    source = getattr(getattr(bridge.hf_pretrained, "state", None), "source", None)
    if not hasattr(source, "save_generator"):
        raise ValueError(f"{hf_model}: Bridge found no safetensors weights to take the file layout from")
    with staged(out) as tmp:
        # what save_hf_pretrained does for a model without ModelOpt quantizers (it imports nvidia-modelopt, and
        # with it scipy, only to look for them): the artifacts (config, tokenizer), then Bridge's weight
        # conversion streamed into safetensors files laid out as the source's
        bridge.hf_pretrained.save_artifacts(tmp)
        source.save_generator(bridge.export_hf_weights(model, cpu=True, show_progress=False), tmp, strict=True)
    return directory


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_mesh_cp.megatron.hf_export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-path", required=True, help="the run's checkpoint directory (its --save)")
    p.add_argument("--hf-model", required=True, help="the Hugging Face model the run started from (id or directory)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--iteration", type=int, default=None, help="an iteration to export (default: the latest)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    args = p.parse_args(argv)
    try:
        _check(args.dtype)
        check_inputs(args.megatron_path, args.out, args.iteration)
        directory = export_hf(args.megatron_path, args.hf_model, args.out, args.iteration, args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    import torch

    torch.distributed.destroy_process_group()
    print(f"exported {directory} -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
