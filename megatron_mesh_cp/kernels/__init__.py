"""Block-kernel backends behind one interface, and how one is chosen.

``auto`` picks, for the device of the inputs: on CUDA Transformer Engine (``te``), else flash-attn
(``flash``: FA3 on Hopper when installed, else FA2), else PyTorch's own ops (``torch``); on CPU
``torch``. The choice is logged once per process. A forced backend that cannot run here fails with
a ``ValueError`` naming the ones that can.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Type, Union

import torch

from .base import BlockKernel, lse_dtype
from .flash import FlashKernel
from .te import TEKernel
from .torch_sdpa import TorchKernel

__all__ = ["BlockKernel", "TorchKernel", "TEKernel", "FlashKernel", "get_kernel", "available_kernels", "lse_dtype", "KERNELS"]

log = logging.getLogger("megatron_mesh_cp")

#: backends in the order ``auto`` prefers them on CUDA
_BACKENDS: Dict[str, Type[BlockKernel]] = {"te": TEKernel, "flash": FlashKernel, "torch": TorchKernel}
KERNELS = ("auto",) + tuple(_BACKENDS)
_INSTANCES: Dict[str, BlockKernel] = {}
_LOGGED = set()


def available_kernels() -> list:
    """Names of the backends that can run in this process."""
    return [name for name, cls in _BACKENDS.items() if cls.available()]


def _instance(name: str) -> BlockKernel:
    if name not in _INSTANCES:
        _INSTANCES[name] = _BACKENDS[name]()
    return _INSTANCES[name]


def get_kernel(kernel: Union[str, BlockKernel, None] = "auto", device: Optional[torch.device] = None) -> BlockKernel:
    """Resolve a backend name (or pass an instance through) for inputs on ``device``."""
    if isinstance(kernel, BlockKernel):
        return kernel
    name = "auto" if kernel is None else kernel
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(KERNELS)}")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        order = [n for n in _BACKENDS if n != "torch"] + ["torch"] if on_cuda else ["torch"]
        name = next(n for n in order if _BACKENDS[n].available())
        if (name, on_cuda) not in _LOGGED:
            _LOGGED.add((name, on_cuda))
            log.info("mesh attention kernel: %s (auto, %s)", name, "cuda" if on_cuda else "cpu")
        return _instance(name)
    if not _BACKENDS[name].available():
        why = {"te": "transformer_engine is not importable or there is no CUDA device",
               "flash": "flash-attn (flash_attn or flash_attn_interface) is not importable or there is no CUDA device"}
        raise ValueError(
            f"attention kernel {name!r} cannot run here: {why.get(name, 'unavailable')}; "
            f"available: {', '.join(available_kernels())} (or auto)"
        )
    return _instance(name)
