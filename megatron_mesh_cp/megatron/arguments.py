"""Command-line switches for mesh CP and their mapping onto Megatron's own settings.

``--context-parallel-algo {p2p,all_gather,a2a,a2a+p2p,mesh,a2a+mesh}`` selects the CP algorithm
(for the Megatron values it is an alias of ``--cp-comm-type``); ``--mesh-shape AxB|auto`` the tile,
``UxAxB|auto`` for ``a2a+mesh`` (Ulysses degree u x mesh, docs/hybrid.md).
:func:`apply_mesh_args` maps them onto ``cp_comm_type`` and ``hierarchical_context_parallel_sizes``
([a, b], or [u, a, b]: Megatron builds the Ulysses groups and the rings as its hierarchical CP
groups) and rejects every
inconsistent combination *before* training starts -- never a silent fallback to another algorithm
or to CP = 1. It works on flat argparse namespaces and on Megatron's ``--yaml-cfg`` namespaces
(settings under ``model_parallel``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Optional, Sequence

import torch

from ..runtime import MeshShape, parse_shape
from . import variant_args
from .settings import MeshOptions, configure

__all__ = ["ALGORITHMS", "MESH_ALGORITHMS", "add_mesh_args", "apply_mesh_args", "apply_mesh_args_or_exit", "MeshArgumentError",
           "escape_stray_percent"]

ALGORITHMS = ("p2p", "all_gather", "a2a", "a2a+p2p", "mesh", "a2a+mesh")
MESH_ALGORITHMS = variant_args.MESH_ALGORITHMS  # ("mesh", "a2a+mesh")
from ..runtime.kernels import KERNELS  # noqa: E402  (the registry's names, auto first)
from .layout import CUTTING_LAYOUTS, LAYOUT_CHOICES  # noqa: E402


class MeshArgumentError(ValueError):
    """An inconsistent mesh-CP configuration (raised before any process group or model exists)."""


def add_mesh_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the mesh-CP switches to a Megatron argument parser (usable as ``extra_args_provider``).

    Flags a patched Megatron (patches/) already defines are left as they are.
    """
    g = parser.add_argument_group(title="mesh context parallelism (megatron-mesh-cp)")
    have = set(parser._option_string_actions)

    def add(flag, **kw):
        if flag not in have:
            g.add_argument(flag, **kw)

    add("--context-parallel-algo", choices=ALGORITHMS, default=None,
        help="CP algorithm; mesh = Mesh-Attention, the others alias --cp-comm-type")
    add("--mesh-shape", default=None, help="mesh tile AxB with A*B = --context-parallel-size (a2a+mesh: UxAxB, "
        "U*A*B = CP), or auto (the default)")
    add("--mesh-kernel", choices=KERNELS, default="auto", help="block-kernel backend for mesh CP")
    add("--mesh-partial-dtype", choices=("fp32", "bf16"), default="fp32",
        help="wire dtype of partial O/dQ/dKV (fp32: exact; bf16: half the reduction bytes)")
    add("--mesh-planner", choices=("greedy", "in-order"), default="greedy")
    add("--mesh-cluster", default=None,
        help="cluster preset or YAML the greedy planner and mesh-shape=auto tune for (default h100-ib400)")
    add("--mesh-check-finite", action="store_true",
        help="check attention inputs and output gradients for NaN/Inf on every call (all CP ranks raise)")
    add("--mesh-packed-data", action="store_true",
        help="launcher: train on packed sequences (documents padded to --mesh-pack-multiple; THD under mesh CP, "
             "a block-diagonal mask at CP = 1)")
    add("--mesh-pack-multiple", type=int, default=None,
        help="with --mesh-packed-data: pad every document to a multiple of this (default 2 x CP; a multiple of it)")
    add("--mesh-layout", choices=LAYOUT_CHOICES, default=None,
        help="with --reset-attention-mask under mesh CP: each micro-batch's token layout; auto (default) the one the "
             "cost model predicts fastest (among them split:K:H, the last H of K split documents cut over half of each "
             "mesh row's chunks), zigzag the dataset's order, balanced whole documents reordered to even the "
             "zigzag chunks, tiled whole documents reordered to even the mesh's ranks (each computes a tile of "
             "blocks), tiled-cut that order with a few documents re-laid to even them further, split the "
             "longest documents cut into pieces over every chunk, split-half over half of each mesh row's chunks "
             "(a and b even; where they fit, else as split) (exact in every case)")
    add("--mesh-document-order", choices=("balanced", "given"), default=None,
        help="the older name of --mesh-layout balanced / zigzag")
    add("--mesh-plan-search", type=int, default=0, metavar="N",
        help="with document masking (--reset-attention-mask) or a sliding window under mesh CP: replays per phase "
             "the order search may spend, every micro-batch, improving the pruned plans (deterministic; about 1 ms "
             "of host time each at 32 mesh ranks; 0, the default: none)")
    add("--mesh-pack-doc-tokens", type=int, default=None,
        help="with --mesh-packed-data: cut documents into pieces of at most this many tokens (default: whole files)")
    return escape_stray_percent(parser)


_FORMAT = re.compile(r"%%|%\([A-Za-z_]\w*\)[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]|%")


def escape_stray_percent(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Double every ``%`` in help strings that is not a format spec, so ``--help`` works even when a
    Megatron release copies a docstring with a bare ``%`` into a help string (0.19's
    ``transformer_config.py`` does: ``unsupported format character ')'``)."""
    for action in parser._actions:
        if isinstance(action.help, str) and "%" in action.help:
            action.help = _FORMAT.sub(lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", action.help)
    return parser


def _mp(args):
    """The namespace holding model-parallel settings (flat args, or --yaml-cfg's model_parallel)."""
    return getattr(args, "model_parallel", None) if getattr(args, "yaml_cfg", None) else args


def _get(args, name, default=None):
    mp = _mp(args)
    if mp is not args and hasattr(mp, name):
        return getattr(mp, name)
    return getattr(args, name, default)


def _set(args, name, value) -> None:
    mp = _mp(args)
    setattr(mp if mp is not None and mp is not args and hasattr(mp, "context_parallel_size") else args, name, value)


def _as_list(v) -> List[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else list(v)


def _cp_algorithm(args) -> str:
    """The CP algorithm this run runs: --context-parallel-algo, else the first --cp-comm-type (Megatron's p2p)."""
    return _get(args, "context_parallel_algo") or (_as_list(_get(args, "cp_comm_type")) or ["p2p"])[0]


def _explicit(argv: Optional[Sequence[str]], flag: str) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def apply_mesh_args(args, argv: Optional[Sequence[str]] = None, *, launcher: bool = True):
    """Validate the mesh switches and map them onto Megatron's settings; returns ``args``.

    Raises :class:`MeshArgumentError` naming the fix. ``argv`` (default ``sys.argv[1:]``) tells
    which flags were given explicitly, so a contradicting ``--cp-comm-type`` is caught.
    ``launcher``: the arguments are for this package's launcher, whose get_batch hands document
    boundaries to the attention (False: stock ``pretrain_gpt.py``, whose get_batch does not).
    """
    opts: dict = {}  # what the options resolve to, configured once at the end (settings.MeshOptions)
    args = _apply_cp_algo(args, argv, opts)
    _check_mesh_only_flags(args)
    _check_packed_data(args)
    _check_lr_schedule(args)
    _check_document_masking(args, launcher, opts)
    try:
        variant_args.check_attention_variants(lambda name, default=None: _get(args, name, default), launcher)
    except ValueError as exc:
        raise MeshArgumentError(str(exc)) from None
    opts["plan_search"] = _plan_search(args, opts)  # after the variants: a window it reads is a valid one
    configure(MeshOptions(**opts))
    return args


#: flags only mesh CP's attention reads, with their defaults (given otherwise in a run without mesh CP: refused)
MESH_ONLY_FLAGS = (("--mesh-kernel", "mesh_kernel", "auto"), ("--mesh-partial-dtype", "mesh_partial_dtype", "fp32"),
                   ("--mesh-planner", "mesh_planner", "greedy"), ("--mesh-check-finite", "mesh_check_finite", False))


def _check_mesh_only_flags(args) -> None:
    """Flags a run would accept and ignore, refused: --mesh-kernel, --mesh-partial-dtype, --mesh-planner and
    --mesh-check-finite without mesh CP (CP = 1 or a TE algorithm runs Megatron's or TE's attention, which read
    none of them), --mesh-pack-multiple and --mesh-pack-doc-tokens without --mesh-packed-data."""
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    algo = _get(args, "context_parallel_algo")
    if not (cp > 1 and algo in MESH_ALGORITHMS):
        why = "runs CP = 1" if cp <= 1 else f"runs --context-parallel-algo {_cp_algorithm(args)}"
        for flag, name, default in MESH_ONLY_FLAGS:
            value = _get(args, name, default)
            if value is not None and value != default:
                shown = "" if isinstance(value, bool) else f" {value}"
                raise MeshArgumentError(f"{flag}{shown} sets mesh CP's attention (--context-parallel-algo mesh or "
                                        f"a2a+mesh, CP > 1), which this run does not use (it {why}): drop it")
    if not _get(args, "mesh_packed_data", False):
        for flag, name in (("--mesh-pack-multiple", "mesh_pack_multiple"), ("--mesh-pack-doc-tokens", "mesh_pack_doc_tokens")):
            if _get(args, name) is not None:
                raise MeshArgumentError(f"{flag} shapes --mesh-packed-data's packing, which this run does not use: add "
                                        "--mesh-packed-data or drop it")


def _check_lr_schedule(args) -> None:
    """Megatron's LR scheduler asserts warmup < decay (core/optimizer_param_scheduler.py, after the model is
    built; get_optimizer_param_scheduler in training/training.py: decay defaults to the whole run): said here
    with the flags to change, before anything starts."""
    fraction = _get(args, "lr_warmup_fraction", None)
    if _get(args, "train_iters", None):
        unit, decay = "iterations", _get(args, "lr_decay_iters", None) or _get(args, "train_iters")
        warmup, flags = _get(args, "lr_warmup_iters", 0) or 0, ("--lr-warmup-iters", "--lr-decay-iters", "--train-iters")
    elif _get(args, "train_samples", None):
        unit, decay = "samples", _get(args, "lr_decay_samples", None) or _get(args, "train_samples")
        warmup, flags = _get(args, "lr_warmup_samples", 0) or 0, ("--lr-warmup-samples", "--lr-decay-samples",
                                                                 "--train-samples")
    else:
        return
    if fraction is not None:
        if not 0 <= fraction < 1:
            raise MeshArgumentError(f"--lr-warmup-fraction {fraction} must be in [0, 1): Megatron's LR scheduler "
                                    "asserts warmup < decay")
        return
    if warmup >= decay:
        raise MeshArgumentError(
            f"{flags[0]} {warmup} is not below the LR decay's {decay} {unit} ({flags[1]}, or {flags[2]} where it is "
            f"unset): Megatron's LR scheduler asserts warmup < decay; raise {flags[2]} or lower {flags[0]}")


def _plan_search(args, opts: dict) -> int:
    """``--mesh-plan-search N``: refused where it would change nothing (no pruned plans: no document masking
    or window under mesh CP) and for N < 0."""
    from ..runtime import check_window, search_budget_error

    n = _get(args, "mesh_plan_search", 0) or 0
    why = search_budget_error(n)
    if why:
        raise MeshArgumentError(f"--mesh-plan-search counts replays per phase: {why}")
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    algo = _cp_algorithm(args)
    sizes = [int(x) for x in (_get(args, "hierarchical_context_parallel_sizes") or [])]
    if n and cp > 1 and algo in MESH_ALGORITHMS and len(sizes) >= 2 and sizes[-2] * sizes[-1] == 1:
        raise MeshArgumentError(
            f"--mesh-plan-search re-orders the mesh's pruned plans, and this run's mesh {'x'.join(map(str, sizes))} "
            "(--mesh-shape, given or chosen by auto) is one block with no transfers (Ulysses alone), so there is "
            "nothing to re-order: drop --mesh-plan-search, or give --mesh-shape UxAxB with A*B > 1")
    if not n or opts.get("documents") == "eod":
        return n
    window = _get(args, "window_size", None)
    windowed = cp > 1 and algo in MESH_ALGORITHMS and window is not None and check_window(tuple(window), True) is not None
    if not windowed:
        raise MeshArgumentError(
            "--mesh-plan-search re-orders the pruned plans of masked attention, which this run has none of (packed "
            "THD documents, --mesh-packed-data, and a window that bounds nothing run unpruned plans): add "
            "--reset-attention-mask (documents) or a sliding window under mesh CP, or drop --mesh-plan-search")
    return n


def _check_document_masking(args, launcher: bool, opts: dict) -> None:
    """``--reset-attention-mask`` (documents end at EOD tokens, Megatron's GPTDataset): honoured by
    mesh CP through the launcher (each micro-batch's EOD boundaries, unpadded, pruned plans, the
    tokens in the layout ``--mesh-layout`` chooses) and by Megatron's local attention at CP = 1 (its
    dense mask); refused wherever it would be dropped, as are ``--mesh-layout`` / ``--mesh-document-order``
    without it."""
    _check_documents(args, launcher, opts)
    if opts["documents"] == "eod" and int(_get(args, "mtp_num_layers", 0) or 0) > 0:
        # megatron/core/transformer/multi_token_prediction.py (core_v0.19.0): roll_tensor takes the
        # packed-sequence path whenever packed_seq_params is given, slicing each rank's tokens at cu_seqlens // CP
        raise MeshArgumentError(
            "--mtp-num-layers with --reset-attention-mask under mesh CP: Megatron's multi-token prediction shifts "
            "tokens, labels and loss mask per document of the batch's packed-sequence parameters as if each document "
            "were split over the CP ranks on its own (THD), while mesh CP splits the whole (re-laid) sequence, so the "
            "MTP targets would be wrong; drop --mtp-num-layers or --reset-attention-mask")
    layout = _layout(args)
    given = _get(args, "mesh_layout") is not None or _get(args, "mesh_document_order") is not None
    if given and opts["documents"] != "eod":
        flag = "--mesh-layout" if _get(args, "mesh_layout") is not None else "--mesh-document-order"
        if _get(args, "mesh_packed_data"):
            why = "--mesh-packed-data pads and lays out its own documents (THD)"
        elif not _get(args, "reset_attention_mask"):
            why = "it has no --reset-attention-mask, so attention crosses document boundaries"
        elif int(_get(args, "context_parallel_size", 1) or 1) <= 1:
            why = "CP = 1 runs Megatron's dense mask"
        else:
            why = "its CP is not mesh CP"
        raise MeshArgumentError(
            f"{flag} lays out the documents of --reset-attention-mask under mesh CP (CP > 1, this launcher); there are "
            f"none to lay out in this run ({why}): drop it")
    if opts["documents"] == "eod":
        cuts = _why_not_split(args)
        if layout in CUTTING_LAYOUTS and cuts:
            raise MeshArgumentError(f"--mesh-layout {layout} cuts documents into pieces, which {cuts}; use "
                                    "--mesh-layout auto, tiled, balanced or zigzag (auto then keeps documents whole)")
        if layout == "split-half":
            every = [int(x) for x in (_get(args, "hierarchical_context_parallel_sizes") or [])]
            sizes = every[-2:]
            if len(sizes) != 2 or sizes[0] % 2 or sizes[1] % 2:
                mesh = "x".join(map(str, sizes)) or "none"
                even = _even_sides(sizes[0] * sizes[1]) if len(sizes) == 2 else None
                lead = every[:-2]
                if even is None and len(sizes) == 2 and lead:  # a2a+mesh: a smaller Ulysses degree may leave one
                    cp, u = lead[0] * sizes[0] * sizes[1], lead[0]
                    smaller = next((d for d in range(u - 1, 0, -1) if u % d == 0 and _even_sides(cp // d)), None)
                    if smaller:
                        lead, even = [smaller], _even_sides(cp // smaller)
                fix = ("or a --mesh-shape with both sides even (e.g. " + "x".join(map(str, lead + list(even))) + ")"
                       if even else f"or a CP size that is a multiple of 4 (a x b = {sizes[0] * sizes[1]} has no such mesh)"
                       if len(sizes) == 2 else "or a --mesh-shape with both sides even (e.g. 2x2)")
                raise MeshArgumentError(f"{SPLIT_HALF_NEEDS}; this run's mesh is {mesh}: use --mesh-layout split "
                                        f"(over every chunk) or auto, {fix}")
        opts["layout"] = layout
        if layout == "auto" and cuts:  # said in the dry run and the log: auto keeps documents whole here
            opts["whole_documents"] = True
            opts["layout_note"] = (f"--mesh-layout auto keeps documents whole (zigzag, balanced or tiled, by the cost "
                                   f"model): split and tiled-cut cut them into pieces, "
                                   f"which {cuts}")
    else:
        opts["layout"] = "zigzag"


#: what both split-half refusals (a run's mesh, auto's shapes for its CP size) begin with
SPLIT_HALF_NEEDS = ("--mesh-layout split-half cuts documents over half of each mesh row's chunks, which needs a mesh "
                    "a x b with a and b even")


def _even_sides(n: int):
    """The squarest (a, b) with a * b = n and both even, or None (n not a multiple of 4)."""
    pairs = [(a, n // a) for a in range(2, n + 1, 2) if n % a == 0 and (n // a) % 2 == 0]
    return min(pairs, key=lambda p: abs(p[0] - p[1])) if pairs else None


def _layout(args) -> str:
    """``--mesh-layout`` (auto by default), or the older ``--mesh-document-order`` it replaces."""
    layout, order = _get(args, "mesh_layout"), _get(args, "mesh_document_order")
    if order is not None:
        old = {"given": "zigzag", "balanced": "balanced"}[order]
        if layout is not None and layout != old:
            raise MeshArgumentError(f"--mesh-document-order {order} is --mesh-layout {old}, which contradicts "
                                    f"--mesh-layout {layout}; pass --mesh-layout alone")
        return old
    return layout or "auto"


def _why_not_split(args) -> str:
    """Why this model cannot run a layout that cuts documents ('' when it can)."""
    if _get(args, "window_size") is not None:
        return "a sliding window (--window-size) does not take (its blocks are described piece by piece of the zigzag)"
    if _get(args, "multi_latent_attention", False):
        return "MLA's own rotary embedding does not follow (it would rotate the pieces at their new places)"
    pos = _get(args, "position_embedding_type", "learned_absolute") or "learned_absolute"
    if pos not in ("rope", "learned_absolute", "none"):
        return f"--position-embedding-type {pos} does not follow (only rope, learned_absolute and none are re-laid)"
    return ""


def _check_documents(args, launcher: bool, opts: dict) -> None:
    opts["documents"] = ""
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    algo = _cp_algorithm(args)
    if cp > 1 and algo in MESH_ALGORITHMS and _get(args, "eod_mask_loss", False) \
            and not _get(args, "calculate_per_token_loss", False):
        raise MeshArgumentError(
            "--eod-mask-loss with CP > 1 needs --calculate-per-token-loss: masking the EOD tokens leaves the CP ranks "
            "unequal numbers of loss tokens, and Megatron's default per-rank mean would weight them unequally (the "
            "gradients would not be those of CP = 1)")
    if not _get(args, "reset_attention_mask", False):
        return
    dense = bool(_get(args, "create_attention_mask_in_dataloader", True))
    if cp > 1 and algo in MESH_ALGORITHMS:
        if not launcher:
            raise MeshArgumentError(
                "--reset-attention-mask under mesh CP needs megatron-mesh-cp's launcher (scripts/pretrain_gpt_mesh.py or "
                "mesh-cp-pretrain), whose get_batch hands each micro-batch's EOD document boundaries to the attention; "
                "stock pretrain_gpt.py's get_batch does not, and the documents would be ignored")
        if dense:
            raise MeshArgumentError(
                "--reset-attention-mask with --create-attention-mask-in-dataloader (the default) builds a dense "
                "S x S mask per sample that mesh CP never reads (4 TiB at 1M tokens); pass "
                "--no-create-attention-mask-in-dataloader: mesh CP takes the documents from the EOD tokens")
        mbs = int(_get(args, "micro_batch_size", 1) or 1)
        if mbs != 1:
            raise MeshArgumentError(
                f"--reset-attention-mask under mesh CP runs one sequence per micro-batch (each has its own documents); "
                f"use --micro-batch-size 1 (got {mbs}) and reach the global batch by gradient accumulation")
        if _get(args, "mesh_packed_data", False):
            raise MeshArgumentError("--reset-attention-mask and --mesh-packed-data are two ways to mask documents; "
                                    "pass one of them")
        opts["documents"] = "eod"
        return
    if not launcher:  # Megatron's own paths without mesh CP are Megatron's
        return
    if cp > 1:
        raise MeshArgumentError(
            f"--reset-attention-mask with --context-parallel-algo {algo}: Transformer Engine's causal attention ignores "
            "Megatron's dense document mask, so documents would attend across each other; use "
            "--context-parallel-algo mesh or a2a+mesh (document masking from the EOD tokens)")
    if not dense:
        raise MeshArgumentError(
            "--reset-attention-mask at CP = 1 with --no-create-attention-mask-in-dataloader: no attention would see the "
            "documents (at CP = 1 Megatron's local attention reads the dataloader's dense mask); drop "
            "--no-create-attention-mask-in-dataloader, or run mesh CP (CP > 1)")
    from .attention import _te_attention

    if _te_attention() is not None:
        raise MeshArgumentError(
            "--reset-attention-mask at CP = 1 would run Transformer Engine's attention, whose causal mask ignores "
            "Megatron's dense document mask; run mesh CP (CP > 1), or --transformer-impl local without TE")


def _check_packed_data(args) -> None:
    """``--mesh-packed-data``: the packing multiple must split every document over the CP ranks."""
    if not _get(args, "mesh_packed_data", False):
        return
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    algo = _get(args, "context_parallel_algo")
    if cp > 1 and algo not in MESH_ALGORITHMS:
        raise MeshArgumentError("--mesh-packed-data runs with --context-parallel-algo mesh or a2a+mesh (or CP = 1)")
    if int(_get(args, "tensor_model_parallel_size", 1) or 1) > 1 or int(_get(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise MeshArgumentError("--mesh-packed-data is built for TP = PP = 1 (the launcher does not broadcast "
                                "packed batches over TP or pipeline stages); drop it or the TP/PP sizes")
    multiple = _get(args, "mesh_pack_multiple") or 2 * cp
    if multiple % (2 * cp):
        raise MeshArgumentError(f"--mesh-pack-multiple {multiple} is not a multiple of 2 * CP = {2 * cp}; "
                                "every document must split into 2 * CP equal pieces")
    seq = _get(args, "seq_length")
    if seq is not None and seq % multiple:
        raise MeshArgumentError(f"--seq-length {seq} is not a multiple of the packing multiple {multiple}")
    if cp > 1 and not _get(args, "calculate_per_token_loss", False):
        raise MeshArgumentError(
            "--mesh-packed-data with CP > 1 needs --calculate-per-token-loss: padding leaves the CP ranks unequal "
            "numbers of loss tokens, and Megatron's default per-rank mean would weight them unequally (the "
            "gradients would not be those of CP = 1)"
        )
    args.mesh_pack_multiple = multiple


def _apply_cp_algo(args, argv: Optional[Sequence[str]] = None, opts: Optional[dict] = None):
    """The CP-algorithm part of :func:`apply_mesh_args` (what it resolves goes into ``opts``)."""
    opts = {} if opts is None else opts
    algo = _get(args, "context_parallel_algo")
    shape_text = _get(args, "mesh_shape")
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    comm = _as_list(_get(args, "cp_comm_type"))
    comm_explicit = _explicit(argv, "--cp-comm-type") or (comm and comm != ["p2p"])
    if algo is None:
        if any(c in MESH_ALGORITHMS for c in comm):
            algo = next(c for c in comm if c in MESH_ALGORITHMS)  # --cp-comm-type mesh selects mesh too
        elif shape_text is not None:
            raise MeshArgumentError("--mesh-shape needs --context-parallel-algo mesh (or a2a+mesh)")
        else:
            return args
    if algo not in ALGORITHMS:
        raise MeshArgumentError(f"--context-parallel-algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
    if algo in MESH_ALGORITHMS and len(comm) > 1:  # Megatron's per-layer list
        try:
            comm = variant_args.check_cp_comm_list(comm, algo, _get(args, "num_layers"))
        except ValueError as exc:
            raise MeshArgumentError(str(exc)) from None
    if comm_explicit and comm and any(c != algo for c in comm):
        raise MeshArgumentError(
            f"--context-parallel-algo {algo} contradicts --cp-comm-type {' '.join(comm)}; pass only one of them"
        )
    if algo not in MESH_ALGORITHMS:
        if shape_text is not None:
            raise MeshArgumentError(f"--mesh-shape only applies to --context-parallel-algo mesh or a2a+mesh, not {algo}")
        _set(args, "cp_comm_type", [algo])
        return args
    if cp <= 1:
        raise MeshArgumentError(
            f"--context-parallel-algo {algo} needs --context-parallel-size > 1 (with CP = 1 nothing is split); "
            "raise --context-parallel-size or drop --context-parallel-algo"
        )
    seq = _get(args, "seq_length")
    if seq is not None and seq % (2 * cp):
        raise MeshArgumentError(
            f"--seq-length {seq} is not divisible by 2 * context-parallel-size = {2 * cp}; "
            f"use a multiple of {2 * cp}"
        )
    dropout = _get(args, "attention_dropout", 0.0)
    if dropout:
        raise MeshArgumentError(f"mesh CP does not support attention dropout ({dropout}); set --attention-dropout 0")
    if _get(args, "attention_backend") is not None and str(_get(args, "attention_backend")).endswith("local"):
        raise MeshArgumentError(
            "--attention-backend local makes Megatron swap in its own (CP = 1 only) attention; "
            "drop it (the default auto keeps mesh attention)"
        )
    if _get(args, "sft", False) or _get(args, "dataloader_inter_document_masking", False):
        raise MeshArgumentError(
            "Megatron's packed datasets (--sft / --dataloader-inter-document-masking) do not pad documents to a "
            f"multiple of 2 * CP = {2 * cp}, which mesh CP's per-document split needs; use this launcher's "
            "--mesh-packed-data, or pass PackedSeqParams with cu_seqlens_padded from your own data pipeline"
        )
    _refuse_incompatible_features(args)
    opts["max_live"] = None  # an explicit shape plans without a limit; auto sets the one that fits its budget
    if algo == "a2a+mesh":
        sizes = _resolve_hybrid_shape(args, shape_text or "auto", cp, opts)
    else:
        shape = _resolve_shape(args, shape_text or "auto", cp, opts)
        sizes = [shape.a, shape.b]
    text = "x".join(map(str, sizes))
    hier = _get(args, "hierarchical_context_parallel_sizes")
    if hier and list(hier) != sizes:
        raise MeshArgumentError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, hier))} contradicts mesh shape {text} "
            f"(they must be {sizes}); drop one of them"
        )
    _set(args, "hierarchical_context_parallel_sizes", sizes)
    _set(args, "cp_comm_type", comm if len(comm) > 1 else [algo])  # a per-layer list: every entry is algo
    _set(args, "context_parallel_algo", algo)
    _set(args, "mesh_shape", text)
    opts["kernel"] = _get(args, "mesh_kernel", "auto") or "auto"
    opts["deterministic"] = bool(_get(args, "deterministic_mode", False))
    _check_kernel(args, cp, opts["kernel"], opts["deterministic"])
    opts["partial_dtype"] = torch.bfloat16 if _get(args, "mesh_partial_dtype", "fp32") == "bf16" else None
    opts["planner"] = _get(args, "mesh_planner", "greedy") or "greedy"
    opts["check_finite"] = bool(_get(args, "mesh_check_finite", False))
    return args


def _refuse_incompatible_features(args) -> None:
    """Megatron features that cannot run with mesh CP, refused at start-up with the reason."""
    from .precision import check_fp8_attention

    try:  # TE's FP8 attention (--fp8-format alone is fine: FP8 GEMMs, attention in bf16; precision.py)
        check_fp8_attention(lambda name, default=None: _get(args, name, default))
    except ValueError as exc:
        raise MeshArgumentError(str(exc)) from None
    if _get(args, "hybrid_context_parallel", False):
        raise MeshArgumentError(
            "--hybrid-context-parallel regroups CP ranks per packed sample; mesh CP needs one fixed CP group "
            "of a*b ranks and no packed sequences; drop --hybrid-context-parallel"
        )
    graphs = str(_get(args, "cuda_graph_impl", "none") or "none")
    if graphs != "none" or _get(args, "enable_cuda_graph", False) or _get(args, "external_cuda_graph", False):
        raise MeshArgumentError(
            "CUDA graphs (--cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph) are not supported with "
            "mesh CP: its attention chooses and issues its ring transfers from Python on every call, which a "
            "graph replay would skip; drop the CUDA-graph flag"
        )


def _cluster(args):
    from ..planning import load_cluster
    from ..planning import default_cluster

    name = _get(args, "mesh_cluster")
    try:
        return load_cluster(name) if name else default_cluster()
    except ValueError as exc:
        raise MeshArgumentError(f"--mesh-cluster: {exc}") from None


def _tp(args) -> int:
    return int(_get(args, "tensor_model_parallel_size", 1) or 1)


def _layer(args, cp: int):
    """One rank's attention inputs: (tokens, micro batch, heads, kv heads, q/k head dim) after TP and CP."""
    tp = _tp(args)
    heads = int(_get(args, "num_attention_heads"))
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention", False) else None
    kv_heads = int(groups or heads)
    head_dim, _ = variant_args.head_dims(lambda name, default=None: _get(args, name, default))
    return (int(_get(args, "seq_length")) // cp, int(_get(args, "micro_batch_size", 1) or 1), max(1, heads // tp),
            max(1, kv_heads // tp), int(head_dim))


def _check_kernel(args, cp: int, kernel: str, deterministic: bool) -> None:
    """Choose and check the block kernel for this model's attention inputs now, before any process
    group: a forced backend that cannot run them (or TE without a fused backend for them on this GPU
    and cuDNN, e.g. head dim > 128 off sm90, or --deterministic-mode where TE has no deterministic
    backward; MLA's value head dim, a sliding window, the max logit of --qk-clip) fails here, naming
    the alternative; with documents (--mesh-packed-data, --reset-attention-mask) the backend must also
    run packed (THD) blocks, and windows over them. On CUDA the check runs on this rank's own GPU."""
    from ..runtime import KernelNeeds, get_kernel, input_spec, select_kernel

    try:
        if not torch.cuda.is_available():
            if kernel != "auto":
                get_kernel(kernel, "cpu")
            return
        s, b, h, hk, d = _layer(args, cp)
        _, dv = variant_args.head_dims(lambda name, default=None: _get(args, name, default))
        half = torch.bfloat16 if _get(args, "bf16", False) else torch.float16 if _get(args, "fp16", False) else torch.float32
        local = _get(args, "local_rank", None)
        local = int(local if local is not None else os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        with torch.cuda.device(dev):
            q = input_spec((s, b, h, d), half, dev)
            documents = bool(_get(args, "mesh_packed_data", False) or _get(args, "reset_attention_mask", False))
            kk, vv = input_spec((s, b, hk, d), half, dev), input_spec((s, b, hk, dv), half, dev)
            window = _get(args, "window_size") is not None  # the kernel runs the window layers' partial blocks
            top = bool(_get(args, "qk_clip", False) or _get(args, "log_max_attention_logit", False))
            select_kernel(kernel, KernelNeeds(q, kk, vv, deterministic=deterministic, varlen=documents, window=window,
                                              window_documents=window and documents, max_logit=top,
                                              max_logit_packed=top and documents))
    except ValueError as exc:
        raise MeshArgumentError(f"--mesh-kernel {kernel}: {exc}") from None


def _resolve_shape(args, text: str, cp: int, opts: dict) -> MeshShape:
    cluster = _cluster(args)
    opts["cluster"] = cluster
    if str(text).lower() != "auto":
        if str(text).lower().replace("×", "x").count("x") == 2:
            raise MeshArgumentError(f"--mesh-shape {text} has three factors (UxAxB); use --context-parallel-algo a2a+mesh")
        try:
            return MeshShape.for_size(parse_shape(text), cp)
        except ValueError as exc:
            raise MeshArgumentError(f"--mesh-shape: {exc}") from None
    from ..planning import cached_choice

    choice = cached_choice("mesh", cp, cluster, _workload(args, cp), stride=_tp(args),  # choose_shape, on disk
                           even=_auto_even(args, cp))
    opts["shape_explanation"] = choice.explanation  # choose_shape has logged it
    opts["max_live"] = choice.max_live  # the plans that run are the ones that fit the budget
    return choice.shape


def _auto_even(args, cp: int) -> bool:
    """Whether ``--mesh-shape auto`` chooses only among meshes a x b with a and b even (of u x a x b for
    a2a+mesh): ``--mesh-layout split-half`` over the documents of ``--reset-attention-mask`` needs them.
    Where the CP size has none (not a multiple of 4; u = 1 is always a Ulysses degree) it is refused here,
    before any shape is simulated."""
    if not (_get(args, "reset_attention_mask", False) and not _get(args, "mesh_packed_data", False)
            and _layout(args) == "split-half") or _why_not_split(args):
        return False  # (a model that cannot cut documents is refused for that reason, after the shape)
    if _even_sides(cp) is None:
        raise MeshArgumentError(
            f"{SPLIT_HALF_NEEDS}; CP = {cp} has none (a x b = {cp} is not a multiple of 4), so --mesh-shape auto cannot "
            f"choose one: use --mesh-layout split (over every chunk) or auto, or a CP size that is a multiple of 4")
    return True


def _workload(args, cp: int):
    from ..planning import Workload

    seq_local, batch, heads, kv_heads, head_dim = _layer(args, cp)
    half = _get(args, "bf16", False) or _get(args, "fp16", False)
    return Workload(
        seq_local=seq_local, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        batch=batch, causal=True, bytes_per_element=2 if half else 4,
        partial_bytes=2 if _get(args, "mesh_partial_dtype", "fp32") == "bf16" else 4,
    )


def _parse_hybrid(text: str) -> List[int]:
    parts = str(text).lower().replace("×", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise MeshArgumentError(
            f"--mesh-shape for a2a+mesh must look like UxAxB (Ulysses degree x mesh tile, e.g. 2x2x4) or auto, got {text!r}"
        )
    return [int(p) for p in parts]


def _resolve_hybrid_shape(args, text: str, cp: int, opts: dict) -> List[int]:
    """[u, a, b] for a2a+mesh, validated against the CP size, the heads and (if known) the node size."""
    from ..runtime import valid_ulysses

    cluster = _cluster(args)
    opts["cluster"] = cluster
    _, _, heads, _, _ = _layer(args, cp)
    tp = _tp(args)
    if str(text).lower() == "auto":
        from ..planning import cached_choice

        choice = cached_choice("a2a+mesh", cp, cluster, _workload(args, cp), stride=tp,  # choose_hybrid_shape, on disk
                               even=_auto_even(args, cp))
        opts["shape_explanation"] = choice.explanation  # choose_hybrid_shape has logged it
        opts["max_live"] = choice.max_live
        return [choice.u, choice.shape.a, choice.shape.b]
    u, a, b = _parse_hybrid(text)
    if u * a * b != cp:
        raise MeshArgumentError(
            f"--mesh-shape {text}: {u}x{a}x{b} = {u * a * b} ranks but --context-parallel-size is {cp}; "
            f"choose U, A, B with U*A*B = {cp}"
        )
    if heads % u:
        raise MeshArgumentError(
            f"--mesh-shape {text}: the Ulysses degree {u} does not divide the {heads} attention heads per rank "
            f"(--num-attention-heads / --tensor-model-parallel-size {tp}); use U in {valid_ulysses(heads, cp)}"
        )
    known = _get(args, "mesh_cluster") or os.environ.get("MESH_CP_CLUSTER")
    if known and u * tp > cluster.gpus_per_node:
        fit = [x for x in valid_ulysses(heads, cp) if x * tp <= cluster.gpus_per_node]
        raise MeshArgumentError(
            f"--mesh-shape {text}: a Ulysses group of {u} ranks x TP {tp} = {u * tp} GPUs spans more than one "
            f"node of {cluster.name} ({cluster.gpus_per_node} GPUs); use U in {fit}"
        )
    return [u, a, b]


def apply_mesh_args_or_exit(args, argv: Optional[Sequence[str]] = None):
    """:func:`apply_mesh_args` for command lines (the patched stock ``pretrain_gpt.py``): a bad
    setting prints one ``error:`` line (from rank 0; ``$RANK``) and exits with code 2, as argparse
    does, instead of a traceback on every rank."""
    try:
        return apply_mesh_args(args, argv, launcher=False)
    except MeshArgumentError as exc:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
