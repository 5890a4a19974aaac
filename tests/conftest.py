"""Shared fixtures: one pool of gloo ranks per world size, reused across the tests that need it.

Every process the tests start (pooled ranks, torchrun workers, scripts) computes on one thread per rank
(``OMP_NUM_THREADS=1`` unless set; the pool also pins torch's own counts), so n ranks on 2 cores do not
oversubscribe them. The session ends with each pool's worker threads and memory, first seen -> last seen.
"""

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

from megatron_mesh_cp.spawn import RankPool  # noqa: E402  (imports torch: this process keeps its own threads)

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every subprocess and spawned rank
# the suite is the CPU proof (gloo ranks; GPU checks are scripts/gpu_check.sh): hide any GPU, since ranks forked from
# a fork server that imported megatron.core cannot initialise CUDA, and the CPU shims refuse where CUDA is visible
os.environ["CUDA_VISIBLE_DEVICES"] = ""

#: imported once by the fork server the pools' ranks are forked from (each rank would pay seconds of CPU per
#: module tree: on 2 cores a 16-rank pool took ~20 s to start, and ~30 s more at its first Megatron task)
PRELOAD = ("torch", "torch.distributed", "megatron_mesh_cp", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.dist_checkpointing",
           "megatron.core.transformer.transformer_config")

#: per pool: [ranks, first status seen, last status seen, highest thread count], for the session's closing lines
_POOL_STATS = []


def _worker_status(pool: RankPool) -> dict:
    """Threads and resident memory (MiB) of the pool's busiest worker, read from /proc (Linux)."""
    threads, rss = 0, 0
    for p in pool._procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        threads = max(threads, int(fields["Threads"]))
        rss = max(rss, int(fields["VmRSS"].split()[0]) // 1024)
    return {"threads": threads, "rss_mib": rss}


class _Pools:
    """Keeps at most one pool alive (16 ranks of torch are a lot of memory on a 24 GiB box)."""

    def __init__(self) -> None:
        self._pool = None

    def get(self, n: int) -> RankPool:
        if self._pool is not None and self._pool.n == n and self._pool._procs:
            self._record()
            return self._pool
        self.close()
        self._pool = RankPool(n, timeout_s=180, preload=PRELOAD)
        _POOL_STATS.append([n, None, None, 0])
        return self._pool

    def _record(self) -> None:
        """After the pool's first task and at each later test: its workers' threads and memory."""
        stats, status = _POOL_STATS[-1], _worker_status(self._pool)
        if status["threads"]:
            stats[1] = stats[1] or status
            stats[2] = status
            stats[3] = max(stats[3], status["threads"])

    def close(self) -> None:
        if self._pool is not None:
            if self._pool._procs:
                self._record()
            self._pool.close()
            self._pool = None


@pytest.fixture(scope="session")
def pools():
    p = _Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(hf dir, Megatron checkpoint dir) of tests/hf_llama.py's model, converted once for the session."""
    from hf_llama import convert

    return convert(tmp_path_factory.mktemp("tiny_llama"))


def pytest_terminal_summary(terminalreporter):
    for n, first, last, top in _POOL_STATS:
        if first is not None:
            terminalreporter.write_line(
                f"rank pool of {n}: worker threads {first['threads']} -> {last['threads']} (max {top}), "
                f"resident {first['rss_mib']} -> {last['rss_mib']} MiB per worker (first seen -> last seen)")
