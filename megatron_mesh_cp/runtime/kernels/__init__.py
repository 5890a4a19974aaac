"""Block-kernel backends behind one interface, and how one is chosen.

``auto`` tries, for the inputs at hand, Transformer Engine (``te``), then flash-attn (``flash``: FA3
when its build can run here, else FA2), then PyTorch's own ops (``torch``), and takes the first whose
library is importable *and* whose ``check`` accepts these inputs (dtype, head dim, GPU generation,
TE's own backend selection). It logs once per distinct choice which backend it took and why each
one before it was skipped. A forced backend that cannot run here fails with a ``ValueError`` naming
the ones that can.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Dict, Optional, Sequence, Tuple, Type, Union

import torch

from .base import BlockKernel, KernelNeeds, Varlen, lse_dtype
from .flash import FlashKernel
from .te import TEKernel
from .torch_sdpa import TorchKernel

__all__ = ["BlockKernel", "KernelNeeds", "Varlen", "TorchKernel", "TEKernel", "FlashKernel", "get_kernel", "select_kernel", "input_spec",
           "available_kernels", "lse_dtype", "KERNELS"]

log = logging.getLogger("megatron_mesh_cp")

#: backends in the order ``auto`` prefers them on CUDA
_BACKENDS: Dict[str, Type[BlockKernel]] = {"te": TEKernel, "flash": FlashKernel, "torch": TorchKernel}
KERNELS = ("auto",) + tuple(_BACKENDS)
_INSTANCES: Dict[Tuple, BlockKernel] = {}
_LOGGED = set()
_AUTO: Dict[Tuple, BlockKernel] = {}  # auto's choice per input signature (it runs on every attention call)
_WHY_ABSENT = {"te": "transformer_engine is not importable or there is no CUDA device",
               "flash": "flash-attn (flash_attn or flash_attn_interface) is not importable or there is no CUDA device"}


def input_spec(shape: Sequence[int], dtype: torch.dtype, device) -> SimpleNamespace:
    """What backend checks and ``auto`` read of an input -- shape ``[s, b, h, d]``, dtype, device --
    without a tensor, so a configuration can be checked at start-up, before any process group."""
    return SimpleNamespace(shape=torch.Size(shape), dtype=dtype, device=torch.device(device))


def available_kernels() -> list:
    """Names of the backends that can run in this process."""
    return [name for name, cls in _BACKENDS.items() if cls.available()]


def _instance(name: str, **options) -> BlockKernel:
    key = (name,) + tuple(sorted(options.items()))
    if key not in _INSTANCES:
        _INSTANCES[key] = _BACKENDS[name](**options)
    return _INSTANCES[key]


def _options(name: str, deterministic: bool) -> dict:
    return {"deterministic": True} if deterministic else {}


def get_kernel(kernel: Union[str, BlockKernel, None] = "auto", device: Optional[torch.device] = None,
               *, deterministic: bool = False) -> BlockKernel:
    """Resolve a backend name (or pass an instance through) for ``device``, without looking at inputs.

    ``auto`` here is the first backend whose library imports (``torch`` on CPU); use
    :func:`select_kernel` when the inputs are known, so ``auto`` skips backends that cannot run them.
    """
    if isinstance(kernel, BlockKernel):
        return kernel
    name = "auto" if kernel is None else kernel
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(KERNELS)}")
    if name == "auto":
        on_cuda = device is not None and torch.device(device).type == "cuda"
        order = list(_BACKENDS) if on_cuda else ["torch"]
        name = next(n for n in order if _BACKENDS[n].available())
        return _instance(name, **_options(name, deterministic))
    if not _BACKENDS[name].available():
        raise ValueError(
            f"attention kernel {name!r} cannot run here: {_WHY_ABSENT.get(name, 'unavailable')}; "
            f"available: {', '.join(available_kernels())} (or auto)"
        )
    return _instance(name, **_options(name, deterministic))


def _why_not(name: str, needs: KernelNeeds) -> Optional[str]:
    """Why backend ``name`` cannot run ``needs`` here (absent, refused at construction, or by its
    needs check), or None."""
    if not _BACKENDS[name].available():
        return "not importable here"
    try:
        blk = _instance(name, **_options(name, needs.deterministic))
    except ValueError as exc:  # e.g. a library version the backend refuses
        return str(exc)
    return blk.unsupported(needs)


def _alternatives(needs: KernelNeeds, refused: str) -> str:
    """The other registered kernels that run ``needs`` here, as a hint (the registry answers, not the
    message that refused)."""
    order = list(_BACKENDS) if needs.q.device.type == "cuda" else ["torch"]
    ok = []
    for name in order:
        try:
            if name != refused and _why_not(name, needs) is None:
                ok.append(name)
        except Exception:  # noqa: BLE001 -- a hint only: a backend failing otherwise (a library's RuntimeError,
            continue  # KeyError, ...) is left out of it and must not replace the refusal being explained
    if not ok:
        return "no other attention kernel here runs these inputs"
    return "kernels that run these inputs here: " + ", ".join(f"{x} (kernel={x!r}; Megatron: --mesh-kernel {x})"
                                                              for x in ok)


def select_kernel(kernel: Union[str, BlockKernel, None], needs, k=None, *, deterministic: bool = False,
                  packed: bool = False, v=None) -> BlockKernel:
    """The backend that will run a call's blocks, checked against what they need; raises
    ``ValueError`` naming the fix.

    ``needs`` is a :class:`KernelNeeds` (or, as a shorthand, the block inputs ``q`` and ``k`` --
    sequence-major ``[s, b, h, d]`` as the blocks are: TE's selection reads the sequence length from
    dim 0 -- with ``deterministic``, ``packed`` (varlen blocks) and ``v`` (its head dim may differ
    under MLA)). ``auto`` takes the first backend (te, flash, torch) that is importable and supports
    the needs, and logs the choice with the reason each earlier backend was skipped.
    """
    if not isinstance(needs, KernelNeeds):
        needs = KernelNeeds(needs, k, v, deterministic=deterministic, varlen=packed)
    q = needs.q
    if kernel not in (None, "auto"):
        try:
            blk = get_kernel(kernel, q.device, deterministic=needs.deterministic)
        except ValueError as exc:  # unknown or absent names list the choices; a refused version gets them here
            if kernel not in KERNELS or not _BACKENDS[kernel].available():
                raise
            raise ValueError(f"{exc}; {_alternatives(needs, kernel)}") from None
        why = blk.unsupported(needs)
        if why is not None:
            raise ValueError(f"{why}; {_alternatives(needs, blk.name)}")
        return blk
    sig = needs.key()
    if sig in _AUTO:
        return _AUTO[sig]
    order = list(_BACKENDS) if q.device.type == "cuda" else ["torch"]
    skipped = []
    for name in order:
        why = _why_not(name, needs)
        if why is not None:
            skipped.append(f"{name}: {why}")
            continue
        blk = _instance(name, **_options(name, needs.deterministic))
        logged = (q.device.type, str(q.dtype), q.shape[-1], name, tuple(skipped))
        if logged not in _LOGGED:
            _LOGGED.add(logged)
            log.info("mesh attention kernel: %s (auto, %s %s d=%d)%s", name, q.device.type, str(q.dtype)[6:],
                     q.shape[-1], "; skipped " + "; ".join(skipped) if skipped else "")
        _AUTO[sig] = blk
        while len(_AUTO) > 64:  # bounded: new shapes every batch must not grow it
            _AUTO.pop(next(iter(_AUTO)))
        return blk
    raise ValueError("no attention kernel can run these inputs: " + "; ".join(skipped))
