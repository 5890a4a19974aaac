"""Helpers for tests that run the GPT launcher (Megatron's real training loop) on local gloo ranks.

Each launch costs far more than its iterations (a tiny model: importing torch and Megatron on every rank
dominates), so a test module launches each configuration once and every assertion reads that run.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "scripts" / "pretrain_gpt_mesh.py"

#: a tiny GPT with RoPE, GQA (4 heads, 2 groups), causal mask, no dropout, fp32; Megatron's fused bias-GeLU and
#: bias-dropout-add are off, as in configs/gpt_tiny_cpu.yaml (on CPU each run would torch.compile them)
BASE = {
    "distributed_backend": "gloo", "transformer_impl": "local", "num_layers": 2, "hidden_size": 64,
    "ffn_hidden_size": 128, "num_attention_heads": 4, "group_query_attention": True, "num_query_groups": 2,
    "position_embedding_type": "rope", "no_rope_fusion": True, "seq_length": 128, "max_position_embeddings": 128,
    "micro_batch_size": 2, "global_batch_size": 2, "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "lr": 3.0e-3, "min_lr": 3.0e-4, "lr_decay_style": "cosine", "lr_warmup_iters": 2, "train_iters": 10,
    "weight_decay": 0.01, "clip_grad": 0.0, "seed": 1234, "log_interval": 1, "eval_iters": 0, "eval_interval": 1000,
    "no_gradient_accumulation_fusion": True, "no_masked_softmax_fusion": True, "no_persist_layer_norm": True,
    "rerun_mode": "disabled", "no_bias_gelu_fusion": True, "no_bias_dropout_fusion": True,
}
#: optional packages Megatron imports whenever they are installed (megatron/training/training.py: modelopt;
#: megatron/core/tokenizers/text/libraries: transformers) that no run here uses: the runs see an install of
#: megatron-core without them (each costs every rank seconds of CPU at start-up); ``env(full=True)`` keeps them
HIDDEN = ("modelopt", "transformers")
_HIDDEN_DIR = None


def _hidden_dir() -> str:
    """A directory whose packages stand for HIDDEN and raise ModuleNotFoundError, as absent packages do."""
    global _HIDDEN_DIR
    if _HIDDEN_DIR is None:
        root = Path(tempfile.mkdtemp(prefix="mesh-cp-minimal-"))
        for name in HIDDEN:
            (root / name).mkdir()
            (root / name / "__init__.py").write_text(
                f"raise ModuleNotFoundError('{name} is hidden from the launcher test runs (tests/megatron_runs.py)', "
                f"name='{name}')\n")
        _HIDDEN_DIR = str(root)
        atexit.register(shutil.rmtree, _HIDDEN_DIR, True)
    return _HIDDEN_DIR


def env(tmp: Path, full: bool = False) -> Dict[str, str]:
    """The launcher's environment: one thread per rank, the corpus under ``tmp``, HIDDEN hidden unless ``full``."""
    e = dict(os.environ)
    paths = ([] if full else [_hidden_dir()]) + [str(ROOT / "tests"), e.get("PYTHONPATH", "")]
    e.update(CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
             MESH_CP_DATA_DIR=str(tmp / "data"), PYTHONPATH=os.pathsep.join(paths).rstrip(os.pathsep))
    return e


def write_config(tmp: Path, name: str, **overrides) -> Path:
    cfg = dict(BASE, **overrides)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(tmp: Path, name: str, nproc: int, extra: Sequence[str] = (), timeout: int = 600, **overrides) -> Dict:
    """Run the launcher on ``nproc`` local ranks (forked from tests/zygote.py, as torchrun would start them;
    ``MESH_CP_TEST_TORCHRUN=1``: under torchrun itself); return its summary JSON (and the grads file path)."""
    cfg = write_config(tmp, name, **overrides)
    summary = tmp / f"{name}.json"
    grads = tmp / f"{name}.grads.pt"
    argv = ["--config", str(cfg), "--summary-json", str(summary), "--dump-grads", str(grads), *extra]
    code, stdout, stderr = launch(tmp, name, nproc, argv, timeout)
    if code != 0 or not summary.exists():  # Megatron exits 0 on some failures (sys.exit())
        raise AssertionError(f"{name} failed ({code}):\n{stdout[-4000:]}\n{stderr[-6000:]}")
    result = json.loads(summary.read_text())
    result["grads_path"] = str(grads)
    result["stdout"] = stdout
    return result


def launch(tmp: Path, name: str, nproc: int, argv: Sequence[str], timeout: int = 600, script: Path = LAUNCHER,
           environ: Dict[str, str] = None):
    """(exit code, stdout, stderr) of ``script`` (the launcher) on ``nproc`` local ranks with ``argv`` and
    ``environ`` (``env(tmp)``): forked from tests/zygote.py (0 when every rank exited 0, as torchrun's), or under
    torchrun itself with ``MESH_CP_TEST_TORCHRUN=1``."""
    environ = env(tmp) if environ is None else environ
    if os.environ.get("MESH_CP_TEST_TORCHRUN") == "1":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(_port()), str(script), *argv]
        out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return out.returncode, out.stdout, out.stderr
    codes, stdout, stderr = _forked(tmp, name, nproc, list(argv), timeout, script=str(script), env=dict(environ))
    return (0 if not any(codes) else 1), stdout, stderr


def run_script(tmp: Path, name: str, script: Path, argv: Sequence[str], environ: Dict[str, str], cwd: Path = ROOT,
               timeout: int = 600):
    """(exit code, stdout, stderr) of ``python script argv`` with exactly ``environ``, for the launcher's
    single-process runs (dry runs, argument checks): forked from tests/zygote.py (torch and Megatron imported
    there once, ~8 s of CPU a fresh interpreter pays), or a fresh interpreter with ``MESH_CP_TEST_TORCHRUN=1``."""
    if os.environ.get("MESH_CP_TEST_TORCHRUN") == "1":
        out = subprocess.run([sys.executable, str(script), *argv], env=environ, capture_output=True, text=True,
                             timeout=timeout, cwd=cwd)
        return out.returncode, out.stdout, out.stderr
    codes, stdout, stderr = _forked(tmp, name, 1, list(argv), timeout, script=str(script), env=dict(environ),
                                    cwd=str(cwd), torchrun=False)
    return codes[0], stdout, stderr


_ZYGOTE = None


def _zygote(tmp: Path) -> subprocess.Popen:
    """The session's fork server (started on first use, with the runs' environment; stopped at exit)."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.poll() is not None:
        log = open(Path(tempfile.mkdtemp(prefix="mesh-cp-zygote-")) / "zygote.log", "w")
        _ZYGOTE = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"), str(LAUNCHER)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env(tmp),
                                   cwd=ROOT)
        _ZYGOTE.log_path = log.name
        if not _ZYGOTE.stdout.readline():
            raise AssertionError(f"the fork server did not start: {Path(log.name).read_text()[-4000:]}")
        atexit.register(_ZYGOTE.kill)
    return _ZYGOTE


def _forked(tmp: Path, name: str, nproc: int, argv: List[str], timeout: int, **request):
    """(every rank's exit code, stdout, stderr) of one run forked by the server (``request``: more of its fields)."""
    z = _zygote(tmp)
    out, err = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
    for f in (out, err):
        f.write_text("")
    req = dict(argv=argv, env=env(tmp), cwd=str(ROOT), nproc=nproc, port=_port(), stdout=str(out), stderr=str(err),
               timeout=timeout)
    req.update(request)
    z.stdin.write(json.dumps(req) + "\n")
    z.stdin.flush()
    line = z.stdout.readline()
    if not line:
        raise AssertionError(f"the fork server died during {name}: {Path(z.log_path).read_text()[-4000:]}")
    reply = json.loads(line)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(name, timeout, out.read_text(), err.read_text())
    return reply["codes"], out.read_text(), err.read_text()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bad_args(cases: List[List[str]], tmp: Path, world_size: int = 4) -> List[Dict]:
    """Run the launcher's argument handling for each argv in one process (``run_script``); report exit code + stderr."""
    script = tmp / "bad_args.py"
    script.write_text(
        "import contextlib, io, json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from megatron_mesh_cp.megatron.pretrain import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    code = 0\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "        except Exception as e:\n"
        "            code, _ = 'exception', err.write(f'{type(e).__name__}: {e}')\n"
        "    out.append({'argv': argv, 'code': code, 'stderr': err.getvalue()[-2000:]})\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    e = env(tmp)
    e.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    _, stdout, stderr = run_script(tmp, "bad_args", script, [json.dumps(cases)], e)
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise AssertionError(f"bad-args runner failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return json.loads(line[len("RESULT"):])
