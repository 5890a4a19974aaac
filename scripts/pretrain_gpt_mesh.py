#!/usr/bin/env python
"""GPT pretraining with Mesh-Attention CP through Megatron's training loop (the checkout's launcher).

    torchrun --nproc_per_node 4 scripts/pretrain_gpt_mesh.py --config configs/gpt_tiny_cpu.yaml
    torchrun ... scripts/pretrain_gpt_mesh.py <Megatron args> --context-parallel-algo mesh --mesh-shape auto

The installed package offers the same as ``mesh-cp-pretrain``. See megatron_mesh_cp/megatron/pretrain.py
for the launcher options (--config, --summary-json, --plot-loss, --dump-grads, --dry-run).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mesh_cp.megatron.pretrain import cli  # noqa: E402

if __name__ == "__main__":
    cli()
