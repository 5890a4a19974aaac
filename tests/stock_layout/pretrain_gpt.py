"""A stand-in with the layout of Megatron-LM's ``pretrain_gpt.py`` (core_v0.19.x), written for the
tests: Megatron's own argument parsing (patched: ``--context-parallel-algo mesh``), the GPT model
builder from ``megatron/training/models/gpt.py`` (patched: mesh core attention), and ``pretrain``.
It holds no mesh-CP code of its own; the step and data functions have the stock contract.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron_mesh_cp.megatron.pretrain import datasets_provider, forward_step

if __name__ == "__main__":
    args = parse_and_validate_args()
    container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)
