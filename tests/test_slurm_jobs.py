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
sys.path.insert(0, str(ROOT / "tests"))
import fake_checkpoint  # noqa: E402
import fake_dataset  # noqa: E402


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
    """Two dataset prefixes (.idx listing long and short documents, an empty .bin), a tokenizer directory and the
    converted Llama-3.1-8B checkpoint's .metadata: what the preflight and the dry run read."""
    fake_dataset.write(tmp_path / "a_text_document", [300_000, 200_000] * 20)  # books: longer than stage 1's 128K
    fake_dataset.write(tmp_path / "b_text_document", [2048, 4096, 8192] * 50)
    (tmp_path / "tokenizer").mkdir()
    fake_checkpoint.write(tmp_path / "hf8b", fake_checkpoint.LLAMA31_8B)  # what stage 1 starts from
    return {"DATA_PATH": f"0.3 {tmp_path}/a_text_document 0.7 {tmp_path}/b_text_document",
            "TOKENIZER_MODEL": str(tmp_path / "tokenizer"), "RUNS_DIR": str(tmp_path / "runs"),
            "LLAMA31_8B_CKPT": str(tmp_path / "hf8b")}


def test_256gpu_dry_run_resumes_exits_in_time_and_passes_preflight(dataset):
    res = _dry("pretrain_256gpu.sbatch", "--gpu-memory-gib", "40", CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.10-py3",
               CONTAINER_MOUNTS="/data:/data", **dataset)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    ckpt = f"{dataset['RUNS_DIR']}/llama31_8b_cpt_s1_128k/checkpoints"
    assert f"--save {ckpt} --load {ckpt}" in out  # one directory per config: every resubmission resumes
    assert "--exit-duration-in-mins 225 --exit-signal-handler" in out  # 4 h limit - 15 min margin
    assert f"--tensorboard-dir {dataset['RUNS_DIR']}/llama31_8b_cpt_s1_128k/tensorboard" in out
    assert f"export LLAMA31_8B_CKPT={dataset['LLAMA31_8B_CKPT']}" in out  # every variable the config substitutes
    assert f"checkpoints: {ckpt} (starts from {dataset['LLAMA31_8B_CKPT']}: weights only, iteration 0)" in out
    assert "--wandb-project" not in out  # W&B only with WANDB_API_KEY
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out and "export NCCL_IB_TIMEOUT=22" in out
    assert "srun --nodes=32" in out and "--nproc-per-node=8" in out and "--container-mounts=/data:/data," in out
    assert ("srun --nodes=1 --ntasks=1 --nodelist=$FIRST_NODE --gpus-per-node=8 --container-image=nvcr.io/nvidia/"
            "pytorch:25.10-py3") in out and " python -m megatron_mesh_cp.megatron.preflight" in out
    assert "bash -c 'python -m torch.distributed.run" in out  # the container's interpreter, never this machine's
    srun = [line for line in out.splitlines() if line.strip().startswith("srun ")]
    assert len(srun) == 2 and not any(sys.executable in line for line in srun), srun
    assert "software checked in the container at job start" in out
    assert "preflight: ok   checkpoint model: 32 layers, hidden 4096, vocabulary 128256: the config's model" in out
    layout = next(line for line in out.splitlines() if "layout: --mesh-layout auto (" in line)
    assert "sampled micro-batches) over 4 chunks; busiest chunk (rank, where tiled) " in layout, layout
    assert "documents: a_text_document, b_text_document (190 documents): " in out
    assert "step time (estimate: attention simulated on the h100-ib400 preset" in out and "save_interval 50: " in out
    assert "preflight: ok   data: 2 dataset prefix(es), .bin and .idx present" in out and "preflight: passed" in out
    assert "CP 32 x DP 8; CP algorithm a2a+mesh, mesh shape 8x" in out and "mesh_shape=auto (a2a+mesh) ->" in out
    assert "memory per GPU (estimate):" in out and "optimizer 0.4 (over 256 shards)" in out
    # the empty tokenizer directory does not load: the estimate says so and how to give the vocabulary
    assert f"vocabulary assumed 128256 (Llama-3's: the tokenizer {dataset['TOKENIZER_MODEL']} did not load here" in out
    assert "or pass --vocab-size N to the dry run)" in out
    assert "exceeds the GPU's 40 GiB" in out  # the 8B estimate is ~50 GiB
    assert not Path(ckpt).exists()  # a dry run creates nothing


def test_preflight_refuses_a_checkpoint_of_another_model(dataset, tmp_path, monkeypatch):
    """A 2-layer, 64-hidden checkpoint passed as LLAMA31_8B_CKPT fails before anything is queued, naming what
    differs; the 8B one passes, and so does a later stage's (a Megatron training checkpoint, same keys)."""
    from megatron_mesh_cp.megatron.preflight import run_checks

    tiny = fake_checkpoint.write(tmp_path / "tiny", fake_checkpoint.TINY)
    for k, v in dict(dataset, LLAMA31_8B_CKPT=str(tiny)).items():
        monkeypatch.setenv(k, v)
    config = str(ROOT / "configs" / "llama31_8b_cpt_s1_128k.yaml")
    model = [c for c in run_checks(config, save=str(tmp_path / "run"), software=False) if c.name == "checkpoint model"]
    assert len(model) == 1 and not model[0].ok
    assert f"{tiny} holds another model (2 layers, hidden 64, vocabulary 384): " in model[0].detail
    assert "decoder.layers.self_attention.linear_qkv.weight: checkpoint [2, 128, 64], config [32, 6144, 4096]" in \
        model[0].detail
    monkeypatch.setenv("LLAMA31_8B_CKPT", dataset["LLAMA31_8B_CKPT"])
    model = [c for c in run_checks(config, save=str(tmp_path / "run"), software=False) if c.name == "checkpoint model"]
    assert model[0].ok, model
    # resuming its own checkpoint: the same check on what it resumes (here a 2-layer one left in the run directory)
    fake_checkpoint.write(tmp_path / "run", fake_checkpoint.TINY, iteration=3)
    checks = {c.name: c for c in run_checks(config, save=str(tmp_path / "run"), software=False)}
    assert checks["checkpoints"].detail.endswith("(resumes from its latest checkpoint)")
    assert not checks["checkpoint model"].ok and "holds another model (2 layers" in checks["checkpoint model"].detail


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
    assert res.returncode == 0, out[-3000:]  # what a login node can check passes, TE or not
    assert "--exit-duration-in-mins 25" in out  # 30 min limit - 5 min margin
    assert "preflight: ok   megatron-core: 0.19" in out and "preflight: ok   data: mock data" in out
    # a login node: Transformer Engine is the compute node's to import, whether this machine has it or not
    assert "preflight: ok   transformer-engine: not checked here (a GPU package: the compute node's preflight" in out
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
echo "CONFIG=$CONFIG MESH_CP_ROOT=$MESH_CP_ROOT RUNS_DIR=$RUNS_DIR $*" >> {calls}
n=$(( $(wc -l < {calls}) + 4200 ))
case " $* " in *" --parsable "*) echo "$n";; *) echo "Submitted batch job $n";; esac
""")
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    env = _env(SBATCH=str(fake), RUNS_DIR=str(runs), CONFIG="llama31_8b_1m_ring")
    res = subprocess.run(["bash", str(SLURM / "submit.sh"), "pretrain_256gpu.sbatch", "--chain", "2", "--qos=high"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and (runs / "llama31_8b_1m_ring" / "logs").is_dir()
    for line in lines:  # the job finds the checkout (MESH_CP_ROOT, --chdir) and the runs directory
        assert line.startswith(f"CONFIG=llama31_8b_1m_ring MESH_CP_ROOT={ROOT} RUNS_DIR={runs} ")
        assert f"--chdir={ROOT} --job-name=mesh-cp-llama31_8b_1m_ring" in line
        assert f"--output={runs}/llama31_8b_1m_ring/logs/slurm-%j.out --qos=high" in line
    # the second job runs only if the first exited 0 (a planned stop); a failed one cancels the rest of the chain
    assert "--dependency" not in lines[0] and "--dependency=afterok:4201 --kill-on-invalid-dep=yes" in lines[1]
    assert res.stdout.split() == ["4201", "4202"]
    header = (SLURM / "pretrain_256gpu.sbatch").read_text()
    assert "#SBATCH --requeue" in header and "#SBATCH --dependency=singleton" in header
    assert "#SBATCH --signal=TERM@" in header and "#SBATCH --output=slurm-%x-%j.out" in header
    bench = subprocess.run(["bash", str(SLURM / "submit.sh"), "bench_ab.sbatch", "--nodes=32"], capture_output=True,
                           text=True, env=dict(env, CONFIG=""), cwd=tmp_path, timeout=60)
    assert bench.returncode == 0, bench.stderr  # no config: named after the script
    assert f"--job-name=mesh-cp-bench_ab --output={runs}/bench_ab/logs/slurm-%j.out --nodes=32" in calls.read_text()
    bad = subprocess.run(["bash", str(SLURM / "submit.sh"), "pretrain_256gpu.sbatch", "--chain", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--chain takes a positive count" in bad.stderr


# --- the sbatch bodies as sbatch runs them: a spool copy, the submit directory elsewhere ---------


def _cluster_stubs(tmp_path, nodes):
    """srun, scontrol, squeue and the compute nodes' python replaced by recording stand-ins on PATH.

    srun records its argv and runs its command as task 0 of node 0 would; the stand-in python records
    torchrun, the preflight and the launcher instead of starting them and runs everything else (job.py)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    stubs = {
        "srun": f"""#!/bin/bash
echo "srun $*" >> {calls}
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS_PER_NODE=8 SLURM_NTASKS=$((8 * {nodes})) exec "$@"
""",
        "scontrol": f"""#!/bin/bash
case "$1 $2" in
  "show hostnames") for i in $(seq -f "%03g" 1 {nodes}); do echo "node$i"; done ;;
  "show job") echo "JobId=$3 JobName=x"; echo "   Command=${{SUBMITTED_SCRIPT:-}}" ;;
esac
""",
        "squeue": "#!/bin/bash\necho 3:50:00\n",
        "python3": f"""#!/bin/bash
for a in "$@"; do
  case "$a" in torch.distributed.run|megatron_mesh_cp.megatron.preflight|*/pretrain_gpt_mesh.py)
    echo "python RANK=${{RANK:-}} WORLD_SIZE=${{WORLD_SIZE:-}} LOCAL_RANK=${{LOCAL_RANK:-}} $*" >> {calls}
    if [ "$a" = torch.distributed.run ]; then  # FAKE_SUMMARY: what the launcher's last rank wrote
      prev=""; for b in "$@"; do
        [ "$prev" = --summary-json ] && [ -n "${{FAKE_SUMMARY:-}}" ] && printf '%s' "$FAKE_SUMMARY" > "$b"; prev="$b"
      done
      exit "${{FAKE_RC:-0}}"
    fi
    exit 0 ;;
  esac
done
exec {sys.executable} "$@"
""",
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, calls


def _as_sbatch(tmp_path, script, *args, cwd, root_env=True, submitted=None, nodes=32, **env):
    """Run the job script the way sbatch does: a copy in a spool directory, SLURM_SUBMIT_DIR elsewhere."""
    bin_dir, calls = _cluster_stubs(tmp_path, nodes)
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text((SLURM / script).read_text())
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    e = _env(**env)
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python3"), SLURM_JOB_ID="4242",
             SLURM_NNODES=str(nodes), SLURM_NTASKS=str(nodes), SLURM_JOB_NODELIST=f"node[001-{nodes:03d}]",
             SLURM_SUBMIT_DIR=str(elsewhere), RUNS_DIR=str(tmp_path / "runs"))
    e.pop("MESH_CP_ROOT", None)
    if root_env:
        e["MESH_CP_ROOT"] = str(ROOT)
    if submitted:
        e["SUBMITTED_SCRIPT"] = str(submitted)
    res = subprocess.run(["bash", str(copy), *args], capture_output=True, text=True, timeout=120,
                         cwd=elsewhere if cwd == "elsewhere" else cwd, env=e)
    return res, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("how", ["submit.sh", "--chdir only", "sbatch from elsewhere"])
def test_256gpu_body_reaches_the_launch_from_a_spool_copy(tmp_path, how):
    kw = {"submit.sh": dict(cwd=ROOT), "--chdir only": dict(cwd=ROOT, root_env=False),
          "sbatch from elsewhere": dict(cwd="elsewhere", root_env=False,
                                        submitted=SLURM / "pretrain_256gpu.sbatch")}[how]
    res, calls = _as_sbatch(tmp_path, "pretrain_256gpu.sbatch", **kw)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = tmp_path / "runs" / "llama31_8b_cpt_s1_128k"
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 2 and srun[0].startswith("srun --nodes=1 --ntasks=1 --nodelist=node001 --gpus-per-node=8")
    assert f"-m megatron_mesh_cp.megatron.preflight --config {ROOT}/configs/llama31_8b_cpt_s1_128k.yaml" in srun[0]
    assert "--torchrun-shutdown-timeout 300" in srun[0]
    assert srun[1].startswith(f"srun --nodes=32 --kill-on-bad-exit=1 --output={run}/logs/4242-node%n.log "
                              f"--chdir={ROOT} --ntasks=32 --ntasks-per-node=1 --gpus-per-node=8 bash -c ")
    torchrun = [c for c in calls if c.startswith("python ") and "torch.distributed.run" in c]
    assert len(torchrun) == 1  # what node 0 ran: rank and master from its own environment
    t = torchrun[0]
    assert ("-m torch.distributed.run --nnodes=32 --nproc-per-node=8 --node-rank=0 --master-addr=node001 "
            "--master-port=29500 --shutdown-timeout=300 ") in t  # SIGTERM@300: the workers get 300 s to save
    assert f"{ROOT}/scripts/pretrain_gpt_mesh.py --config {ROOT}/configs/llama31_8b_cpt_s1_128k.yaml" in t
    assert f"--save {run}/checkpoints --load {run}/checkpoints --exit-duration-in-mins 215" in t  # 3:50 left - 15
    assert f"iteration lines (Megatron logs them from the last rank): {run}/logs/4242-node31.log" in res.stdout
    assert (run / "logs").is_dir() and (run / "checkpoints").is_dir()


@pytest.mark.parametrize("summary,rc,want", [
    ('{"exit": "Megatron exited early (code 0) at iteration 9: signal 15 (--exit-signal-handler); checkpoint saved", '
     '"failed": false}', 1, 0),  # torchrun re-raises SIGTERM after the workers saved: still a planned stop
    ('{"exit": "Megatron exited with code None from megatron/training/checkpointing.py:2693", "failed": true}', 1, 1),
    ("", 1, 1),  # no summary: the launcher never got that far
])
def test_the_job_exits_0_only_after_a_planned_stop(tmp_path, summary, rc, want):
    res, _ = _as_sbatch(tmp_path, "pretrain_256gpu.sbatch", cwd=ROOT, FAKE_SUMMARY=summary, FAKE_RC=str(rc))
    assert res.returncode == want, res.stdout[-2000:] + res.stderr[-2000:]
    assert ("the launcher stopped as planned" in res.stdout) == (want == 0)


def test_tasks_launcher_passes_ntasks_and_each_task_sees_its_rank(tmp_path):
    res, calls = _as_sbatch(tmp_path, "pretrain_256gpu.sbatch", "--launcher", "tasks", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    srun = [c for c in calls if c.startswith("srun ")]
    assert "--ntasks=256 --ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=none" in srun[1]  # not the batch step's 32
    assert "--torchrun-shutdown-timeout" not in srun[0]
    launched = [c for c in calls if "pretrain_gpt_mesh.py" in c and c.startswith("python ")]
    assert launched and launched[0].startswith("python RANK=0 WORLD_SIZE=256 LOCAL_RANK=0 ")
    assert "iteration lines (Megatron logs them from the last rank): " in res.stdout and "-rank255.log" in res.stdout


def test_smoke_body_from_a_spool_copy_and_a_lost_checkout_fails_naming_the_fix(tmp_path):
    res, calls = _as_sbatch(tmp_path, "smoke_2node.sbatch", cwd=ROOT, root_env=False, nodes=2)
    assert res.returncode == 0, res.stderr[-3000:]
    t = next(c for c in calls if c.startswith("python ") and "torch.distributed.run" in c)
    assert "--nnodes=2" in t and "--shutdown-timeout=120" in t and "--exit-duration-in-mins 225" in t  # 5 min margin
    assert "configs/gpt_smoke_128k_16gpu_mesh.yaml" in t
    (tmp_path / "lost").mkdir()
    lost, calls = _as_sbatch(tmp_path / "lost", "pretrain_256gpu.sbatch", cwd="elsewhere", root_env=False)
    assert lost.returncode == 2 and "cannot find the megatron-mesh-cp checkout" in lost.stderr
    assert "MESH_CP_ROOT" in lost.stderr and not calls


def test_bench_ab_body_runs_the_four_algorithms_and_both_of_our_baselines_into_one_table(tmp_path):
    res, calls = _as_sbatch(tmp_path, "bench_ab.sbatch", cwd=ROOT, root_env=False, nodes=32, SEQ="1048576")
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 1, (res.returncode, calls, res.stdout[-2000:], res.stderr[-2000:])
    assert srun[0].startswith(
        f"srun --nodes=32 --ntasks=32 --ntasks-per-node=1 --gpus-per-node=8 --kill-on-bad-exit=1 --chdir={ROOT} bash -c ")
    t = next(c for c in calls if c.startswith("python ") and "torch.distributed.run" in c)
    out = tmp_path / "runs" / "bench_ab" / "4242"
    assert ("-m torch.distributed.run --nnodes=32 --nproc-per-node=8 --node-rank=0 --master-addr=node001 "
            "--master-port=29500 scripts/bench_attention.py --seq 1048576 --heads 32 --kv-heads 8 --head-dim 128 "
            "--algos p2p,a2a+p2p,mesh,a2a+mesh --shapes auto,1x256,8x1x32 --ulysses 8 --cluster h100-ib400 "
            f"--csv {out}/bench.csv --markdown {out}/bench.md --plot {out}/bench.png") in t
    # the stand-in benchmark writes nothing: the job says so instead of printing an empty table
    assert res.returncode == 1 and f"the benchmark wrote no table ({out}/bench.md)" in res.stderr
    dry = subprocess.run(["bash", str(SLURM / "bench_ab.sbatch"), "--dry-run"], capture_output=True, text=True,
                         timeout=60, env=_env(HEADS="12", ULYSSES="8"))
    assert dry.returncode == 2 and "ULYSSES=8 must divide HEADS=12" in dry.stderr
    # --dry-run after the benchmark's own options still prints only; outside an allocation it fails naming the fix
    e = {k: v for k, v in _env().items() if not k.startswith("SLURM_")}
    late = subprocess.run(["bash", str(SLURM / "bench_ab.sbatch"), "--repeats", "3", "--dry-run"],
                          capture_output=True, text=True, timeout=60, env=e)
    assert late.returncode == 0 and "--repeats 3" in late.stdout and "--dry-run" not in late.stdout, late.stderr
    bare = subprocess.run(["bash", str(SLURM / "bench_ab.sbatch")], capture_output=True, text=True, timeout=60, env=e)
    assert bare.returncode == 2 and "not inside a SLURM allocation" in bare.stderr, bare.stderr


def test_preflight_accepts_the_megatron_core_versions_the_launcher_runs_on(monkeypatch):
    """0.19.x (CI) and 0.20 (Megatron-LM main, checked by hand); the extra's range ends where the preflight's does."""
    import re
    from types import SimpleNamespace

    from megatron.core import package_info

    from megatron_mesh_cp.megatron import preflight

    args = SimpleNamespace(transformer_impl="local", tensorboard_dir=None, wandb_project=None, tokenizer_type=None)
    verdict = {}
    for version in ("0.18.2", "0.19.0", "0.19.2", "0.20.0", "0.20.1rc0", "0.21.0"):
        monkeypatch.setattr(package_info, "__version__", version)
        verdict[version] = next(c for c in preflight._software(args) if c.name == "megatron-core").ok
    assert verdict == {"0.18.2": False, "0.19.0": True, "0.19.2": True, "0.20.0": True, "0.20.1rc0": True, "0.21.0": False}
    extra = re.search(r'megatron = \["megatron-core(>=[\d.]+,<[\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert extra == ">=0.16,<0.21"  # 0.16-0.18 for the direct GPTModel path only; the launcher's preflight says so
