"""Two C++ rules of Transformer Engine's F16 fused attention that the TE stand-ins (fake_kernels) follow.

* The sliding-window clause of ``nvte_get_fused_attn_backend`` (``common/fused_attn/fused_attn.cpp``):
  which (mask, window) pairs have a backend. Before cuDNN 9.2: no window. From 9.2: ``no_mask`` with
  (-1, -1), or a (left, 0) window with ``no_mask`` / ``causal`` (sq <= skv, bshd/sbhd only) -- so the
  ``padding`` masks have no backend at all with cuDNN 9.2-9.5. From 9.6: any mask with (-1, -1) or
  (-1, 0), and two-sided windows with the bottom-right and ``padding`` masks (sq <= skv); ``no_mask``
  joins that list in v2.16 (it is absent at v2.12-v2.15, present at v2.16-v2.18).
* The cuDNN graph caches of ``fused_attn_f16_arbitrary_seqlen.cu`` (v2.18): one ``static thread_local
  std::map<FADescriptor_v1, graph>`` per direction, never evicted. The key holds b, heads, kv heads,
  s_q, s_kv, head dims, scale, layout, mask, window, alignment, determinism, dtype, max logit. Only
  ragged (THD) inputs are bucketed, and only with cuDNN >= 9.6 (and not on sm120 from v2.14): b
  becomes ``get_max_batch_size(b)`` (the forward keeps the real b from v2.18 with cuDNN >= 9.24,
  which passes ``cu_seqlens`` to cuDNN directly) and s_q / s_kv become ``get_max_tokens`` of the
  token counts (``common/fused_attn/utils.cu``). Every other call's key holds its exact sizes.

:func:`window_backend` returns whether the clause holds; :func:`record_graph` adds a call's key to
:data:`GRAPHS` under the current :data:`PROCESS` (the caches are per process: one per rank).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

#: distinct graph keys per process ("rank") and direction, as TE's caches would hold them
GRAPHS: Dict[object, Dict[str, set]] = {}
#: the process the next calls run in (a virtual rank, set by whoever drives several in one process)
PROCESS = {"rank": 0}

_PADDING = ("padding", "padding_causal", "padding_causal_bottom_right")
_BOTTOM_RIGHT = ("causal_bottom_right", "padding_causal_bottom_right")


def get_max_batch_size(b: int) -> int:
    """``get_max_batch_size`` (utils.cu): 32 up to 32 sequences, then the next power of two up to
    512, then multiples of 512."""
    log2_b = math.ceil(math.log2(b)) if b > 0 else 0
    if log2_b <= 5:
        return 32
    if log2_b <= 9:
        return 2 ** log2_b
    return (b + 511) // 512 * 512


def get_max_tokens(t: int) -> int:
    """``get_max_tokens`` (utils.cu): 1024 up to 1024 tokens, then the next power of two up to 32K,
    then multiples of 32K."""
    log2_t = math.ceil(math.log2(t)) if t > 0 else 0
    if log2_t <= 10:
        return 1024
    if log2_t <= 15:
        return 2 ** log2_t
    return (t + 32767) // 32768 * 32768


def window_backend(mask: str, window: Tuple[int, int], sq: int, skv: int, fmt: str, te: Tuple[int, int],
                   cudnn: Tuple[int, int, int], cap: Tuple[int, int]) -> bool:
    """The sliding-window clause of ``nvte_get_fused_attn_backend`` for a training call without bias
    or dropout (fused_attn.cpp@v2.15 L445-L479, @v2.16 L412-L447: the same but for ``NVTE_NO_MASK``
    in the 9.6 list). ``fmt``: "sbhd" or "thd"."""
    left, right = window
    if cudnn == (9, 14, 0) and skv > 1024 and left != -1 and mask not in ("causal", "causal_bottom_right"):
        return False  # fused_attn.cpp@v2.12-v2.18: no non-causal windowed backend past 1024 keys on cuDNN 9.14.0
    if cudnn < (9, 2, 0):
        return left == -1 and right in (-1, 0)
    if left == -1 and right == -1 and mask == "no_mask":
        return True
    if left >= -1 and right == 0 and sq <= skv and fmt in ("sbhd", "bshd") and (
            mask in ("no_mask", "causal") or (mask == "causal_bottom_right" and sq == skv)):
        return True
    if cudnn < (9, 6, 0):
        return False
    if left == -1 and right in (-1, 0):
        return True
    two_sided = set(_PADDING) | {"causal_bottom_right"} | ({"no_mask"} if te >= (2, 16) else set())
    if mask in ("causal_bottom_right", "padding_causal_bottom_right") and cap >= (10, 0) and cudnn <= (9, 7, 0) \
            and sq != skv:
        return False  # the sm100 bottom-right cross-attention bug TE works around
    return left >= -1 and right >= -1 and mask in two_sided and sq <= skv


def record_graph(direction: str, *, b: int, h: int, hg: int, s_q: int, s_kv: int, t_q: int, t_kv: int, d_qk: int,
                 d_v: int, scale: float, layout: str, mask: str, window: Tuple[int, int],
                 bottom_right: Optional[bool], deterministic: bool, dtype, max_logit: bool, te: Tuple[int, int],
                 cudnn: Tuple[int, int, int], cap: Tuple[int, int]) -> tuple:
    """Form the FADescriptor_v1 key of one forward (``direction="fwd"``) or backward call as
    fused_attn_f16_arbitrary_seqlen.cu@v2.18 does (L113-L129 and L143-L183 forward, L691-L745
    backward), record it for the current process and return it. ``s_q``/``s_kv``: the call's
    max_seqlen; ``t_q``/``t_kv``: its token counts (dim 0 of THD tensors)."""
    thd = layout.startswith("thd")
    brd = bool(bottom_right) if bottom_right is not None else mask in _BOTTOM_RIGHT  # the Python default
    if mask in _BOTTOM_RIGHT and s_q == s_kv and mask not in _PADDING:
        brd = False  # square bottom-right causal is plain causal
    if thd and cudnn >= (9, 6, 0) and not (cap == (12, 0) and te >= (2, 14)):
        if not (direction == "fwd" and te >= (2, 18) and cudnn >= (9, 24, 0)):
            b = get_max_batch_size(b)
        s_q, s_kv = get_max_tokens(t_q), get_max_tokens(t_kv)
    key = (b, h, hg, s_q, s_kv, d_qk, d_v, float(scale), layout, mask, tuple(window), brd,
           bool(deterministic) if direction == "bwd" else True, str(dtype), bool(max_logit) and direction == "fwd")
    GRAPHS.setdefault(PROCESS["rank"], {"fwd": set(), "bwd": set()})[direction].add(key)
    return key


def graph_counts() -> Dict[object, Tuple[int, int]]:
    """Distinct (forward, backward) graph keys per process so far."""
    return {rank: (len(d["fwd"]), len(d["bwd"])) for rank, d in GRAPHS.items()}
