"""Kernel backends: selection, forced-backend errors, input checks, and the TE / flash adapters run
through the real executor (virtual ranks) against CPU stand-ins with the libraries' signatures."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import fake_kernels
from megatron_mesh_cp import kernels as K
from megatron_mesh_cp.reference import reference_attention
from megatron_mesh_cp.virtual import virtual_mesh_attention


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(K, "_INSTANCES", {})
    monkeypatch.setattr(K, "_LOGGED", set())


def _pretend_cuda(monkeypatch, te=True, flash=True):
    fake_kernels.install(monkeypatch, te=te, flash=flash)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_picks_a_backend_that_can_run_the_inputs_and_logs_why(monkeypatch, caplog):
    """Item 5: auto tries te, flash, torch in order, each against these inputs; fp32 CUDA inputs get
    torch (not a ValueError from te), and the log says why te and flash were skipped."""
    caplog.set_level(logging.INFO, logger="megatron_mesh_cp")
    cpu = torch.empty(16, 1, 8, 128)
    assert K.select_kernel("auto", cpu, cpu).name == "torch"  # CPU: always torch
    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert K.select_kernel("auto", _fake_q(), _fake_q()).name == "te"
    K.select_kernel("auto", _fake_q(), _fake_q())
    assert caplog.text.count("mesh attention kernel: te (auto, cuda bfloat16 d=128)") == 1  # logged once
    assert K.select_kernel("auto", _fake_q(torch.float32), _fake_q(torch.float32)).name == "torch"
    line = [ln for ln in caplog.text.splitlines() if "kernel: torch (auto, cuda float32" in ln]
    assert len(line) == 1 and "skipped te: " in line[0] and "takes fp16/bf16, not torch.float32" in line[0]
    assert "; flash: the flash kernel (flash-attn 2) takes fp16/bf16" in line[0]
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine.pytorch.constants", None)
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
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    kern.check(_fake_q(), _fake_q())
    with pytest.raises(ValueError, match="fp16/bf16.*--mesh-kernel torch"):
        kern.check(_fake_q(torch.float32), _fake_q())
    with pytest.raises(ValueError, match="head dim <= 256 and a multiple of 8.*--mesh-kernel torch"):
        kern.check(_fake_q(d=100), _fake_q())
    with pytest.raises(ValueError, match="needs CUDA tensors; on CPU use --mesh-kernel torch"):
        kern.check(torch.empty(16, 1, 8, 128, dtype=torch.bfloat16), _fake_q())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    with pytest.raises(ValueError, match="sm80\\+.*--mesh-kernel torch"):
        kern.check(_fake_q(), _fake_q())


@pytest.mark.parametrize("name", ["te", "flash"])
@pytest.mark.parametrize("shape,causal,heads", [((2, 2), True, (8, 2)), ((1, 3), False, (4, 4)), ((4, 1), True, (4, 1))])
def test_adapters_through_the_executor(monkeypatch, name, shape, causal, heads):
    """The TE and flash adapters, driven by the real executor on virtual ranks, are exact."""
    _pretend_cuda(monkeypatch)
    kern = K.get_kernel(name, "cuda")
    monkeypatch.setattr(type(kern), "check", lambda self, q, k: None)  # CPU tensors stand in for CUDA ones
    h, hk = heads
    n = shape[0] * shape[1]
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(2, 4 * n, x, 16, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=causal)
    ro.backward(do)
    res = virtual_mesh_attention(q, k, v, shape, dout=do, causal=causal, kernel=kern)
    for got, ref in ((res["out"], ro), (res["lse"], rl), (res["dq"], qr.grad), (res["dk"], kr.grad), (res["dv"], vr.grad)):
        # fp64 inputs, fp32 lse (as the libraries return it): wiring mistakes would show as O(1) errors
        assert float((got - ref.detach()).norm() / ref.detach().norm()) < 1e-6


def test_te_older_than_2_is_refused(monkeypatch):
    _pretend_cuda(monkeypatch)
    import sys

    fa = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"]

    def old_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, qkv_dtype,
                fused_attention_backend, attn_bias=None):
        raise AssertionError("not called")

    monkeypatch.setattr(fa, "fused_attn_fwd", old_fwd)
    with pytest.raises(ValueError, match="Transformer Engine < 2.0 is not supported.*--mesh-kernel flash / torch"):
        K.TEKernel()
