"""Run functions on n local gloo ranks: a reusable process pool for tests, demos and CPU benchmarks.

``RankPool(n)`` starts n processes once (each joins one gloo world); ``pool.run("pkg.mod:func",
*args)`` calls ``func(ctx, *args)`` on every rank and returns the per-rank results, re-raising a
failure with every rank's error. ``ctx`` carries ``rank``, ``world_size`` and a per-process
``cache`` (for example process groups built once and reused across calls). Each rank computes on
``OMP_NUM_THREADS`` threads (default 1: n ranks on a few cores must not oversubscribe them).
``RankPool(n, preload=[...])`` forks the ranks from a server that imported those modules once
(multiprocessing's forkserver) instead of spawning fresh interpreters: for a process that starts many
pools (a test suite), each rank then skips seconds of importing torch (and Megatron). Both start methods
re-import the caller's main module in the server or ranks: a script that starts a pool guards it with
``if __name__ == "__main__":``. A rank that dies (crashed, killed, failed to start) fails ``run`` at once;
one that stalls fails it after ``timeout_s`` + 30 s. The ranks are for CPU work: a preloaded module that
asks torch about CUDA (``import megatron.core`` does) leaves every forked rank unable to use CUDA
("Cannot re-initialize CUDA in forked subprocess"); pools whose tasks use a GPU preload nothing (spawn). A preloaded module read its environment when the
server imported it: variables set later (by the caller or per rank) do not reach what it read then
(the ranks' OpenMP thread count alone is set again in each rank).
"""

from __future__ import annotations

import gc
import importlib
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Sequence

import torch.multiprocessing as mp

from .logs import inherited_env

__all__ = ["RankPool", "RankContext", "RankError", "free_port"]


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (exception type name, message)."""

    def __init__(self, errors: Dict[int, tuple]) -> None:
        self.errors = errors
        lines = [f"rank {r}: {t}: {m}" for r, (t, m, _) in sorted(errors.items())]
        first = next(iter(sorted(errors.items())))[1][2]
        super().__init__("\n".join(lines) + "\n--- first traceback ---\n" + first)


@dataclass
class RankContext:
    rank: int
    world_size: int
    cache: Dict[Any, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker(rank: int, world: int, port: int, tasks, results, timeout_s: float, env: dict) -> None:
    os.environ.update(env)
    from .logs import configure_rank

    configure_rank(rank)
    import torch
    import torch.distributed as dist

    value = os.environ.get("OMP_NUM_THREADS", "1")
    threads = int(value) if value.isdigit() and int(value) > 0 else 1  # torch came in before env did: pin here
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    ctx = RankContext(rank, world)
    while True:
        item = tasks.get()
        if item is None:
            break
        path, args, kwargs = item
        try:
            results.put((rank, True, _resolve(path)(ctx, *args, **kwargs)))
        except BaseException as exc:  # report everything, the parent decides
            results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.destroy_process_group()
    gc.freeze()  # exiting: the interpreter need not collect torch's objects (seconds per rank)


class RankPool:
    """n persistent gloo ranks on this machine."""

    def __init__(self, n: int, *, timeout_s: float = 120.0, env: Dict[str, str] = None,
                 preload: Sequence[str] = ()) -> None:
        """``preload``: modules the fork server imports before the first pool forks from it (one server per
        process: the first preload list given is the one it keeps; modules that fail to import are skipped)."""
        self.n = n
        self.timeout_s = timeout_s
        if preload:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
        else:
            ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._results = ctx.Queue()
        port = free_port()
        env = dict(env or {})
        env.setdefault("OMP_NUM_THREADS", "1")
        for key, value in inherited_env().items():
            env.setdefault(key, value)
        self._procs = [
            ctx.Process(target=_worker, args=(r, n, port, self._tasks[r], self._results, timeout_s, env), daemon=True)
            for r in range(n)
        ]
        for p in self._procs:
            p.start()

    def run(self, path: str, *args, **kwargs) -> List[Any]:
        """Call ``path`` (``"module:function"``) as ``f(ctx, *args, **kwargs)`` on every rank."""
        for q in self._tasks:
            q.put((path, args, kwargs))
        out: Dict[int, Any] = {}
        errors: Dict[int, tuple] = {}
        limit = self.timeout_s + 30
        deadline = time.monotonic() + limit
        while len(out) + len(errors) < self.n:
            try:  # short waits: a rank that died (killed, crashed, failed to start) fails the call at once
                rank, ok, value = self._results.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                lost = {r: p.exitcode for r, p in enumerate(self._procs)
                        if not p.is_alive() and r not in out and r not in errors}
                if not lost and time.monotonic() < deadline:
                    continue
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close(force=True)
                detail = "".join(f"\nrank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(errors.items()))
                what = (f"ranks {sorted(lost)} died before answering (exit codes {[lost[r] for r in sorted(lost)]})"
                        if lost else f"ranks did not answer within {limit:.0f}s")
                raise RuntimeError(
                    f"{what} (dead: {dead}; answered: {sorted(out)}, failed: {sorted(errors)}){detail}"
                ) from None
            (out if ok else errors)[rank] = value
        if errors:
            raise RankError(errors)
        return [out[r] for r in range(self.n)]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 20)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
