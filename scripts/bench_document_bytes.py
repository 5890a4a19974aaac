"""What document masking saves on the wire, measured on real data: the Python stdlib's files as
documents (the launcher's corpus, EOD after every file), in sequences of S tokens, as Megatron's
GPTDataset cuts them (documents shuffled, one contiguous window per sequence).

For every mesh shape of CP = 4 and 8 (and a2a+mesh shapes) it prints the bytes the pruned plans
move as a share of the full plans' bytes (forward + backward, bf16 inputs, fp32 partials), the
blocks kept, and the host time to prepare one batch (mask, kept blocks, pruning, the pool layout,
one rank's kernel calls) at CP = 256, and the launcher's document reordering (--mesh-layout
balanced, runtime/balance.py: bytes are shown in both orders, and its host time). Plan bytes are exact (plan_traffic, which the executor's
counters equal); nothing here is simulated.

    python scripts/bench_document_bytes.py [--seq 32768 131072 1048576] [--batches 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from megatron_mesh_cp import valid_shapes
from megatron_mesh_cp.planning import build_plans
from megatron_mesh_cp.runtime import balance_order
from megatron_mesh_cp.runtime import Documents
from megatron_mesh_cp.runtime import memory_layout as layout
from megatron_mesh_cp.runtime import ChunkDims, plan_traffic
from megatron_mesh_cp.runtime import prune
from megatron_mesh_cp.runtime import MeshShape


def stdlib_lengths() -> np.ndarray:
    """Token counts (bytes + EOD) of the launcher's corpus documents, in corpus order."""
    from megatron_mesh_cp.megatron.data import build_stdlib_corpus

    cache = os.path.join(os.environ.get("MESH_CP_DATA_DIR", os.path.expanduser("~/.cache/megatron-mesh-cp")),
                         f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}_text_document")
    if not os.path.exists(cache + ".idx"):
        build_stdlib_corpus(cache)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(cache)
    return np.array(dataset.sequence_lengths, dtype=np.int64)  # a copy: the index's memory map dies with it


def batches(lengths: np.ndarray, seq: int, count: int, seed: int = 0):
    """``count`` sequences of ``seq`` tokens: documents in a shuffled order, one window each."""
    rng = np.random.default_rng(seed)
    order = lengths[rng.permutation(len(lengths))]
    ends = np.cumsum(order)
    for k in range(count):
        start = int(rng.integers(0, ends[-1] - seq))
        inside = ends[(ends > start) & (ends < start + seq)] - start
        yield Documents(tuple([0] + inside.tolist() + [seq]))


def bytes_of(plans, dims) -> int:
    return sum(sum(plan_traffic(p, dims).values()) for p in plans)


def reordered(docs: Documents, chunks: int) -> Documents:
    """The batch's documents in the launcher's balanced order for ``chunks`` mesh chunks."""
    lens = np.diff(docs.cu)
    order = balance_order(lens.tolist(), chunks)
    return Documents(tuple([0] + np.cumsum(lens[list(order)]).tolist()))


def shares(lengths, seq, count, n, shape, u=1, balanced=False):
    """Mean share of the full plans' bytes the pruned plans move, and mean kept blocks."""
    inner = MeshShape(*shape)
    dims = ChunkDims(1, u * seq // n, 32 // u, 8 * u // np.gcd(8, u) // u, 128, torch.bfloat16)
    full = build_plans(inner.a, inner.b, chains="both-ways")
    total = bytes_of(full, dims)
    got, kept = [], []
    for docs in batches(lengths, seq, count):
        if balanced:
            docs = reordered(docs, inner.n)
        keep = docs.bind(inner.n, docs.cu[-1], True).needed(inner)
        got.append(bytes_of([prune(p, keep) for p in full], dims) / total if total else 1.0)
        kept.append(len(keep))
    return float(np.mean(got)), float(np.mean(kept)), inner.n * 0 + inner.a * inner.b


def prepare_time(lengths, shape, seq=1 << 20, repeats=3) -> float:
    """Seconds of host work to prepare one batch on one rank at this mesh shape (what
    mesh_attention does once per new batch, before any transfer)."""
    inner = MeshShape(*shape)
    dims = ChunkDims(1, seq // inner.n, 32, 8, 128, torch.bfloat16)
    full = build_plans(inner.a, inner.b, chains="both-ways")
    docs = next(batches(lengths, seq, 1, seed=1))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mask = docs.bind(inner.n, docs.cu[-1], True)
        keep = mask.needed(inner)
        pruned = [prune(p, keep) for p in full]
        for p in pruned:
            layout.__wrapped__(p, dims)
        mask.rank_parts(inner, 0, "cpu")
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072, 1048576])
    p.add_argument("--batches", type=int, default=16)
    a = p.parse_args()
    lengths = stdlib_lengths()
    print(f"stdlib corpus: {len(lengths)} documents (files), mean {lengths.mean():.0f} tokens, median "
          f"{np.median(lengths):.0f}; {a.batches} sequences per length; bf16, 32 heads / 8 kv heads, d 128")
    print(f"{'seq':>7} {'CP':>3} {'shape':>8} {'docs/seq':>8} {'kept blocks':>12} {'bytes vs full':>14}"
          f"{'balanced order':>16}")
    for seq in a.seq:
        docs_per_seq = np.mean([d.count for d in batches(lengths, seq, a.batches)])
        for n in (4, 8):
            rows = [((x, y), 1) for x, y in valid_shapes(n)] + [((x, y), u) for u in (2, 4) if n % u == 0
                                                                for x, y in valid_shapes(n // u)]
            for shape, u in rows:
                share, kept, tile = shares(lengths, seq, a.batches, n, shape, u)
                bal = shares(lengths, seq, a.batches, n, shape, u, balanced=True)[0]
                name = ("x".join(map(str, shape)) if u == 1 else f"{u}x" + "x".join(map(str, shape)))
                print(f"{seq:>7} {n:>3} {name:>8} {docs_per_seq:>8.2f} {kept:>6.1f}/{tile:<5} {share:>13.1%}"
                      f"{bal:>16.1%}")
    for shape in ((1, 256), (16, 16), (8, 32), (8, 4), (1, 32)):
        print(f"host time to prepare one batch at 1M tokens, mesh {shape[0]}x{shape[1]}: "
              f"{prepare_time(lengths, shape) * 1e3:.1f} ms")
    docs = next(batches(lengths, 1 << 20, 1, seed=1))
    for chunks in (256, 32, 8):
        t0 = time.perf_counter()
        reordered(docs, chunks)
        print(f"host time to reorder one batch's {docs.count} documents at 1M tokens for {chunks} chunks "
              f"(--mesh-layout balanced): {(time.perf_counter() - t0) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
