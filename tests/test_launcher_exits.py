"""How a run through the launcher ends, as a requeued or chained job sees it: a planned early exit (Megatron saved
and stopped) exits 0; a failed resume (Megatron's bare ``sys.exit()`` in ``load_checkpoint``) and the scheduler
check on a resume with other schedule flags exit non-zero with Megatron's reason and the fix.

One save run (2 ranks, mesh 1x2, stopped by ``--exit-interval 2``) feeds both failing resumes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import launch, write_config  # noqa: E402

RUN = dict(train_iters=4, context_parallel_size=2, context_parallel_algo="mesh", mesh_shape="1x2", save_interval=100)


def _launch(work: Path, name: str, nproc: int, extra=(), **overrides):
    """The launcher's exit code as torchrun reports it (tests/megatron_runs.py's launch), its output and summary."""
    cfg = write_config(work, name, **overrides)
    summary = work / f"{name}.json"
    rc, stdout, stderr = launch(work, name, nproc, ["--config", str(cfg), "--summary-json", str(summary), *extra])
    return SimpleNamespace(rc=rc, out=stdout + stderr, summary=json.loads(summary.read_text()) if summary.exists() else None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    work = tmp_path_factory.mktemp("exits")
    ckpt = work / "ckpt"
    return work, ckpt, _launch(work, "save", 2, extra=["--exit-interval", "2"], save=str(ckpt), **RUN)


def test_a_planned_early_exit_saves_and_exits_0(saved):
    """Megatron's early exits (--exit-duration-in-mins, the signal handler, --exit-interval) leave through
    sys.exit inside pretrain(); the last rank still writes the summary, saying why it stopped."""
    _, ckpt, res = saved
    assert res.rc == 0, res.out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    s = res.summary
    assert [it for it, _ in s["losses"]] == [1, 2] and s["failed"] is False
    assert s["attention_calls"] > 0 and "summary written to" in res.out
    assert s["exit"] == (f"Megatron exited early (code 0) at iteration 2: --exit-interval 2; checkpoint saved "
                         f"(iteration 2 in {ckpt})")


def test_a_failed_resume_exits_non_zero_with_megatrons_reason(saved):
    """On CPU the CUDA RNG tracker is empty, so loading the RNG state fails: Megatron prints why and calls
    sys.exit() (code None), which used to end the job with 0."""
    work, ckpt, _ = saved
    res = _launch(work, "resume-rng", 2, load=str(ckpt), save=str(work / "ckpt-rng"), **RUN)
    assert res.rc != 0, res.out[-4000:]
    assert "error: Megatron exited with code None from megatron/training/checkpointing.py:" in res.out
    assert "Unable to load rng state from checkpoint" in res.out and "Specify --no-load-rng" in res.out
    assert res.summary["failed"] is True and not res.summary["losses"]


def test_a_resume_with_another_schedule_names_the_scheduler_flags(saved):
    work, ckpt, _ = saved
    run = dict(RUN, context_parallel_size=1, context_parallel_algo=None, mesh_shape=None, train_iters=6)
    res = _launch(work, "resume-iters", 1, load=str(ckpt), no_load_rng=True, **run)
    assert res.rc != 0, res.out[-4000:]
    assert "error: resuming: OptimizerParamScheduler: class input value" in res.out
    assert "--override-opt_param-scheduler" in res.out and "--use-checkpoint-opt_param-scheduler" in res.out


def test_classify_tells_planned_from_failed_and_checks_the_save(tmp_path, monkeypatch):
    from megatron_mesh_cp.megatron import exits

    monkeypatch.setitem(exits._STATE, "planned", {"iteration": 7, "reason": "--exit-duration-in-mins 225 (226.0 min)"})
    monkeypatch.setitem(exits._STATE, "said", {})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    late = exits.classify(SystemExit(0), str(tmp_path))  # Megatron stopped at 7 but the tracker says 5
    assert not late.planned and late.code == 1 and "the latest checkpoint" in late.reason
    assert "is 5, not 7" in late.reason
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    ok = exits.classify(SystemExit(0), str(tmp_path))
    assert ok.planned and ok.code == 0 and "checkpoint saved (iteration 7" in ok.reason
    assert exits.classify(SystemExit(0), None).planned  # no --save: planned, and says nothing was saved
    monkeypatch.setitem(exits._STATE, "planned", None)
    monkeypatch.setitem(exits._STATE, "said", {"megatron.training.checkpointing": ">> '--exit-on-missing-checkpoint' "
                                                                               "set ... exiting. <<"})
    bare = exits.classify(SystemExit(), str(tmp_path))
    assert not bare.planned and bare.code == 1 and "exit-on-missing-checkpoint" in bare.reason
    assert exits.classify(SystemExit(16), str(tmp_path)).code == 16  # the rerun state machine's own code
    assert exits.scheduler_mismatch(AssertionError("something else")) is None
