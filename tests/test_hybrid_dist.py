"""``a2a+mesh`` (Ulysses x mesh) on real gloo process groups against a float64 reference.

n = 8 as (u, a, b) in {(2,2,2), (2,1,4), (4,2,1), (8,1,1)}, n = 12 as (2,2,3) and (3,2,2), n = 16 as
(2,2,4) and (4,2,2); causal and not; MHA, GQA (h_kv = 4, 2) and MQA (KV heads replicated when u
does not divide them); both layouts; fp32 (relative error <= 1e-5) and bf16 (<= 1.3x single-device bf16 error);
bitwise repeatable. Measured bytes = the mesh plans' bytes + :func:`ulysses_traffic`. One pool
launch per n runs every shape and case of that n. (Bad inputs: test_mesh_attention_dist.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh_cp import ChunkDims, MeshShape, plan_traffic
from megatron_mesh_cp.call import plan, resolve
from megatron_mesh_cp.runtime.ulysses import kv_repeats, ulysses_traffic
from megatron_mesh_cp.virtual import VirtualMesh

SHAPES = {8: [(2, 2, 2), (2, 1, 4), (4, 2, 1), (8, 1, 1)], 12: [(2, 2, 3), (3, 2, 2)], 16: [(2, 2, 4), (4, 2, 2)]}
DIM, S_LOCAL, BATCH = 16, 4, 2
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases(u, n):
    """n = 8: every head layout causal and not; n = 12, 16 (slow on 2 cores): each head layout once,
    causal and not alternating; both layouts, and a bf16 pair, everywhere."""
    h = 12 if u == 3 else 8  # u must divide the query heads
    heads = {"mha": (h, h), "gqa4": (h, 4), "gqa2": (h, 2), "mqa": (h, 1)}
    out = []
    for i, (name, (hq, hk)) in enumerate(heads.items()):
        for causal in (True, False) if n == 8 else (i % 2 == 0,):
            layout = ("bshd", "sbhd")[(i + causal) % 2]
            out.append(dict(causal=causal, heads=hq, kv_heads=hk, layout=layout, dtype="fp32", batch=BATCH,
                            seq=S_LOCAL * n, dim=DIM, name=f"{'causal' if causal else 'full'}-{name}-{layout}-fp32"))
    for name, causal, layout in (("gqa2", True, "sbhd"), ("mha", False, "bshd")):
        hq, hk = heads[name]
        out.append(dict(causal=causal, heads=hq, kv_heads=hk, layout=layout, dtype="bf16", batch=BATCH,
                        seq=S_LOCAL * n, dim=DIM, twice=causal, name=f"{'causal' if causal else 'full'}-{name}-{layout}-bf16"))
    return out


def _rel(per_rank, qty):
    num = sum(r["errors"][qty][0] for r in per_rank)
    den = sum(r["errors"][qty][1] for r in per_rank)
    return math.sqrt(num / den)


def _expected_bytes(shape, case):
    """The mesh plans' bytes on the super-ranks' inputs plus the all-to-all's, from metadata alone."""
    u, a, b = shape
    h, hk = case["heads"], case["kv_heads"]
    r = kv_repeats(h, hk, u)
    dtype = DTYPE_OF[case["dtype"]]
    meta = lambda heads: torch.empty(S_LOCAL, BATCH, heads, DIM, dtype=dtype, device="meta")  # noqa: E731
    spec = resolve(meta(h), meta(hk), meta(hk), VirtualMesh((u, a, b)), causal=case["causal"], layout="sbhd")
    fwd, bwd = plan(spec)[0]
    super_dims = ChunkDims(BATCH, u * S_LOCAL, h // u, hk * r // u, DIM, dtype)
    local_dims = ChunkDims(BATCH, S_LOCAL, h, hk, DIM, dtype)
    want = {**plan_traffic(fwd, super_dims), **plan_traffic(bwd, super_dims)}
    for phase in ("forward", "backward"):
        want.update(ulysses_traffic(u, local_dims, phase, return_lse=True))
    return {k: v for k, v in want.items() if v}


def check_shapes(pool, n, report=None):
    shapes = SHAPES[n]
    cases = {s: _cases(s[0], n) for s in shapes}
    failures = []
    pool.run("rank_tasks_hybrid:build_meshes", shapes)
    for shape in shapes:  # one call per shape: each answers well within the pool's timeout
        per_rank = pool.run("rank_tasks_hybrid:exactness", [shape], cases, seed=17 * n + shapes.index(shape))
        for idx, case in enumerate(cases[shape]):
            results = [r[shape][idx] for r in per_rank]
            for qty in ("out", "lse", "dq", "dk", "dv"):
                err = _rel(results, qty)
                if case["dtype"] == "fp32":
                    limit = 1e-5
                else:
                    limit = 1.3 * results[0]["single_device"][qty]
                if report is not None:
                    report.append((shape, case["name"], qty, err, limit))
                if not err <= limit:
                    failures.append(f"{shape} {case['name']} {qty}: rel err {err:.3g} > {limit:.3g}")
            if case.get("twice") and not all(r["bitwise"] for r in results):
                failures.append(f"{shape} {case['name']}: two runs differ")
            want = _expected_bytes(shape, case)
            for g, r in enumerate(results):
                if r["traffic"] != want or r["received"] != want:
                    failures.append(f"{shape} {case['name']} rank {g}: sent {r['traffic']} != expected {want}")
    assert not failures, "\n".join(failures)


MEGATRON_SIZES = {8: [[2, 2, 2], [2, 1, 4], [4, 2, 1]], 16: [[2, 2, 4]]}


def check_megatron_groups(pool, n):
    """Megatron's create_hierarchical_groups for [u, a, b] is exactly the a2a+mesh layout."""
    for sizes in MEGATRON_SIZES.get(n, []):
        u, a, b = sizes
        got = pool.run("rank_tasks_hybrid:megatron_groups", sizes)
        for g, res in enumerate(got):
            assert res["shape"] == (u, a, b) and res["position"] == g // u
            ulysses, row, col = res["ranks"]
            base = g // (u * a) * (u * a) + g % u
            assert ulysses == list(range(g // u * u, g // u * u + u))
            assert row == [base + u * i for i in range(a)]
            assert col == [g % (u * a) + u * a * i for i in range(b)]


@pytest.mark.parametrize("n", sorted(SHAPES))
def test_hybrid_on_real_gloo_groups(pools, n):
    """Exactness, bytes and determinism of every listed (u, a, b) of n; at n = 8 and 16 also the
    group layout against megatron.core.parallel_state (one pool launch per n for both)."""
    pool = pools.get(n)
    check_shapes(pool, n)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return
    check_megatron_groups(pool, n)
