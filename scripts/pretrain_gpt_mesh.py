#!/usr/bin/env python
"""GPT pretraining with Mesh-Attention CP through Megatron's training loop.

    torchrun --nproc_per_node 4 scripts/pretrain_gpt_mesh.py --config configs/gpt_tiny_cpu.yaml
    torchrun ... scripts/pretrain_gpt_mesh.py <Megatron args> --context-parallel-algo mesh --mesh-shape auto

See megatron_mesh_cp/megatron/pretrain.py for the launcher options (--config, --summary-json,
--plot-loss, --dump-grads, --dry-run).
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Megatron requires one CUDA connection with TP/CP > 1; it must be set before CUDA starts
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
if not os.environ.get("MESH_CP_VERBOSE"):
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

from megatron_mesh_cp.megatron.pretrain import main  # noqa: E402

if __name__ == "__main__":
    main()
