"""Mesh attention on real gloo process groups against a float64 single-device reference.

Every factorisation (a, b) of n in {1, 2, 3, 4, 6, 8}, plus 3x3 and 4x4; causal and not; MHA, GQA
and MQA; batch 2; both layouts; fp32 (relative error <= 1e-5) and bf16 (<= 2x the error of
single-device bf16 attention). Measured bytes must equal the plan's bytes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_mesh_cp import ChunkDims, MeshShape, plan_traffic, valid_shapes
from megatron_mesh_cp.call import plan, resolve
from megatron_mesh_cp.spawn import RankError
from megatron_mesh_cp.virtual import VirtualMesh

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
SHAPES = [s for n in (1, 2, 3, 4, 6, 8) for s in valid_shapes(n)] + [(3, 3), (4, 4)]
#: the order the shapes run in: one pool lives at a time, so each size starts once where it can: 16 ranks (after the
#: bytes test at 16), 9 down to 1, then 4, and 8 last (the two 8-rank tests follow it)
_GROUP = {16: 0, 4: 2, 8: 3}
POOL_ORDER = sorted(SHAPES, key=lambda s: (_GROUP.get(s[0] * s[1], 1), -s[0] * s[1]))
DIM, S_LOCAL, BATCH = 16, 8, 2
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(n, causal, heads, layout, dtype):
    h, hk = HEADS[heads]
    return dict(causal=causal, heads=h, kv_heads=hk, layout=layout, dtype=dtype, batch=BATCH,
                seq=S_LOCAL * n, dim=DIM, name=f"{'causal' if causal else 'full'}-{heads}-{layout}-{dtype}")


def _cases(n):
    fp32 = [_case(n, c, h, l, "fp32") for c, h, l in itertools.product((True, False), HEADS, ("bshd", "sbhd"))]
    bf16 = [_case(n, True, "gqa", "sbhd", "bf16"), _case(n, False, "mha", "bshd", "bf16")]
    # partials on the wire in bf16 (half the reduction bytes): same tolerance
    wire = dict(_case(n, True, "mqa", "bshd", "bf16"), partial="bf16")
    wire["name"] += "-bf16wire"
    return fp32 + bf16 + [wire]


def _rel(per_rank, qty):
    num = sum(r["errors"][qty][0] for r in per_rank)
    den = sum(r["errors"][qty][1] for r in per_rank)
    return math.sqrt(num / den)


def test_mesh_moves_fewer_bytes_than_ring_at_16(pools):
    pool = pools.get(16)
    case = _case(16, True, "mha", "bshd", "bf16")
    totals = {}
    for shape in ((1, 16), (4, 4)):
        per_rank = pool.run("rank_tasks:exactness", shape, [case], seed=5)
        totals[shape] = [sum(r[0]["traffic"].values()) for r in per_rank]
    assert len(set(totals[(4, 4)])) == 1 and len(set(totals[(1, 16)])) == 1
    assert totals[(4, 4)][0] < totals[(1, 16)][0], totals


@pytest.mark.parametrize("shape", POOL_ORDER, ids=[f"{a}x{b}" for a, b in POOL_ORDER])
def test_exact_against_float64_reference(pools, shape):
    a, b = shape
    n = a * b
    cases = _cases(n)
    per_rank = pools.get(n).run("rank_tasks:exactness", shape, cases, seed=1000 * a + b)
    failures = []
    for idx, case in enumerate(cases):
        results = [r[idx] for r in per_rank]
        for qty in ("out", "lse", "dq", "dk", "dv"):
            err = _rel(results, qty)
            if case["dtype"] == "fp32":
                limit = 1e-5
            else:
                limit = 2 * results[0]["single_device"][qty]
            if not err <= limit:
                failures.append(f"{case['name']} {qty}: rel err {err:.3g} > {limit:.3g}")
        # bytes measured on every rank == bytes the plans predict
        dtype, partial = DTYPE_OF[case["dtype"]], DTYPE_OF.get(case.get("partial"))
        dims = ChunkDims(BATCH, S_LOCAL, case["heads"], case["kv_heads"], DIM, dtype, partial_dtype=partial)
        # the plans the run used (greedy, tuned for these dims), rebuilt here from metadata alone
        meta = lambda h: torch.empty(BATCH, S_LOCAL, h, DIM, dtype=dtype, device="meta")  # noqa: E731
        kv = meta(case["kv_heads"])
        spec = resolve(meta(case["heads"]), kv, kv, VirtualMesh((a, b)), causal=case["causal"], partial_dtype=partial)
        fwd_plan, bwd_plan = plan(spec)[0]
        want = {**plan_traffic(fwd_plan, dims), **plan_traffic(bwd_plan, dims)}
        want = {k: v for k, v in want.items() if v}
        for g, r in enumerate(results):
            if r["traffic"] != want or r["received"] != want:
                failures.append(f"{case['name']} rank {g}: sent {r['traffic']} received {r['received']} != plan {want}")
    assert not failures, "\n".join(failures)


def test_ring_and_mesh_shapes_agree(pools):
    """Ring (1x8), pass-Q (8x1) and the true meshes give the same outputs and gradients."""
    shapes = valid_shapes(8)
    case = _case(8, True, "gqa", "bshd", "fp32")
    per_rank = pools.get(8).run("rank_tasks:shapes_agree", shapes, case, seed=7)
    ring = (1, 8)
    for shape in shapes:
        for qi, qty in enumerate(("out", "lse", "dq", "dk", "dv")):
            num = sum(float((r[shape][qi] - r[ring][qi]).pow(2).sum()) for r in per_rank)
            den = sum(float(r[ring][qi].pow(2).sum()) for r in per_rank)
            assert math.sqrt(num / den) <= 1e-5, (shape, qty)


def test_bitwise_deterministic(pools):
    case = _case(8, True, "gqa", "sbhd", "bf16")
    for shape in ((2, 4), (4, 2)):
        assert all(pools.get(8).run("rank_tasks:bitwise_twice", shape, case, seed=3))


BAD = {
    "odd_sequence": "not divisible by 2*CP",
    "heads": "multiple of kv heads",
    "dtype": "dtypes differ",
    "device": "devices differ",
    "batch": "batch sizes differ",
    "layout": "layout must be one of",
    "shape_product": "choose one of",
    "group_sizes": "hierarchical_context_parallel_sizes",
    "group_members": "consecutive CP ranks",
    # a2a+mesh (rank_tasks_hybrid.bad_input)
    "hybrid_ulysses_size": "does not divide the CP size 4",
    "hybrid_ulysses_shape": "does not fit the CP group of 4 ranks",
    "hybrid_ulysses_group": "consecutive CP ranks",
    "hybrid_heads": "use u in [1]",
    "hybrid_plans": "plans are for 4x1, the mesh is 1x2",
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_bad_input_raises_on_every_rank(pools, what):
    pool = pools.get(4)
    with pytest.raises(RankError) as info:
        if what.startswith("hybrid_"):
            pool.run("rank_tasks_hybrid:bad_input", what[len("hybrid_"):])
        else:
            pool.run("rank_tasks:bad_input", what)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert {t for t, _, _ in errors.values()} == {"ValueError"}, errors
    messages = {m for _, m, _ in errors.values()}
    assert all(BAD[what] in m for m in messages), messages
    if what not in ("group_members", "hybrid_ulysses_group"):  # membership errors name the rank's own groups
        assert len(messages) == 1, messages
