"""Shared fixtures: one pool of gloo ranks per world size, reused across the tests that need it."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_tasks must import in spawned workers too
# mesh_shape=auto's disk cache (planning/shape_cache.py): one fresh directory per test session, inherited by the
# launcher subprocesses, so no test reads an entry an earlier session left and nothing is written to ~/.cache
os.environ["MESH_CP_CACHE_DIR"] = tempfile.mkdtemp(prefix="mesh-cp-shapes-")
atexit.register(shutil.rmtree, os.environ["MESH_CP_CACHE_DIR"], True)

from megatron_mesh_cp.spawn import RankPool  # noqa: E402


class _Pools:
    """Keeps at most one pool alive (16 ranks of torch are a lot of memory on a 24 GiB box)."""

    def __init__(self) -> None:
        self._pool = None

    def get(self, n: int) -> RankPool:
        if self._pool is not None and self._pool.n == n and self._pool._procs:
            return self._pool
        self.close()
        self._pool = RankPool(n, timeout_s=180)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


@pytest.fixture(scope="session")
def pools():
    p = _Pools()
    yield p
    p.close()
