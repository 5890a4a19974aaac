"""A fork server for the launcher test runs: torch and Megatron imported once, each rank forked from it.

Importing torch and Megatron costs every rank about 8-10 s of CPU (tests/megatron_runs.py); a 4-rank run on two cores
paid ~20 s of wall time before its first iteration. This process imports them once, then for each request forks
the ranks of one run, each with the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, ...,
MASTER_ADDR/PORT), the run's own environment and working directory, Megatron's checkpoint write-results
queue already started (``_write_results_queue``), its stdout/stderr appended to the run's two
log files, and runs ``scripts/pretrain_gpt_mesh.py`` as ``__main__``, as torchrun would. Like torchrun, when one
rank fails the others are stopped, and a run past its timeout is killed. The server stays single-threaded (so
forking it is safe): it imports no process group, and checks its thread count before every fork.

Protocol (one JSON object per line): request ``{"argv", "env", "cwd", "nproc", "port", "stdout", "stderr",
"timeout"}`` on stdin, reply ``{"codes": [...], "timed_out": bool}`` on stdout. Optional: ``"script"`` (run it
instead of the launcher) and ``"torchrun": false`` (a plain ``python script argv`` process: the request's
environment only, no torchrun variables), for the launcher's single-process runs (dry runs, argument checks).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PRELOAD = ("megatron_mesh_cp.megatron.pretrain", "megatron.training", "megatron.training.training",
           "megatron.training.checkpointing", "megatron.core.models.gpt", "megatron.core.datasets.gpt_dataset",
           "megatron.core.datasets.blended_megatron_dataset_builder", "megatron_mesh_cp.megatron.specs",
           "megatron_mesh_cp.megatron.cp_layer", "megatron_mesh_cp.megatron.data",
           "megatron.core.dist_checkpointing.strategies.filesystem_async")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a module this megatron-core lacks: the run imports what it needs itself
            pass


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _write_results_queue() -> None:
    """Start Megatron's checkpoint write-results queue now, forked while the rank is single-threaded. Left to the
    first save, it is a ``multiprocessing.Manager`` started by spawn: a fresh interpreter that re-imports the
    launcher, ~8-10 s of CPU per rank on 2 cores (as under torchrun). The checkpoints written are the same."""
    import inspect

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    get = getattr(filesystem_async, "get_write_results_queue", None)
    if get is not None and "mp_mode" in inspect.signature(get).parameters:
        get(mp_mode="fork")


def _rank(req: dict, rank: int, launcher: str) -> None:
    """In the forked child: become rank ``rank`` of the run and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: stopping the run also stops what the rank started
        out = os.open(req["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        n = req["nproc"]
        if req.get("torchrun", True):
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                              GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(req["port"]), TORCHELASTIC_RUN_ID="zygote")
        os.chdir(req["cwd"])
        _write_results_queue()
        script = req.get("script") or launcher
        sys.argv = [script] + list(req["argv"])
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _stop(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(req: dict, launcher: str) -> dict:
    if _threads() != 1:
        raise RuntimeError(f"the fork server has {_threads()} threads; forking it is not safe")
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(req, rank, launcher)
        pids.append(pid)
    codes, deadline, timed_out = {}, time.monotonic() + req["timeout"], False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                _stop([p for p in pids if p not in codes])
                deadline = float("inf")
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun: one failed rank ends the run
            _stop([p for p in pids if p not in codes])
    _stop(pids)  # whatever the ranks started (a sub-launch) goes with them
    return {"codes": [codes[p] for p in pids], "timed_out": timed_out}


def main() -> None:
    launcher = sys.argv[1]
    _preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(_run(json.loads(line), launcher)), flush=True)


if __name__ == "__main__":
    main()
