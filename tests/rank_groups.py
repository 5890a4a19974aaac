"""Process-group hygiene for rank tasks: the groups a task builds for itself are released when it returns.

A pooled rank lives for the whole suite and every gloo group it keeps holds three threads, so a task
that builds throwaway groups (Megatron's model-parallel groups, deliberately wrong rings) releases
them; meshes a task keeps for reuse live in ``ctx.cache``, one per shape, built outside these.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["released_groups", "megatron_task", "proc_status"]


def _registered():
    return dist.distributed_c10d._world.pg_map


def _release_since(before) -> None:
    for pg in [g for g in list(_registered()) if g not in before]:
        dist.destroy_process_group(pg)
    gc.collect()  # a group's threads end when its last reference goes (models hold some in cycles)


@contextmanager
def released_groups():
    """Every process group created inside the block is destroyed when it ends (also on an error)."""
    before = set(_registered())
    try:
        yield
    finally:
        _release_since(before)


def megatron_task(fn):
    """Decorator for rank tasks that initialise Megatron's model parallelism: on return (or error) the
    model-parallel state is torn down, the cached meshes and rotary embeddings dropped and every group the
    task made released (``destroy_model_parallel`` forgets most groups without destroying them)."""

    @functools.wraps(fn)
    def task(ctx, *args, **kwargs):
        from megatron.core import parallel_state

        from megatron_mesh_cp.megatron.attention import _MESHES

        before = set(_registered())
        try:
            return fn(ctx, *args, **kwargs)
        finally:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            _forget_groups(parallel_state)
            _MESHES.clear()
            _clear_rope_caches()
            _release_since(before)

    return task


def _forget_groups(module) -> None:
    """Globals ``destroy_model_parallel`` leaves set (0.19.2: the hierarchical CP groups, the intra-partial DP
    groups) would keep their groups alive and hand destroyed ones to the next task: set to None."""
    for name, value in list(vars(module).items()):
        items = value if isinstance(value, (list, tuple)) else [value]
        if name.startswith("_") and any(isinstance(x, dist.ProcessGroup) for x in items):
            setattr(module, name, None)


def _clear_rope_caches() -> None:
    """Megatron's rotary embeddings memoise ``forward`` with ``functools.lru_cache`` (megatron/core/models/common/
    embeddings/rotary_pos_embedding.py, 0.19.2): the cache keeps the last 32 modules alive, each with its CP group."""
    import importlib

    for name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        try:
            module = importlib.import_module(f"megatron.core.models.common.embeddings.{name}")
        except ImportError:
            continue
        for obj in vars(module).values():
            clear = getattr(getattr(obj, "forward", None), "cache_clear", None) if isinstance(obj, type) else None
            if clear is not None:
                clear()


def proc_status(ctx) -> dict:
    """This rank's thread count, resident memory (kB) and live process groups (not counting the world)."""
    out = {"groups": len(_registered()) - 1}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(value.split()[0])
    return out
