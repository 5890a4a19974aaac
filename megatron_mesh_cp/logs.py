"""The package's one logging setup: library code logs to ``megatron_mesh_cp``; entry points configure it.

Modules only call ``logging.getLogger("megatron_mesh_cp")``. The entry points (launcher, demo,
benchmarks) call :func:`configure` once: a ``[mesh-cp]`` stdout handler on that logger alone (no
root logger, no warning filters; Megatron configures the root logger itself). The level comes from
``MESH_CP_LOG_LEVEL`` (default INFO); ranks spawned by :mod:`.spawn` get it through
:func:`inherited_env` (rank 0 at that level, the others warnings only).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

__all__ = ["LOGGER", "configure", "configure_rank", "inherited_env"]

LOGGER = "megatron_mesh_cp"
_ENV = "MESH_CP_LOG_LEVEL"


def _level(level: Optional[str]) -> int:
    text = (level or os.environ.get(_ENV) or "INFO").upper()
    value = logging.getLevelName(text)
    if not isinstance(value, int):
        raise ValueError(f"{_ENV}={text!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    return value


def configure(level: Optional[str] = None, prefix: str = "[mesh-cp]") -> logging.Logger:
    """Attach the ``prefix``-formatted stdout handler to the package logger (idempotent)."""
    log = logging.getLogger(LOGGER)
    for h in [h for h in log.handlers if getattr(h, "_mesh_cp", False)]:
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(prefix + " %(message)s"))
    handler._mesh_cp = True
    log.addHandler(handler)
    log.setLevel(_level(level))
    log.propagate = False  # Megatron's root handler would print every record a second time
    return log


def inherited_env() -> dict:
    """What a spawned rank needs to log like this process: the level, if an entry point configured it."""
    log = logging.getLogger(LOGGER)
    if any(getattr(h, "_mesh_cp", False) for h in log.handlers):
        return {_ENV: logging.getLevelName(log.level)}
    return {}


def configure_rank(rank: int) -> None:
    """In a spawned rank: configure only if the parent did (or the user set the level)."""
    if os.environ.get(_ENV):
        level = _level(None)
        configure(logging.getLevelName(level if rank == 0 else max(level, logging.WARNING)), f"[mesh-cp r{rank}]")
