#!/usr/bin/env python3
"""Resolve and launch a mesh-CP pretraining job inside a SLURM allocation (or print it: --dry-run).

    python scripts/slurm/job.py --config llama3_8b_1m_256gpu_mesh --nodes 32 [--dry-run] [-- extra args]

Builds the run directory (runs/<config>/<job id>/ with logs/ and checkpoints/), the NCCL/CUDA
environment, and one ``srun`` that starts torchrun on every node (``--launcher torchrun``, default)
or one task per GPU (``--launcher tasks``), optionally inside a container (pyxis/enroot:
``--container-image``/``--container-mounts`` or $CONTAINER_IMAGE/$CONTAINER_MOUNTS). The config is
selected by name from configs/. ``--dry-run`` prints the resolved commands and the mesh shape the
config resolves to for this many GPUs, and launches nothing. The .sbatch files next to this script
call it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

NCCL_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron: ordered kernel launch for TP/CP overlap
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed rank takes the job down instead of hanging it
    "NCCL_IB_TIMEOUT": "22",
    "NCCL_IB_QPS_PER_CONNECTION": "4",  # spread point-to-point traffic over more queue pairs
    "NCCL_P2P_NET_CHUNKSIZE": "524288",  # larger chunks for the CP rings' inter-node send/recv
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "8",
}
PASSTHROUGH = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "DATA_PATH", "TOKENIZER_MODEL", "HF_HOME",
               "MESH_CP_CLUSTER", "WANDB_API_KEY")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="name of a YAML in configs/ (with or without .yaml)")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--launcher", choices=("torchrun", "tasks"), default="torchrun")
    p.add_argument("--container-image", default=os.environ.get("CONTAINER_IMAGE"))
    p.add_argument("--container-mounts", default=os.environ.get("CONTAINER_MOUNTS"))
    p.add_argument("--runs-dir", default=os.environ.get("RUNS_DIR", str(ROOT / "runs")))
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"), help="interpreter on the compute nodes")
    p.add_argument("--dry-run", action="store_true")
    args, extra = p.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return args, extra


def config_path(name: str) -> Path:
    path = ROOT / "configs" / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
        raise SystemExit(f"error: no config {name!r} in configs/; choose one of: {', '.join(known)}")
    return path


def build(args, extra):
    cfg = config_path(args.config)
    job = os.environ.get("SLURM_JOB_ID", "dryrun" if args.dry_run else "local")
    run = Path(args.runs_dir) / cfg.stem / job
    ckpt, logs = run / "checkpoints", run / "logs"
    world = args.nodes * args.gpus_per_node
    env = dict(NCCL_ENV)
    env.update({k: os.environ[k] for k in PASSTHROUGH if k in os.environ})
    train = [args.python, str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config", str(cfg),
             "--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", str(run / "tensorboard"),
             "--summary-json", str(run / "summary.json"), *extra]
    srun = ["srun", f"--nodes={args.nodes}", "--kill-on-bad-exit=1", f"--output={logs}/%x-%j-%t.log"]
    if args.container_image:
        srun += [f"--container-image={args.container_image}", f"--container-workdir={ROOT}"]
        mounts = [m for m in (args.container_mounts or "").split(",") if m] + [f"{ROOT}:{ROOT}", f"{run}:{run}"]
        srun += [f"--container-mounts={','.join(mounts)}"]
    if args.launcher == "torchrun":
        srun += ["--ntasks-per-node=1", f"--gpus-per-node={args.gpus_per_node}"]
        inner = [args.python, "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
                 f"--nproc-per-node={args.gpus_per_node}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$MASTER_ADDR:29500", f"--rdzv-id={job}"] + train[1:]
        cmd = srun + ["bash", "-c", " ".join(shlex.quote(c) if not c.startswith("--rdzv-endpoint") else c for c in inner)]
    else:
        srun += [f"--ntasks-per-node={args.gpus_per_node}", "--gpus-per-task=1", "--cpu-bind=none"]
        export = "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID MASTER_PORT=29500"
        cmd = srun + ["bash", "-c", export + "; " + " ".join(shlex.quote(c) for c in train)]
    return cfg, run, world, env, cmd


def resolve_shape(cfg: Path, world: int, python: str) -> str:
    """The launcher's --dry-run for this world size: the parallel layout and the mesh shape."""
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    env.setdefault("TOKENIZER_MODEL", "/unset/tokenizer")
    env.setdefault("DATA_PATH", "/unset/data")
    env["PYTHONWARNINGS"] = "ignore"
    try:
        out = subprocess.run([python, str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config", str(cfg), "--dry-run"],
                             env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(not resolved here: {exc})"
    lines = [l for l in out.stdout.splitlines() if l.startswith("[mesh-cp]")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return f"(not resolved here: {tail})"
    return "\n".join(lines)


def main(argv=None):
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    cfg, run, world, env, cmd = build(args, extra)
    header = (f"job: config {cfg.name}, {args.nodes} nodes x {args.gpus_per_node} GPUs = {world} ranks, "
              f"launcher {args.launcher}{', container ' + args.container_image if args.container_image else ''}")
    if args.dry_run:
        print(header)
        print(f"run dir: {run}  (logs/, checkpoints/, tensorboard/, summary.json)")
        print("environment:\n" + "\n".join(f"  export {k}={shlex.quote(v)}" for k, v in env.items()))
        print("command:\n  " + " ".join(shlex.quote(c) for c in cmd))
        py = sys.executable if args.python == "python3" else args.python
        print("resolved on this machine:\n" + resolve_shape(cfg, world, py))
        return 0
    if "SLURM_JOB_ID" not in os.environ:
        raise SystemExit("error: not inside a SLURM allocation; submit the .sbatch script with sbatch, or pass --dry-run")
    (run / "logs").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    os.environ["MASTER_ADDR"] = nodes[0]
    print(header, flush=True)
    print("command: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
