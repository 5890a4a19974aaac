#!/usr/bin/env python
"""Host cost of the ready order (planning/ready.py) per micro-batch: planning a new batch's documents.

    OMP_NUM_THREADS=1 python scripts/bench_ready_host.py          # a2a+mesh 8x2x16, 8x4x8 and Ring 1x256

A micro-batch with new documents plans once (``planning.call_plans``, what ``mesh_attention`` calls; not
cached per batch): the full plans are cached, so its cost is pruning and, re-ordering, the ready orders
and their replays. Each of 8 draws of 1M tokens of 4K-64K documents (seeds 1-8, the issue's layer: 32
heads, 8 kv (MHA for 8x4x8), d 128, bf16 partials, tiled layout, h100-ib400) is planned 7 times with
``reorder=False`` and with ``reorder=None`` (the default); per draw the least CPU time of the 7
(``time.process_time``: the machine may be shared), averaged over the draws.
"""

from __future__ import annotations

import time

from megatron_mesh_cp.planning import Workload, load_cluster
from megatron_mesh_cp.planning import ulysses_inner
from megatron_mesh_cp.planning import sample_documents
from megatron_mesh_cp.planning import resolve_layout
from megatron_mesh_cp.planning import call_plans

CLUSTER = load_cluster("h100-ib400")
#: (ulysses, a, b, max_live, kv heads): the shapes --mesh-shape auto picks for the issue's layer
CASES = ((8, 2, 16, 35, 8), (8, 4, 8, None, 32), (1, 1, 256, None, 8))


def layer(seed: int, u: int, a: int, b: int, kv: int) -> Workload:
    docs = sample_documents(1 << 20, 4096, 65536, seed=seed).with_layout("tiled")
    w = Workload(seq_local=4096, heads=32, kv_heads=kv, head_dim=128, partial_bytes=2, mask=docs)
    return resolve_layout(ulysses_inner(u, w) if u > 1 else w, a, b, CLUSTER, u)


def main() -> None:
    for u, a, b, max_live, kv in CASES:
        layers = [layer(seed, u, a, b, kv) for seed in range(1, 9)]
        best = {False: {}, None: {}}
        for _ in range(7):
            for reorder in best:
                for i, w in enumerate(layers):
                    t0 = time.process_time()
                    call_plans(a, b, workload=w.unmasked, cluster=CLUSTER, stride=u, max_live=max_live,
                               keep=w.needed(a, b), masked=True, slabs=w.blocks(a * b).zigzag_keys, layer=w,
                               reorder=reorder)
                    t = time.process_time() - t0
                    best[reorder][i] = min(best[reorder].get(i, t), t)
        ms = {r: sum(d.values()) / len(d) * 1e3 for r, d in best.items()}
        print(f"{u}x{a}x{b}: pruned {ms[False]:.2f} ms, re-ordered {ms[None]:.2f} ms per micro-batch "
              f"(ready order +{ms[None] - ms[False]:.2f} ms)")


if __name__ == "__main__":
    main()
