"""Kernel backends: auto selection, forced-backend errors, input checks, the square-causal-block
guard, and the torch backend's CUDA paths through the real executor against stand-ins of the aten
ops (the TE / flash call surfaces are in test_kernel_surfaces.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import fake_aten
import fake_kernels
from megatron_mesh_cp.runtime import kernels as K
from megatron_mesh_cp.runtime.kernels import torch_sdpa


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(K, "_INSTANCES", {})
    monkeypatch.setattr(K, "_LOGGED", set())
    monkeypatch.setattr(K, "_AUTO", {})


def _pretend_cuda(monkeypatch, **versions):
    fake_kernels.pretend_cuda(monkeypatch, **versions)


def test_auto_picks_a_backend_that_can_run_the_inputs_and_logs_why(monkeypatch, caplog):
    """Auto tries te, flash, torch in order, each against these inputs; fp32 CUDA inputs get
    torch (not a ValueError from te), and the log says why te and flash were skipped."""
    caplog.set_level(logging.INFO, logger="megatron_mesh_cp")
    cpu = torch.empty(16, 1, 8, 128)
    assert K.select_kernel("auto", cpu, cpu).name == "torch"  # CPU: always torch
    _pretend_cuda(monkeypatch)
    assert K.select_kernel("auto", _fake_q(), _fake_q()).name == "te"
    K.select_kernel("auto", _fake_q(), _fake_q())
    assert caplog.text.count("mesh attention kernel: te (auto, cuda bfloat16 d=128)") == 1  # logged once
    assert K.select_kernel("auto", _fake_q(torch.float32), _fake_q(torch.float32)).name == "torch"
    line = [ln for ln in caplog.text.splitlines() if "kernel: torch (auto, cuda float32" in ln]
    assert len(line) == 1 and "skipped te: " in line[0] and "takes fp16/bf16, not torch.float32" in line[0]
    assert "; flash: the flash kernel (flash-attn 2.8.3) takes fp16/bf16" in line[0]
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine.pytorch.constants", None)
    assert K.select_kernel("auto", _fake_q(), _fake_q()).name == "te"  # auto's choice is kept per input signature
    monkeypatch.setattr(K, "_AUTO", {})  # (a new process)
    assert K.select_kernel("auto", _fake_q(), _fake_q()).name == "flash"
    assert "kernel: flash (auto, cuda bfloat16 d=128); skipped te: not importable here" in caplog.text
    assert K.available_kernels() == ["flash", "torch"]


def test_forced_backend_that_is_absent_names_the_alternatives():
    with pytest.raises(ValueError, match=r"'te' cannot run here: transformer_engine .*available: torch \(or auto\)"):
        K.get_kernel("te", "cpu")
    with pytest.raises(ValueError, match=r"'flash' cannot run here: flash-attn"):
        K.get_kernel("flash", "cpu")
    with pytest.raises(ValueError, match="choose one of auto, te, flash, torch"):
        K.get_kernel("cudnn")


def _fake_q(dtype=torch.bfloat16, d=128, device="cuda"):
    return SimpleNamespace(device=torch.device(device) if device != "cuda" else SimpleNamespace(type="cuda"),
                           dtype=dtype, shape=(16, 1, 8, d))


@pytest.mark.parametrize("name", ["te", "flash"])
def test_backend_input_checks_name_the_fix(monkeypatch, name):
    _pretend_cuda(monkeypatch)
    kern = K.get_kernel(name, "cuda")
    kern.check(_fake_q(), _fake_q())
    with pytest.raises(ValueError, match="fp16/bf16, not torch.float32$"):
        kern.check(_fake_q(torch.float32), _fake_q())
    with pytest.raises(ValueError, match="head dim <= 256 and a multiple of 8 \\(got 100\\)$"):
        kern.check(_fake_q(d=100), _fake_q())
    with pytest.raises(ValueError, match="needs CUDA tensors$"):
        kern.check(torch.empty(16, 1, 8, 128, dtype=torch.bfloat16), _fake_q())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    with pytest.raises(ValueError, match="sm80\\+"):
        kern.check(_fake_q(), _fake_q())
    # forced, the refusal ends with what the registry finds runs the inputs here (the fix)
    with pytest.raises(ValueError, match="needs CUDA tensors; kernels that run these inputs here: torch \\(kernel='torch'"):
        K.select_kernel(name, torch.empty(16, 1, 8, 128), torch.empty(16, 1, 8, 128))


@pytest.mark.parametrize("path,dtype,tol", [("flash", torch.float16, 5e-3), ("efficient", torch.float32, 1e-5)])
@pytest.mark.parametrize("m,shape,causal,heads", [(12, (2, 2), True, (8, 2)), (32, (1, 4), False, (4, 4)),
                                                  (16, (4, 1), True, (4, 1))])
def test_torch_kernel_cuda_paths_through_the_executor(monkeypatch, path, dtype, tol, m, shape, causal, heads):
    """The torch backend's CUDA flash and efficient paths against stand-ins of the aten ops
    that apply their argument rules (defined cum_seq => varlen; lse read as the kernel reads it);
    m = 12 and 16 give row ranges that are not multiples of 32 (the padded-lse path)."""
    monkeypatch.setattr(torch_sdpa, "_aten", fake_aten.namespace())
    monkeypatch.setattr(torch_sdpa.TorchKernel, "_is_cuda", staticmethod(lambda t: True))
    monkeypatch.setattr(torch_sdpa, "cuda_path", lambda q: path)
    fake_kernels.assert_exact_through_executor(torch_sdpa.TorchKernel(), shape, causal, heads, dtype, m, tol)


def test_cuda_flash_backward_stand_in_takes_a_defined_cum_seq_as_varlen():
    """The stand-in is as strict as the op: ``torch.empty(0)`` for cum_seq_q (what main passed)
    selects the varlen path and fails the batch-size check; ``None`` (undefined) is the dense path."""
    q = torch.randn(1, 4, 32, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 32, 16, dtype=torch.float16)
    out, lse, cq, ck, mq, mk, rng, unused, _ = fake_aten.flash_forward(q, k, k, 0.0, True, False, scale=0.25)
    assert cq is None and ck is None  # what the dense forward returns
    empty = torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        fake_aten.flash_backward(q, q, k, k, out, lse, empty, empty, 32, 32, 0.0, True, rng, unused, scale=0.25)
    dq, dk, dv = fake_aten.flash_backward(q, q, k, k, out, lse, None, None, 32, 32, 0.0, True, rng, unused, scale=0.25)
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("name", ["torch", "te", "flash"])
def test_rectangular_causal_blocks_are_refused(monkeypatch, name):
    """The libraries align a rectangular causal mask differently (top-left vs bottom-right),
    so every backend refuses a causal block that is not square instead of computing one silently."""
    _pretend_cuda(monkeypatch)
    kern = K.TorchKernel() if name == "torch" else K.get_kernel(name, "cuda")
    q, k = torch.randn(8, 1, 2, 16), torch.randn(4, 1, 2, 16)
    with pytest.raises(ValueError, match="8 query rows and 4 keys: block kernels only take square causal blocks"):
        kern.forward(q, k, k, causal=True, scale=0.25)
    with pytest.raises(ValueError, match="square causal blocks"):
        kern.backward(q, q, k, k, q, torch.zeros(1, 2, 8), causal=True, scale=0.25)
    if name == "torch":
        kern.forward(q, k, k, causal=False, scale=0.25)  # non-causal rectangles are fine


def test_torch_kernel_refuses_dtypes_the_cuda_efficient_op_has_no_kernel_for(monkeypatch):
    """Defect 6: fp32/fp64 on CUDA go to the memory-efficient op, whose kernels are fp32, fp16 and bf16
    only (bf16 from sm80; ``sdp_utils.cpp``); check() refuses fp64 (and bf16 below sm80) naming the fix,
    instead of the op raising inside the forward. The stand-in is as strict as the op."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    kern = torch_sdpa.TorchKernel()
    with pytest.raises(ValueError, match="memory-efficient op has no float64 kernel.*float32 or bfloat16.*on CPU"):
        K.select_kernel("torch", _fake_q(torch.float64), _fake_q(torch.float64))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kern.check(_fake_q(dtype), _fake_q(dtype))
    kern.check(_fake_q(torch.float64, device="cpu"), _fake_q(torch.float64, device="cpu"))  # the CPU op has fp64
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(ValueError, match="no bfloat16 kernel"):
        kern.check(_fake_q(torch.bfloat16), _fake_q(torch.bfloat16))
    x = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Only fp32, half & bf16 supported"):
        fake_aten.efficient_forward(x, x, x, None, True, 0.0, False, scale=0.25)


def test_torch_kernel_gqa_fallback_only_when_the_op_refuses_gqa(monkeypatch):
    """Defect 7: an OOM (or any error that is not about the K/V heads) is re-raised and leaves the
    native-GQA path on; only the op refusing GQA switches to expanded K/V, and only once that runs."""
    ns = fake_aten.namespace()
    real, errors = ns._scaled_dot_product_flash_attention, []

    def flaky(q, k, *args, **kw):
        if errors and q.shape[1] != k.shape[1]:
            raise errors.pop(0)
        return real(q, k, *args, **kw)

    ns._scaled_dot_product_flash_attention = flaky
    monkeypatch.setattr(torch_sdpa, "_aten", ns)
    monkeypatch.setattr(torch_sdpa.TorchKernel, "_is_cuda", staticmethod(lambda t: True))
    monkeypatch.setattr(torch_sdpa, "cuda_path", lambda q: "flash")
    kern = torch_sdpa.TorchKernel()
    q, k = torch.randn(32, 1, 4, 16, dtype=torch.float16), torch.randn(32, 1, 2, 16, dtype=torch.float16)
    for exc in (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("boom")):
        errors.append(exc)
        with pytest.raises(type(exc)):
            kern.forward(q, k, k, causal=True, scale=0.25)
        assert kern._gqa_native
    out, lse = kern.forward(q, k, k, causal=True, scale=0.25)  # native GQA again
    errors.append(RuntimeError("Number of heads in key/value must equal the number of heads in query"))
    out2, lse2 = kern.forward(q, k, k, causal=True, scale=0.25)
    assert not kern._gqa_native and torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("path,dtype", [("flash", torch.float16), ("efficient", torch.float32)])
def test_torch_kernel_deterministic_backward_on_cuda(monkeypatch, path, dtype):
    """The CUDA SDPA backward ops are deterministic only under torch.use_deterministic_algorithms(True)
    (attention_backward.cu: "Flash Attention defaults to a non-deterministic algorithm"); a
    deterministic torch kernel runs them so, restoring the setting, and a default one leaves it."""
    monkeypatch.setattr(torch_sdpa, "_aten", fake_aten.namespace())
    monkeypatch.setattr(torch_sdpa.TorchKernel, "_is_cuda", staticmethod(lambda t: True))
    monkeypatch.setattr(torch_sdpa, "cuda_path", lambda q: path)
    q = torch.randn(32, 1, 2, 16, dtype=dtype)
    for det in (False, True):
        kern = K.get_kernel("torch", "cpu", deterministic=det)
        assert kern.deterministic is det
        out, lse = kern.forward(q, q, q, causal=True, scale=0.25)
        kern.backward(q, q, q, q, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=0.25)
        assert fake_aten.SEEN[f"{path}_backward"] is det
        assert not torch.are_deterministic_algorithms_enabled()  # restored
