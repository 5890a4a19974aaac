"""Faults must fail loudly and fast: ranks that disagree, stall, or grow memory.

Every multi-rank test runs on a RankPool, whose result wait is a hard timeout (the pool's
process-group timeout + 30 s), so a hang fails the test instead of stalling CI. The stall tests
use their own pool with a 5 s process-group timeout and close it afterwards (a timed-out gloo
group is not reusable).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from megatron_mesh_cp.attention import resolve_scale
from megatron_mesh_cp.spawn import RankPool

DISAGREE = {
    "causal": "disagree on causal: True on CP rank 0 (global rank 0) but False on CP rank 2",
    "seq": "disagree on local sequence length: 8 on CP rank 0 (global rank 0) but 12 on CP rank 2",
    "heads": "disagree on query heads: 4 on CP rank 0 (global rank 0) but 2 on CP rank 2",
    "scale": "disagree on softmax_scale",
    "local_error": "CP rank 2 (global rank 2) rejected its inputs: sequence length 28",
}


def _same_error_everywhere(results, fragment, kind="ValueError"):
    types = {r[0] for r in results}
    messages = {r[1] for r in results}
    assert types == {kind}, results
    assert len(messages) == 1, messages
    assert fragment in messages.pop(), results[0][1]


@pytest.mark.parametrize("what", sorted(DISAGREE))
def test_one_rank_calling_differently_raises_the_same_error_on_every_rank(pools, what):
    results = pools.get(4).run("rank_tasks_faults:disagree", what)
    _same_error_everywhere(results, DISAGREE[what])


def test_create_with_another_shape_on_one_rank_raises_everywhere(pools):
    _same_error_everywhere(pools.get(4).run("rank_tasks_faults:create_shape"),
                           "ranks ask for different mesh shapes: 2x2 on rank 0 but 4x1 on rank 2")


def test_from_groups_with_a_bad_group_on_one_rank_raises_everywhere(pools):
    _same_error_everywhere(pools.get(4).run("rank_tasks_faults:from_groups_one_bad"),
                           "MeshGroups.from_groups: on rank 3: rank 3: row group [1, 3]")


def test_rings_inherit_the_default_timeout_or_take_an_explicit_one(pools):
    pool = pools.get(4)
    assert pool.run("rank_tasks_faults:timeouts")[0] == [180.0] * 3  # the pool's init_process_group timeout
    assert pool.run("rank_tasks_faults:timeouts", 7)[0] == [7.0] * 3


def test_megatron_rings_keep_distributed_timeout_minutes(pools):
    pytest.importorskip("megatron.core")
    assert pools.get(4).run("rank_tasks_faults:megatron_timeout", 3)[0] == [180.0] * 3


@pytest.fixture(scope="module")
def stall_pool():
    """Ranks whose stalls break only the groups a test builds (closed, not reused, afterwards)."""
    pool = RankPool(4, timeout_s=60)
    yield pool
    pool.close(force=True)


@pytest.mark.parametrize("where,fragment", [
    ("first_call", "mesh attention (agreement check): the collective on the CP group"),
    ("ring", "mesh attention forward: waiting in the "),
])
def test_a_stalled_rank_makes_the_others_fail_within_the_timeout(stall_pool, where, fragment):
    timeout = 5.0
    started = time.monotonic()
    results = stall_pool.run("rank_tasks_faults:stall", where, timeout)
    wall = time.monotonic() - started
    others = results[1:]
    assert all(r[0] == "RuntimeError" and fragment in r[1] for r in others), others
    # each waited about the timeout: not 30 minutes, not an instant crash
    assert all(timeout - 0.5 <= r[2] <= timeout + 10 for r in others), [r[2] for r in others]
    assert wall < 60, wall
    if where == "ring":
        assert all(" ring (" in r[1] and "receiving from rank" in r[1] for r in others), others


def test_fifty_sequence_lengths_keep_the_pool_within_its_cap(pools):
    pool = pools.get(4)
    lengths = list(range(2, 102, 2))  # 50 local lengths, forward and backward each
    by_shapes = pool.run("rank_tasks_faults:varlen", lengths)
    assert all(count <= 4 for rank in by_shapes for _, count in rank)  # default: 4 layer shapes
    cap = 256 * 1024
    by_bytes = pool.run("rank_tasks_faults:varlen", lengths, max_bytes=cap)
    assert all(nbytes <= cap for rank in by_bytes for nbytes, _ in rank)
    assert by_bytes[0][-1][0] > 0


def test_check_finite_raises_on_every_rank_naming_the_rank_with_the_nan(pools):
    pool = pools.get(4)
    _same_error_everywhere(pool.run("rank_tasks_faults:nan_check"),
                           "non-finite values (NaN or Inf) in q, k or v on CP rank 1 (global rank 1)")
    assert all(r[0] is None for r in pool.run("rank_tasks_faults:nan_check", 1, False))  # opt-in


def test_a_tensor_softmax_scale_is_read_to_the_host_once_per_version():
    """Defect 7 of docs/DESIGN.md section 6: reading a 0-d CUDA tensor is a device sync, and every call keys its cached
    plan by the scale; the same tensor object is read once (again only after an in-place change)."""
    from megatron_mesh_cp.attention import _options
    from megatron_mesh_cp.call import call_key
    from megatron_mesh_cp.runtime.masks import FULL
    from megatron_mesh_cp.virtual import VirtualMesh

    reads = []

    class Counting(torch.Tensor):
        def __float__(self):
            reads.append(1)
            return super().__float__()

    scale = torch.tensor(0.25).as_subclass(Counting)
    q = torch.zeros(1, 8, 2, 4)
    mesh = VirtualMesh((1, 1))
    opts = dict(causal=True, kernel="auto", plans=None, partial_dtype=None, planner="greedy", deterministic=False,
                check_finite=False, sink=None, return_max_logit=False)
    keys = [call_key(q, q, q, mesh, "bshd", FULL, _options(softmax_scale=scale, **opts)) for _ in range(5)]
    assert len(reads) == 1 and len(set(keys)) == 1 and resolve_scale(scale, 4) == 0.25 and len(reads) == 1
    scale.fill_(0.5)  # in place: a new version, read again
    assert resolve_scale(scale, 4) == 0.5 and len(reads) == 2


def test_softmax_scale_accepts_any_real_scalar(pools):
    assert pools.get(4).run("rank_tasks_faults:scales") == [True] * 4
    assert resolve_scale(np.float32(0.5), 64) == 0.5 and resolve_scale(torch.tensor(2), 64) == 2.0
    assert resolve_scale(None, 64) == 0.125
    for bad in (True, float("nan"), -1.0, 0, torch.tensor([0.3]), "0.3", float("inf"), torch.tensor(1j)):
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite real number"):
            resolve_scale(bad, 64)


def test_a_rank_that_dies_fails_the_pool_call_at_once_not_after_the_timeout(pools):
    """A pooled rank that dies (crashed, killed, a script without the ``__main__`` guard) fails ``run`` within
    seconds, naming it and its exit code, instead of after the pool's timeout + 30 s (here 90 s). Its own pool,
    forked from the session's fork server (conftest's preload list: no fresh interpreters)."""
    preload = sys.modules[type(pools).__module__].PRELOAD
    with RankPool(2, timeout_s=60, preload=preload) as pool:
        assert pool.run("rank_tasks_faults:exit_on", -1) == [0, 1]  # started and answering
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"ranks \[1\] died before answering \(exit codes \[3\]\)"):
            pool.run("rank_tasks_faults:exit_on", 1)
        assert time.monotonic() - started < 45  # the timeout path takes 90 s
        assert pool._procs == []  # closed: the surviving rank may wait in a collective for the dead one
