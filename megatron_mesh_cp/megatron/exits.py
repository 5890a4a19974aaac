"""How a Megatron run ended: a planned early exit (saved and stopped) told apart from every other exit.

Megatron-core 0.19.2 leaves ``pretrain`` through ``sys.exit`` in two very different cases
(megatron/training/training.py, checkpointing.py at core_v0.19.2):

* planned: ``checkpoint_and_decide_exit`` returns True after ``--exit-signal-handler`` caught its
  signal, ``--exit-duration-in-mins`` elapsed or ``--exit-interval`` was reached (each saves first
  when ``--save`` is set), and ``train`` ends in ``sys.exit(exit_code)``, code 0;
* everything else: ``load_checkpoint`` giving up (``Unable to load rng state``, a missing checkpoint
  under ``--exit-on-missing-checkpoint``, an unreadable tracker file or iteration) ends in a bare
  ``sys.exit()``, code None, which the shell reads as 0 -- so a requeued or chained job went on as if
  it had saved; the rerun state machine exits with 16 or 17.

:func:`install` wraps ``checkpoint_and_decide_exit`` to record a planned exit (its reason and
iteration) and records the last message Megatron printed from those modules, so :func:`classify`
can say which case a ``SystemExit`` is: planned (code 0, and the checkpoint it saved is the latest
one in ``--save``), or a failure with Megatron's own reason and a non-zero code.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Dict, Optional

__all__ = ["install", "classify", "Exit", "scheduler_mismatch"]

#: the code a failure exits with when Megatron gave none (or 0)
FAILED = 1
_STATE: Dict[str, object] = {"planned": None, "said": {}}


@dataclass
class Exit:
    planned: bool
    code: int
    reason: str


def _pinned(module, name: str):
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} is gone; this launcher supports megatron-core 0.19.x and 0.20")
    return getattr(module, name)


def install() -> None:
    """Record planned exits and the last line Megatron's training and checkpointing modules printed."""
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training

    _STATE["planned"], _STATE["said"] = None, {}
    for module in (checkpointing, training):
        orig = _pinned(module, "print_rank_0")
        if getattr(orig, "_mesh_cp_recording", False):
            continue

        def print_rank_0(message, *a, _orig=orig, _name=module.__name__, **k):
            _STATE["said"][_name] = str(message).strip()  # every rank: rank 0 alone prints it
            return _orig(message, *a, **k)

        print_rank_0._mesh_cp_recording = True
        module.print_rank_0 = print_rank_0
    decide = _pinned(training, "checkpoint_and_decide_exit")
    if getattr(decide, "_mesh_cp_recording", False):
        return

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, *a, **k):
        stop = decide(model, optimizer, opt_param_scheduler, iteration, *a, **k)
        if stop:
            _STATE["planned"] = {"iteration": int(iteration), "reason": _planned_reason(training, iteration)}
        return stop

    checkpoint_and_decide_exit._mesh_cp_recording = True
    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit


def _planned_reason(training, iteration: int) -> str:
    """Which of checkpoint_and_decide_exit's three tests stopped the run (checked in its order)."""
    from megatron.training import get_args

    args = get_args()
    if args.exit_signal_handler:
        from megatron.training.global_vars import get_signal_handler

        if any(get_signal_handler().signals_received()):
            return f"signal {args.exit_signal} (--exit-signal-handler)"
    if args.exit_duration_in_mins:
        minutes = (time.time() - getattr(training, "_TRAIN_START_TIME", time.time())) / 60.0
        if minutes > args.exit_duration_in_mins:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins} ({minutes:.1f} min)"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    return "--phase-transition-iterations"


def _latest(save: str) -> Optional[str]:
    try:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except OSError:
        return None


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    inside = (f"{os.sep}megatron{os.sep}training{os.sep}", f"{os.sep}megatron{os.sep}core{os.sep}")
    megatron = [f for f in frames if any(part in f.filename for part in inside)]
    f = (megatron or frames or [None])[-1]
    if f is None:
        return "an unknown place"
    parts = f.filename.split(os.sep)
    short = os.sep.join(parts[parts.index("megatron"):]) if "megatron" in parts else os.path.basename(f.filename)
    return f"{short}:{f.lineno} ({f.name})"


def classify(exc: SystemExit, save: Optional[str]) -> Exit:
    """A ``SystemExit`` out of Megatron's ``pretrain``: planned (code 0) or a failure (non-zero code)."""
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else FAILED)
    planned = _STATE["planned"]
    if planned is not None and code == 0:
        it, why = planned["iteration"], planned["reason"]
        if not save:
            return Exit(True, 0, f"Megatron exited early (code 0) at iteration {it}: {why}; no --save, so no "
                        "checkpoint was written")
        latest = _latest(save)
        if latest == str(it):
            return Exit(True, 0, f"Megatron exited early (code 0) at iteration {it}: {why}; checkpoint saved "
                        f"(iteration {it} in {save})")
        return Exit(False, FAILED, f"Megatron stopped at iteration {it} ({why}) but the latest checkpoint in {save} "
                    f"is {latest or 'none'}, not {it}: the save did not complete")
    said = _STATE["said"]
    message = said.get("megatron.training.checkpointing") or said.get("megatron.training.training") or ""
    text = f"Megatron exited with code {exc.code!r} from {_where(exc)} before finishing training"
    if message:
        text += f"; its last message: {message}"
    return Exit(False, code if code else FAILED, text)


def scheduler_mismatch(exc: AssertionError) -> Optional[str]:
    """Megatron's optimizer-scheduler check on resume (``OptimizerParamScheduler._check_and_set``, an
    assert), in words that name the fix; None for any other assertion."""
    text = str(exc)
    if not text.startswith("OptimizerParamScheduler: class input value"):
        return None
    return (f"resuming: {text} (the learning-rate schedule in the checkpoint differs from this run's flags, e.g. "
            "after changing --train-iters, --lr-decay-iters, --lr-warmup-iters, --lr or --min-lr). Keep the flags "
            "the checkpoint was trained with; or pass --override-opt_param-scheduler to take this run's schedule "
            "(the LR jumps to it at the resumed iteration), or --use-checkpoint-opt_param-scheduler to keep the "
            "checkpoint's")
