"""Single-process tests of a2a+mesh: the super-zigzag reorder, KV replication, the byte model, and
``virtual_mesh_attention`` with a ``(u, a, b)`` shape against the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_mesh_cp import ChunkDims, zigzag_shard
from megatron_mesh_cp.runtime.layout import zigzag_positions
from megatron_mesh_cp.reference import reference_attention
from megatron_mesh_cp.runtime.ulysses import (
    check_ulysses_heads, fold_replicas, heads_to_members, kv_repeats, members_to_heads, members_to_super,
    replicate_kv, super_to_members, ulysses_traffic,
)
from megatron_mesh_cp.virtual import virtual_mesh_attention


@pytest.mark.parametrize("u,n_super", [(2, 1), (2, 3), (3, 2), (4, 2)])
def test_all_to_all_lands_tokens_in_the_super_zigzag_layout(u, n_super):
    """Members' zigzag shares over n ranks, exchanged and reordered, are the super-rank's share over
    N = n/u ranks; the inverse path gives every member its own tokens and all heads back."""
    n, S, h = u * n_super, 4 * u * n_super, 2 * u
    # token position in dim 0, head index in dim 2: x[s, 0, head, 0] = 1000 * head + position
    full = (torch.arange(S).view(S, 1, 1, 1) + 1000 * torch.arange(h).view(1, 1, h, 1)).double()
    for G in range(n_super):
        packs = [heads_to_members(zigzag_shard(full, n, G * u + j, dim=0), u) for j in range(u)]
        for j in range(u):
            sup = members_to_super(torch.stack([p[j] for p in packs]), u)
            want = zigzag_positions(S, n_super, G).double().view(-1, 1, 1, 1) + 1000 * torch.arange(
                j * h // u, (j + 1) * h // u).view(1, 1, -1, 1)
            assert torch.equal(sup, want)
        backs = [super_to_members(members_to_super(torch.stack([p[j] for p in packs]), u), u) for j in range(u)]
        for j in range(u):
            assert torch.equal(members_to_heads(torch.stack([b[j] for b in backs]), u),
                               zigzag_shard(full, n, G * u + j, dim=0))


def test_kv_replication_and_its_gradient():
    assert [kv_repeats(h, hk, u) for h, hk, u in [(8, 8, 2), (8, 2, 4), (8, 1, 8), (12, 6, 4), (12, 4, 3)]] == [1, 2, 8, 2, 3]
    x = torch.randn(3, 2, 2, 4)
    rep = replicate_kv(x, 3)
    assert rep.shape == (3, 2, 6, 4) and torch.equal(rep[:, :, 3], x[:, :, 1])  # head i -> i*r .. i*r+r-1
    assert torch.allclose(fold_replicas(rep, 3), 3 * x)
    with pytest.raises(ValueError, match=r"u=3 does not divide the 8 query heads per rank.*use u in \[1, 2, 4, 8\]"):
        check_ulysses_heads(8, 2, 3, 8)


def test_byte_model_by_hand():
    # u = 4, batch 1, 8 tokens, 8 heads, 2 kv heads (replicated x2 -> 4), d = 4, bf16, fp32 lse
    dims = ChunkDims(1, 8, 8, 2, 4, torch.bfloat16)
    q = 3 * 8 * 2 * 4 * 2  # 3 of 4 head groups of 2 heads leave, 8 tokens x d 4 x 2 bytes
    kv = 2 * 3 * 8 * 1 * 4 * 2
    assert ulysses_traffic(4, dims, "forward", return_lse=True) == {
        ("forward", "a2a-Q"): q, ("forward", "a2a-KV"): kv, ("forward", "a2a-O"): q, ("forward", "a2a-LSE"): 3 * 8 * 2 * 4}
    assert ulysses_traffic(4, dims, "backward") == {("backward", "a2a-dO"): q, ("backward", "a2a-dQ"): q,
                                                   ("backward", "a2a-dKV"): kv}
    assert ulysses_traffic(1, dims, "forward") == {}


CASES = [((2, 2, 2), 8, 8), ((2, 1, 4), 8, 1), ((4, 2, 1), 8, 2), ((3, 1, 2), 12, 4), ((8, 1, 1), 8, 4)]


@pytest.mark.parametrize("shape,h,hk", CASES, ids=[f"{s[0]}x{s[1]}x{s[2]}-{h}h{hk}kv" for s, h, hk in CASES])
def test_virtual_hybrid_matches_reference(shape, h, hk):
    u = shape[0]
    n = u * shape[1] * shape[2]
    g = torch.Generator().manual_seed(n * 10 + hk)
    mk = lambda heads: torch.randn(2, 4 * n, heads, 8, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
    for causal, layout in itertools.product((True, False), ("bshd", "sbhd")):
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ro, rl = reference_attention(qr, kr, vr, causal=causal)
        ro.backward(do)
        t = (lambda x: x.transpose(0, 1).contiguous()) if layout == "sbhd" else (lambda x: x)
        res = virtual_mesh_attention(t(q), t(k), t(v), shape, dout=t(do), causal=causal, layout=layout)
        got = [t(res["out"]), res["lse"], t(res["dq"]), t(res["dk"]), t(res["dv"])]
        for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, (ro, rl, qr.grad, kr.grad, vr.grad)):
            assert float((x - r).norm() / r.norm()) < 1e-12, (shape, causal, layout, name)
        local = ChunkDims(2, 4, h, hk, 8, torch.float64, torch.float64)
        want = {**ulysses_traffic(u, local, "forward", return_lse=True), **ulysses_traffic(u, local, "backward")}
        for rank_traffic in res["traffic"]:
            assert {key: v for key, v in rank_traffic.sent.items() if key[1].startswith("a2a")} == want
