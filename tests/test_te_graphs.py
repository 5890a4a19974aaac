"""TE's cuDNN graph cache under documents: the te kernel issues document sub-blocks (dense calls of
new sizes every batch and rank) as THD calls of one sequence, whose graph keys TE buckets, so the
distinct keys per rank stay bounded over changing batches; counted by the TE stand-in the way TE
v2.18 forms them (fake_te_backend), and exact through the executor on both routes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fake_kernels
import fake_te_backend
from megatron_mesh_cp.reference import relative_errors, variant_reference
from megatron_mesh_cp.runtime import kernels as K
from megatron_mesh_cp.virtual import virtual_mesh_attention

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(K, "_INSTANCES", {})
    monkeypatch.setattr(K, "_AUTO", {})
    monkeypatch.setattr(fake_te_backend, "GRAPHS", {})


def _bench():
    spec = importlib.util.spec_from_file_location("bench_graph_keys", ROOT / "scripts" / "bench_graph_keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel(monkeypatch, capability=(9, 0), te="2.15"):
    fake_kernels.pretend_cuda(monkeypatch, capability=capability, te=te, flash=None)
    kern = K.get_kernel("te", "cuda")
    monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(type(kern), "check_varlen", lambda self, q, k=None, v=None: None)
    return kern


def test_te_bucket_is_tes_get_max_tokens():
    from megatron_mesh_cp.runtime.kernels.te import _te_bucket

    for t in list(range(1, 5000)) + [32767, 32768, 32769, 65536, 65537, 100000, 10 ** 6]:
        assert _te_bucket(t) == fake_te_backend.get_max_tokens(t), t


def test_te_documents_through_the_executor_on_both_routes(monkeypatch):
    """Documents on a 1x2 mesh, 4096 tokens: a sub-block of sizes off TE's buckets (476 x 1024) runs
    as THD of one sequence, one of bucket sizes (1024 x 1024) stays sbhd (and the own blocks are
    varlen THD). out, lse and the gradients match float64 attention, so both forms of the
    backward's softmax stats (``_Stats``: dense for sbhd, ragged for THD) are right."""
    kern = _kernel(monkeypatch)
    g = torch.Generator().manual_seed(1)
    t = 4096
    q, k, v, do = (torch.randn(t, x, 8, generator=g, dtype=torch.float64) for x in (2, 1, 1, 2))
    cu = [0, 1500, 2048, t]  # pieces of 1024, chunks of 2048
    ref = variant_reference(q, k, v, do, cu, causal=True)
    ref.pop("max_logit")
    seen = []
    forward = kern.forward

    def recording(q, k, v, **kw):
        seen.append((q.shape[0], k.shape[0], kw.get("varlen") is None, kern._one_sequence(q, k, v, kw["causal"], None)))
        return forward(q, k, v, **kw)

    monkeypatch.setattr(kern, "forward", recording)
    res = virtual_mesh_attention(*(x.half()[None] for x in (q, k, v)), (1, 2), dout=do.half()[None], causal=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32), kernel=kern)
    got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
    for name, err in relative_errors(got, ref).items():
        assert err < 5e-3, (name, err)
    dense = {(sq, sk, one) for sq, sk, plain, one in seen if plain}
    assert (1024, 1024, False) in dense and (476, 1024, True) in dense, dense


@pytest.mark.parametrize("capability,cudnn,rows,keys,one", [
    ((9, 0), (9, 10, 0), 476, 1024, True),
    ((9, 0), (9, 10, 0), 1024, 2048, False),  # bucket sizes: the sbhd key is as shared
    ((9, 0), (9, 5, 0), 476, 1024, False),  # cuDNN < 9.6: TE keys THD with exact sizes too
    ((8, 0), (9, 10, 0), 476, 1024, False),  # no THD below sm90
    ((12, 0), (9, 19, 0), 476, 1024, False),  # sm120 (TE >= 2.14): THD keys exact
    ((10, 0), (9, 14, 0), 3000, 700, True),
])
def test_te_one_sequence_route_is_taken_where_te_buckets(monkeypatch, capability, cudnn, rows, keys, one):
    kern = _kernel(monkeypatch, capability, te="2.18")
    monkeypatch.setitem(fake_kernels.CUDNN, "version", cudnn)
    q, k = torch.empty(rows, 1, 4, 64, dtype=torch.bfloat16), torch.empty(keys, 1, 2, 64, dtype=torch.bfloat16)
    assert kern._one_sequence(q, k, k, False, None) is one
    assert kern._one_sequence(q.expand(rows, 2, 4, 64), k.expand(keys, 2, 2, 64), k, False, None) is False  # batch 2


def test_te_graph_keys_per_rank_stay_bounded_over_changing_documents(monkeypatch):
    """12 batches of a long-context mix (a few long documents among many short ones, new each batch),
    32K tokens on a 2x2 mesh: the dense calls come in 73 distinct exact sizes, which an sbhd call puts
    into TE's graph key as they are (a graph built and kept per size and direction: up to 28 per rank
    and direction before); as THD of one sequence they share TE's token buckets: at most 13. The kernel's own
    cu_seqlens tensors, one per length, stay bounded too (te._CU_SIZE; they grew by every new length)."""
    from megatron_mesh_cp.runtime.kernels import te as te_kernel

    bound = getattr(te_kernel, "_CU_SIZE", 64)
    kern = _kernel(monkeypatch)
    del kern
    counts, sizes, calls = _bench().count_keys(12, 32768, (2, 2), te="2.15", cudnn=(9, 10, 0), capability=(9, 0))
    assert len(sizes) > 60 and calls > 100, (len(sizes), calls)
    assert len(counts) == 4 and all(f <= 16 and b <= 16 for f, b in counts.values()), counts
    kern = K.get_kernel("te", "cuda")
    lengths = {n for pair in sizes for n in pair}
    assert len(lengths) > bound and len(kern._cu) <= bound, (len(lengths), len(kern._cu))
