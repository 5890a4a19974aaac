"""Stock Megatron on CPU and in errors: the dataset-helper build, the CPU route
for a stock-layout ``pretrain_gpt.py`` against a patched copy of Megatron, one ``error:`` line for
bad mesh settings, and help text despite stray ``%`` in Megatron's help strings (the launcher's ``--help``
itself: test_megatron_integration.py)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

from megatron_runs import BASE, _port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STOCK = ROOT / "tests" / "stock_layout" / "pretrain_gpt.py"


def test_compile_helpers_builds_only_when_the_helper_is_missing():
    from megatron_mesh_cp.megatron.cpu_compat import compile_helpers_if_missing

    calls = []

    def build():  # Megatron's compile_helpers: make, and sys.exit(1) when make fails
        calls.append(1)
        sys.exit(1)

    compile_helpers_if_missing(build)()  # the wheel's helper imports: nothing is built
    assert calls == []
    with pytest.raises(RuntimeError, match=r"make -C megatron/core/datasets"):
        compile_helpers_if_missing(build, module="megatron_mesh_cp._no_such_helper")()
    assert calls == [1]
    built = []
    compile_helpers_if_missing(lambda: built.append(1), module="megatron_mesh_cp._no_such_helper")()
    assert built == [1]


def test_stray_percent_in_help_strings_is_escaped():
    from megatron_mesh_cp.megatron.arguments import add_mesh_args

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--a", default=3, help="keeps %(default)s and 100%% but not (50%) or 5% alone")
    with pytest.raises((ValueError, TypeError)):
        p.format_help()
    text = add_mesh_args(p).format_help()
    assert "keeps 3 and 100% but not (50%) or 5% alone" in " ".join(text.split())


def _patched_megatron(tmp: Path) -> Path:
    """A copy of the installed Megatron with patches/ applied (what a patched checkout holds). The bytecode
    comes along (copytree keeps the sources' times, so only the patched files compile again on every rank)."""
    import megatron

    src = Path(megatron.__path__[0])
    dst = tmp / "mlm"
    shutil.copytree(src, dst / "megatron")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patches.sh"), str(dst)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return dst


def _env(tmp: Path, mlm: Path, **extra) -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mlm), str(ROOT)]), PYTHONWARNINGS="ignore",
             OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    e.update(extra)
    return e


def _argv(data_prefix: str, **overrides) -> list:
    from megatron_mesh_cp.megatron.data import VOCAB_SIZE
    from megatron_mesh_cp.megatron.pretrain import config_to_argv

    cfg = dict(BASE, train_iters=3, lr_warmup_iters=1, **overrides)
    path = Path(data_prefix).parent / "stock.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return config_to_argv(str(path)) + ["--data-path", data_prefix, "--tokenizer-type", "NullTokenizer",
                                        "--vocab-size", str(VOCAB_SIZE), "--split", "98,2,0",
                                        "--data-cache-path", str(Path(data_prefix).parent / "idx")]


def test_stock_layout_pretrain_gpt_runs_on_cpu_through_the_wrapper(tmp_path):
    from megatron_mesh_cp.megatron.data import ensure_stdlib_corpus

    mlm = _patched_megatron(tmp_path)
    data = ensure_stdlib_corpus(str(tmp_path / "data" / "stdlib_text_document"))
    argv = _argv(data, context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(_port()),
           "-m", "megatron_mesh_cp.megatron.stock_cpu", str(STOCK), *argv]
    res = subprocess.run(cmd, env=_env(tmp_path, mlm), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out = res.stdout + res.stderr
    assert "iteration        3/       3" in out and "lm loss" in out, out[-3000:]

    # a bad mesh setting through the stock script: one error: line, exit code 2, no traceback
    bad = _argv(data, context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="3x3")
    res = subprocess.run([sys.executable, "-m", "megatron_mesh_cp.megatron.stock_cpu", str(STOCK), *bad],
                         env=_env(tmp_path, mlm, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1 and "--mesh-shape" in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr

