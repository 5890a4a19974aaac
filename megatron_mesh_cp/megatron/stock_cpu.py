"""Run Megatron-LM's stock ``pretrain_gpt.py`` on CPU (gloo), patched by apply_megatron_patches.sh.

    torchrun --nproc_per_node 4 -m megatron_mesh_cp.megatron.stock_cpu /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron args> --context-parallel-algo mesh --mesh-shape 2x2

Without CUDA, Megatron's initialisation would start NCCL and skips the model-parallel groups. This
wrapper activates :mod:`cpu_compat`, makes Megatron's distributed initialisation start gloo and
build the model-parallel groups first (what our own launcher does), then runs the script as
``__main__``. With CUDA it refuses: run the script itself.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional, Sequence

__all__ = ["main", "install"]


def install() -> None:
    """Wrap Megatron's ``_initialize_distributed``: gloo process group and model-parallel groups first."""
    from . import cpu_compat
    from .pretrain import _init_distributed_cpu

    owner, name = cpu_compat._resolve("megatron.training.initialize", "_initialize_distributed")
    original = getattr(owner, name)
    if getattr(original, "_mesh_cp_cpu", False):
        return

    def _initialize_distributed(*args, **kwargs):
        from megatron.training import get_args

        _init_distributed_cpu(get_args())
        return original(*args, **kwargs)

    _initialize_distributed._mesh_cp_cpu = True
    setattr(owner, name, _initialize_distributed)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        _fail("usage: python -m megatron_mesh_cp.megatron.stock_cpu PATH/TO/pretrain_gpt.py [Megatron arguments]")
    script = os.path.abspath(args[0])
    if not os.path.isfile(script):
        _fail(f"{args[0]} is not a file; pass the path of Megatron-LM's pretrain_gpt.py")
    import torch

    if torch.cuda.is_available():
        _fail("CUDA is available: run the script itself (this wrapper is for machines without a GPU)")
    from . import cpu_compat

    cpu_compat.activate()
    install()
    sys.argv = [script] + args[1:]
    sys.path.insert(0, os.path.dirname(script))  # the stock script imports its siblings
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
