"""Attention variants under mesh and a2a+mesh on virtual ranks: sliding windows, learnable sinks,
MLA head dims (v head dim != q/k head dim), the max logit; against the float64 reference
(reference.variant_reference) for every factorisation of n in {2, 4, 6, 8} and three a2a+mesh
shapes, fp32 <= 1e-5 and bf16 <= 1.3x single-device; window-pruned bytes = the pruned plans' and
a halo's at a small window. Gloo runs and bad input: test_variants_dist.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh_cp import valid_shapes
from megatron_mesh_cp.planning.schedule import build_plans
from megatron_mesh_cp.reference import relative_errors, variant_reference
from megatron_mesh_cp.runtime.plan import ChunkDims, plan_traffic
from megatron_mesh_cp.virtual import virtual_mesh_attention

SHAPES = [s for n in (2, 4, 6, 8) for s in valid_shapes(n)] + [(2, 1, 2), (2, 2, 1), (4, 1, 2)]


def cases(piece):
    """(causal, window, heads, kv heads, qk head dim, v head dim, documents, sink, max logit)."""
    return [
        (True, (7, 0), 4, 2, 8, 8, False, True, True),
        (True, (3 * piece, 0), 4, 4, 8, 8, True, False, False),
        (False, (4, 4), 4, 2, 8, 8, False, True, True),
        (False, (2, 9), 4, 4, 8, 8, True, False, False),
        (True, None, 4, 4, 8, 8, False, True, False),
        (False, None, 4, 2, 8, 8, False, True, False),
        (True, (3, 0), 4, 2, 40, 24, True, False, True),  # MLA 40/24 with documents and a window
    ]


def run(shape, causal, window, h, hk, d, dv, docs, sink, top, dtype=torch.float32, seed=0, t=None):
    n = math.prod(shape)
    t = t or 16 * n
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, x, d, generator=g, dtype=torch.float64) for x in (h, hk))
    v, do = (torch.randn(t, x, dv, generator=g, dtype=torch.float64) for x in (hk, h))
    s = torch.randn(h, generator=g, dtype=torch.float64) if sink else None
    cu = [0, 5, 4 + t // 8, t // 2 + 3, t] if docs else None  # lengths 5, 2n-1 (t = 16n), ..., a long one
    ref = variant_reference(q, k, v, do, cu, causal=causal, window=window, sink=s)
    kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    res = virtual_mesh_attention(*(x.to(dtype)[None] for x in (q, k, v)), shape, dout=do.to(dtype)[None],
                                 causal=causal, window=window, sink=None if s is None else s.float(),
                                 return_max_logit=top, kernel="torch", **kw)
    got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
    if sink:
        got["dsink"] = res["dsink"]
    if top:
        got["max_logit"] = res["max_logit"]
    else:
        ref.pop("max_logit")
    return got, ref, res


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_variants_exact_against_float64(shape):
    for case in cases(piece=8):
        got, ref, _ = run(shape, *case)
        for name, err in relative_errors(got, ref).items():
            assert err <= 1e-5, (shape, case, name, err)


def test_variants_bf16_close_to_single_device_bf16():
    """bf16 inputs (fp32 partials): the mesh's error stays within 1.3x that of the same dense
    math done once in bf16."""
    for shape in ((2, 2), (1, 4), (2, 1, 2)):
        for case in ((True, (7, 0), 16, 4, 16, 16, True, True, False), (False, (4, 4), 16, 4, 16, 16, False, True, False)):
            got, ref, _ = run(shape, *case, dtype=torch.bfloat16, seed=1)
            single, _, _ = run((1, 1), *case, dtype=torch.bfloat16, seed=1, t=16 * math.prod(shape))
            base = relative_errors(single, ref)
            for name, err in relative_errors(got, ref).items():
                assert err <= 1.3 * base[name], (shape, case, name, err, base[name])


def test_small_window_sends_a_halo():
    """A window far below the chunk: the pruned Ring keeps the own block and its two neighbours
    (a halo exchange) and every rank sends exactly the pruned plans' bytes."""
    shape, n = (1, 8), 8
    got, ref, res = run(shape, True, (3, 0), 4, 2, 8, 8, False, False, False)
    assert max(relative_errors(got, ref).values()) <= 1e-5
    fwd, bwd = res["plans"]
    assert sorted(fwd.blocks) == [(0, 0), (0, 1), (0, 7)] and {t.src for t in fwd.transfers} == {0}
    dims = ChunkDims(1, 16, 4, 2, 8, torch.float32)
    want = {**plan_traffic(fwd, dims), **plan_traffic(bwd, dims)}
    assert all(dict(tr.sent) == want for tr in res["traffic"])
    full = build_plans(1, n, chains="both-ways")
    full_bytes = sum(sum(plan_traffic(p, dims).values()) for p in full)
    assert sum(want.values()) <= 0.35 * full_bytes  # 2 of 7 KV chunks, their dK/dV
