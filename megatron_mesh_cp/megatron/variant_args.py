"""Megatron's attention-variant settings under mesh CP: the ones honoured and the ones refused.

Honoured under ``mesh`` and ``a2a+mesh`` (MeshCoreAttention): ``--window-size`` on the layers
``--window-attn-skip-freq`` gives a window (window-pruned plans there, full plans elsewhere, one
mesh), ``--softmax-type off-by-one|learnable``, ``--qk-clip`` / ``--log-max-attention-logit`` (the
max logit), ``--multi-latent-attention`` (key and value head dims may differ), and a per-layer
``--cp-comm-type`` list whose entries are all ``mesh`` (or all ``a2a+mesh``). Refused before any
process group, naming the fix: a list mixing mesh with TE's algorithms (or with the other mesh
algorithm), a window seeing keys to the right of a causal query, a window with padded THD
documents (``--mesh-packed-data``), and at CP = 1 a window with ``--reset-attention-mask`` (Megatron's
local attention replaces the document mask by its window mask).
:mod:`.arguments` calls these with its settings and raises their ``ValueError`` as its own error.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

__all__ = ["check_cp_comm_list", "check_attention_variants", "head_dims"]

MESH_ALGORITHMS = ("mesh", "a2a+mesh")


def head_dims(get: Callable) -> Tuple[int, int]:
    """(query/key head dim, value head dim) from ``get(name, default)``: MLA's qk-head-dim +
    qk-pos-emb-head-dim and v-head-dim, else kv-channels (or hidden / heads) for both."""
    if get("multi_latent_attention", False):
        qk = int(get("qk_head_dim", 0) or 0) + int(get("qk_pos_emb_head_dim", 0) or 0)
        return qk, int(get("v_head_dim", 0) or 0)
    d = get("kv_channels", None) or int(get("hidden_size", None)) // int(get("num_attention_heads", None))
    return int(d), int(d)


def check_cp_comm_list(comm: List[str], algo: str, num_layers) -> List[str]:
    """The ``cp_comm_type`` to set for mesh algorithm ``algo``: Megatron's per-layer list kept when
    every entry is ``algo`` (window layers then run window-pruned plans, the others full plans, on
    the same mesh), else ``[algo]``; a list mixing algorithms is refused."""
    if len(comm) <= 1:
        return [algo]
    others = sorted(set(comm) - {algo})
    if any(c not in MESH_ALGORITHMS for c in others):
        raise ValueError(
            f"--cp-comm-type {' '.join(comm)} mixes {algo} with Transformer Engine's CP algorithms "
            f"({', '.join(c for c in others if c not in MESH_ALGORITHMS)}) per layer, which is not built; give every "
            f"layer {algo} (sliding-window layers then run window-pruned plans and full layers full plans on the "
            f"same mesh), or one TE algorithm for every layer")
    if others:
        raise ValueError(
            f"--cp-comm-type {' '.join(comm)} mixes mesh and a2a+mesh per layer, which is not built (Megatron builds "
            "one set of hierarchical CP groups: [a, b] for mesh, [u, a, b] for a2a+mesh); give every layer the same one")
    if num_layers is not None and len(comm) != int(num_layers):
        raise ValueError(
            f"--cp-comm-type lists {len(comm)} algorithms for {num_layers} layers; give one per layer (or just one)")
    return list(comm)


def check_attention_variants(get: Callable, launcher: bool) -> None:
    """Refuse the attention variants a path would not honour (see the module docstring); ``get(name,
    default)`` reads a setting, ``launcher``: megatron_mesh_cp's launcher runs (its CP = 1 path is
    Megatron's local attention)."""
    window = get("window_size", None)
    if window is None:
        return
    from ..runtime.masks import check_window

    cp = int(get("context_parallel_size", 1) or 1)
    algo = get("context_parallel_algo", None)
    text = ",".join(map(str, window)) if isinstance(window, (tuple, list)) else str(window)
    if cp > 1 and algo in MESH_ALGORITHMS:
        try:
            check_window(tuple(window) if isinstance(window, (tuple, list)) else window, causal=True)
        except ValueError as exc:  # the launcher and pretrain_gpt.py train causal GPTs
            raise ValueError(f"--window-size {text}: {exc}") from None
        if get("mesh_packed_data", False):
            raise ValueError(
                "--window-size with --mesh-packed-data: a sliding window over padded THD documents is not built; "
                "mask the documents with --reset-attention-mask --no-create-attention-mask-in-dataloader (unpadded, "
                "takes windows)")
    elif cp == 1 and launcher and get("reset_attention_mask", False):
        raise ValueError(
            f"--window-size {text} with --reset-attention-mask at CP = 1: Megatron's local attention replaces the "
            "dataloader's document mask by its window mask, so documents would attend across each other; run mesh "
            "CP (CP > 1), which applies both")
