"""The package as pip builds it (entry points, presets as package data, setup.py) and the main-job script
a user starts with."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_entry_points_resolve_to_callables():
    scripts = _project()["project"]["scripts"]
    assert {"mesh-cp-pretrain", "mesh-cp-simulate", "mesh-cp-demo"} <= set(scripts)
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_presets_are_package_data_found_without_the_checkout():
    from megatron_mesh_cp.planning.cluster import cluster_presets

    cfg = _project()
    patterns = cfg["tool"]["setuptools"]["package-data"]["megatron_mesh_cp"]
    pkg = ROOT / "megatron_mesh_cp"
    shipped = {p for pattern in patterns for p in pkg.glob(pattern)}
    on_disk = {p for p in (pkg / "configs").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk and shipped == on_disk  # every preset file is in the wheel
    assert {"h100-ib400", "a100-ib200"} <= set(cluster_presets())
    extras = cfg["project"]["optional-dependencies"]
    assert {"megatron", "te", "flash", "plot", "test"} <= set(extras) and any("transformers" in d for d in extras["megatron"])


def test_setup_py_defers_to_pyproject(tmp_path):
    """setup.py (kept for `python setup.py develop` and tools that look for it) reports pyproject's name
    and version, and passes setup() nothing of its own, so the two cannot drift."""
    import ast
    import subprocess

    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
    assert len(calls) == 1 and not calls[0].args and not calls[0].keywords
    project = _project()["project"]
    for cwd in (ROOT, tmp_path):  # also called by its path from outside the checkout
        out = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--name", "--version"], cwd=cwd, check=True,
                             capture_output=True, text=True, timeout=60).stdout.split()
        assert out == [project["name"], project["version"]], cwd


def test_main_job_script_keeps_the_callers_directory(tmp_path):
    """scripts/run_main_job.sh called by its path from elsewhere: the launcher runs in the caller's
    directory (so --plot-loss loss.png / --summary-json s.json land there, not in the checkout), on the
    checkout's launcher and config by absolute path, after a one-process check of the same arguments whose
    refusal stops it before torchrun. torchrun, python and env.sh are recording stand-ins."""
    import shutil
    import subprocess

    fake = tmp_path / "checkout"
    (fake / "scripts").mkdir(parents=True)
    (fake / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run_main_job.sh", fake / "scripts" / "run_main_job.sh")
    (fake / "scripts" / "env.sh").write_text("exit 0\n")
    torchrun = fake / ".venv" / "bin" / "torchrun"
    torchrun.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$PWD" "$@" > "$RECORD"\n')
    torchrun.chmod(0o755)
    python = fake / ".venv" / "bin" / "python"  # the one-process check before torchrun (the launcher's --dry-run)
    python.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$PWD" "$@" > "$RECORD.check"\nexit "${CHECK_RC:-0}"\n')
    python.chmod(0o755)
    caller = tmp_path / "elsewhere"
    caller.mkdir()
    record = tmp_path / "record.txt"
    subprocess.run(["bash", str(fake / "scripts" / "run_main_job.sh"), "--plot-loss", "loss.png"], cwd=caller,
                   env=dict(os.environ, RECORD=str(record)), check=True, timeout=60)
    cwd, *argv = record.read_text().splitlines()
    assert Path(cwd).resolve() == caller.resolve()
    assert str(fake / "scripts" / "pretrain_gpt_mesh.py") in argv
    assert str(fake / "configs" / "gpt_tiny_cpu.yaml") in argv
    assert argv[-2:] == ["--plot-loss", "loss.png"]
    cwd, *check = (tmp_path / "record.txt.check").read_text().splitlines()
    assert Path(cwd).resolve() == caller.resolve()
    assert check[-3:] == ["--plot-loss", "loss.png", "--dry-run"] and str(fake / "configs" / "gpt_tiny_cpu.yaml") in check
    # a refusal (the check's exit 2) ends the script with that code before torchrun starts
    record.unlink()
    res = subprocess.run(["bash", str(fake / "scripts" / "run_main_job.sh"), "--bad"], cwd=caller,
                         env=dict(os.environ, RECORD=str(record), CHECK_RC="2"), timeout=60)
    assert res.returncode == 2 and not record.exists()
