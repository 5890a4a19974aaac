#!/usr/bin/env python3
"""Resolve and launch a mesh-CP pretraining job inside a SLURM allocation (or print it: --dry-run).

    python scripts/slurm/job.py --config llama31_8b_cpt_s1_128k --nodes 32 [--time-limit 04:00:00] [--dry-run] [-- extra args]

One directory per config under the runs directory ($RUNS_DIR, else $SCRATCH/mesh-cp-runs, else
$HOME/mesh-cp-runs: never inside the checkout; a 70B checkpoint is ~1 TB), so a resubmitted or
requeued job resumes: <runs>/<config>/checkpoints (``--save`` and ``--load``), logs/ (the batch log
and one file per node or rank and job), tensorboard/ and summary-<job>.json. The configs name the
previous stage's checkpoints as ${RUNS_DIR}/<stage>/checkpoints; this script exports RUNS_DIR.
Megatron stops and saves ``--exit-margin-min`` before the time limit (``--exit-duration-in-mins``)
and on SIGTERM (``--exit-signal-handler``; SLURM sends it ``--signal-lead`` seconds before the
limit, and torchrun's ``--shutdown-timeout`` gives the workers that long to save before it kills
them, instead of its default 30 s). The job exits 0 only after such a planned stop (or the end of
training), read from the launcher's summary (:func:`job_exit_code`), and non-zero on any failure, so
``submit.sh --chain``'s afterok dependencies stop the chain there. Before ``srun`` fans out, a preflight
(:mod:`megatron_mesh_cp.megatron.preflight`) runs on the first node and stops the job in seconds if
the software, tokenizer, data or checkpoints are wrong. Launchers: ``torchrun`` (default: one agent
per node, static rendezvous with node rank = SLURM node id, so global ranks follow the node order)
or ``tasks`` (one task per GPU: RANK/LOCAL_RANK from SLURM, every task sees all the node's GPUs and
binds GPU LOCAL_RANK, as Megatron does). Both pass ``--ntasks`` explicitly (the batch step's
SLURM_NTASKS is the node count). Containers: ``--container-image``/``--container-mounts`` (pyxis)
or $CONTAINER_IMAGE/$CONTAINER_MOUNTS; srun then runs the container's interpreter (``--container-python``,
$CONTAINER_PYTHON, default ``python``), never this machine's ``--python``. ``--dry-run`` prints the
environment, commands and log files, runs the same preflight here (the software checks only without a
container image, whose software is checked at job start, and never Transformer Engine's import, a GPU
package the compute node's preflight checks) and the launcher's own dry run (layout, mesh shape, memory
estimate, simulated step time), and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

NCCL_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron: ordered kernel launch for TP/CP overlap
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed rank takes the job down instead of hanging it
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # less fragmentation with 1M-token activations
    "NCCL_IB_TIMEOUT": "22",
    "NCCL_IB_QPS_PER_CONNECTION": "4",  # spread point-to-point traffic over more queue pairs
    "NCCL_P2P_NET_CHUNKSIZE": "524288",  # larger chunks for the CP rings' inter-node send/recv
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "8",
}
PASSTHROUGH = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "DATA_PATH", "TOKENIZER_MODEL", "HF_HOME",
               "MESH_CP_CLUSTER", "MESH_CP_CLUSTER_DIR", "MESH_CP_CACHE_DIR", "MESH_CP_LOG_LEVEL", "WANDB_API_KEY", "WANDB_PROJECT")
PORT = 29500


def default_runs_dir() -> str:
    """$RUNS_DIR, else $SCRATCH/mesh-cp-runs (the cluster's parallel file system), else $HOME/mesh-cp-runs."""
    if os.environ.get("RUNS_DIR"):
        return os.environ["RUNS_DIR"]
    return os.path.join(os.environ.get("SCRATCH") or os.path.expanduser("~"), "mesh-cp-runs")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="name of a YAML in configs/ (with or without .yaml)")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--launcher", choices=("torchrun", "tasks"), default="torchrun")
    p.add_argument("--time-limit", default=None, help="the job's SLURM time limit (inside a job: asked from squeue)")
    p.add_argument("--exit-margin-min", type=int, default=15, help="stop and save this long before the limit")
    p.add_argument("--signal-lead", type=int, default=300,
                   help="seconds before the limit SLURM sends SIGTERM (#SBATCH --signal=TERM@N); torchrun waits this "
                        "long for the workers' save before it kills them")
    p.add_argument("--container-image", default=os.environ.get("CONTAINER_IMAGE"))
    p.add_argument("--container-mounts", default=os.environ.get("CONTAINER_MOUNTS"))
    p.add_argument("--runs-dir", default=default_runs_dir(), help="default: $RUNS_DIR, $SCRATCH/mesh-cp-runs or "
                   "$HOME/mesh-cp-runs")
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                   help="interpreter on the compute nodes without a container, and for --dry-run's checks here")
    p.add_argument("--container-python", default=os.environ.get("CONTAINER_PYTHON", "python"),
                   help="interpreter inside --container-image (default $CONTAINER_PYTHON or python): srun runs it "
                        "there, never --python, which is this machine's")
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


def config_variables(path: Path, seen=()) -> list:
    """The environment variables a config (and what it includes) substitutes: the job passes each one on."""
    if path in seen:
        return []
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0]
        inc = re.match(r"\s*include:\s*(\S+)", line)
        if inc:
            names += config_variables(path.parent / inc.group(1), seen + (path,))
        names += re.findall(r"(?<!\$)\$\{?([A-Za-z_][A-Za-z0-9_]*)", line)
    return list(dict.fromkeys(names))


def slurm_minutes(text: str) -> int:
    """A SLURM time (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) in whole minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m or text.strip() in ("UNLIMITED", "INVALID"):
        raise SystemExit(f"error: cannot read the time limit {text!r}; pass --time-limit like 04:00:00")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        return int(days) * 1440 + int(a) * 60 + int(b or 0)
    if c is not None:  # H:M:S
        return int(a) * 60 + int(b)
    return int(a)  # M or M:S


def time_limit(args) -> str:
    """The running job's time left (squeue), else --time-limit."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and not args.dry_run:
        try:
            left = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
            if left:
                return left
        except (OSError, subprocess.TimeoutExpired):
            pass
    if not args.time_limit:
        raise SystemExit("error: no time limit known; pass --time-limit (the .sbatch files pass their #SBATCH --time)")
    return args.time_limit


def container_flags(args, run: Path):
    if not args.container_image:
        return [f"--chdir={ROOT}"]
    mounts = [m for m in (args.container_mounts or "").split(",") if m] + [f"{ROOT}:{ROOT}", f"{run}:{run}"]
    return [f"--container-image={args.container_image}", f"--container-workdir={ROOT}",
            f"--container-mounts={','.join(mounts)}"]


def log_files(args, logs: Path, job: str):
    """Where the job's output goes: (srun's --output pattern, {what: file})."""
    last = args.nodes - 1 if args.launcher == "torchrun" else args.nodes * args.gpus_per_node - 1
    unit = "node" if args.launcher == "torchrun" else "rank"
    pattern = f"{logs}/{job}-{unit}%{'n' if unit == 'node' else 't'}.log"
    return pattern, {
        "iteration lines (Megatron logs them from the last rank)": f"{logs}/{job}-{unit}{last}.log",
        "arguments, model build, checkpoint saves (rank 0)": f"{logs}/{job}-{unit}0.log",
        "this script, the preflight and the commands": f"{logs}/slurm-{job}.out (submit.sh's --output)",
    }


def build(args, extra):
    cfg = config_path(args.config)
    job = os.environ.get("SLURM_JOB_ID", "dryrun" if args.dry_run else "local")
    run = Path(args.runs_dir) / cfg.stem
    ckpt, logs = run / "checkpoints", run / "logs"
    world = args.nodes * args.gpus_per_node
    exit_min = slurm_minutes(time_limit(args)) - args.exit_margin_min
    if exit_min < 5:
        raise SystemExit(f"error: the time limit leaves {exit_min} min after the {args.exit_margin_min} min exit margin")
    env = dict(NCCL_ENV)
    env.update({k: os.environ[k] for k in PASSTHROUGH + tuple(config_variables(cfg)) if k in os.environ})
    env["RUNS_DIR"] = str(args.runs_dir)  # the configs' ${RUNS_DIR}/<previous stage>/checkpoints
    logging = ["--tensorboard-dir", str(run / "tensorboard")]
    if "WANDB_API_KEY" in os.environ:  # W&B only when the key is there
        logging += ["--wandb-project", os.environ.get("WANDB_PROJECT", "megatron-mesh-cp"), "--wandb-exp-name",
                    f"{cfg.stem}-{job}", "--wandb-save-dir", str(run / "wandb")]
    train = [str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config", str(cfg),
             "--save", str(ckpt), "--load", str(ckpt), "--exit-duration-in-mins", str(exit_min),
             "--exit-signal-handler", *logging, "--summary-json", str(run / f"summary-{job}.json"), *extra]
    box = container_flags(args, run)
    python = args.container_python if args.container_image else args.python  # what srun starts on the nodes
    shutdown = ["--torchrun-shutdown-timeout", str(args.signal_lead)] if args.launcher == "torchrun" else []
    preflight = ["srun", "--nodes=1", "--ntasks=1", "--nodelist=$FIRST_NODE", f"--gpus-per-node={args.gpus_per_node}",
                 *box, python, "-m", "megatron_mesh_cp.megatron.preflight", "--config", str(cfg),
                 "--gpus-per-node", str(args.gpus_per_node), "--save", str(ckpt), *shutdown, *logging, *extra]
    pattern, _ = log_files(args, logs, job)
    srun = ["srun", f"--nodes={args.nodes}", "--kill-on-bad-exit=1", f"--output={pattern}", *box]
    if args.launcher == "torchrun":
        # static rendezvous: node rank = SLURM node id, so the last node holds the last ranks (and their log lines);
        # --shutdown-timeout: SIGTERM reaches the workers and they get the signal lead to save (torchrun: 30 s)
        srun += [f"--ntasks={args.nodes}", "--ntasks-per-node=1", f"--gpus-per-node={args.gpus_per_node}"]
        inner = [python, "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
                 f"--nproc-per-node={args.gpus_per_node}", "--node-rank=$SLURM_NODEID", "--master-addr=$MASTER_ADDR",
                 f"--master-port={PORT}", f"--shutdown-timeout={args.signal_lead}"] + train
        cmd = srun + ["bash", "-c", " ".join(c if "=$" in c else shlex.quote(c) for c in inner)]
    else:
        # every task sees all the node's GPUs (no --gpus-per-task: Megatron calls set_device(LOCAL_RANK))
        srun += [f"--ntasks={world}", f"--ntasks-per-node={args.gpus_per_node}", f"--gpus-per-node={args.gpus_per_node}",
                 "--gpu-bind=none", "--cpu-bind=none"]
        export = ("export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
                  f"LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE MASTER_PORT={PORT}")
        cmd = srun + ["bash", "-c", export + "; " + " ".join(shlex.quote(c) for c in [python] + train)]
    return cfg, run, world, env, preflight, cmd, logging + extra


def local_checks(args, cfg: Path, run: Path, world: int, flags) -> int:
    """--dry-run: the preflight and the launcher's dry run, here; returns the number of failures."""
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", PYTHONPATH=str(ROOT),
               RUNS_DIR=str(args.runs_dir))
    py = sys.executable if args.python == "python3" else args.python
    shutdown = ["--torchrun-shutdown-timeout", str(args.signal_lead)] if args.launcher == "torchrun" else []
    # here is a login node: the software is the container's when there is one; without one this machine's, but
    # Transformer Engine (a GPU package a login node need not import) is left to the compute node's preflight
    checks = [("preflight", [py, "-m", "megatron_mesh_cp.megatron.preflight", "--config", str(cfg),
                             "--save", str(run / "checkpoints"), *flags]
               + (["--no-software"] if args.container_image else ["--no-gpu-software", *shutdown])),
              ("launcher dry run", [py, str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config", str(cfg), "--dry-run", *flags])]
    failed = 0
    for name, command in checks:
        try:
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"{name}: could not run here: {exc}")
            failed += 1
            continue
        lines = [l for l in out.stdout.splitlines() if l.startswith(("preflight:", "[mesh-cp]"))]
        lines += [f"error: {l[7:]}" for l in out.stderr.splitlines() if l.startswith("error: ")]
        print(f"{name} (here{', software checked in the container at job start' if args.container_image and name == 'preflight' else ''}):")
        print("\n".join("  " + l for l in lines) or f"  (no output; exit {out.returncode}) {out.stderr.strip()[-500:]}")
        failed += out.returncode != 0
    return failed


def main(argv=None):
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    cfg, run, world, env, preflight, cmd, flags = build(args, extra)
    header = (f"job: config {cfg.name}, {args.nodes} nodes x {args.gpus_per_node} GPUs = {world} ranks, "
              f"launcher {args.launcher}{', container ' + args.container_image if args.container_image else ''}")
    _, logs = log_files(args, run / "logs", os.environ.get("SLURM_JOB_ID", "<job>" if args.dry_run else "local"))
    where = "log files:\n" + "\n".join(f"  {what}: {path}" for what, path in logs.items())
    if args.dry_run:
        print(header)
        print(f"run dir: {run}  (checkpoints/ resumed by every resubmission, logs/, tensorboard/, summary-<job>.json)")
        print(where)
        print("environment:\n" + "\n".join(f"  export {k}={shlex.quote(v)}" for k, v in env.items()))
        print("preflight (first node):\n  " + " ".join(shlex.quote(c) if "$" not in c else c for c in preflight))
        print("command:\n  " + " ".join(shlex.quote(c) for c in cmd))
        return 1 if local_checks(args, cfg, run, world, flags) else 0
    if "SLURM_JOB_ID" not in os.environ:
        raise SystemExit("error: not inside a SLURM allocation; submit with scripts/slurm/submit.sh, or pass --dry-run")
    (run / "logs").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    os.environ["MASTER_ADDR"] = os.environ["FIRST_NODE"] = nodes[0]
    print(header, flush=True)
    print(where, flush=True)
    check = [c.replace("$FIRST_NODE", nodes[0]) for c in preflight]
    print("preflight: " + " ".join(shlex.quote(c) for c in check), flush=True)
    if subprocess.run(check).returncode != 0:
        raise SystemExit(f"error: preflight failed on {nodes[0]}; nothing was started on the other nodes")
    print("command: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    summary = run / f"summary-{os.environ['SLURM_JOB_ID']}.json"
    summary.unlink(missing_ok=True)  # a requeued job keeps its id: only this attempt's summary counts
    return job_exit_code(subprocess.run(cmd).returncode, summary)


def job_exit_code(rc: int, summary: Path) -> int:
    """The job's exit code, which chained jobs wait on (afterok): srun's, except that a planned stop the launcher
    recorded in the summary (Megatron saved and stopped) is 0 even when srun's is not -- on SIGTERM torchrun,
    signalled itself, re-raises the signal after its workers saved and exited 0."""
    if rc == 0:
        return 0
    try:
        s = json.loads(summary.read_text())
    except (OSError, ValueError):
        return rc
    if s.get("exit") and s.get("failed") is False:
        print(f"job: srun exited {rc}, but the launcher stopped as planned: {s['exit']}; exiting 0", flush=True)
        return 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
