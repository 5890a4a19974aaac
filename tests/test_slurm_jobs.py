"""SLURM jobs as a cluster user runs them: generated commands and environment, resume paths, exit
before the time limit, device binding in both launcher modes, the preflight in the dry run, and
submit.sh creating the log directory before sbatch (with a stand-in sbatch as strict as SLURM there)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "scripts" / "slurm"


def _env(**extra):
    e = {k: v for k, v in os.environ.items()
         if k not in ("SLURM_JOB_ID", "DATA_PATH", "TOKENIZER_MODEL", "CONTAINER_IMAGE", "CONTAINER_MOUNTS",
                      "WANDB_API_KEY", "CONFIG")}
    e.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore", **extra)
    return e


def _dry(script, *args, **env):
    return subprocess.run(["bash", str(SLURM / script), "--dry-run", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=_env(**env))


@pytest.fixture
def dataset(tmp_path):
    """Two dataset prefixes (.bin/.idx present) and a tokenizer directory: what the preflight looks for."""
    for name in ("a_text_document", "b_text_document"):
        for ext in ("bin", "idx"):
            (tmp_path / f"{name}.{ext}").write_bytes(b"")
    (tmp_path / "tokenizer").mkdir()
    return {"DATA_PATH": f"0.3 {tmp_path}/a_text_document 0.7 {tmp_path}/b_text_document",
            "TOKENIZER_MODEL": str(tmp_path / "tokenizer"), "RUNS_DIR": str(tmp_path / "runs")}


def test_256gpu_dry_run_resumes_exits_in_time_and_passes_preflight(dataset):
    res = _dry("pretrain_256gpu.sbatch", "--gpu-memory-gib", "40", CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.10-py3",
               CONTAINER_MOUNTS="/data:/data", **dataset)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    ckpt = f"{dataset['RUNS_DIR']}/llama3_8b_1m_256gpu_mesh/checkpoints"
    assert f"--save {ckpt} --load {ckpt}" in out  # one directory per config: every resubmission resumes
    assert "--exit-duration-in-mins 225 --exit-signal-handler" in out  # 4 h limit - 15 min margin
    assert f"--tensorboard-dir {dataset['RUNS_DIR']}/llama3_8b_1m_256gpu_mesh/tensorboard" in out
    assert "--wandb-project" not in out  # W&B only with WANDB_API_KEY
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out and "export NCCL_IB_TIMEOUT=22" in out
    assert "srun --nodes=32" in out and "--nproc-per-node=8" in out and "--container-mounts=/data:/data," in out
    assert ("srun --nodes=1 --ntasks=1 --nodelist=$FIRST_NODE --gpus-per-node=8 --container-image=nvcr.io/nvidia/"
            "pytorch:25.10-py3") in out and "-m megatron_mesh_cp.megatron.preflight" in out
    assert "software checked in the container at job start" in out
    assert "preflight: ok   data: 2 dataset prefix(es), .bin and .idx present" in out and "preflight: passed" in out
    assert "CP 256 x DP 1; CP algorithm mesh, mesh shape" in out and "mesh_shape=auto ->" in out
    assert "memory per GPU (estimate):" in out and "optimizer 0.4 (over 256 shards)" in out
    assert "exceeds the GPU's 40 GiB" in out  # the 8B/CP256 estimate is ~55 GiB
    assert not Path(ckpt).exists()  # a dry run creates nothing


def test_dry_run_fails_loudly_on_unset_data_and_binds_devices_in_tasks_mode():
    res = _dry("pretrain_256gpu.sbatch", "--launcher", "tasks")
    out = res.stdout
    assert res.returncode == 1, out[-3000:]
    assert "preflight: FAIL config:" in out and "DATA_PATH is not set" in out and "TOKENIZER_MODEL is not set" in out
    assert "error: " in out and "launcher dry run" in out
    # one task per GPU, all GPUs visible to each, Megatron binds GPU LOCAL_RANK = SLURM_LOCALID
    assert "--ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=none" in out and "--gpus-per-task" not in out
    assert "LOCAL_RANK=$SLURM_LOCALID" in out and "LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE" in out


def test_dry_run_without_container_checks_this_machines_software():
    res = _dry("smoke_2node.sbatch")  # mock data, NullTokenizer, Transformer Engine layers
    out = res.stdout
    assert res.returncode == 1, out[-3000:]
    assert "--exit-duration-in-mins 25" in out  # 30 min limit - 5 min margin
    assert "preflight: ok   megatron-core: 0.19" in out and "preflight: ok   data: mock data" in out
    te = "transformer_engine" in sys.modules or importlib.util.find_spec("transformer_engine") is not None
    assert ("preflight: FAIL transformer-engine" in out) != te
    assert "2 nodes x 8 GPUs = 16 ranks" in out and "CP 16 x DP 1; CP algorithm mesh" in out


def test_job_errors_and_time_limits():
    bad = _dry("pretrain_256gpu.sbatch", CONFIG="nope")
    assert bad.returncode != 0 and "no config 'nope' in configs/; choose one of" in bad.stderr
    live = subprocess.run([sys.executable, str(SLURM / "job.py"), "--config", "gpt_tiny_cpu", "--time-limit", "60"],
                          capture_output=True, text=True, cwd=ROOT, env=_env())
    assert live.returncode != 0 and "not inside a SLURM allocation" in live.stderr
    spec = importlib.util.spec_from_file_location("slurm_job", SLURM / "job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert [job.slurm_minutes(t) for t in ("90", "45:30", "04:00:00", "1-02", "1-02:30", "2-00:00:59")] == [
        90, 45, 240, 1560, 1590, 2880]
    with pytest.raises(SystemExit, match="cannot read the time limit"):
        job.slurm_minutes("UNLIMITED")


def test_submit_creates_the_log_dir_first_and_chains_per_config(tmp_path):
    fake = tmp_path / "sbatch"
    calls = tmp_path / "calls.txt"
    # like sbatch: the job script must exist and --output's directory must already exist
    fake.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
for a in "$@"; do
  case "$a" in --output=*) d="$(dirname "${{a#--output=}}")"; [ -d "$d" ] || {{ echo "sbatch: no dir $d" >&2; exit 1; }};; esac
done
[ -f "${{@: -1}}" ] || {{ echo "sbatch: no script" >&2; exit 1; }}
echo "CONFIG=$CONFIG $*" >> {calls}
echo "Submitted batch job $RANDOM"
""")
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    env = _env(SBATCH=str(fake), RUNS_DIR=str(runs), CONFIG="llama3_8b_1m_256gpu_ring")
    res = subprocess.run(["bash", str(SLURM / "submit.sh"), "pretrain_256gpu.sbatch", "--chain", "2", "--qos=high"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and (runs / "llama3_8b_1m_256gpu_ring" / "logs").is_dir()
    for line in lines:
        assert line.startswith("CONFIG=llama3_8b_1m_256gpu_ring ")
        assert f"--chdir={ROOT} --job-name=mesh-cp-llama3_8b_1m_256gpu_ring" in line
        assert f"--output={runs}/llama3_8b_1m_256gpu_ring/logs/slurm-%j.out --qos=high" in line
    header = (SLURM / "pretrain_256gpu.sbatch").read_text()
    assert "#SBATCH --requeue" in header and "#SBATCH --dependency=singleton" in header
    assert "#SBATCH --signal=TERM@" in header and "#SBATCH --output=slurm-%x-%j.out" in header
    bad = subprocess.run(["bash", str(SLURM / "submit.sh"), "pretrain_256gpu.sbatch", "--chain", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--chain takes a positive count" in bad.stderr
