#!/usr/bin/env python
"""How many cuDNN graphs Transformer Engine builds for mesh attention over documents (counted on CPU).

TE keeps one cuDNN graph per distinct ``FADescriptor_v1`` in an unbounded per-process cache, one per
direction (fused_attn_f16_arbitrary_seqlen.cu@v2.18). This runs the real executor on virtual ranks
with the TE stand-in (tests/fake_kernels.py: TE's call surface and rules, the math skipped), which
forms every call's key as TE v2.18 does (tests/fake_te_backend.py), over batches of a long-context
document mix -- a few long documents among many short ones, new every batch -- and prints the
distinct forward / backward keys per rank (a rank is a process: its own caches).

    PYTHONPATH=. python scripts/bench_graph_keys.py --batches 100 --seq 131072 --shape 2x4
    PYTHONPATH=. python scripts/bench_graph_keys.py --te 2.18 --cudnn 9.24   # TE 2.18's cu_seqlens path

``PYTHONPATH`` picks the package measured (another checkout measures its adapter with these stand-ins).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the TE stand-in
sys.path.append(str(ROOT))  # the package, unless PYTHONPATH names another checkout


class _Patch:
    """The two monkeypatch methods the stand-ins' install() uses, without undo (a script)."""

    @staticmethod
    def setitem(mapping, key, value):
        mapping[key] = value

    @staticmethod
    def setattr(obj, name, value):
        setattr(obj, name, value)


def document_mix(rng: random.Random, seq: int, long_docs=(2, 4), short_len=(64, 3072)):
    """Global offsets of one batch: a few long documents (seq/16 to 3 seq/8 tokens: 8K-48K of 128K)
    among many short ones, in random order."""
    lens, total = [], 0
    for _ in range(rng.randint(*long_docs)):
        n = min(rng.randint(seq // 16, 3 * seq // 8), seq - total)
        if n > 0:
            lens.append(n)
            total += n
    while total < seq:
        n = min(rng.randint(*short_len), seq - total)
        lens.append(n)
        total += n
    rng.shuffle(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def count_keys(batches: int, seq: int, shape, te: str = "2.15", cudnn=(9, 10, 0), capability=(9, 0), heads=(2, 1),
               head_dim=8, seed=0, progress=None):
    """Run ``batches`` document batches forward and backward through mesh attention with the TE
    stand-in; returns (per-rank (forward, backward) key counts, distinct exact (rows, keys) sizes of
    the dense calls, kernel calls). Heads and head dim do not change which calls are made (the key
    count is per configuration); small ones keep the CPU work small."""
    import fake_kernels
    import fake_te_backend
    from megatron_mesh_cp.runtime import execute
    from megatron_mesh_cp.runtime import kernels as K
    from megatron_mesh_cp.virtual import virtual_mesh_attention

    fake_kernels.pretend_cuda(_Patch, capability=capability, te=te, flash=None)
    fake_kernels.CUDNN["version"] = tuple(cudnn)
    fake_kernels.COMPUTE["on"] = False
    fake_te_backend.GRAPHS.clear()
    K._INSTANCES.clear()
    kern = K.get_kernel("te", "cuda")
    kern.check = lambda q, k, v=None: None  # CPU tensors stand in for CUDA ones
    kern.check_varlen = lambda q, k=None, v=None: None
    step = execute.Executor.step
    sizes, calls = set(), [0]

    def attributed(self, op):  # each virtual rank is its own process: its own graph caches
        fake_te_backend.PROCESS["rank"] = self.position
        return step(self, op)

    forward = kern.forward

    def seen(q, k, v, **kw):
        calls[0] += 1
        if kw.get("varlen") is None:
            sizes.add((q.shape[0], k.shape[0]))
        return forward(q, k, v, **kw)

    execute.Executor.step, kern.forward = attributed, seen
    try:
        rng = random.Random(seed)
        h, hk = heads
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, seq, x, head_dim, generator=g).half() for x in (h, hk, hk))
        for i in range(batches):
            cu = torch.tensor(document_mix(rng, seq), dtype=torch.int32)
            virtual_mesh_attention(q, k, v, shape, dout=q, causal=True, cu_seqlens=cu, kernel=kern)
            if progress:
                progress(i)
    finally:
        execute.Executor.step = step
        fake_kernels.COMPUTE["on"] = True
    return fake_te_backend.graph_counts(), sizes, calls[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--seq", type=int, default=131072, help="tokens per sequence (global)")
    ap.add_argument("--shape", default="2x4", help="mesh AxB")
    ap.add_argument("--te", default="2.15", help="TE release the stand-in models")
    ap.add_argument("--cudnn", default="9.10.0")
    ap.add_argument("--sm", default="90", help="compute capability, e.g. 90, 80, 120")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.lower().split("x"))
    cudnn = tuple(int(x) for x in (args.cudnn.split(".") + ["0", "0"])[:3])
    cap = (int(args.sm[:-1]), int(args.sm[-1]))
    counts, sizes, calls = count_keys(args.batches, args.seq, shape, args.te, cudnn, cap, seed=args.seed,
                                      progress=lambda i: print(f"batch {i + 1}/{args.batches}", end="\r",
                                                               file=sys.stderr))
    fwd = [c[0] for c in counts.values()]
    bwd = [c[1] for c in counts.values()]
    print(f"TE {args.te} stand-in, cuDNN {args.cudnn}, sm{args.sm}; {args.batches} batches of {args.seq} tokens, "
          f"mesh {args.shape}; {calls} forward kernel calls, {len(sizes)} distinct dense (rows, keys) sizes")
    print(f"distinct TE graph keys per rank: forward max {max(fwd)} (mean {sum(fwd) / len(fwd):.1f}), "
          f"backward max {max(bwd)} (mean {sum(bwd) / len(bwd):.1f})")


if __name__ == "__main__":
    main()
