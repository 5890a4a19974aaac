"""Command-line switches for mesh CP and their mapping onto Megatron's own settings.

``--context-parallel-algo {p2p,all_gather,a2a,a2a+p2p,mesh}`` selects the CP algorithm (for the
non-mesh values it is an alias of ``--cp-comm-type``); ``--mesh-shape AxB|auto`` the tile.
:func:`apply_mesh_args` maps them onto ``cp_comm_type`` and ``hierarchical_context_parallel_sizes``
(Megatron builds the row and column rings as its hierarchical CP groups) and rejects every
inconsistent combination *before* training starts -- never a silent fallback to another algorithm
or to CP = 1. It works on flat argparse namespaces and on Megatron's ``--yaml-cfg`` namespaces
(settings under ``model_parallel``).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

import torch

from ..topology import MeshShape, parse_shape
from .settings import SETTINGS

__all__ = ["ALGORITHMS", "add_mesh_args", "apply_mesh_args", "MeshArgumentError"]

ALGORITHMS = ("p2p", "all_gather", "a2a", "a2a+p2p", "mesh")
KERNELS = ("auto", "torch", "te", "flash")


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
    add("--mesh-shape", default=None, help="mesh tile AxB with A*B = --context-parallel-size, or auto (default with mesh)")
    add("--mesh-kernel", choices=KERNELS, default="auto", help="block-kernel backend for mesh CP")
    add("--mesh-partial-dtype", choices=("fp32", "bf16"), default="fp32",
        help="wire dtype of partial O/dQ/dKV (fp32: exact; bf16: half the reduction bytes)")
    add("--mesh-planner", choices=("greedy", "in-order"), default="greedy")
    add("--mesh-cluster", default=None,
        help="cluster preset or YAML the greedy planner and mesh-shape=auto tune for (default h100-ib400)")
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


def _explicit(argv: Optional[Sequence[str]], flag: str) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def apply_mesh_args(args, argv: Optional[Sequence[str]] = None):
    """Validate the mesh switches and map them onto Megatron's settings; returns ``args``.

    Raises :class:`MeshArgumentError` naming the fix. ``argv`` (default ``sys.argv[1:]``) tells
    which flags were given explicitly, so a contradicting ``--cp-comm-type`` is caught.
    """
    algo = _get(args, "context_parallel_algo")
    shape_text = _get(args, "mesh_shape")
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    comm = _as_list(_get(args, "cp_comm_type"))
    comm_explicit = _explicit(argv, "--cp-comm-type") or (comm and comm != ["p2p"])
    if algo is None:
        if "mesh" in comm:
            algo = "mesh"  # --cp-comm-type mesh selects mesh too
        elif shape_text is not None:
            raise MeshArgumentError("--mesh-shape needs --context-parallel-algo mesh")
        else:
            return args
    if algo not in ALGORITHMS:
        raise MeshArgumentError(f"--context-parallel-algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
    if comm_explicit and comm and any(c != algo for c in comm):
        raise MeshArgumentError(
            f"--context-parallel-algo {algo} contradicts --cp-comm-type {' '.join(comm)}; pass only one of them"
        )
    if algo != "mesh":
        if shape_text is not None:
            raise MeshArgumentError(f"--mesh-shape only applies to --context-parallel-algo mesh, not {algo}")
        _set(args, "cp_comm_type", [algo])
        return args
    if cp <= 1:
        raise MeshArgumentError(
            "--context-parallel-algo mesh needs --context-parallel-size > 1 (with CP = 1 nothing is split); "
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
            "mesh CP does not support packed sequences (THD) yet; drop --sft / --dataloader-inter-document-masking "
            "or use another --context-parallel-algo"
        )
    if _get(args, "window_size") is not None:
        raise MeshArgumentError("mesh CP does not support sliding-window attention yet; drop --window-size")
    shape = _resolve_shape(args, shape_text or "auto", cp)
    hier = _get(args, "hierarchical_context_parallel_sizes")
    if hier and list(hier) != [shape.a, shape.b]:
        raise MeshArgumentError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, hier))} contradicts mesh shape {shape} "
            f"(they must be [{shape.a}, {shape.b}]); drop one of them"
        )
    _set(args, "hierarchical_context_parallel_sizes", [shape.a, shape.b])
    _set(args, "cp_comm_type", ["mesh"])
    _set(args, "context_parallel_algo", "mesh")
    _set(args, "mesh_shape", f"{shape.a}x{shape.b}")
    SETTINGS.kernel = _get(args, "mesh_kernel", "auto") or "auto"
    if SETTINGS.kernel != "auto":  # a forced backend must exist here, before any process group
        from ..kernels import get_kernel

        try:
            get_kernel(SETTINGS.kernel, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as exc:
            raise MeshArgumentError(f"--mesh-kernel {SETTINGS.kernel}: {exc}") from None
    SETTINGS.partial_dtype = torch.bfloat16 if _get(args, "mesh_partial_dtype", "fp32") == "bf16" else None
    SETTINGS.planner = _get(args, "mesh_planner", "greedy") or "greedy"
    return args


def _cluster(args):
    from ..cluster import load_cluster
    from ..schedule import default_cluster

    name = _get(args, "mesh_cluster")
    try:
        return load_cluster(name) if name else default_cluster()
    except ValueError as exc:
        raise MeshArgumentError(f"--mesh-cluster: {exc}") from None


def _resolve_shape(args, text: str, cp: int) -> MeshShape:
    cluster = _cluster(args)
    SETTINGS.cluster = cluster
    if str(text).lower() != "auto":
        try:
            return MeshShape.for_size(parse_shape(text), cp)
        except ValueError as exc:
            raise MeshArgumentError(f"--mesh-shape: {exc}") from None
    from ..autoshape import choose_shape
    from ..cluster import Workload

    tp = int(_get(args, "tensor_model_parallel_size", 1) or 1)
    heads = int(_get(args, "num_attention_heads"))
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention", False) else None
    kv_heads = int(groups or heads)
    head_dim = _get(args, "kv_channels") or int(_get(args, "hidden_size")) // heads
    seq = int(_get(args, "seq_length"))
    half = _get(args, "bf16", False) or _get(args, "fp16", False)
    w = Workload(
        seq_local=seq // cp, heads=max(1, heads // tp), kv_heads=max(1, kv_heads // tp), head_dim=int(head_dim),
        batch=int(_get(args, "micro_batch_size", 1) or 1), causal=True, bytes_per_element=2 if half else 4,
        partial_bytes=2 if _get(args, "mesh_partial_dtype", "fp32") == "bf16" else 4,
    )
    choice = choose_shape(cp, cluster, w, stride=tp)
    SETTINGS.shape_explanation = choice.explanation  # choose_shape has logged it
    return choice.shape
