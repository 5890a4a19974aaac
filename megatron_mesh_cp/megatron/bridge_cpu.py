"""Megatron-Bridge's Hugging Face -> Megatron checkpoint import, on a machine without a GPU (CPU, gloo).

    python -m megatron_mesh_cp.megatron.bridge_cpu --hf-model meta-llama/Llama-3.1-8B --megatron-path CKPT

The conversion is Megatron-Bridge's own (``AutoBridge``: its Llama parameter mappings, its
``save_megatron_model``), the same calls as ``AutoBridge.import_ckpt`` with two differences that a
machine without Transformer Engine needs:

* the model is built with Megatron's local layer spec instead of the TE spec, and CUDA-only fusions
  are off. Weights do not change: the local spec's sharded state dict uses the TE spec's checkpoint
  keys (megatron-core maps ``input_layernorm.`` to ``self_attention.linear_qkv.layer_norm_`` and
  ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``), so the checkpoint is the one a TE run loads;
* ``import megatron.bridge`` imports ``transformer_engine.pytorch`` unconditionally (its LoRA layers,
  via ``models/conversion/model_bridge.py``). While that import runs, and only then, a placeholder
  module stands in for it: any call on it raises, it is removed from ``sys.modules`` afterwards,
  megatron-core's own TE probes run before it exists, and a megatron-core module that saw it fails
  the import loudly instead of believing TE is there.

The inputs are checked first (the model's config, a tokenizer, an empty output path) and the checkpoint
is written under a temporary name beside ``--megatron-path``, moved into place only when complete, so a
failed conversion leaves nothing that looks like a checkpoint. With CUDA available it refuses: run
``AutoBridge.import_ckpt`` itself (README, "From Hugging Face weights").
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Optional, Sequence

__all__ = ["import_hf", "main"]

#: CUDA-only kernel choices Bridge's Llama provider turns on; none of them changes a weight
CUDA_FUSIONS = ("apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
                "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion")


class _AbsentTE(types.ModuleType):
    """``transformer_engine`` while Bridge imports without it: attributes resolve, calls raise."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _AbsentTE(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} called, but Transformer Engine is not installed (bridge_cpu placeholder)")

    def __getitem__(self, item):  # type annotations such as tuple[te.ops.Sequential, ...]
        return self


def _placeholder(name: str, package: bool) -> _AbsentTE:
    module = _AbsentTE(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__version__ = "0.0.0"
    return module


def import_bridge():
    """``import megatron.bridge`` on a machine without Transformer Engine; returns the module."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return importlib.import_module("megatron.bridge")
    # megatron-core probes TE at import (and caches its version): let it see none before the placeholder exists
    for name in ("megatron.core", "megatron.core.extensions.transformer_engine", "megatron.core.fp8_utils",
                 "megatron.core.distributed", "megatron.core.models.gpt", "megatron.training"):
        importlib.import_module(name)
    importlib.import_module("megatron.core.utils").get_te_version()
    before = set(sys.modules)
    te = _placeholder("transformer_engine", package=True)
    te.pytorch = _placeholder("transformer_engine.pytorch", package=False)
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
    try:
        bridge = importlib.import_module("megatron.bridge")
    finally:
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]
    fooled = sorted(n for n in set(sys.modules) - before
                    if n.startswith("megatron.core") and getattr(sys.modules[n], "HAVE_TE", False))
    if fooled:
        raise RuntimeError(f"megatron-core modules {fooled} imported while the TE placeholder was in place and now "
                           "believe TE is installed; import them in bridge_cpu.import_bridge before the placeholder")
    return bridge


def _init_single_rank() -> None:
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from ..spawn import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def _check(dtype: str) -> None:
    import torch

    if torch.cuda.is_available():
        raise ValueError("CUDA is available: run Megatron-Bridge's AutoBridge.import_ckpt itself "
                         "(this wrapper is for machines without a GPU or Transformer Engine)")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r}: use float32, bfloat16 or float16")


def check_inputs(hf_model: str, megatron_path: str, hf_tokenizer: Optional[str] = None) -> str:
    """What the conversion needs, checked before any model is built: the model's config, a tokenizer (the
    checkpoint keeps a copy in ``tokenizer/``, which the launcher's ``tokenizer_model`` can point at) and an output
    path that holds nothing yet. Returns the tokenizer's source; ``ValueError`` naming the fix."""
    local = os.path.isdir(hf_model)
    hub_id = hf_model.count("/") == 1 and not hf_model.startswith((".", "/", "~"))
    if not local and not hub_id:
        raise ValueError(f"--hf-model {hf_model}: no such directory (and not a Hugging Face id such as "
                         "meta-llama/Llama-3.1-8B)")
    if local and not os.path.isfile(os.path.join(hf_model, "config.json")):
        raise ValueError(f"--hf-model {hf_model} has no config.json: pass the directory save_pretrained wrote")
    source = hf_tokenizer or hf_model
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # missing files, a hub id that cannot be reached, a tokenizer transformers cannot build
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"no tokenizer loads from {source} ({type(exc).__name__}: {first}); the conversion copies "
                         "the tokenizer into the checkpoint's tokenizer/ directory: save it into the Hugging Face "
                         "directory (tokenizer.save_pretrained) or pass --hf-tokenizer DIR") from None
    if os.path.exists(megatron_path) and (not os.path.isdir(megatron_path) or os.listdir(megatron_path)):
        raise ValueError(f"--megatron-path {megatron_path} exists and is not empty: remove it or choose another path "
                         "(the conversion writes a new checkpoint directory)")
    return source


def import_hf(hf_model: str, megatron_path: str, dtype: str = "float32", hf_tokenizer: Optional[str] = None) -> None:
    """Convert a Hugging Face checkpoint (id or directory) into a Megatron checkpoint at ``megatron_path``, written
    under a temporary name and moved into place only when complete."""
    import torch

    from .staging import staged

    _check(dtype)
    tokenizer = check_inputs(hf_model, megatron_path, hf_tokenizer)
    from . import cpu_compat

    cpu_compat.activate(training=False)
    _init_single_rank()
    bridge_module = import_bridge()
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = bridge_module.AutoBridge.from_hf_pretrained(hf_model, torch_dtype=getattr(torch, dtype))
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = local_layer_spec
    for name in CUDA_FUSIONS:
        setattr(provider, name, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    with staged(megatron_path) as tmp:
        bridge.save_megatron_model(model, tmp, hf_tokenizer_path=tokenizer, low_memory_save=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_mesh_cp.megatron.bridge_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-model", required=True, help="Hugging Face model id or local directory")
    p.add_argument("--megatron-path", required=True, help="output directory (Megatron torch_dist checkpoint)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--hf-tokenizer", default=None, help="where the tokenizer is, if not in --hf-model")
    args = p.parse_args(argv)
    try:
        _check(args.dtype)
        check_inputs(args.hf_model, args.megatron_path, args.hf_tokenizer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    import_hf(args.hf_model, args.megatron_path, args.dtype, args.hf_tokenizer)
    import torch

    torch.distributed.destroy_process_group()
    print(f"converted {args.hf_model} -> {args.megatron_path}", flush=True)


if __name__ == "__main__":
    main()
