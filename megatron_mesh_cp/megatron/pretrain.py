"""GPT pretraining through Megatron's real training loop with mesh CP (megatron-core 0.19.x / 0.20).

``scripts/pretrain_gpt_mesh.py`` calls :func:`main`. Megatron's own arguments plus the mesh-CP
switches (``--context-parallel-algo mesh --mesh-shape AxB|auto``...) and a few launcher options:

* ``--config FILE.yaml`` -- a flat YAML of Megatron arguments (``context_parallel_algo: mesh``,
  ``mesh_shape: 2x2``...; ``${VAR}`` from the environment, see :mod:`.config`); command-line flags
  after it override it;
* ``--summary-json FILE`` -- per-iteration lm loss and attention bytes, written by the last rank (also
  when Megatron exits early on ``--exit-duration-in-mins`` / ``--exit-signal-handler``);
* ``--plot-loss FILE.png`` -- after training, rerun the same config with CP = 1 on one process and
  plot both loss curves;
* ``--dump-grads FILE`` -- save every parameter's reduced gradient of the first step (parity tests);
* ``--dry-run`` -- resolve and validate the arguments (mesh shape included), print them, start nothing;
* ``--gpu-memory-gib``, ``--data-cache-dir`` -- the dry run's memory threshold, the stdlib corpus cache.

``--help`` lists these first, then Megatron's own arguments. Megatron's ``--yaml-cfg`` is refused
(it fails inside megatron-core's own parser); ``--config`` takes flat YAML instead.

``--mesh-packed-data`` trains on packed sequences (documents padded to a multiple of 2·CP, THD
under mesh CP, a block-diagonal mask at CP = 1; :mod:`.packing`). Megatron's own
``--reset-attention-mask`` (documents end at EOD tokens) runs under mesh CP unpadded: each
micro-batch's document boundaries are read from its tokens here and handed to the attention
(``PackedSeqParams(qkv_format="sbhd")``); at CP = 1 Megatron's local attention reads its dense mask.

Without ``--data-path`` (and without ``--mock-data``) it trains on the Python standard library's
sources, byte-level (``megatron_mesh_cp.megatron.data``). On a machine without CUDA it runs on gloo
through :mod:`megatron_mesh_cp.megatron.cpu_compat`; with CUDA that module is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .config import ConfigError, config_to_argv

__all__ = ["main", "cli", "config_to_argv", "parse_megatron_args"]

log = logging.getLogger("megatron_mesh_cp")

LAUNCHER_FLAGS = ("--config", "--summary-json", "--plot-loss", "--dump-grads", "--data-cache-dir", "--gpu-memory-gib",
                  "--stdlib-doc-bytes", "--show-megatron-args")
YAML_CFG_REFUSED = (
    "--yaml-cfg: Megatron's experimental YAML path fails inside megatron-core's own parse_args (0.19.2 and "
    "main: AttributeError: 'types.SimpleNamespace' object has no attribute 'disable_msc_deprecated'); use "
    "--config FILE.yaml, a flat YAML with the flags' own names (configs/*.yaml)"
)
_LOSSES: List[List[float]] = []


def _has(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def parse_megatron_args(argv: Sequence[str], defaults: Optional[Dict] = None, set_globals: bool = True):
    """Megatron's parse -> mesh mapping/validation -> Megatron's validation -> global variables."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    from .arguments import add_mesh_args, apply_mesh_args

    saved = sys.argv
    sys.argv = [saved[0]] + list(argv)
    try:
        args = parse_args(extra_args_provider=add_mesh_args)
    finally:
        sys.argv = saved
    apply_mesh_args(args, argv)
    try:
        validate_args(args, defaults or {})
    except AssertionError as exc:  # Megatron's own rules are asserts: said as a refusal (exit 2), not a traceback
        from .arguments import MeshArgumentError

        if "world size" not in str(exc):
            raise MeshArgumentError(_megatron_rule(exc)) from exc
        raise MeshArgumentError(
            f"{exc}: the world size is WORLD_SIZE ({args.world_size} here; torchrun sets it from --nnodes x "
            "--nproc-per-node): launch as many ranks as a multiple of TP x PP x CP, or for a dry run set WORLD_SIZE to "
            "the job's GPU count (WORLD_SIZE=256 ... --dry-run for a 256-GPU job)") from exc
    if set_globals:
        set_global_variables(args)
    return args


def _megatron_rule(exc: AssertionError) -> str:
    """An assert of Megatron's validate_args as one line: its message, or the asserted condition where it has none
    (``assert args.hidden_size % args.num_attention_heads == 0``), and where it is."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1] if frames else None
    said = str(exc).strip() or (where.line.strip() if where is not None and where.line else "an assert without a message")
    at = f" ({os.path.basename(where.filename)}:{where.lineno} {where.name})" if where is not None else ""
    return f"Megatron's argument check refused these arguments: {said}{at}; change the arguments it names"


def _init_distributed_cpu(args) -> None:
    """What Megatron's initialisation skips without a GPU: gloo process group and model-parallel groups."""
    from datetime import timedelta

    from megatron.core import parallel_state as mpu

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo", world_size=args.world_size, rank=args.rank,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            order="tp-cp-ep-dp-pp",
        )


def _pinned(module, name: str):
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} is gone; this launcher supports megatron-core 0.19.x and 0.20")
    return getattr(module, name)


def _capture_losses() -> None:
    """Record the lm loss Megatron logs each iteration (already averaged over data and CP ranks)."""
    import megatron.training.training as training

    orig = _pinned(training, "training_log")

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k):
        if "lm loss" in loss_dict:
            v = loss_dict["lm loss"]
            _LOSSES.append([int(iteration), float(v.item() if torch.is_tensor(v) else v)])
        return orig(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k)

    training.training_log = training_log


def _full_grads_of_distributed_optimizer(model) -> None:
    """With --use-distributed-optimizer each rank holds only its reduced shard of every grad bucket;
    all-gather the shards so every rank's main_grad is the full reduced gradient (the optimizer reads
    only its own shard, which this leaves unchanged)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in model:
        for group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", []):
            if not group.ddp_config.use_distributed_optimizer:
                continue
            size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                torch.distributed.all_gather_into_tensor(
                    bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group
                )


def _capture_first_grads(path: str) -> None:
    """Save every parameter's reduced gradient right before the first optimizer step.

    Keys are ``tp{t}.pp{p}.c{chunk}.{name}``: rank 0 gathers the grads of every (TP, PP) position
    (CP and DP ranks hold the same reduced grads), so runs with the same TP/PP compare one to one.
    """
    import megatron.training.training as training
    from megatron.core import parallel_state as mpu

    orig = _pinned(training, "train_step")
    state = {"done": False}

    def train_step(forward_step_func, data_iterator, model, optimizer, *a, **k):
        if not state["done"]:
            state["done"] = True
            step = optimizer.step

            def first_step(*sa, **sk):
                _full_grads_of_distributed_optimizer(model)
                grads = {}
                if mpu.get_context_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
                    where = f"tp{mpu.get_tensor_model_parallel_rank()}.pp{mpu.get_pipeline_model_parallel_rank()}"
                    for c, chunk in enumerate(model):
                        for name, p in chunk.named_parameters():
                            g = getattr(p, "main_grad", None)
                            g = p.grad if g is None else g
                            if g is not None:
                                grads[f"{where}.c{c}.{name}"] = g.detach().double().cpu().clone()
                everyone = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(everyone, grads)
                if torch.distributed.get_rank() == 0:
                    torch.save({k: v for part in everyone for k, v in part.items()}, path)
                optimizer.step = step
                return step(*sa, **sk)

            optimizer.step = first_step
        return orig(forward_step_func, data_iterator, model, optimizer, *a, **k)

    training.train_step = train_step


# --- the GPT step (the same contract as Megatron's pretrain_gpt.py; packed data: .packing) ------


def _get_packed_batch(data_iterator, args):
    """--mesh-packed-data: documents padded to the packing multiple, split per document (TP = PP = 1)."""
    from megatron.core import mpu

    from .packing import packed_batch

    raw = next(data_iterator)
    batch = {k: raw[k].cuda(non_blocking=True) for k in ("tokens", "labels", "loss_mask", "cu_seqlens")}
    out = packed_batch(batch, args.mesh_pack_multiple, args.mesh_pack_doc_tokens, args.context_parallel_size,
                       mpu.get_context_parallel_rank())
    return [out[k] for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "packed_seq_params")]


def _get_batch(data_iterator):
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    from .settings import options

    args = get_args()
    if getattr(args, "mesh_packed_data", False):
        return _get_packed_batch(data_iterator, args)
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    batch, raw = {}, None
    if mpu.get_tensor_model_parallel_rank() == 0:
        raw = next(data_iterator)
        batch = {k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None) for k in keys}
    if args.tensor_model_parallel_size > 1:
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length, mtp_on_this_rank=False,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
        )
    params = ahead = None
    if options().documents == "eod":
        from .layout import AHEAD_FIELDS

        mine = None if raw is None or raw.get(AHEAD_FIELDS[0]) is None else tuple(raw[k] for k in AHEAD_FIELDS)
        params, ahead = _documents(raw["tokens"] if raw is not None else None, args, mine)
    if params is not None:  # the micro-batch's layout (megatron/layout.py), agreed once over the CP group
        from .attention import agree_batch_documents
        from .layout import lay_out

        error = None
        try:
            batch, params = lay_out(batch, params, args, ahead)
        except ValueError as exc:  # a damaged sample (its layout or orders): raised on every CP rank, none waits
            error = exc
        agree_batch_documents(params, error)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return [batch.get(k) for k in keys] + [params]


def _documents(tokens, args, ahead=None):
    """--reset-attention-mask under mesh CP: this micro-batch's documents (ending at EOD tokens, as
    Megatron's dense mask has them) as global offsets, read on the first TP rank and broadcast to
    the others, for every pipeline stage (the attention of every layer needs them); with them
    ``ahead``, the layout the data loader chose (megatron/layout.py ``AHEAD_FIELDS``; None: none).
    Returns ``(PackedSeqParams, ahead)``."""
    from megatron.core import mpu
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.training import get_tokenizer

    from ..runtime import documents_from_eod
    from .layout import AHEAD_FIELDS

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cu = documents_from_eod(tokens[0].to(device), get_tokenizer().eod) if tokens is not None else None
    if args.tensor_model_parallel_size > 1:  # one broadcast: sizes, then offsets and the layout (float64 as bits)
        group, src = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_src_rank()
        parts = [] if cu is None else [cu.to(torch.int64)] + [
            t.reshape(-1).to(device).view(torch.int64) for t in (ahead or ())]
        count = torch.tensor([p.numel() for p in parts] + [0] * (1 + len(AHEAD_FIELDS) - len(parts)), dtype=torch.int64,
                             device=device)
        torch.distributed.broadcast(count, src, group=group)
        flat = torch.cat(parts) if parts else torch.empty(int(count.sum()), dtype=torch.int64, device=device)
        torch.distributed.broadcast(flat, src, group=group)
        pieces = flat.split(count.tolist())
        cu = pieces[0].to(torch.int32)
        ahead = (pieces[1], pieces[2].view(torch.float64), pieces[3].view(torch.float64), pieces[4]) if count[1] else None
    s = args.seq_length
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s,
                           max_seqlen_kv=s), ahead


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = _get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                   packed_seq_params=packed_seq_params)
    return output, partial(_loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split

    from .settings import options

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size,
        inter_document_masking=bool(getattr(args, "mesh_packed_data", False)),
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    built = lambda: mpu.get_tensor_model_parallel_rank() == 0  # noqa: E731
    datasets = BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, built, config).build()
    if (options().documents == "eod" and args.context_parallel_size > 1
            and args.dataloader_type in ("single", "cyclic")):  # layouts chosen where samples load (Megatron's loader)
        from .layout import wrap_datasets

        datasets = wrap_datasets(datasets, args, config.tokenizer.eod)
    return datasets


datasets_provider.is_distributed = True


# --- main ---------------------------------------------------------------------------------------


def _launcher_parser() -> argparse.ArgumentParser:
    """This launcher's own options (taken out before Megatron parses the rest); listed first by --help."""
    p = argparse.ArgumentParser(add_help=False, prog="pretrain_gpt_mesh.py (mesh-cp-pretrain)",
                                usage="%(prog)s [launcher options] [Megatron arguments]")
    g = p.add_argument_group("launcher options (megatron-mesh-cp)")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="flat YAML of Megatron arguments (name: value, ${VAR} from the environment, include: BASE.yaml); "
                        "command-line flags after it override it")
    g.add_argument("--summary-json", default=None, metavar="FILE",
                   help="per-iteration lm loss and attention bytes, written by the last rank at the end and when "
                        "Megatron exits early (--exit-duration-in-mins, --exit-signal-handler, --exit-interval)")
    g.add_argument("--plot-loss", default=None, metavar="FILE.png",
                   help="after training, rerun the same config with CP = 1 on one process and plot both loss curves")
    g.add_argument("--dump-grads", default=None, metavar="FILE",
                   help="save every parameter's reduced gradient of the first step (parity tests)")
    g.add_argument("--dry-run", action="store_true",
                   help="resolve and validate the arguments (mesh shape included), print the layout and a per-GPU "
                        "memory estimate, start nothing (WORLD_SIZE: the job's world size)")
    g.add_argument("--show-megatron-args", action="store_true",
                   help="with --dry-run: also print Megatron's own list of resolved arguments (hundreds of lines)")
    g.add_argument("--gpu-memory-gib", type=float,
                   default=float(os.environ.get("MESH_CP_GPU_MEMORY_GIB", "0")) or None,
                   help="the dry run's memory warning threshold (default: this GPU's memory, else 80)")
    g.add_argument("--data-cache-dir", default=os.environ.get("MESH_CP_DATA_DIR", str(Path.home() / ".cache" / "megatron-mesh-cp")),
                   help="where the stdlib corpus is built when no --data-path / --mock-data is given "
                        "(default $MESH_CP_DATA_DIR or ~/.cache/megatron-mesh-cp)")
    g.add_argument("--stdlib-doc-bytes", type=_doc_sizes, default=None, metavar="N[,N...]",
                   help="the built-in stdlib corpus: cut every file into documents of at most N bytes; several "
                        "sizes are used in turn (e.g. 90,6,6,6,6,6: a long document among short ones); default: one "
                        "document per file")
    return p


def _doc_sizes(text: str) -> tuple:
    """``--stdlib-doc-bytes``: positive document sizes, one or a comma-separated cycle of them."""
    try:
        sizes = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--stdlib-doc-bytes takes positive byte counts N or N,N,..., got {text!r}")
    return sizes


def _bad_mesh_args(argv: Sequence[str]) -> Optional[str]:
    """Why ``argv``'s mesh-CP flags do not parse, by their own rules (``add_mesh_args``: choices, types;
    None: they do), said before Megatron's parser, which prints its whole usage for any of them."""
    from .arguments import add_mesh_args

    parser = add_mesh_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False))
    try:
        parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        hint = (" (split chooses how many of the longest documents to cut per micro-batch; a fixed split:K is the "
                "simulator's --layout only)" if exc.argument_name == "--mesh-layout" and "invalid choice: 'split" in str(exc) else "")
        return f"{exc}{hint}"
    return None


def _launcher_options(argv: Sequence[str]):
    return _launcher_parser().parse_known_args(list(argv))


def _default_data(argv: List[str], cache_dir: str, doc_bytes: Optional[tuple] = None, build: bool = True) -> List[str]:
    """Without --data-path / --mock-data: the stdlib corpus and its byte-level tokenizer. ``build``
    False (--dry-run): only the tokenizer flags, so the estimate sees the real vocabulary."""
    if _has(argv, "--data-path") or _has(argv, "--mock-data"):
        return argv
    from .data import VOCAB_SIZE, ensure_stdlib_corpus

    extra = []
    if build:
        name = f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}" + (
            f"-docs{'-'.join(map(str, doc_bytes))}" if doc_bytes else "")
        prefix = ensure_stdlib_corpus(os.path.join(cache_dir, f"{name}_text_document"), doc_bytes=doc_bytes)
        extra = ["--data-path", prefix, "--data-cache-path", os.path.join(cache_dir, "index-cache")]
    if not _has(argv, "--tokenizer-type"):
        extra += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE)]
    if not _has(argv, "--split"):
        extra += ["--split", "98,2,0"]
    return argv + extra


def _documents_per_sequence() -> Optional[float]:
    from .packing import STATS

    return STATS["documents"] / STATS["sequences"] if STATS["sequences"] else None


def _summary(args, opts, started: float) -> Dict:
    from .attention import attention_traffic
    from ..planning import SEARCHES
    from .settings import COUNTERS, options

    traffic = attention_traffic()
    return {
        "losses": _LOSSES,
        "context_parallel_size": args.context_parallel_size,
        "algo": getattr(args, "context_parallel_algo", None) or "p2p",
        "mesh_shape": getattr(args, "mesh_shape", None),
        "shape_explanation": options().shape_explanation,
        "attention_bytes_sent_per_rank": traffic["mesh_bytes"],
        "ring_bytes_per_rank": traffic["ring_bytes"],
        "attention_calls": traffic["calls"],
        "document_attention_calls": COUNTERS.document_calls,  # masked documents: packed THD or EOD (unpadded)
        "packed_documents_per_sequence": _documents_per_sequence(),
        "layout": options().layout if options().documents == "eod" else None,
        "layout_note": options().layout_note or None,  # why auto kept documents whole
        "plan_search": options().plan_search,  # --mesh-plan-search: replays per phase of the order search
        # where those searches ran: in the data loader (orders found ahead, taken) or in the step
        "plan_searches_ahead": SEARCHES["ahead"], "plan_searches_in_step": SEARCHES["here"],
        "layouts": COUNTERS.layout_summary(),
        "document_batches_reordered": COUNTERS.relaid,
        "seconds": time.time() - started,
    }


def _missing_data(args) -> Optional[str]:
    """--dry-run: the local dataset files the job will read (each prefix's .bin and .idx), as the preflight checks
    them; None when all are there (or the data is mock, remote or the built-in corpus)."""
    from .preflight import data_check

    paths = [p for p in (args.data_path or []) + (args.train_data_path or []) if "://" not in str(p)]
    if args.mock_data or not paths:
        return None
    check = data_check(args)
    if check.ok:
        return None
    return (f"--data-path: {check.detail} (a dataset prefix PREFIX names PREFIX.bin and PREFIX.idx, as "
            "tools/preprocess_data.py writes them; a real run would fail only after building the model)")


def _print_resolved(args, gpu_gib: Optional[float]) -> None:
    """--dry-run: the parallel layout, CP algorithm, per-GPU memory estimate and the simulated step on the configured
    data (nothing is started)."""
    from .checkpoint_model import padded_vocab
    from .memory import report, tokenizer_vocab
    from .step_estimate import dry_run_estimate, layout_lines

    algo = getattr(args, "context_parallel_algo", None) or (args.cp_comm_type[0] if args.cp_comm_type else "p2p")
    log.info(f"world {args.world_size}: TP {args.tensor_model_parallel_size} x PP "
             f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size}; "
             f"CP algorithm {algo}" + (f", mesh shape {args.mesh_shape}" if algo in ("mesh", "a2a+mesh") else "")
             + f"; seq {args.seq_length}, {args.num_layers} layers, heads {args.num_attention_heads}"
             f"/{args.num_query_groups if args.group_query_attention else args.num_attention_heads} kv")
    log.info(f"document masking: {_masking(args)}")
    from .settings import options

    if options().plan_search:
        log.info(f"plan search (--mesh-plan-search {options().plan_search}): up to {options().plan_search} replays per "
                 "phase re-order each micro-batch's pruned plans (planning/search.py; about 1 ms of host time each at "
                 "32 mesh ranks), under document masking where each micro-batch loads (the data loader's workers with "
                 "--num-workers > 0), ahead of its step; the step "
                 "time below prices the unsearched plans")
    if algo in ("mesh", "a2a+mesh"):
        from .precision import precision_line

        line = precision_line(lambda name, default=None: getattr(args, name, default))
        if line:
            log.info(line)
    if gpu_gib is None:
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    vocab, hint = tokenizer_vocab(args)
    if vocab:
        args.padded_vocab_size = padded_vocab(vocab, args)
    for level, line in report(args, gpu_gib, hint) + layout_lines(dry_run_estimate(args), args.save_interval):
        getattr(log, level)(line)


def _masking(args) -> str:
    """The document masking a run does, in words (the dry run prints it)."""
    from .settings import options

    if getattr(args, "mesh_packed_data", False):
        return f"packed THD (--mesh-packed-data), every document padded to a multiple of {args.mesh_pack_multiple}"
    if options().documents == "eod":
        layout = {
            # narrowed auto: its note already says the cost model chooses (no nested repeat of it)
            "auto": ("; each micro-batch's token layout: " + options().layout_note if options().layout_note else
                     "; each micro-batch's token layout chosen by the cost model (--mesh-layout auto: zigzag, "
                     "balanced or tiled document order, tiled with a few documents re-laid, or the "
                     "longest documents split over every chunk or over half of each mesh row's)"),
            "balanced": "; documents reordered per micro-batch to balance the zigzag chunks (--mesh-layout balanced)",
            "split": "; the longest documents split over every chunk, the others reordered around them (--mesh-layout "
                     "split)",
            "split-half": "; the longest documents split over half of each mesh row's chunks (where they fit, else over "
                          "every chunk), the others reordered around them (--mesh-layout split-half)",
            "tiled": "; documents reordered per micro-batch to balance the mesh's ranks (--mesh-layout tiled)",
            "tiled-cut": "; documents reordered per micro-batch to balance the mesh's ranks, a few re-laid "
                         "(--mesh-layout tiled-cut)",
            "zigzag": "; documents in the dataset's order (--mesh-layout zigzag)",
        }[options().layout]
        return "from EOD (--reset-attention-mask), unpadded; blocks and chunks no document needs are pruned" + layout
    if getattr(args, "reset_attention_mask", False):
        return "from EOD (--reset-attention-mask), Megatron's dense mask (CP = 1)"
    return "none (attention crosses document boundaries)"


def _print_summary(s: Dict) -> None:
    if s["losses"]:
        it, loss = s["losses"][-1]
        log.info(f"final lm loss {loss:.6f} at iteration {it} "
                 f"(CP={s['context_parallel_size']}, {s['algo']}{' ' + s['mesh_shape'] if s['mesh_shape'] else ''})")
    if s["attention_calls"]:
        mesh, ring = s["attention_bytes_sent_per_rank"], s["ring_bytes_per_rank"]
        n = s["context_parallel_size"]
        every = " sending every chunk, as TE's does with documents," if s.get("layout") else ""
        log.info(f"attention bytes sent by this rank: {mesh / 2**20:.2f} MiB over {s['attention_calls']} "
                 f"layer calls; Ring (1x{n}){every} would have sent {ring / 2**20:.2f} MiB "
                 f"({(1 - mesh / ring) if ring else 0:.1%} less with mesh)")
    lay = s.get("layouts")
    if lay:
        ran = ", ".join(f"{name} x {count}" for name, count in sorted(lay["micro_batches"].items()))
        flag = s.get("layout_note") or f"--mesh-layout {s['layout']}"
        log.info(f"token layouts ({flag}): {ran}; busiest / mean work (chunks; ranks for tiled) "
                 f"{lay['busiest_over_mean_mean']:.2f} on average (max {lay['busiest_over_mean_max']:.2f}); "
                 f"{lay['host_ms_mean']:.1f} ms host time per micro-batch (max {lay['host_ms_max']:.1f})"
                 + (f"; {lay['chosen_ahead']} chosen ahead by data loader workers ({lay['ahead_choice_ms_mean']:.1f} "
                    "ms each there)" if lay.get("chosen_ahead") else ""))
    if s.get("plan_search"):
        log.info(f"plan search (--mesh-plan-search {s['plan_search']}): {s['plan_searches_ahead']} plans took the order a "
                 f"data loader worker found ahead, {s['plan_searches_in_step']} were searched in the step")
    log.info(f"done in {s['seconds']:.1f} s")


def _reference_run(argv: List[str], out_json: str) -> Dict:
    """The same Megatron arguments with CP = 1 on one process (for the loss plot)."""
    import socket

    from .arguments import MESH_ONLY_FLAGS

    drop = {"--context-parallel-algo", "--mesh-shape", "--hierarchical-context-parallel-sizes", "--cp-comm-type",
            "--context-parallel-size", "--no-create-attention-mask-in-dataloader"}  # CP = 1 reads the dense mask
    # and mesh CP's attention settings (--mesh-kernel, ...), which a CP = 1 run refuses (_check_mesh_only_flags)
    drop |= {flag for flag, _, _ in MESH_ONLY_FLAGS}
    clean, skip = [], False
    for a in argv:
        if skip:
            if a.startswith("--"):
                skip = False
            else:
                continue
        if a.split("=")[0] in drop:
            skip = "=" not in a
            continue
        clean.append(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a standalone single process: none of torchrun's agent settings (its store would be used)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))}
    env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, os.path.abspath(sys.argv[0])] + clean + ["--context-parallel-size", "1", "--summary-json", out_json]
    log.info("reference run (CP=1): " + " ".join(cmd[1:3]) + " ...")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    with open(out_json) as f:
        return json.load(f)


def _plot(summary: Dict, ref: Dict, path: str) -> None:
    """Both loss curves, and below them |loss(CP=n) - loss(CP=1)| per iteration on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = f"CP={summary['context_parallel_size']} {summary['algo']} {summary['mesh_shape'] or ''}".strip()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for s, name, style in ((ref, "CP=1", "-"), (summary, label, "--")):
        xs, ys = zip(*s["losses"]) if s["losses"] else ((), ())
        top.plot(xs, ys, style, marker="o", ms=3, label=name)
    top.set_ylabel("lm loss")
    top.legend()
    ref_loss = dict((int(i), v) for i, v in ref["losses"])
    pairs = [(int(i), abs(v - ref_loss[int(i)])) for i, v in summary["losses"] if int(i) in ref_loss]
    if pairs:
        xs, ds = zip(*pairs)
        floor = min([d for d in ds if d > 0], default=1e-7) / 10  # equal losses: drawn here, not dropped
        bottom.semilogy(xs, [d if d > 0 else floor for d in ds], color="C3", lw=1,
                        label=f"max |Δ| = {max(ds):.2e}")
        same = [x for x, d in pairs if d == 0]
        bottom.semilogy(same, [floor] * len(same), "v", color="C2", label="identical (Δ = 0)")
        nonzero = [(x, d) for x, d in pairs if d > 0]
        if nonzero:
            bottom.semilogy(*zip(*nonzero), "o", ms=3, color="C3")
        bottom.legend(fontsize=8)
    bottom.set_ylabel("|Δ lm loss| vs CP=1")
    bottom.set_xlabel("iteration")
    top.set_title(f"GPT on {summary.get('data', 'the configured data')}: {label} vs CP=1", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _data_label(args, stdlib: bool, doc_bytes: Optional[tuple] = None) -> str:
    if stdlib and getattr(args, "reset_attention_mask", False):
        cut = f"documents of <= {','.join(map(str, doc_bytes))} bytes" if doc_bytes else "files as documents"
        return f"the Python stdlib's sources ({cut}, masked at EOD)"
    if stdlib and getattr(args, "mesh_packed_data", False):
        cut = f" of <= {args.mesh_pack_doc_tokens} bytes" if args.mesh_pack_doc_tokens else ""
        return f"the Python stdlib's sources packed (documents{cut}, padded to {args.mesh_pack_multiple})"
    if stdlib:
        return "the Python stdlib's sources (byte-level)"
    if getattr(args, "mock_data", False):
        return "mock data"
    paths = [p for p in (getattr(args, "data_path", None) or []) if not p.replace(".", "").isdigit()]
    return ", ".join(os.path.basename(p) for p in paths) or "the configured data"


def cli() -> None:
    """Console entry point ``mesh-cp-pretrain`` (the same as ``scripts/pretrain_gpt_mesh.py``)."""
    # Megatron requires one CUDA connection with TP/CP > 1; it must be set before CUDA starts
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        main()
    finally:  # the run is over: the interpreter's exit need not walk torch's and Megatron's objects (seconds per rank)
        gc.freeze()


def main(argv: Optional[Sequence[str]] = None) -> None:
    started = time.time()
    from ..logs import configure as configure_logging

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # rank 0 and the last rank (it reports the loss) at the configured level, the others warnings only
    configure_logging(None if rank in (0, world - 1) else "WARNING")
    raw = list(sys.argv[1:] if argv is None else argv)
    opts, rest = _launcher_options(raw)
    if {"-h", "--help"} & set(rest):  # ours first; Megatron's parser then prints its own and exits
        print(_launcher_parser().format_help(), flush=True)
    try:
        megatron_argv = (config_to_argv(opts.config) if opts.config else []) + rest
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if _has(megatron_argv, "--yaml-cfg"):
        print(f"error: {YAML_CFG_REFUSED}", file=sys.stderr, flush=True)
        sys.exit(2)
    bad = _bad_mesh_args(megatron_argv)
    if bad:  # one line, before Megatron's parser prints its whole usage for a bad value
        print(f"error: {bad}", file=sys.stderr, flush=True)
        sys.exit(2)
    cpu = not torch.cuda.is_available()
    if cpu:
        from . import cpu_compat

        cpu_compat.activate()
    stdlib = False
    if opts.dry_run:  # the vocabulary the job would train on, without building the corpus
        megatron_argv = _default_data(megatron_argv, opts.data_cache_dir, build=False)
    elif not ({"-h", "--help"} & set(megatron_argv)):
        given = len(megatron_argv)
        megatron_argv = _default_data(megatron_argv, opts.data_cache_dir, opts.stdlib_doc_bytes)
        stdlib = len(megatron_argv) > given
    from .arguments import MeshArgumentError

    quiet = opts.dry_run and not opts.show_megatron_args  # Megatron's argument dump: hundreds of lines
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            args = parse_megatron_args(megatron_argv, set_globals=not opts.dry_run)
    except MeshArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if opts.dry_run:
        missing = _missing_data(args)
        if missing:
            print(f"error: {missing}", file=sys.stderr, flush=True)
            sys.exit(2)
        _print_resolved(args, opts.gpu_memory_gib)
        if quiet:
            log.info("(Megatron's own resolved arguments: add --show-megatron-args)")
        return
    if cpu:
        _init_distributed_cpu(args)
    _capture_losses()
    if opts.dump_grads:
        _capture_first_grads(opts.dump_grads)

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args

    from .specs import gpt_mesh_spec

    model_cfg = gpt_config_from_args(args)
    if args.spec is None:
        model_cfg.transformer_layer_spec = gpt_mesh_spec
    container = pretrain_cfg_container_from_args(args, model_cfg)
    from . import exits

    exits.install()
    from .settings import options

    from .layout import CUTTING_LAYOUTS, install_rotary

    cuts = options().layout in CUTTING_LAYOUTS or (options().layout == "auto" and not options().whole_documents)
    if options().documents == "eod" and cuts:  # layouts that cut documents: each piece rotated at its positions
        install_rotary()
    try:
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    except SystemExit as exc:  # planned early exits (duration, signal, interval) and failures both end in sys.exit
        verdict = exits.classify(exc, args.save)
        if not verdict.planned and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(f"error: {verdict.reason}", file=sys.stderr, flush=True)
        if torch.distributed.is_initialized():
            _finish(args, opts, megatron_argv, started, stdlib, exit=verdict.reason, failed=not verdict.planned)
        raise SystemExit(verdict.code) from None
    except AssertionError as exc:  # Megatron's scheduler check on resume is an assert: name the fix
        fix = exits.scheduler_mismatch(exc)
        if fix is None:
            raise
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"error: {fix}", file=sys.stderr, flush=True)
        if torch.distributed.is_initialized():
            _finish(args, opts, megatron_argv, started, stdlib, exit=fix, failed=True)
        raise SystemExit(exits.FAILED) from None
    _finish(args, opts, megatron_argv, started, stdlib)


def _finish(args, opts, megatron_argv: List[str], started: float, stdlib: bool, exit: Optional[str] = None,
            failed: bool = False) -> None:
    """The last rank's summary (and summary JSON); after a complete run also the CP = 1 loss plot."""
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    summary = _summary(args, opts, started)
    summary["data"] = _data_label(args, stdlib, opts.stdlib_doc_bytes)
    summary["exit"] = exit
    summary["failed"] = failed
    if not last:
        return
    if exit:
        (log.error if failed else log.info)(exit)
    _print_summary(summary)
    if opts.summary_json:
        Path(opts.summary_json).parent.mkdir(parents=True, exist_ok=True)
        with open(opts.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
        log.info(f"summary written to {opts.summary_json}")
    if opts.plot_loss and args.context_parallel_size > 1 and not exit:
        same_batches = []  # packed data: keep this run's packing multiple, so CP = 1 sees the same batches
        if getattr(args, "mesh_packed_data", False) and not _has(megatron_argv, "--mesh-pack-multiple"):
            same_batches = ["--mesh-pack-multiple", str(args.mesh_pack_multiple)]
        ref = _reference_run(megatron_argv + same_batches, str(Path(opts.plot_loss).with_suffix(".cp1.json")))
        _plot(summary, ref, opts.plot_loss)
        log.info(f"loss curve (vs CP=1) written to {opts.plot_loss}")
