"""One logging setup (megatron_mesh_cp.logs), configured by entry points only; no warning filters."""

from __future__ import annotations

import io
import logging
import runpy
import warnings
from pathlib import Path

import pytest

from megatron_mesh_cp import logs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_logger(monkeypatch):
    monkeypatch.setenv("MESH_CP_LOG_LEVEL", "")  # recorded, so teardown restores the original state
    monkeypatch.delenv("MESH_CP_LOG_LEVEL")
    log = logging.getLogger(logs.LOGGER)
    saved = (list(log.handlers), log.level, log.propagate)
    yield log
    log.handlers[:] = saved[0]
    log.setLevel(saved[1])
    log.propagate = saved[2]


def test_configure_is_idempotent_prefixed_and_exported(clean_logger, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr("sys.stdout", buf)
    logs.configure()
    logs.configure()
    ours = [h for h in clean_logger.handlers if getattr(h, "_mesh_cp", False)]
    assert len(ours) == 1 and not clean_logger.propagate
    logging.getLogger("megatron_mesh_cp.runtime.kernels").info("chosen")
    logging.getLogger("megatron_mesh_cp").debug("hidden at INFO")
    assert buf.getvalue() == "[mesh-cp] chosen\n"
    import os

    assert "MESH_CP_LOG_LEVEL" not in os.environ  # nothing leaks into unrelated subprocesses
    assert logs.inherited_env() == {"MESH_CP_LOG_LEVEL": "INFO"}  # what RankPool hands its ranks
    os.environ.update(logs.inherited_env())  # as in a spawned rank (monkeypatch restores it)
    logs.configure_rank(3)
    assert clean_logger.level == logging.WARNING and clean_logger.handlers[-1].formatter._fmt.startswith("[mesh-cp r3]")


def test_bad_level_names_the_variable(clean_logger, monkeypatch):
    monkeypatch.setenv("MESH_CP_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="MESH_CP_LOG_LEVEL='LOUD' is not a logging level"):
        logs.configure()


def test_launcher_script_installs_no_warning_filters():
    import megatron_mesh_cp.megatron.pretrain  # noqa: F401  (what its imports register is theirs)

    before = list(warnings.filters)
    runpy.run_path(str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), run_name="not_main")
    assert warnings.filters == before
