"""A GPT block spec with mesh attention and a sequence-parallel-capable LayerNorm on CPU (tests).

Megatron's local spec uses torch's LayerNorm when apex is missing, and that wrapper refuses
``--sequence-parallel`` (torch_norm.py). Apex's FusedLayerNorm and TE's norms support it by marking
their parameters ``sequence_parallel`` so Megatron all-reduces their gradients over the TP group;
``SequenceParallelLayerNorm`` is torch's LayerNorm with exactly that, standing in for apex's
norm on CPU (same constructor, same LayerNorm-only and no-zero-centred-gamma limits).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_mesh_cp.megatron.specs import with_mesh_attention


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm whose weight and bias carry Megatron's ``sequence_parallel`` flag."""

    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="LayerNorm"):
        if config.normalization != "LayerNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelLayerNorm is a plain LayerNorm (like apex's FusedLayerNorm)")
        super().__init__(hidden_size, eps=eps)
        for p in (self.weight, self.bias):
            setattr(p, "sequence_parallel", config.sequence_parallel)


def gpt_mesh_sp_spec(config, vp_stage=None) -> ModuleSpec:
    """Block spec for ``--spec sp_norm_spec gpt_mesh_sp_spec``: local layers, mesh attention, SP norms."""
    cfg = getattr(config, "transformer", config)
    layer = with_mesh_attention(get_gpt_layer_local_spec())
    layer.submodules.input_layernorm = SequenceParallelLayerNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    n = get_num_layers_to_build(cfg, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SequenceParallelLayerNorm))
