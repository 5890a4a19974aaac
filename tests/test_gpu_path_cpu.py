"""The CPU-testable parts of the GPU path: buffer reuse, the GPU check script (smoke), the
attention benchmark on gloo, and the SLURM job dry runs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_mesh_cp import MeshShape
from megatron_mesh_cp.comm import VirtualHub
from megatron_mesh_cp.virtual import virtual_mesh_attention

ROOT = Path(__file__).resolve().parent.parent


def test_buffers_are_allocated_once_per_layer_shape_and_never_alias_results():
    from megatron_mesh_cp.attention import plans_for
    from megatron_mesh_cp.execute import run_virtual
    from megatron_mesh_cp.kernels import TorchKernel
    from megatron_mesh_cp.layout import zigzag_shard

    shape = MeshShape(2, 2)
    hub = VirtualHub(shape)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 2, h, 8, generator=g) for h in (4, 2, 2))
    mesh = type("M", (), {"shape": shape, "cluster": None, "stride": 1})()
    fwd, _ = plans_for(q, k, mesh, True, "sbhd", None, "greedy")
    per = [dict(q=zigzag_shard(q, 4, r, 0), k=zigzag_shard(k, 4, r, 0), v=zigzag_shard(v, 4, r, 0)) for r in range(4)]
    first, _ = run_virtual(fwd, shape, per, TorchKernel(), causal=True, scale=0.3, hub=hub)
    sizes = [len(c.buffers) for c in hub.ranks]
    nbytes = [c.buffers.nbytes() for c in hub.ranks]
    second, _ = run_virtual(fwd, shape, per, TorchKernel(), causal=True, scale=0.3, hub=hub)  # "the next layer"
    assert [len(c.buffers) for c in hub.ranks] == sizes == [1] * 4 and [c.buffers.nbytes() for c in hub.ranks] == nbytes
    arenas = [(a.buf.data_ptr(), a.buf.data_ptr() + a.nbytes) for c in hub.ranks for a in c.buffers._arenas.values()]
    for (o1, l1), (o2, l2) in zip(first, second):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)  # the first results were not overwritten
        for t in (o1, l1):
            assert not any(lo <= t.data_ptr() < hi for lo, hi in arenas)


def test_gpu_check_script_smoke_on_cpu(tmp_path):
    """The GPU check's CPU smoke run: every section runs in its own process and reports rows, and
    both the markdown and the JSON of raw numbers land in the output directory."""
    import json

    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "", "--device", "cpu", "--quick"],
                         capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    text = (tmp_path / "gpu_results.md").read_text()
    for section in ("(a) Block kernels", "(b) Mesh attention on virtual ranks", "(d) Block-time sweep", "(c) One rank's block work"):
        assert section in text
    assert "FAIL" not in text and "ERROR" not in text
    assert text.count("| torch | float32 |") == 4 and text.count("| torch | bfloat16 |") == 4
    assert "te: not installed; flash: not installed; torch: available" in text
    raw = json.loads((tmp_path / "gpu_results.json").read_text())["results"]
    assert [r["n"] for r in raw["b"]["data"]] == [4, 16] and len(raw["c"]["data"]) == 2
    sweep = raw["d"]["data"][1:]
    assert len(sweep) == 8 and all(r["ms"] > 0 and r["ms_copies"] is None for r in sweep)  # no copy stream on CPU


def test_attention_benchmark_on_gloo(tmp_path):
    out_csv, out_png = tmp_path / "b.csv", tmp_path / "b.png"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29731",
           str(ROOT / "scripts" / "bench_attention.py"), "--seq", "256", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "16", "--shapes", "auto,2x2,1x4", "--iters", "2", "--warmup", "1",
           "--csv", str(out_csv), "--plot", str(out_png)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["algorithm"] for r in rows][1:] == ["mesh 2x2", "mesh 1x4"] and rows[0]["algorithm"].startswith("mesh auto")
    assert all(float(r["ms"]) > 0 and int(r["bytes_per_rank"]) > 0 and r["bytes_source"] == "measured" for r in rows)
    assert "skip p2p: needs Transformer Engine on CUDA" in res.stdout
    assert out_png.stat().st_size > 10_000


def _dry(script, **env):
    e = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore", **env)
    e.pop("SLURM_JOB_ID", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / script), "--dry-run"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=e)


def test_slurm_256gpu_dry_run_resolves_commands_and_mesh_shape():
    res = _dry("pretrain_256gpu.sbatch", CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.10-py3", CONTAINER_MOUNTS="/data:/data")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "config llama3_8b_1m_256gpu_mesh.yaml, 32 nodes x 8 GPUs = 256 ranks" in out
    assert "export NCCL_IB_TIMEOUT=22" in out and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in out
    assert "srun --nodes=32" in out and "--nproc-per-node=8" in out and "--container-image=nvcr.io/nvidia/pytorch:25.10-py3" in out
    assert "--container-mounts=/data:/data," in out
    assert "/runs/llama3_8b_1m_256gpu_mesh/dryrun/checkpoints" in out
    assert "CP 256 x DP 1; CP algorithm mesh, mesh shape" in out and "mesh_shape=auto ->" in out


def test_slurm_smoke_and_ab_configs_and_errors():
    res = _dry("smoke_2node.sbatch")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 nodes x 8 GPUs = 16 ranks" in res.stdout and "CP 16 x DP 1; CP algorithm mesh" in res.stdout
    ring = _dry("pretrain_256gpu.sbatch", CONFIG="llama3_70b_1m_256gpu_ring")
    assert "TP 8 x PP 1 x CP 32 x DP 1; CP algorithm p2p" in ring.stdout
    bad = _dry("pretrain_256gpu.sbatch", CONFIG="nope")
    assert bad.returncode != 0 and "no config 'nope' in configs/; choose one of" in bad.stderr
    e = dict(os.environ)
    e.pop("SLURM_JOB_ID", None)
    live = subprocess.run([sys.executable, str(ROOT / "scripts" / "slurm" / "job.py"), "--config", "gpt_tiny_cpu"],
                          capture_output=True, text=True, cwd=ROOT, env=e)
    assert live.returncode != 0 and "not inside a SLURM allocation" in live.stderr
