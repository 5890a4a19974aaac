"""The core attention and spec on a GPTModel built directly (no training loop), CP = 4 mesh (and
a2a+mesh 2x1x2 on Megatron's hierarchical CP groups [u, a, b]) vs CP = 1.

Runs on every megatron-core the project supports: CI runs it under megatron-core 0.19.x
(Python 3.12) and 0.16.1 (Python 3.11, CPU torch).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def _assert_same(got, ref, tag, tol=1e-5):
    loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 10
    errs = {n: float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref["grads"].items()}
    print(f"[direct] {tag}: rel loss diff {loss_err:.1e}, max rel grad diff {max(errs.values()):.1e}")
    assert loss_err <= tol, (tag, got["loss"], ref["loss"])
    assert max(errs.values()) <= tol, (tag, max(errs, key=errs.get), max(errs.values()))


@pytest.fixture(scope="module")
def cp1_ref(pools):
    return pools.get(4).run("rank_tasks_megatron:gpt_direct", 1, (1, 1), seed=3)[0]


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1), (2, 1, 2)], ids=["2x2", "1x4", "4x1", "a2a+mesh-2x1x2"])
def test_gpt_model_mesh_matches_cp1(pools, cp1_ref, shape):
    got = pools.get(4).run("rank_tasks_megatron:gpt_direct", 4, shape, seed=3)[0]
    _assert_same(got, cp1_ref, shape)


# Activation recompute: selective re-runs core attention (the mesh forward, with its communication)
# inside the backward; full re-runs whole layers. Megatron's checkpointing reads and restores the
# CUDA RNG state, which on CPU is cpu_compat's stand-in generator.
RECOMPUTE = {
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@pytest.mark.parametrize("mode", sorted(RECOMPUTE))
def test_gpt_model_mesh_under_recompute_matches_cp1(pools, cp1_ref, mode):
    got = pools.get(4).run("rank_tasks_megatron:gpt_direct", 4, (2, 2), seed=3, **RECOMPUTE[mode])[0]
    _assert_same(got, cp1_ref, mode)


def test_full_recompute_replays_dropout_exactly(pools):
    """With hidden dropout on, recomputed layers must draw the forward's masks: same grads as no recompute."""
    pool = pools.get(4)
    plain = pool.run("rank_tasks_megatron:gpt_direct", 4, (2, 2), seed=3, hidden_dropout=0.2)[0]
    again = pool.run("rank_tasks_megatron:gpt_direct", 4, (2, 2), seed=3, hidden_dropout=0.2, **RECOMPUTE["full"])[0]
    _assert_same(again, plain, "dropout", tol=1e-6)


def test_checkpointing_restores_the_stand_in_cuda_rng(pools):
    for r in pools.get(4).run("rank_tasks_megatron:cuda_rng_under_checkpoint"):
        assert r["roundtrip"] and r["same_noise"] and r["grad_err"] == 0.0, r
