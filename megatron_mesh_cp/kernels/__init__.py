"""Block-kernel backends behind one interface, and how one is chosen."""

from __future__ import annotations

from typing import Dict, Type, Union

from .base import BlockKernel, lse_dtype
from .torch_sdpa import TorchKernel

__all__ = ["BlockKernel", "TorchKernel", "get_kernel", "available_kernels", "lse_dtype"]

_BACKENDS: Dict[str, Type[BlockKernel]] = {"torch": TorchKernel}


def available_kernels() -> list:
    """Names of the backends that can run in this process."""
    return list(_BACKENDS)


def get_kernel(kernel: Union[str, BlockKernel, None] = "auto") -> BlockKernel:
    """Resolve a backend name (or pass an instance through); ``auto`` picks the best available."""
    if isinstance(kernel, BlockKernel):
        return kernel
    if kernel in (None, "auto"):
        kernel = "torch"
    if kernel not in _BACKENDS:
        raise ValueError(
            f"unknown attention kernel {kernel!r}; available here: {', '.join(available_kernels())}"
        )
    return _BACKENDS[kernel]()
