"""The package as pip builds it: entry points resolve, the cluster presets are package data."""

from __future__ import annotations

import importlib
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
