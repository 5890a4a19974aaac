"""Run Megatron's real training loop on CPU (gloo): a small, separate compatibility layer.

Megatron-LM's training loop assumes CUDA throughout (see docs/megatron_on_cpu.md). On a machine
without CUDA, :func:`activate` installs:

* one generic ``TorchFunctionMode`` that rewrites ``device="cuda"`` (str, ``torch.device`` or int)
  to CPU, makes ``Tensor.cuda()`` / ``Tensor.to("cuda")`` / ``pin_memory`` no-ops and has
  ``Tensor.type()`` name CPU tensors ``torch.cuda.*`` (the distributed optimizer checks it).
  Autograd runs backward code without Python modes, so custom-Function backwards and tensor hooks
  (where activation recompute re-runs the forward) re-enter it;
* no-op stand-ins for ``torch.cuda`` streams, events, ``synchronize`` and ``current_device``;
* a separate CPU generator standing in for the CUDA one: random tensors asked for on "cuda" draw
  from it, and ``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` act on it. So
  CUDA-side randomness (e.g. Megatron's JIT warm-up, sized by the CP degree) never shifts the CPU
  generator that initialises the weights, and runs with different CP sizes start identically;
* pinned one-line patches of Megatron names (listed in :data:`PATCHES`): the ``allow_no_cuda``
  initialisation, the dataset-helper compile step (skipped only when the built helper imports, as
  in the wheel; a source checkout still builds it), the model-parallel RNG fork (dropout uses the
  CPU generator), the device-architecture query, the JIT-fusion warm-up (it only compiles
  CUDA-sized fusions ahead of the first step), and the CUDA RNG state get/set of activation
  checkpointing (``--recompute-granularity``), which act on the stand-in generator (Megatron's own
  set would be queued by ``torch.cuda._lazy_call`` and never run).

It is never active when CUDA is present (``activate`` refuses), and it fails loudly, naming the
attribute, if a Megatron release moved a name it patches. Process-group setup (gloo, and model-
parallel groups before ``pretrain``) is the launcher's job, not this module's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import List, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["activate", "is_active", "PATCHES"]

_ACTIVE = False
_MODE = None

#: (module, attribute, why) for every Megatron name this module replaces (the first also without
#: the training loop).
PATCHES: List[Tuple[str, str, str]] = [
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork", "no CUDA RNG states: use the CPU generator"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "recompute saves the stand-in generator's state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "recompute restores the stand-in generator's state"),
    ("megatron.training.training", "initialize_megatron", "pass allow_no_cuda=True"),
    ("megatron.core.datasets.utils", "compile_helpers", "skip the build when the helper already imports (wheel)"),
    ("megatron.training.arguments", "get_device_arch_version", "no device to query"),
    ("megatron.training.training", "set_jit_fusion_options",
     "a GPU warm-up: on CPU it only compiles (Inductor) CUDA-sized fusions, ~6 CPU-s per rank"),
]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_GENERATOR = torch.Generator()  # stands in for the CUDA default generator
_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal}


def _in_mode(fn):
    """``fn`` run with the mode pushed: autograd runs backward code (custom-Function backwards, tensor
    hooks) without the Python mode stack, so e.g. a recomputed forward would otherwise reach CUDA."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _MODE is None or torch._C._len_torch_function_stack() > 0:
            return fn(*args, **kwargs)
        with _MODE:
            return fn(*args, **kwargs)

    return wrapped


class _CudaToCpu(TorchFunctionMode):
    """Send every CUDA placement to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.register_hook:
            return func(args[0], _in_mode(args[1]))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            # the distributed optimizer accepts only "torch.cuda.*Tensor" parameters: name the
            # stand-in device's tensors as CUDA ones (a conversion, .type(dtype), is left alone)
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
            if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = _CUDA_GENERATOR
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _resolve(module: str, attr: str):
    """(owner object, leaf name) of ``module.attr``; raises naming what moved."""
    try:
        owner = importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"cpu_compat: cannot import {module} ({exc}); Megatron moved it, update PATCHES") from None
    parts = attr.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
        if owner is None:
            raise RuntimeError(f"cpu_compat: {module}.{attr} no longer exists; Megatron moved it, update PATCHES")
    if not hasattr(owner, parts[-1]):
        raise RuntimeError(f"cpu_compat: {module}.{attr} no longer exists; Megatron moved it, update PATCHES")
    return owner, parts[-1]


def _patch_megatron(training: bool) -> None:
    owner, name = _resolve("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork")

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    setattr(owner, name, fork)
    owner, name = _resolve("megatron.core.tensor_parallel.random", "_get_cuda_rng_state")
    setattr(owner, name, lambda device="cuda", clone=False, graph_safe=False: _CUDA_GENERATOR.get_state())
    owner, name = _resolve("megatron.core.tensor_parallel.random", "_set_cuda_rng_state")
    setattr(owner, name, lambda new_state, device=-1, graph_safe=False: _CUDA_GENERATOR.set_state(new_state))
    if not training:
        return
    owner, name = _resolve("megatron.training.training", "initialize_megatron")
    setattr(owner, name, functools.partial(getattr(owner, name), allow_no_cuda=True))

    owner, name = _resolve("megatron.core.datasets.utils", "compile_helpers")
    setattr(owner, name, compile_helpers_if_missing(getattr(owner, name)))

    owner, name = _resolve("megatron.training.arguments", "get_device_arch_version")
    setattr(owner, name, lambda: 9)

    owner, name = _resolve("megatron.training.training", "set_jit_fusion_options")
    setattr(owner, name, lambda *a, **k: None)


def compile_helpers_if_missing(build, module: str = "megatron.core.datasets.helpers_cpp"):
    """Megatron's ``compile_helpers`` that skips the build when the helper already imports.

    The wheel ships ``helpers_cpp`` prebuilt and no Makefile (so building fails there); a source
    checkout has the Makefile and no built helper (so skipping would fail later). If the build
    fails, say how to build it by hand.
    """

    def compile_helpers():
        try:
            importlib.import_module(module)
            return
        except ImportError:
            pass
        try:
            build()
        except SystemExit as exc:  # Megatron's compile_helpers exits on a failed make
            raise RuntimeError(
                f"cannot import {module} and building it failed; build it once by hand: "
                "`make -C megatron/core/datasets` in the Megatron-LM checkout (needs a C++ compiler "
                "and `pip install pybind11`)"
            ) from exc

    return compile_helpers


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _FakeStream
    cuda.Event = _FakeEvent
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: _CUDA_GENERATOR.get_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, *a, **k: _CUDA_GENERATOR.set_state(state)
    cuda.manual_seed = lambda seed: _CUDA_GENERATOR.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: _CUDA_GENERATOR.manual_seed(int(seed))
    backward_node = torch.autograd.function.BackwardCFunction
    backward_node.apply = _in_mode(backward_node.apply)
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0


def activate(training: bool = True) -> None:
    """Install the CPU stand-ins (idempotent). Refuses when CUDA is available.

    ``training=False`` leaves ``megatron.training`` alone (megatron-core without the training loop,
    e.g. 0.16.x, or a model built directly).
    """
    global _ACTIVE, _MODE
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat must not be activated on a machine with CUDA; run the GPU path instead")
    if _ACTIVE:
        return
    _patch_megatron(training)
    _patch_torch_cuda()
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    _ACTIVE = True


def is_active() -> bool:
    return _ACTIVE
