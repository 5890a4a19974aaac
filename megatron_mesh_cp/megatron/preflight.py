"""Preflight for a cluster job: check in seconds, on one node, what would otherwise fail on all of them.

    python -m megatron_mesh_cp.megatron.preflight --config configs/X.yaml [--gpus-per-node 8] [--save DIR]

Checks the config (environment variables set, see :mod:`.config`), the software (this package,
megatron-core 0.19.x or 0.20 for the launcher, Transformer Engine when the config uses it, ``transformers``
for a Hugging Face tokenizer, torchrun's ``--shutdown-timeout`` when the job gives it one), the
tokenizer and data paths (each blend prefix's ``.bin``/``.idx``), that the checkpoint directory is
writable and that the job has weights to start from (its own latest checkpoint, else
``--pretrained-checkpoint``: the converted model or the previous stage) of the config's model
(:mod:`.checkpoint_model`: layers, hidden, heads, FFN, vocabulary from the tensors' shapes), the GPUs
this node shows, and the mesh settings (``mesh_shape: auto`` is resolved here once, filling the shape
cache the ranks read). Prints one line per check and exits 1 if any failed. ``scripts/slurm/job.py``
runs it on the first node before ``srun`` fans out, and its ``--dry-run`` runs the same checks here (``--no-software``/``--no-gpus`` when this
machine is not the one that will run the job, e.g. a container image; ``--no-gpu-software`` on a login
node without one: everything but Transformer Engine's import).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from typing import List, NamedTuple, Optional

__all__ = ["Check", "run_checks", "data_check", "main"]

#: megatron-core minor versions the launcher runs on: CI runs 0.19.2; Megatron-LM main (0.20.0, d98e8a6)
#: passed the launcher's Megatron tests by hand (README, Compatibility)
LAUNCHER_MCORE = ((0, 19), (0, 20))


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str


def _version(module: str) -> str:
    mod = importlib.import_module(module)
    return str(getattr(mod, "__version__", "unknown"))


def _software(args, gpu: bool = True) -> List[Check]:
    """``gpu`` False (a login node): Transformer Engine is reported as left to the compute node's preflight."""
    out = []
    import megatron_mesh_cp

    out.append(Check("megatron-mesh-cp", True, f"{megatron_mesh_cp.__version__} at {os.path.dirname(megatron_mesh_cp.__file__)}"))
    try:
        from megatron.core import package_info

        ok = tuple(int(x) for x in package_info.__version__.split(".")[:2]) in LAUNCHER_MCORE
        out.append(Check("megatron-core", ok, package_info.__version__ + ("" if ok else
                         "; the launcher needs 0.19.x or 0.20.x (pip install 'megatron-core>=0.19,<0.21')")))
    except ImportError as exc:
        out.append(Check("megatron-core", False, f"not importable ({exc}); pip install 'megatron-core>=0.19,<0.21'"))
    if args.transformer_impl == "transformer_engine" and not gpu:
        out.append(Check("transformer-engine", True, "not checked here (a GPU package: the compute node's preflight "
                         "imports it at job start)"))
    elif args.transformer_impl == "transformer_engine":
        try:
            out.append(Check("transformer-engine", True, _version("transformer_engine")))
        except Exception as exc:  # TE fails with OSError/RuntimeError too when its CUDA libraries are missing
            out.append(Check("transformer-engine", False, f"not importable ({type(exc).__name__}: {exc}); the config "
                             "sets transformer_impl: transformer_engine (use a TE container or pip install "
                             "'megatron-mesh-cp[te]')"))
    for wanted, module, why in ((args.tensorboard_dir, "torch.utils.tensorboard", "--tensorboard-dir needs the tensorboard package"),
                                (args.wandb_project, "wandb", "--wandb-project (W&B logging) needs the wandb package")):
        if wanted:
            try:
                importlib.import_module(module)
                out.append(Check(module, True, "importable"))
            except ImportError:
                out.append(Check(module, False, f"not importable; {why}"))
    if args.tokenizer_type == "HuggingFaceTokenizer":
        try:
            out.append(Check("transformers", True, _version("transformers")))
        except ImportError:
            out.append(Check("transformers", False, "not importable; HuggingFaceTokenizer needs it "
                             "(pip install 'megatron-mesh-cp[megatron]')"))
    return out


def _torchrun(shutdown_timeout: Optional[int]) -> List[Check]:
    """The job's torchrun must honour --shutdown-timeout (older torch kills workers 30 s after SIGTERM)."""
    if shutdown_timeout is None:
        return []
    from torch.distributed.run import get_args_parser

    if "--shutdown-timeout" in get_args_parser()._option_string_actions:
        return [Check("torchrun", True, f"--shutdown-timeout {shutdown_timeout} s: the SIGTERM save gets the signal lead")]
    import torch

    return [Check("torchrun", False, f"torch {torch.__version__}'s torchrun has no --shutdown-timeout: it would kill the "
                  "workers 30 s after SIGTERM, before their checkpoint is saved; use a newer torch or --launcher tasks")]


def _tokenizer(args, software: bool, found: dict) -> List[Check]:
    """The tokenizer loads; ``found["vocab"]``: its size, when known (the checkpoint check reads it)."""
    if args.tokenizer_type in (None, "NullTokenizer"):
        found["vocab"] = args.vocab_size
        return []
    path = args.tokenizer_model
    if not path:
        return [Check("tokenizer", False, f"{args.tokenizer_type} needs --tokenizer-model (tokenizer_model:)")]
    if not os.path.exists(path):
        return [Check("tokenizer", False, f"{path} does not exist (compute nodes are usually offline: point "
                      "TOKENIZER_MODEL at a local tokenizer directory)")]
    if args.tokenizer_type == "HuggingFaceTokenizer" and software:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            found["vocab"] = len(tok)
            return [Check("tokenizer", True, f"{path}: {type(tok).__name__}, vocab {len(tok)}")]
        except ImportError:
            return []  # reported by the software check
        except Exception as exc:
            return [Check("tokenizer", False, f"{path} does not load: {type(exc).__name__}: {exc}")]
    return [Check("tokenizer", True, path)]


def _data(args) -> List[Check]:
    return [data_check(args)]


def data_check(args) -> Check:
    """Every data prefix's ``.bin`` and ``.idx`` exist (the launcher's dry run runs this check too)."""
    if args.mock_data:
        return Check("data", True, "mock data")
    from megatron.core.datasets.utils import get_blend_from_list

    blends = [("data_path", args.data_path), ("train_data_path", args.train_data_path),
              ("valid_data_path", args.valid_data_path), ("test_data_path", args.test_data_path)]
    prefixes = [(k, p) for k, v in blends if v for p in get_blend_from_list(v)[0]]
    if not prefixes:
        return Check("data", False, "no data_path (or train/valid/test_data_path) and no mock_data")
    missing = [f"{k}: {p}.{ext}" for k, p in prefixes for ext in ("bin", "idx")
               if "://" not in p and not os.path.isfile(f"{p}.{ext}")]
    if missing:
        return Check("data", False, "missing " + ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else ""))
    return Check("data", True, f"{len(prefixes)} dataset prefix(es), .bin and .idx present")


def _has_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt"))


def _checkpoints(path: Optional[str], args, vocab: Optional[int] = None) -> List[Check]:
    """The checkpoint directory is writable, the job has weights to start from when it must not start fresh, and
    they are the config's model."""
    if not path:
        return []
    existing = path
    while not os.path.exists(existing):  # the job creates it; check the directory it will be created in
        existing = os.path.dirname(existing) or "."
    try:
        with tempfile.NamedTemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return [Check("checkpoints", False, f"{path}: {existing} is not writable: {exc}")]
    load = args.load or path
    if _has_checkpoint(load):
        return [Check("checkpoints", True, f"{path} (resumes from its latest checkpoint)")] + _model(load, args, vocab)
    start = args.pretrained_checkpoint
    if start:
        if _has_checkpoint(start):
            return ([Check("checkpoints", True, f"{path} (starts from {start}: weights only, iteration 0)")]
                    + _model(start, args, vocab))
        return [Check("checkpoints", False, f"neither {load} nor --pretrained-checkpoint {start} holds a checkpoint "
                      "(latest_checkpointed_iteration.txt): run the previous stage first, or convert the Hugging Face "
                      "weights there (README, Long-context recipe)")]
    if args.exit_on_missing_checkpoint:
        return [Check("checkpoints", False, f"{load} holds no checkpoint and the config sets exit_on_missing_checkpoint")]
    return [Check("checkpoints", True, f"{path} (starts fresh)")]


def _model(path: str, args, vocab: Optional[int]) -> List[Check]:
    """The checkpoint the job loads holds the config's model (layers, hidden, heads, FFN, vocabulary)."""
    from .checkpoint_model import compare, describe, iteration_dir, stored_shapes

    stored = stored_shapes(iteration_dir(path))
    problems = compare(args, stored, vocab)
    if problems:
        return [Check("checkpoint model", False, f"{path} holds another model ({describe(stored)}): "
                      + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else "")
                      + " -- point the config at the checkpoint of its own model, or fix the model flags")]
    note = "" if vocab else " (vocabulary not checked: the tokenizer did not load here)"
    return [Check("checkpoint model", True, f"{describe(stored)}: the config's model{note}")]


def _gpus(expected: int) -> List[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("gpus", False, "CUDA is not available on this node")]
    n = torch.cuda.device_count()
    ok = n >= expected
    return [Check("gpus", ok, f"{n} visible ({torch.cuda.get_device_name(0)})" +
                  ("" if ok else f"; the job starts {expected} ranks per node, each binding GPU LOCAL_RANK"))]


def _mesh_settings(args, argv: List[str]) -> List[Check]:
    """The mesh settings resolved as every rank will resolve them: ``mesh_shape: auto`` plans here, once, and
    fills the shape cache (``$MESH_CP_CACHE_DIR``) the job's ranks then read instead of each planning."""
    import copy
    import time

    from ..planning import cache_dir
    from .arguments import MeshArgumentError, apply_mesh_args

    auto = str(getattr(args, "mesh_shape", "") or "").lower() == "auto"
    start = time.perf_counter()
    try:
        resolved = apply_mesh_args(copy.copy(args), argv)
    except MeshArgumentError as exc:
        return [Check("mesh settings", False, str(exc))]
    if getattr(resolved, "context_parallel_algo", None) not in ("mesh", "a2a+mesh"):
        return []
    detail = f"{resolved.context_parallel_algo} {resolved.mesh_shape}"
    if auto:
        where = cache_dir()
        detail += (f" (auto, {time.perf_counter() - start:.1f} s; shape cache {where})" if where else
                   f" (auto, {time.perf_counter() - start:.1f} s; shape cache off: every rank plans it again)")
    return [Check("mesh settings", True, detail)]


def run_checks(config: str, *, gpus_per_node: int = 0, save: Optional[str] = None, software: bool = True,
               extra: Optional[List[str]] = None, torchrun_shutdown_timeout: Optional[int] = None,
               gpu_software: bool = True) -> List[Check]:
    """All checks for one config (plus extra Megatron flags); never raises for a failed check."""
    from .config import ConfigError, config_to_argv, megatron_parser

    try:
        argv = config_to_argv(config) + list(extra or [])
    except ConfigError as exc:
        return [Check("config", False, str(exc))]
    args, _ = megatron_parser().parse_known_args(argv)
    checks = [Check("config", True, config)]
    found: dict = {}
    steps = {
        "software": lambda: (_software(args, gpu_software) + _torchrun(torchrun_shutdown_timeout)) if software else [],
        "tokenizer": lambda: _tokenizer(args, software, found),
        "data": lambda: _data(args),
        "checkpoints": lambda: _checkpoints(save or args.save, args, found.get("vocab")),
        "gpus": lambda: _gpus(gpus_per_node) if gpus_per_node else [],
        "mesh settings": lambda: _mesh_settings(args, argv),
    }
    for name, step in steps.items():
        try:
            checks += step()
        except Exception as exc:  # a check that cannot run is a failed check, reported with the rest
            checks.append(Check(name, False, f"{type(exc).__name__}: {exc}"))
    return checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mesh_cp.megatron.preflight", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--gpus-per-node", type=int, default=0, help="check this many GPUs are visible (0: skip)")
    p.add_argument("--save", default=None, help="checkpoint directory that must be writable")
    p.add_argument("--no-software", action="store_true", help="skip the import/version checks")
    p.add_argument("--no-gpu-software", action="store_true",
                   help="a machine without GPUs (a login node): leave Transformer Engine's import to the compute node")
    p.add_argument("--torchrun-shutdown-timeout", type=int, default=None,
                   help="the job's torchrun waits this long after SIGTERM: check that it can")
    args, extra = p.parse_known_args(argv)
    checks = run_checks(args.config, gpus_per_node=args.gpus_per_node, save=args.save,
                        software=not args.no_software, extra=extra,
                        torchrun_shutdown_timeout=args.torchrun_shutdown_timeout, gpu_software=not args.no_gpu_software)
    for c in checks:
        print(f"preflight: {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}", flush=True)
    failed = [c.name for c in checks if not c.ok]
    print(f"preflight: {'passed' if not failed else 'FAILED (' + ', '.join(failed) + ')'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
