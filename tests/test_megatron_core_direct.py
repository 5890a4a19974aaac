"""The core attention and spec on a GPTModel built directly (no training loop), CP = 4 mesh vs CP = 1.

Runs on every megatron-core the project supports: CI runs it under megatron-core 0.19.x
(Python 3.12) and 0.16.1 (Python 3.11, CPU torch).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1)])
def test_gpt_model_mesh_matches_cp1(pools, shape):
    pool = pools.get(4)
    ref = pool.run("rank_tasks_megatron:gpt_direct", 1, (1, 1), seed=3)[0]
    got = pool.run("rank_tasks_megatron:gpt_direct", 4, shape, seed=3)[0]
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 10
    for name, g in ref["grads"].items():
        err = float((got["grads"][name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= 1e-5, (shape, name, err)
