"""FP8 (and FP4) under mesh CP: Transformer Engine's low-precision GEMMs run, attention stays in bf16/fp16.

``--fp8-format`` (``TransformerConfig.fp8``) makes Megatron run TE's linear layers under TE's FP8
autocast with the ``--fp8-recipe`` (``--fp4-format``: NVFP4 the same way). Under mesh CP the core
attention is :class:`~megatron_mesh_cp.megatron.attention.MeshCoreAttention`: its block kernels
(TE's ``fused_attn_fwd``/``fused_attn_bwd`` called with the layer's bf16/fp16 q, k, v and no
quantizers, so TE selects its F16 backend; flash-attn; torch SDPA) compute attention in the model's
dtype, and the partials it sends and merges are fp32 (or bf16). TE's FP8 attention is reached only
through ``TransformerConfig.fp8_dot_product_attention`` / ``fp8_multi_head_attention``, which
megatron-core hands to TE's recipe as ``fp8_dpa`` / ``fp8_mha`` (0.19.2 ``core/fp8_utils.py``,
``core/extensions/transformer_engine.py``) and which have no command-line flag in 0.19.2 or 0.20
(``training/arguments.py`` lists them under "no CLI argument exists for these"): a Megatron-Bridge
``mixed_precision`` config, a ``TransformerConfig`` built in code, or an ``args`` attribute set by an
extra-arguments provider. Mesh CP does not run FP8 attention, so those are refused, naming the fix.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["FP8_ATTENTION_FIELDS", "check_fp8_attention", "precision_line"]

#: the TransformerConfig fields that turn on TE's FP8 attention (recipe fp8_dpa / fp8_mha)
FP8_ATTENTION_FIELDS = ("fp8_dot_product_attention", "fp8_multi_head_attention")


def check_fp8_attention(get: Callable) -> None:
    """``ValueError`` naming the fix if a setting asks for TE's FP8 attention (``get(name, default)``
    reads a setting of the config or the argument namespace) under mesh CP."""
    asked = [name for name in FP8_ATTENTION_FIELDS if get(name, False)]
    if asked:
        raise ValueError(
            f"{' and '.join(asked)} {'asks' if len(asked) == 1 else 'ask'} for Transformer Engine's FP8 attention "
            "(recipe fp8_dpa / fp8_mha), which mesh CP does not run: its attention kernels run in the model's dtype "
            "and TE's FP8 attention is bypassed; set "
            f"{' and '.join(f'{name}=False' for name in asked)} (--fp8-format alone keeps TE's FP8 GEMMs, attention "
            "in bf16), or use one of TE's CP algorithms (--context-parallel-algo p2p / a2a / a2a+p2p) for FP8 "
            "attention")


def precision_line(get: Callable) -> Optional[str]:
    """What runs in low precision under mesh CP, in words (None without ``--fp8-format`` /
    ``--fp4-format``): the dry run prints it and the attention logs it."""
    fp8, fp4 = get("fp8", None), get("fp4", None)
    if not fp8 and not fp4:
        return None
    if fp8:
        what = f"FP8 GEMMs (--fp8-format {fp8}, --fp8-recipe {get('fp8_recipe', None) or 'delayed'})"
    else:
        what = f"FP4 GEMMs (--fp4-format {fp4}, --fp4-recipe {get('fp4_recipe', None) or 'nvfp4'})"
    dtype = "bf16" if get("bf16", False) else "fp16" if get("fp16", False) else "fp32"
    return (f"precision: Transformer Engine's {what} in the linear layers; attention under mesh CP stays in {dtype}, "
            "the model's dtype (no FP8 attention; partials fp32 unless --mesh-partial-dtype bf16)")
