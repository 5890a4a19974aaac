"""patches/: they apply to the copy of Megatron inside the installed megatron-core wheel (which is
core_v0.19.x), the apply script refuses a mismatch without touching anything, and the patched
parser accepts --context-parallel-algo / --mesh-shape and routes them through megatron_mesh_cp."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_megatron_patches.sh"
FILES = ("megatron/training/arguments.py", "megatron/training/models/gpt.py", "megatron/core/package_info.py")


def _wheel_copy(dst: Path) -> Path:
    import megatron.core

    site = Path(megatron.core.__file__).resolve().parent.parent.parent
    for f in FILES:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / f, dst / f)
    return dst


def _run(dir_: Path):
    return subprocess.run(["bash", str(SCRIPT), str(dir_)], capture_output=True, text=True, timeout=60)


def test_patches_apply_to_the_wheel_and_are_idempotent(tmp_path):
    tree = _wheel_copy(tmp_path / "mlm")
    first = _run(tree)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied: ") == 2
    text = (tree / FILES[0]).read_text()
    assert "--context-parallel-algo" in text and "apply_mesh_args_or_exit(args)" in text
    assert "with_mesh_attention(transformer_layer_spec)" in (tree / FILES[1]).read_text()
    again = _run(tree)
    assert again.returncode == 0 and again.stdout.count("already applied") == 2


def test_mismatch_fails_clearly_and_touches_nothing(tmp_path):
    tree = _wheel_copy(tmp_path / "mlm")
    gpt = tree / FILES[1]
    text = gpt.read_text()
    line = "core_attention = MCoreDotProductAttention"
    assert text.count(line) == 1
    gpt.write_text(text.replace(line, "core_attention = SomethingElse"))  # a context line of 0002
    before = (tree / FILES[0]).read_text()
    res = _run(tree)
    assert res.returncode == 1
    assert "0002-gpt-builder-mesh-core-attention.patch does not apply" in res.stderr and "core_v0.19.x" in res.stderr
    assert (tree / FILES[0]).read_text() == before  # 0001 was not applied either
    assert _run(tmp_path / "nowhere").returncode == 2


def test_patched_parser_accepts_the_flags(tmp_path, monkeypatch, capsys):
    tree = _wheel_copy(tmp_path / "mlm")
    assert _run(tree).returncode == 0
    spec = importlib.util.spec_from_file_location("patched_megatron_arguments", tree / FILES[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--context-parallel-size", "4",
                                      "--context-parallel-algo", "mesh", "--mesh-shape", "2x2"])
    args = mod.parse_args()
    assert args.context_parallel_algo == "mesh" and args.mesh_shape == "2x2"
    # parse_and_validate_args runs megatron_mesh_cp's mapping before Megatron's validation; a bad
    # setting is one error: line and exit code 2 (no traceback)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--context-parallel-size", "1", "--context-parallel-algo", "mesh"])
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        mod.parse_and_validate_args()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "needs --context-parallel-size > 1" in err[0]
