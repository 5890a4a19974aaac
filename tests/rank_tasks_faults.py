"""Rank functions for the fault tests: ranks that disagree, stall, or feed new shapes every step.

Each returns what the test needs to judge (error type, message, seconds to the error) instead of
raising, so one rank's behaviour can be told from another's.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_mesh_cp import MeshGroups, mesh_attention
from megatron_mesh_cp.runtime.kernels import TorchKernel
from rank_groups import megatron_task, released_groups


def _mesh(ctx, shape=(2, 2)):
    key = ("fault-mesh", tuple(shape))
    if key not in ctx.cache:
        ctx.cache[key] = MeshGroups.create(tuple(shape))
    return ctx.cache[key]


def _inputs(seq=8, heads=4, kv_heads=2, dim=8, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    q = torch.randn(batch, seq, heads, dim, generator=g)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g)
    return q, k, v


def _outcome(fn):
    """(error type or None, message, seconds) of calling ``fn``."""
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test judges the type
        return type(exc).__name__, str(exc), time.monotonic() - started
    return None, "", time.monotonic() - started


def disagree(ctx, what, odd_rank=2):
    """One rank (``odd_rank``) calls mesh attention differently from the others."""
    mesh = _mesh(ctx)
    odd = dist.get_rank() == odd_rank
    kw = dict(causal=True)
    seq, heads = 8, 4
    if odd and what == "causal":
        kw["causal"] = False
    elif odd and what == "seq":
        seq = 12
    elif odd and what == "heads":
        heads = 2
    elif odd and what == "scale":
        kw["softmax_scale"] = 0.5
    elif odd and what == "local_error":
        seq = 7  # odd: only this rank's own check fails
    q, k, v = _inputs(seq=seq, heads=heads)
    return _outcome(lambda: mesh_attention(q, k, v, mesh, **kw))


def create_shape(ctx, odd_rank=2):
    """``MeshGroups.create`` with (4, 1) on one rank and (2, 2) on the others."""
    shape = (4, 1) if dist.get_rank() == odd_rank else (2, 2)
    return _outcome(lambda: MeshGroups.create(shape))


def from_groups_one_bad(ctx, odd_rank=3):
    """Correct rings everywhere except one rank, which passes its column ring as its row ring."""
    with released_groups():
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        me = dist.get_rank()
        row, col = rows[me // 2], cols[me % 2]
        if me == odd_rank:
            row, col = col, row
        return _outcome(lambda: MeshGroups.from_groups(None, row, col))


class FlakyKernel(TorchKernel):
    """The torch kernel, except that rank ``fail_rank`` raises in its ``fail_at``-th block forward
    (what an out-of-memory error in the middle of attention looks like to the other ranks)."""

    def __init__(self, fail_rank: int, fail_at: int) -> None:
        super().__init__()
        self.fail_rank, self.fail_at, self.calls = fail_rank, fail_at, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if dist.get_rank() == self.fail_rank and self.calls == self.fail_at:
            raise RuntimeError("simulated failure inside attention")
        return super().forward(*args, **kwargs)


def stall(ctx, where, timeout_s, stall_rank=0):
    """Rank ``stall_rank`` stops taking part; the others must fail within the ``timeout_s`` the
    mesh was built with (a CP group and rings of their own, so the pool's world stays usable).

    ``where``: ``"first_call"`` (the stalled rank never calls: the others wait in the agreement
    check), ``"ring"`` (after a warm-up call, the stalled rank raises inside attention, catches it
    and stays alive: the others wait in a ring exchange).
    """
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    mesh = MeshGroups.create((2, 2), group=dist.new_group(list(range(4)), timeout=timeout), timeout=timeout)
    sleep_s = timeout_s + 3
    me = dist.get_rank()
    q, k, v = _inputs()
    kernel = FlakyKernel(stall_rank, fail_at=10**9)
    if where == "ring":
        mesh_attention(q, k, v, mesh, kernel=kernel)  # warm-up: every rank agrees and caches
        kernel.fail_at = kernel.calls + 2
    if me == stall_rank:
        if where == "ring":
            _outcome(lambda: mesh_attention(q, k, v, mesh, kernel=kernel))  # raises, caught: stays alive
        time.sleep(sleep_s)
        return None, "stalled", 0.0

    def layers():  # a rank that got all it needed from the stalled one fails in the next layer
        for _ in range(3):
            mesh_attention(q, k, v, mesh, kernel=kernel)

    return _outcome(layers)


def timeouts(ctx, explicit_s=None):
    """(mesh.timeout, row ring timeout, column ring timeout) in seconds, for create(timeout=...)."""
    from datetime import timedelta

    from megatron_mesh_cp.runtime.groups import group_timeout

    kw = {} if explicit_s is None else {"timeout": timedelta(seconds=explicit_s)}
    with MeshGroups.create((2, 2), **kw) as mesh:
        return [t.total_seconds() for t in (mesh.timeout, group_timeout(mesh.row_group), group_timeout(mesh.col_group))]


@megatron_task
def megatron_timeout(ctx, minutes=3):
    """The rings Megatron builds for mesh CP keep --distributed-timeout-minutes."""
    from megatron.core import parallel_state

    from megatron_mesh_cp.runtime.groups import group_timeout
    from megatron_mesh_cp.megatron import cpu_compat
    from megatron_mesh_cp.megatron.attention import _MESHES, mesh_groups_for

    cpu_compat.activate(training=False)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _MESHES.clear()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                             distributed_timeout_minutes=minutes)
    try:
        mesh = mesh_groups_for()
        return [t.total_seconds() for t in (mesh.timeout, group_timeout(mesh.row_group), group_timeout(mesh.col_group))]
    finally:
        parallel_state.destroy_model_parallel()
        _MESHES.clear()


def varlen(ctx, lengths, max_bytes=None):
    """Forward + backward at every local length in ``lengths``; the pool's bytes after each call."""
    from megatron_mesh_cp.runtime.buffers import BufferPool

    mesh = _mesh(ctx)
    mesh.buffers = BufferPool(max_bytes=max_bytes) if max_bytes is not None else BufferPool()
    sizes = []
    for seq in lengths:
        q, k, v = (x.requires_grad_(True) for x in _inputs(seq=seq))
        mesh_attention(q, k, v, mesh).sum().backward()
        sizes.append((mesh.buffers.nbytes(), len(mesh.buffers)))
    return sizes


def nan_check(ctx, nan_rank=1, check_finite=True):
    """A NaN in one query token of one rank, with ``check_finite``."""
    mesh = _mesh(ctx)
    q, k, v = _inputs()
    if dist.get_rank() == nan_rank:
        q[0, 3, 1, 0] = float("nan")
    return _outcome(lambda: mesh_attention(q, k, v, mesh, check_finite=check_finite))


def scales(ctx):
    """Outputs for the same scale given as a float, a numpy float32 and a 0-d tensor: all bitwise equal."""
    mesh = _mesh(ctx)
    q, k, v = _inputs()
    s = np.float32(0.3)
    outs = [mesh_attention(q, k, v, mesh, softmax_scale=x) for x in (float(s), s, torch.tensor(s), np.float64(s))]
    return all(torch.equal(outs[0], o) for o in outs[1:])


def agreement_overhead(ctx, calls=200):
    """Seconds per call of the agreement step: a cache hit (mean of ``calls``) and a first call."""
    from megatron_mesh_cp import attention, call

    mesh = _mesh(ctx)
    q, k, v = _inputs()
    mesh_attention(q, k, v, mesh)
    options = dict(causal=True, softmax_scale=None, kernel="auto", plans=None, partial_dtype=None, planner="greedy",
                   deterministic=False, check_finite=False, sink=None, return_max_logit=False)
    t0 = time.perf_counter()
    for _ in range(calls):
        attention._prepared(mesh, q, k, v, "bshd", (None, None, None, None), options)
    hit = (time.perf_counter() - t0) / calls
    firsts = []
    for seq in (10, 14, 18, 22, 26):  # new signatures: validation, planning and one all_gather
        q, k, v = _inputs(seq=seq)
        dist.barrier()
        t0 = time.perf_counter()
        spec = call.resolve(q, k, v, mesh, layout="bshd", mask=call.call_mask("bshd"), **options)
        prepared = call.prepare(spec)
        t1 = time.perf_counter()
        attention.agree("mesh attention", call.agreement(spec, prepared), mesh.cp_group, attention._comm_device(mesh))
        firsts.append((t1 - t0, time.perf_counter() - t1))
    return {"hit_s": hit, "first_prepare_s": min(f[0] for f in firsts), "first_agree_s": min(f[1] for f in firsts)}


def exit_on(ctx, rank, code=3):
    """Rank ``rank`` ends its process without answering (a crash, an OOM kill); the others answer."""
    if ctx.rank == rank:
        import os

        os._exit(code)
    return ctx.rank
