"""The TE and flash adapters against every call surface of the real libraries (CPU stand-ins in
fake_kernels / fake_flash), run through the real executor on virtual ranks; TE's configuration
space gated by TE's own backend selection; the version gates and their messages."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import fake_kernels
from megatron_mesh_cp.runtime import kernels as K
from megatron_mesh_cp.virtual import virtual_mesh_attention

CASES = [((2, 2), True, (8, 2)), ((1, 3), False, (4, 4)), ((4, 1), True, (4, 1))]


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(K, "_INSTANCES", {})
    monkeypatch.setattr(K, "_LOGGED", set())
    monkeypatch.setattr(K, "_AUTO", {})


def _through_executor(monkeypatch, name, shape, causal, heads, **kw):
    kern = K.get_kernel(name, "cuda", **kw)
    monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)  # CPU tensors stand in for CUDA ones
    fake_kernels.assert_exact_through_executor(kern, shape, causal, heads, torch.float16)
    return kern


@pytest.mark.parametrize("fa2", ["2.6", "2.7", "2.8"])
@pytest.mark.parametrize("shape,causal,heads", CASES)
def test_flash_attn_2_surfaces_through_the_executor(monkeypatch, fa2, shape, causal, heads):
    """flash-attn 2.7/2.8 wrap the entry points as torch custom ops (signature ``(*args, **kwargs)``
    on the module attribute); 2.6 takes a ``window_size`` tuple and returns an 8-tuple."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=fa2)
    kern = _through_executor(monkeypatch, "flash", shape, causal, heads)
    assert kern._surface("cuda", 16).label.startswith(f"flash-attn {fa2}")


def test_flash_attn_older_than_2_6_is_refused_by_version(monkeypatch):
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash="2.5")
    with pytest.raises(ValueError, match=r"flash-attn 2\.5\.9\.post1 is older than 2\.6"):
        K.FlashKernel()
    # forced, the refusal names what runs instead: the registry answers (te is absent here)
    with pytest.raises(ValueError, match=r"older than 2\.6.*; kernels that run these inputs here: torch \(kernel='torch'; "
                                         r"Megatron: --mesh-kernel torch\)$"):
        K.select_kernel("flash", *([torch.empty(4, 1, 2, 16)] * 2))
    assert K.select_kernel("auto", *([torch.empty(4, 1, 2, 16)] * 2)).name == "torch"


@pytest.mark.parametrize("fa3", ["2024-07", "2025-03", "2025-08"])
@pytest.mark.parametrize("shape,causal,heads", CASES[:2])
def test_flash_attn_3_surfaces_through_the_executor(monkeypatch, fa3, shape, causal, heads):
    """The first FA3 release returns (out, q, k, v, out_padded, lse, S_dmask); 2025-01..07
    builds need every leading argument and take ``causal`` in the backward; 2025-08+ builds are
    custom ops with ``is_causal`` (and may not be handed an ``out`` buffer: a custom op cannot
    return its input)."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash="2.8", fa3=fa3)
    kern = _through_executor(monkeypatch, "flash", shape, causal, heads)
    assert kern.version == 3 and kern._surface("cuda", 16).label == "flash-attn 3"


@pytest.mark.parametrize("fa3,label", [("2024-07", "flash-attn 2.8.3"), ("2025-08", "flash-attn 3")])
def test_flash_attn_3_on_sm80_runs_where_the_build_can_else_fa2(monkeypatch, fa3, label):
    """The first FA3 builds are sm90-only (the kernel then uses FA2); builds since 2025-01 run on sm80."""
    fake_kernels.pretend_cuda(monkeypatch, capability=(8, 0), te=None, flash=None, fa3="2024-07")
    with pytest.raises(ValueError, match=r"flash kernel \(flash-attn 3\) needs sm90\+.*; install flash-attn 2"):
        K.get_kernel("flash", "cuda").check(K.input_spec((8, 1, 2, 16), torch.float16, "cuda"), None)
    monkeypatch.setattr(K, "_INSTANCES", {})
    fake_kernels.pretend_cuda(monkeypatch, capability=(8, 0), te=None, flash="2.8", fa3=fa3)
    kern = _through_executor(monkeypatch, "flash", (2, 2), True, (8, 2))
    assert kern._surface("cuda", 16).label == label


@pytest.mark.parametrize("te", ["2.0", "2.15"])
@pytest.mark.parametrize("shape,causal,heads", CASES)
def test_te_surfaces_through_the_executor(monkeypatch, te, shape, causal, heads):
    """TE 2.0-2.14 take ``dqkv_dtype`` positionally, 2.15+ do not; causal is passed with
    ``window_size=(-1, 0)``; the backward is non-deterministic unless asked."""
    fake_kernels.pretend_cuda(monkeypatch, te=te, flash=None)
    _through_executor(monkeypatch, "te", shape, causal, heads)
    assert fake_kernels.SEEN["deterministic"] is False
    monkeypatch.setattr(K, "_INSTANCES", {})
    _through_executor(monkeypatch, "te", shape, causal, heads, deterministic=True)
    assert fake_kernels.SEEN["deterministic"] is True


def _spec(d=128, dtype=torch.bfloat16, h=8, hk=2):
    return K.input_spec((1024, 1, h, d), dtype, "cuda"), K.input_spec((1024, 1, hk, d), dtype, "cuda")


@pytest.mark.parametrize("capability,cudnn,d,deterministic,error", [
    ((9, 0), (9, 10, 0), 128, False, None),
    ((9, 0), (9, 10, 0), 256, False, None),
    ((9, 0), (9, 4, 0), 256, False, "no fused-attention backend .*head dim 256.*; kernels that run these inputs here: torch \\(kernel='torch'"),
    ((8, 0), (9, 10, 0), 192, False, "no fused-attention backend .*head dim 192, training on sm80"),
    ((10, 0), (9, 10, 0), 128, False, None),
    ((9, 0), (9, 10, 0), 128, True, None),
    ((8, 0), (9, 10, 0), 128, True, "no deterministic fused-attention backward .*sm80.*--deterministic-mode"),
    ((10, 0), (9, 18, 0), 128, True, "no deterministic fused-attention backward .*sm100"),
    ((10, 0), (9, 18, 1), 128, True, None),
    ((12, 0), (9, 19, 0), 128, True, "no deterministic .*sm120"),
])
def test_te_configurations_are_gated_by_te_backend_selection(monkeypatch, capability, cudnn, d, deterministic, error):
    """What TE cannot run fails in check() -- before any process group -- naming the
    alternative, instead of crashing inside TE's backward after a good forward."""
    fake_kernels.pretend_cuda(monkeypatch, capability=capability, te="2.15", flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", cudnn)
    q, k = _spec(d)
    if error is None:
        assert K.select_kernel("te", q, k, deterministic=deterministic).name == "te"
    else:
        with pytest.raises(ValueError, match=error):
            K.select_kernel("te", q, k, deterministic=deterministic)
        assert K.select_kernel("auto", q, k, deterministic=deterministic).name == "torch"  # auto moves on


def test_te_older_than_2_is_refused(monkeypatch):
    fake_kernels.pretend_cuda(monkeypatch, flash=None)
    fa = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"]

    def old_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, qkv_dtype,
                fused_attention_backend, attn_bias=None):
        raise AssertionError("not called")

    monkeypatch.setattr(fa, "fused_attn_fwd", old_fwd)
    with pytest.raises(ValueError, match="Transformer Engine < 2.0 is not supported by the te kernel; upgrade TE$"):
        K.TEKernel()
    q = K.input_spec((8, 1, 2, 16), torch.float16, "cuda")  # forced: the registry names what runs instead
    with pytest.raises(ValueError, match=r"upgrade TE; kernels that run these inputs here: torch \(kernel='torch'"):
        K.select_kernel("te", q, q)


def test_a_forced_kernels_refusal_survives_an_alternative_that_fails(monkeypatch):
    """A forced kernel's refusal ends with the kernels that run the inputs here, which the registry finds
    by asking the other backends; one that fails otherwise than by refusing (here TE's selection raising
    a RuntimeError, as a library error would) is left out of that hint instead of replacing the refusal."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash="2.8")

    def broken(params):
        raise RuntimeError("cuDNN Error: CUDNN_STATUS_NOT_INITIALIZED")

    sel = sys.modules["transformer_engine.pytorch.attention.dot_product_attention.utils"]
    monkeypatch.setattr(sel, "get_attention_backend", broken)
    q, v = (K.input_spec((8, 1, 2, d), torch.bfloat16, "cuda") for d in (128, 64))  # MLA: FA2 takes one head dim
    with pytest.raises(ValueError, match=r"cannot run a value head dim 64 with query/key head dim 128 .*; no other "
                                         r"attention kernel here runs these inputs$"):
        K.select_kernel("flash", q, q, v=v)
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_NOT_INITIALIZED"):  # asked itself, TE's error is its own
        K.select_kernel("te", q, q, v=v)


def test_deterministic_reaches_the_kernel_from_the_public_api(monkeypatch, caplog):
    """``virtual_mesh_attention`` / ``mesh_attention(deterministic=...)`` build a deterministic kernel;
    the default is not deterministic (as in Megatron without --deterministic-mode)."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash=None)
    q = torch.randn(1, 32, 4, 16, dtype=torch.float16)
    for det in (False, True):
        kern = K.get_kernel("te", "cuda", deterministic=det)
        monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)
        virtual_mesh_attention(q, q, q, (2, 2), dout=q, kernel="te", deterministic=det)
        assert fake_kernels.SEEN["deterministic"] is det


def _megatron_args(**kw):
    from types import SimpleNamespace

    base = dict(context_parallel_algo="mesh", mesh_shape="2x2", context_parallel_size=4, cp_comm_type=None,
                seq_length=4096, attention_dropout=0.0, attention_backend=None, sft=False,
                dataloader_inter_document_masking=False, hierarchical_context_parallel_sizes=None,
                mesh_kernel="te", mesh_partial_dtype="fp32", mesh_planner="greedy", mesh_cluster=None,
                tensor_model_parallel_size=2, num_attention_heads=16, num_query_groups=4,
                group_query_attention=True, kv_channels=256, hidden_size=4096, micro_batch_size=1, bf16=True,
                fp16=False, rank=0, yaml_cfg=None, deterministic_mode=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _megatron_on_gpu(monkeypatch, capability, te="2.15"):
    import contextlib

    from megatron_mesh_cp.megatron import settings

    monkeypatch.setitem(settings._STATE, "options", settings.options())  # restored after the test
    fake_kernels.pretend_cuda(monkeypatch, capability=capability, te=te, flash=None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())


def test_megatron_start_up_checks_the_kernel_for_the_model(monkeypatch):
    """Under Megatron the argument check asks the backend (TE's own selection) about this
    model's attention inputs before any process group, honouring --deterministic-mode."""
    from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args
    from megatron_mesh_cp.megatron.settings import options

    _megatron_on_gpu(monkeypatch, (8, 0))
    args = _megatron_args

    with pytest.raises(MeshArgumentError, match=r"--mesh-kernel te: .*no fused-attention backend for bfloat16, 8 heads "
                                                r"\(2 kv\), head dim 256, training on sm80.*; kernels that run these inputs here: torch "
                                                r"\(kernel='torch'; Megatron: --mesh-kernel torch\)"):
        apply_mesh_args(args(), argv=[])
    apply_mesh_args(args(mesh_kernel="auto"), argv=[])  # auto takes torch here
    apply_mesh_args(args(kv_channels=128), argv=[])
    assert options().deterministic is False
    with pytest.raises(MeshArgumentError, match="no deterministic fused-attention backward .*--deterministic-mode"):
        apply_mesh_args(args(kv_channels=128, deterministic_mode=True), argv=[])
    # docs/DESIGN.md section 6, defect 7: --mesh-packed-data needs a backend for packed (THD) blocks; on sm80 TE has
    # none and auto falls to the torch kernel, whose CUDA path has no varlen
    packed = dict(kv_channels=128, mesh_packed_data=True, tensor_model_parallel_size=1, calculate_per_token_loss=True)
    with pytest.raises(MeshArgumentError, match=r"--mesh-kernel auto: .*torch: the torch attention kernel runs document "
                                                r"\(varlen\) calls -- packed THD or cu_seqlens -- on CPU only"):
        apply_mesh_args(args(mesh_kernel="auto", **packed), argv=[])


# --- packed sequences (THD, varlen) through the TE and flash adapters --------------------------

def _packed_through_executor(monkeypatch, name, shape, heads, **kw):
    kern = K.get_kernel(name, "cuda", **kw)
    monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(type(kern), "check_varlen", lambda self, q, k=None, v=None: None)
    fake_kernels.assert_packed_through_executor(kern, shape, heads, torch.float16)
    return kern


@pytest.mark.parametrize("fa2", ["2.6", "2.7", "2.8"])
@pytest.mark.parametrize("shape", [(2, 2), (2, 1, 2)], ids=["2x2", "a2a2x1x2"])
def test_flash_attn_2_varlen_through_the_executor(monkeypatch, fa2, shape):
    """FA2's varlen entry points (2.6: plain, window_size tuple; 2.7/2.8: custom ops), lse [h, t]."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=fa2)
    _packed_through_executor(monkeypatch, "flash", shape, (4, 2))


@pytest.mark.parametrize("fa3", ["2025-03", "2025-08"])
def test_flash_attn_3_varlen_through_the_executor(monkeypatch, fa3):
    """FA3 builds since 2025-01 take cu_seqlens in their one forward/backward entry point."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=None, fa3=fa3)
    kern = _packed_through_executor(monkeypatch, "flash", (2, 2), (4, 2))
    assert kern._varlen_surface("cuda", 16).label == "flash-attn 3"


def test_flash_varlen_needs_a_build_with_varlen_entry_points(monkeypatch):
    """The first FA3 builds' varlen surface is not wired: packed inputs use FA2 if present, else refuse."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash="2.8", fa3="2024-07")
    assert K.get_kernel("flash", "cuda")._varlen_surface("cuda", 16).label == "flash-attn 2.8.3"
    monkeypatch.setattr(K, "_INSTANCES", {})
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=None, fa3="2024-07")
    q = K.input_spec((8, 1, 2, 16), torch.float16, "cuda")
    with pytest.raises(ValueError, match="flash kernel cannot run packed sequences .*no varlen entry points.*; no other attention kernel here "
                                         "runs these inputs$"):
        K.select_kernel("flash", q, q, packed=True)


@pytest.mark.parametrize("te", ["2.0", "2.10", "2.11", "2.15"])
@pytest.mark.parametrize("cudnn", [(9, 10, 0), (9, 1, 1)], ids=["stats-ragged", "stats-bhs1"])
def test_te_thd_through_the_executor(monkeypatch, te, cudnn):
    """TE's thd_thd_thd with padding_causal / padding; softmax stats ragged from cuDNN 9.6 on --
    [max_tokens(t), h, 1] through TE 2.10 (docs/DESIGN.md section 6, defect 1: at least 1024 rows, the ones past t
    unwritten), [t, h, 1] from 2.11 -- and [b, h, max_seqlen, 1] before (cuDNN 9.1: 9.2-9.5 have no
    padding-mask backend); all converted to and from ours. Below cuDNN 9.6 TE's thd needs as many kv
    heads as heads."""
    fake_kernels.pretend_cuda(monkeypatch, te=te, flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", cudnn)
    _packed_through_executor(monkeypatch, "te", (2, 2), (4, 2) if cudnn >= (9, 6, 0) else (4, 4))
    _packed_through_executor(monkeypatch, "te", (1, 2, 2), (4, 4))


@pytest.mark.parametrize("te", ["2.14", "2.18"])
def test_te_thd_on_sm120_uses_the_dense_stats_layout(monkeypatch, te):
    """Defect 3: on sm120 TE (2.14+, cuDNN >= 9.18.1) runs thd with dense [b, h, max_seqlen, 1] stats in
    both directions (``use_ragged_stats = ... && sm_arch_ != 120``), so the backward gets them dense;
    2.14-2.17 allocate that layout as [t, h, 1], too small for what cuDNN writes: refused at the check."""
    fake_kernels.pretend_cuda(monkeypatch, capability=(12, 0), te=te, flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 19, 0))
    q = K.input_spec((64, 1, 4, 16), torch.float16, "cuda")
    if te == "2.14":
        with pytest.raises(ValueError, match=r"2\.14-2\.17 allocate sm120's dense thd softmax stats .*2\.18\+"):
            K.select_kernel("te", q, q, packed=True)
        return
    assert K.select_kernel("te", q, q, packed=True).name == "te"
    _packed_through_executor(monkeypatch, "te", (2, 2), (4, 4))


def test_te_thd_below_cudnn_9_6_needs_as_many_kv_heads_as_heads(monkeypatch):
    """Defect 4: ``nvte_get_fused_attn_backend`` takes thd only with cuDNN >= 9.6 or (>= 9.1 and
    heads == kv heads), on sm90+; the varlen check asks TE with the real kv heads. With cuDNN 9.2-9.5
    TE's sliding-window clause has no padding mask at all (fused_attn.cpp@v2.15 L445-L479): refused."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 5, 0))
    q = K.input_spec((64, 1, 4, 16), torch.float16, "cuda")
    with pytest.raises(ValueError, match=r"packed sequences .*no padding-mask backend with cuDNN 9\.2-9\.5"):
        K.select_kernel("te", q, q, packed=True)
    monkeypatch.setattr(K, "_INSTANCES", {})
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 1, 1))
    q, k = K.input_spec((64, 1, 4, 16), torch.float16, "cuda"), K.input_spec((64, 1, 2, 16), torch.float16, "cuda")
    with pytest.raises(ValueError, match=r"packed sequences .*4 heads \(2 kv\).*as many heads as kv heads below cuDNN 9\.6"):
        K.select_kernel("te", q, k, packed=True)
    assert K.select_kernel("te", q, q, packed=True).name == "te"
    assert K.select_kernel("auto", q, k).name == "te"  # unpacked GQA is fine
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 6, 0))
    monkeypatch.setattr(K, "_INSTANCES", {})
    assert K.select_kernel("te", q, k, packed=True).name == "te"
    fake_kernels.pretend_cuda(monkeypatch, capability=(8, 0), te="2.15", flash=None)
    monkeypatch.setattr(K, "_INSTANCES", {})
    with pytest.raises(ValueError, match="thd needs sm90"):
        K.select_kernel("te", q, q, packed=True)


def test_te_deterministic_is_selected_without_a_bias(monkeypatch):
    """Defect 2: TE's determinism filter drops FusedAttention while ``core_attention_bias_requires_grad``
    (default True) is set; the kernel passes False (no bias), as TE's DotProductAttention does."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash=None)
    q, k = _spec(128)
    assert K.select_kernel("auto", q, k, deterministic=True).name == "te"
    assert K.select_kernel("te", K.input_spec((64, 1, 4, 16), torch.bfloat16, "cuda"),
                           K.input_spec((64, 1, 4, 16), torch.bfloat16, "cuda"), deterministic=True, packed=True).name == "te"


@pytest.mark.parametrize("fa2", [None, "2.8"])
def test_flash_attn_3_deterministic_head_dim_256_is_refused_or_runs_on_fa2(monkeypatch, fa2):
    """Defect 5: FA3 (hopper/flash_api.cpp, since 2025-09-17) refuses a deterministic backward for head
    dims rounded up to 256; the check refuses it before the forward (or FA2 runs it when installed)."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=fa2, fa3="2025-08")
    kern = K.get_kernel("flash", "cuda", deterministic=True)
    spec = K.input_spec((16, 1, 2, 256), torch.float16, "cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(16, 1, 2, d, generator=g, dtype=torch.float16) for d in (256,) * 4)
    if fa2 is None:
        with pytest.raises(ValueError, match=r"flash-attn 3 has no deterministic backward for head dim 256.*flash-attn 2"):
            K.select_kernel("flash", spec, spec, deterministic=True)
        q1 = q[..., :192].contiguous()
        K.select_kernel("flash", K.input_spec(q1.shape, torch.float16, "cuda"), K.input_spec(q1.shape, torch.float16, "cuda"),
                        deterministic=True)  # 192 rounds to 192: FA3 has it
        q, k, v, do = (x[..., :192].contiguous() for x in (q, k, v, do))
    else:
        assert K.select_kernel("flash", spec, spec, deterministic=True) is kern
    out, lse = kern.forward(q, k, v, causal=True, scale=0.1)
    kern.backward(do, q, k, v, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=0.1)
    if fa2:
        assert kern._surface("cuda", 256).label == "flash-attn 2.8.3" and kern._surface("cuda", 128).label == "flash-attn 3"


def test_auto_kernel_for_packed_inputs_on_gpu(monkeypatch):
    """auto skips backends that cannot run varlen: the torch kernel's CUDA path has none."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash=None)
    q = K.input_spec((8, 1, 2, 16), torch.float16, "cuda")
    with pytest.raises(ValueError, match="torch: the torch attention kernel runs document \\(varlen\\) calls -- packed THD or cu_seqlens -- on CPU only"):
        K.select_kernel("auto", q, q, packed=True)
    monkeypatch.setattr(K, "_AUTO", {})
    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash=None)
    assert K.select_kernel("auto", q, q, packed=True).name == "te"


# --- sliding windows through the TE adapter ------------------------------------------------------

def _te_window_kernel(monkeypatch, te="2.15", capability=(9, 0)):
    fake_kernels.pretend_cuda(monkeypatch, capability=capability, te=te, flash=None)
    kern = K.get_kernel("te", "cuda")
    monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(type(kern), "check_varlen", lambda self, q, k=None, v=None: None)
    return kern


@pytest.mark.parametrize("te,capability", [("2.15", (8, 0)), ("2.16", (8, 0)), ("2.15", (9, 0))],
                         ids=["sbhd-padding", "sbhd-no-mask", "thd"])
@pytest.mark.parametrize("causal,window", [(True, (7, 0)), (False, (4, 4)), (False, (2, 9))])
def test_te_windows_without_documents_through_the_executor(monkeypatch, causal, window, te, capability):
    """Review finding 1: TE's window path (bottom-right aligned band, ``bottom_right_diagonal``) runs
    exactly on CPU through the TE stand-in; without documents every windowed call is square. The
    stand-in has TE's sliding-window clause per version: TE 2.12-2.15 run a two-sided window only with
    a padding (or bottom-right) mask, so there the sbhd rectangles run as ``padding`` with full
    lengths (on sm80: no THD), from 2.16 as ``no_mask``; on sm90 batch-1 calls run as THD of one
    sequence (padding masks)."""
    from megatron_mesh_cp.reference import relative_errors, variant_reference

    kern = _te_window_kernel(monkeypatch, te, capability)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(64, x, 16, generator=g, dtype=torch.float64) for x in (4, 2, 2, 4))
    ref = variant_reference(q, k, v, do, causal=causal, window=window)
    ref.pop("max_logit")
    for shape in ((2, 2), (1, 4), (2, 1, 2)):
        res = virtual_mesh_attention(*(x.half()[None] for x in (q, k, v)), shape, dout=do.half()[None], causal=causal,
                                     window=window, kernel=kern)
        got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
        for name, err in relative_errors(got, ref).items():
            assert err < 5e-3, (shape, name, err)


@pytest.mark.parametrize("te", ["2.12", "2.15", "2.16", "2.18"])
def test_te_two_sided_windows_need_a_padding_mask_before_2_16(monkeypatch, te):
    """TE 2.12-2.15 (fused_attn.cpp@v2.15 L463-L479) find no backend for a two-sided window with
    ``no_mask``; 2.16 adds it (@v2.16 L439). The stand-in refuses what the real TE refuses, the
    selection says the same, and the te kernel accepts windows on both (padding before 2.16):
    earlier it refused every window on 2.12-2.15 as needing a newer cuDNN."""
    fake_kernels.pretend_cuda(monkeypatch, capability=(8, 0), te=te, flash=None)
    x = torch.randn(16, 2, 2, 16, dtype=torch.float16)
    cu = torch.arange(0, 3 * 16, 16, dtype=torch.int32)
    fwd = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"].fused_attn_fwd
    call = dict(attn_scale=0.25, qkv_layout="sbhd_sbhd_sbhd", window_size=(4, 4), bottom_right_diagonal=True)
    version = tuple(int(x) for x in te.split("."))
    call.update({"o_format": "sbhd"} if version >= (2, 15) else {})
    backend = fake_kernels.FusedAttnBackend.F16_arbitrary_seqlen
    fwd(True, 16, 16, cu, cu, x, x, x, x.dtype, backend, attn_mask_type="padding", **call)
    params = dict(qkv_layout="sbhd_sbhd_sbhd", window_size=(4, 4), core_attention_bias_requires_grad=False)
    if version < (2, 16):
        with pytest.raises(RuntimeError, match=r"no backend for no_mask with window \(4, 4\)"):
            fwd(True, 16, 16, cu, cu, x, x, x, x.dtype, backend, attn_mask_type="no_mask", **call)
        selected = fake_kernels.get_attention_backend(fake_kernels.AttentionParams(attn_mask_type="no_mask", **params))
        assert not selected[2]
    else:
        fwd(True, 16, 16, cu, cu, x, x, x, x.dtype, backend, attn_mask_type="no_mask", **call)
    assert fake_kernels.get_attention_backend(fake_kernels.AttentionParams(attn_mask_type="padding", **params))[2]
    K.get_kernel("te", "cuda").check_window(K.input_spec((64, 1, 4, 16), torch.float16, "cuda"))
    assert K.get_kernel("te", "cuda")._window_mask() == ("padding" if version < (2, 16) else "no_mask")


def test_te_stand_in_refuses_tall_windowed_calls(monkeypatch):
    """The stand-in is as strict as TE: a windowed call with more query rows than keys has no fused
    backend (``max_seqlen_q <= max_seqlen_kv``); square and wide ones run."""
    kern = _te_window_kernel(monkeypatch)
    x = torch.randn(30, 1, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"no backend for padding with window \(0, -1\), max_seqlen_q 30, "
                                           "max_seqlen_kv 4"):
        kern.forward(x, x[:4], x[:4], causal=False, scale=0.25, window=(0, -1))
    kern.forward(x[:4], x, x, causal=False, scale=0.25, window=(3, -1))
    kern.forward(x, x, x, causal=True, scale=0.25, window=(3, 0))


def test_te_refuses_a_window_over_documents_before_any_transfer(monkeypatch):
    """Review finding 1: documents + a window give tall windowed calls (30 rows x 4 keys for
    documents (0, 60, 256), window (30, 0) on 2 chunks), which TE cannot run: te (and auto choosing
    te) is refused up front, not mid-plan."""
    _te_window_kernel(monkeypatch)
    q = torch.randn(1, 256, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 60, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match="te kernel cannot run a sliding window over documents.*--mesh-kernel torch"):
        virtual_mesh_attention(q, q, q, (1, 2), dout=q, causal=True, window=(30, 0), cu_seqlens=cu, kernel="te")
    spec = K.input_spec((256, 1, 2, 16), torch.float16, "cuda")
    blk = K.select_kernel("auto", spec, spec, packed=True)
    assert blk.name == "te"
    blk.check_window(spec)  # without documents TE runs windows
    with pytest.raises(ValueError, match="over documents"):
        blk.check_window(spec, documents=True)


def test_megatron_start_up_refuses_te_for_a_window_over_documents(monkeypatch):
    """Review finding 1 under Megatron: --window-size with --reset-attention-mask would give TE tall
    windowed calls; the start-up check refuses --mesh-kernel te (and auto, which takes te) there."""
    from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args

    _megatron_on_gpu(monkeypatch, (9, 0))
    common = dict(kv_channels=128, window_size=(128, 0), create_attention_mask_in_dataloader=False)
    apply_mesh_args(_megatron_args(**common), argv=[])  # a window without documents: TE >= 2.12 runs it
    for kernel in ("te", "auto"):
        lead = "no attention kernel can run these inputs: te: " if kernel == "auto" else ""
        with pytest.raises(MeshArgumentError, match=f"--mesh-kernel {kernel}: {lead}the te kernel cannot run a sliding "
                                                    "window over documents.*drop the window or the document mask"):
            apply_mesh_args(_megatron_args(mesh_kernel=kernel, reset_attention_mask=True, **common), argv=[])


# --- the max logit through the TE adapter ---------------------------------------------------------

@pytest.mark.parametrize("te,cudnn,packed,error", [
    ("2.13", (9, 10, 0), False, None),
    ("2.15", (9, 10, 0), False, r"Transformer Engine 2\.15 returns the max logit only with cuDNN >= 9\.21.*9\.10\.0"),
    ("2.17", (9, 20, 0), False, r"only with cuDNN >= 9\.21"),
    ("2.15", (9, 21, 0), False, None),
    ("2.10", (9, 10, 0), True, r"2\.10 reduces the max logit of packed .*never wrote; upgrade TE to 2\.11\+"),
    ("2.11", (9, 10, 0), True, None),
    ("2.13", (9, 1, 1), True, r"2\.13 reduces the max logit of packed .*padding rows; upgrade TE to 2\.14\+"),
    ("2.13", (9, 5, 0), False, None),
    ("2.18", (9, 21, 0), True, None),
])
def test_te_max_logit_is_gated_by_te_and_cudnn(monkeypatch, te, cudnn, packed, error):
    """Review findings 2, 4: TE >= 2.14 return the max logit only with cuDNN >= 9.21; packed (THD)
    inputs need TE 2.11 (ragged stats) or 2.14 (dense stats, cuDNN < 9.6). What is accepted runs
    through the stand-in and equals the explicit max (in the input dtype); what is refused would
    crash there or return a max over rows TE never wrote."""
    from megatron_mesh_cp.runtime.kernels.base import Varlen

    fake_kernels.pretend_cuda(monkeypatch, te=te, flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", cudnn)
    kern = K.get_kernel("te", "cuda")
    spec = K.input_spec((64, 1, 4, 16), torch.float16, "cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 1, 4, 16, generator=g).half() for _ in range(3))
    varlen = Varlen(torch.tensor([0, 10, 24], dtype=torch.int32), (10, 14), 14) if packed else None
    want = torch.stack([fake_kernels.row_max(*(x.permute(1, 2, 0, 3).float() for x in (q[a:b], k[a:b])), 0.25, True)
                        .amax(dim=(0, 2)) for a, b in (((0, 10), (10, 24)) if packed else ((0, 24),))]).amax(0)
    if error is None:
        kern.check_max_logit(spec, packed=packed)
        top = kern.forward(q, k, v, causal=True, scale=0.25, varlen=varlen, return_max_logit=True)[2]
        assert torch.allclose(top, want.half().float(), rtol=0, atol=0), (top, want)
        return
    with pytest.raises(ValueError, match=error):
        kern.check_max_logit(spec, packed=packed)
    try:
        top = kern.forward(q, k, v, causal=True, scale=0.25, varlen=varlen, return_max_logit=True)[2]
    except RuntimeError:
        return
    assert not torch.allclose(top, want.half().float())


def test_te_max_logit_through_the_executor(monkeypatch):
    """TE's max logit (third forward output, [h], O's dtype) reaches mesh attention's max logit."""
    from megatron_mesh_cp.reference import variant_reference

    kern = _te_window_kernel(monkeypatch)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 21, 0))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(64, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref = variant_reference(q, k, v, None, causal=True, window=(9, 0))["max_logit"]
    res = virtual_mesh_attention(*(x.half()[None] for x in (q, k, v)), (2, 2), causal=True, window=(9, 0),
                                 return_max_logit=True, kernel=kern)
    assert torch.allclose(res["max_logit"].double(), ref, rtol=2e-3), (res["max_logit"], ref)


def test_megatron_start_up_checks_the_max_logit_of_documents(monkeypatch):
    """Review finding 4 under Megatron: --qk-clip with documents (--reset-attention-mask) asks TE
    about the max logit of packed blocks: TE 2.10 reduces rows it never wrote, 2.11 is fine."""
    from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args

    common = dict(kv_channels=128, qk_clip=True, create_attention_mask_in_dataloader=False)
    _megatron_on_gpu(monkeypatch, (9, 0), te="2.10")
    apply_mesh_args(_megatron_args(**common), argv=[])
    with pytest.raises(MeshArgumentError, match=r"--mesh-kernel te: Transformer Engine 2\.10 reduces the max logit of "
                                                r"packed sequences .*2\.11\+"):
        apply_mesh_args(_megatron_args(reset_attention_mask=True, **common), argv=[])
    _megatron_on_gpu(monkeypatch, (9, 0), te="2.11")
    monkeypatch.setattr(K, "_INSTANCES", {})
    apply_mesh_args(_megatron_args(reset_attention_mask=True, **common), argv=[])


# --- MLA (a value head dim of its own) through FA3 ------------------------------------------------

@pytest.mark.parametrize("capability,d,dv,deterministic,error", [
    ((9, 0), 192, 128, False, None),
    ((9, 0), 64, 256, False, None),
    ((8, 0), 192, 128, False, r"MLA, 192/128\) on Hopper \(sm90\) only, not sm80"),
    ((10, 0), 192, 128, False, r"on Hopper \(sm90\) only, not sm100"),
    ((9, 0), 64, 512, False, r"value head dim 512 .*d <= 64 with dv <= 256"),
    ((9, 0), 64, 256, True, r"no deterministic backward for head dim 256"),
    ((9, 0), 64, 192, True, None),
])
def test_flash_attn_3_mla_is_hopper_only_and_trains_up_to_256(monkeypatch, capability, d, dv, deterministic, error):
    """Review finding 5 (hopper/flash_api.cpp): a value head dim of its own needs Hopper
    (``dprops->major == 9``), the backward ``max(d, dv) <= 256``, and the deterministic rule reads
    ``max(d, dv)``. What the check accepts trains through the stand-in; what it refuses crashes there."""
    fake_kernels.pretend_cuda(monkeypatch, capability=capability, te=None, flash=None, fa3="2025-08")
    kern = K.get_kernel("flash", "cuda", deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(16, 1, 2, d, generator=g).half() for _ in range(2))
    v, do = (torch.randn(16, 1, 2, dv, generator=g).half() for _ in range(2))
    spec = lambda x: K.input_spec(x.shape, torch.float16, "cuda")  # noqa: E731

    def train():
        out, lse = kern.forward(q, k, v, causal=True, scale=0.1)
        kern.backward(do, q, k, v, out, kern.lse_for_backward(lse.permute(2, 0, 1)), causal=True, scale=0.1)

    if error is None:
        K.select_kernel("flash", spec(q), spec(k), v=spec(v), deterministic=deterministic)
        train()
        return
    with pytest.raises(ValueError, match=error):
        K.select_kernel("flash", spec(q), spec(k), v=spec(v), deterministic=deterministic)
    with pytest.raises(RuntimeError):
        train()


def test_window_refusals_name_the_kernel_that_runs_windows(monkeypatch):
    """Review finding 6: the flash kernel has no sliding window, so no refusal may send users to it;
    a forced kernel's refusal names, from the registry, the kernels that run windows here (te on GPU
    where cuDNN has a windowed backend, none otherwise)."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.16", flash="2.8")
    spec = K.input_spec((64, 1, 4, 16), torch.float16, "cuda")
    windowed = K.KernelNeeds(spec, spec, window=True)
    with pytest.raises(ValueError, match=r"^the flash attention kernel has no sliding window; kernels that run these "
                                         r"inputs here: te \(kernel='te'; Megatron: --mesh-kernel te\)$") as flash:
        K.select_kernel("flash", windowed)
    with pytest.raises(ValueError, match=r"runs sliding windows on CPU only.*; kernels that run these inputs here: te "):
        K.select_kernel("torch", windowed)
    assert K.select_kernel("auto", windowed).name == "te"
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 5, 0))
    monkeypatch.setattr(K, "_AUTO", {})
    monkeypatch.setattr(K, "_INSTANCES", {})  # TE caches its selection's answers per instance
    with pytest.raises(ValueError, match=r"no fused-attention backend for sliding windows.*cuDNN >= 9\.6.*; no other "
                                         r"attention kernel here runs these inputs$") as te:
        K.select_kernel("te", windowed)
    assert not any("kernel flash" in str(e.value) for e in (flash, te))


def test_auto_asks_again_when_a_windows_keys_pass_1024_on_cudnn_9_14_0(monkeypatch):
    """cuDNN 9.14.0 has no non-causal windowed backend past 1024 keys (fused_attn.cpp@v2.12-v2.18): auto's
    cached choice and TE's cached answer must not carry a short sequence's "te" over to a longer one."""
    fake_kernels.pretend_cuda(monkeypatch, te="2.16", flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 14, 0))
    short, long = (K.input_spec((s, 1, 4, 64), torch.bfloat16, "cuda") for s in (512, 2048))
    assert K.select_kernel("auto", K.KernelNeeds(short, short, window=True)).name == "te"
    with pytest.raises(ValueError, match="te: Transformer Engine has no fused-attention backend for sliding windows"):
        K.select_kernel("auto", K.KernelNeeds(long, long, window=True))
    with pytest.raises(ValueError, match="no fused-attention backend for sliding windows"):
        K.select_kernel("te", K.KernelNeeds(long, long, window=True))


def test_te_window_and_thd_checks_ask_with_mlas_value_head_dim(monkeypatch):
    """Review finding 7: on sm100 TE trains q/k 192 with v 128 (MLA) but not 192/192; the window and
    THD checks must ask TE's selection with the real value head dim and kv heads, not q's."""
    fake_kernels.pretend_cuda(monkeypatch, capability=(10, 0), te="2.15", flash=None)
    monkeypatch.setitem(fake_kernels.CUDNN, "version", (9, 14, 0))
    q = K.input_spec((256, 1, 8, 192), torch.bfloat16, "cuda")
    k = K.input_spec((256, 1, 2, 192), torch.bfloat16, "cuda")
    v = K.input_spec((256, 1, 2, 128), torch.bfloat16, "cuda")
    blk = K.select_kernel("te", q, k, v=v, packed=True)  # check and check_varlen with v
    blk.check_window(q, k, v)
    with pytest.raises(ValueError, match="no fused-attention backend"):
        K.select_kernel("te", q, k, v=k)  # 192/192: not on sm100
    with pytest.raises(ValueError, match="sliding windows"):
        blk.check_window(q, k, k)


def test_kernel_checks_see_sequence_major_inputs_for_bshd(monkeypatch):
    """Review finding 8: blocks run sequence-major, so mesh_attention asks the kernel with
    sequence-major views of bshd inputs: TE's selection reads max_seqlen from dim 0."""
    from megatron_mesh_cp.call import prepare, resolve
    from megatron_mesh_cp.runtime.kernels.te import TEKernel
    from megatron_mesh_cp.virtual import VirtualMesh

    fake_kernels.pretend_cuda(monkeypatch, te="2.15", flash=None)
    seen = []
    real = TEKernel._supported

    def spy(self, q, k, *a, **kw):
        seen.append((q.shape[0], k.shape[0]))
        return real(self, q, k, *a, **kw)

    monkeypatch.setattr(TEKernel, "_supported", spy)
    monkeypatch.setattr("megatron_mesh_cp.runtime.kernels.te.check_cuda_half", lambda *a, **kw: None)  # CPU tensors

    q = torch.randn(1, 96, 4, 16, dtype=torch.float16)  # bshd: batch 1, 96 tokens on this rank
    prepare(resolve(q, q, q, VirtualMesh((2, 2)), layout="bshd", kernel="te"))
    assert seen and all(s == (96, 96) for s in seen), seen
    seen.clear()  # a2a+mesh: the blocks run u times the tokens on h/u heads (and so are asked)
    prepare(resolve(q, q, q, VirtualMesh((2, 1, 2)), layout="bshd", kernel="te"))
    assert seen and all(s == (192, 192) for s in seen), seen


def test_flash_varlen_refuses_mla_where_its_varlen_build_takes_one_head_dim(monkeypatch):
    """Packed blocks run on the varlen surface; where that is flash-attn 2 (an FA3 build without
    varlen entry points), MLA's own value head dim is refused up front instead of crashing FA2."""
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash="2.8", fa3="2024-07")
    blk = K.get_kernel("flash", "cuda")
    q, v = (K.input_spec((128, 1, 4, d), torch.bfloat16, "cuda") for d in (192, 128))
    blk.check_varlen(q, q, q)  # one head dim: FA2's varlen runs it
    with pytest.raises(ValueError, match="takes one head dim, not MLA's 192/128$"):
        blk.check_varlen(q, q, v)
