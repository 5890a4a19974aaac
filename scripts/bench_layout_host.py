#!/usr/bin/env python
"""Host time per micro-batch of auto's token layout (choice) and of the call's preparation, n = 256, 1M tokens.

    python scripts/bench_layout_host.py [--draws 5] [--shape 8x2x16] [--heads 32 --kv-heads 8]

For each document set of docs/packing.md (log-uniform 4K-64K; the heavy-tailed power law on
384-512K tokens) and ``--draws`` fresh draws of it (seeds from the page's), as a rank does for a new
micro-batch: *choice* is the launcher's ``--mesh-layout auto`` (megatron/layout.py ``choose``: the
candidate layouts built, runtime/layouts.py, and priced, planning/layouts.py); *preparation* is
what the rank then does before its first attention call of the micro-batch: the chosen layout's
token order, and for the call's mask (documents, or the split layout's Arranged mask) its resolve,
prepare (kernel, block engine, the cached full plans pruned to the blocks needed), agreement fields
(plan digests) and this rank's kernel calls (``Prepared.for_rank``), as attention.py runs them.
Collectives and device copies are left out. The launcher chooses in the data loader (its
workers, ahead of the step: megatron/layout.py ``LaidOutDataset``), so the step itself only
*decodes* the layout handed over (printed last) and prepares the call. The full plans depend only on the mesh and layer, so
one warm-up call builds them first. Prints the median and max over the draws, in ms (host timings:
noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megatron_mesh_cp.call import agreement, call_mask, prepare, resolve  # noqa: E402
from megatron_mesh_cp.planning import Workload, choose_layout, load_cluster, sample_documents  # noqa: E402
from megatron_mesh_cp.planning import ulysses_inner  # noqa: E402
from megatron_mesh_cp.runtime import Documents, PlanOptions  # noqa: E402
from megatron_mesh_cp.runtime import decode_layout as decode, encode_layout as encode  # noqa: E402
from megatron_mesh_cp.virtual import VirtualMesh  # noqa: E402

N, SEQ, CLUSTER = 256, 1 << 20, "h100-ib400"
#: (title, sample_documents arguments, the page's seed)
SETS = (("Log-uniform 4K-64K", dict(lo=4096, hi=65536), 0),
        ("Heavy-tailed mix", dict(lo=384, hi=512 * 1024, dist="powerlaw"), 7))


def choice_seconds(lengths, u, a, b, cluster, w, stride):
    """(wall, CPU) seconds of auto's choice as the launcher makes it, and the choice."""
    t0, c0 = time.perf_counter(), time.process_time()
    choice = choose_layout(lengths, a, b, cluster, ulysses_inner(u, w) if u > 1 else w, stride=stride)
    return (time.perf_counter() - t0, time.process_time() - c0), choice


def decode_seconds(arr, lengths, chunks):
    """(wall, CPU) seconds of the step's share when the data loader chose the layout ahead
    (megatron/layout.py LaidOutDataset): decoding the layout it handed over."""
    code, work = encode(arr)
    t0, c0 = time.perf_counter(), time.process_time()
    decode(code, work, lengths, chunks)  # its token order is part of the preparation
    return time.perf_counter() - t0, time.process_time() - c0


def preparation_seconds(arr, mesh, local, rank: int = 0):
    """(wall, CPU) seconds of the chosen layout's order and of one rank's call preparation for its mask."""
    t0, c0 = time.perf_counter(), time.process_time()
    arr.order  # noqa: B018 (the launcher re-lays the batch with it)
    if isinstance(arr.mask, Documents):
        mask = call_mask("bshd", torch.tensor(arr.mask.cu, dtype=torch.int32))
    else:
        mask = call_mask("bshd", mask=arr.mask)
    spec = resolve(*local, mesh, layout="bshd", mask=mask)
    prepared = prepare(spec)
    agreement(spec, prepared)
    prepared.for_rank(rank // mesh.ulysses, rank, torch.device("cpu"))
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=5, help="fresh document draws per set (seeds from the page's)")
    p.add_argument("--shape", default="8x2x16", help="u x a x b (default: auto's a2a+mesh shape for both sets, GQA)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    args = p.parse_args(argv)
    u, a, b = (int(x) for x in args.shape.split("x"))
    if u * a * b != N:
        raise SystemExit(f"--shape {args.shape} is not {N} CP ranks")
    cluster = load_cluster(CLUSTER)
    w = Workload(seq_local=SEQ // N, heads=args.heads, kv_heads=args.kv_heads, head_dim=128, partial_bytes=2)
    mesh = VirtualMesh((u, a, b), PlanOptions(cluster=cluster, stride=u))
    # shape-only tensors: resolve and prepare read shapes, dtypes and devices, never values
    q = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, SEQ // N, args.heads, 128)
    kv = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, SEQ // N, args.kv_heads, 128)
    local = (q, kv, kv)
    warm = sample_documents(SEQ, 4096, 65536, seed=10_000)
    preparation_seconds(choice_seconds(warm.lengths, u, a, b, cluster, w, u)[1].arrangement, mesh, local)
    print(f"n = {N}, {SEQ} tokens, a2a+mesh {u}x{a}x{b}, {args.heads}/{args.kv_heads} heads, {CLUSTER}; "
          f"{args.draws} draws per set (host ms, wall / CPU: the median draw's, and the slowest's wall)")
    for title, kw, seed0 in SETS:
        picks, chosen, prepared, decoded = [], [], [], []
        for seed in range(seed0, seed0 + args.draws):
            lengths = sample_documents(SEQ, seed=seed, **kw).lengths
            sec, choice = choice_seconds(lengths, u, a, b, cluster, w, u)
            picks.append(sec)
            chosen.append(choice.describe().split(" (")[0].replace("layout ", ""))
            prepared.append(preparation_seconds(choice.arrangement, mesh, local))
            decoded.append(decode_seconds(choice.arrangement, lengths, a * b))
        print(f"{title}: choice {_ms(picks)}, preparation {_ms(prepared)} (chosen: {', '.join(chosen)}); "
              f"chosen ahead by the data loader, the step decodes it in {_ms(decoded)}")


def _ms(times) -> str:
    """Median wall / median CPU ms, and the slowest wall."""
    wall, cpu = zip(*times)
    return (f"{statistics.median(wall) * 1e3:.1f} / {statistics.median(cpu) * 1e3:.1f} ms "
            f"(max {max(wall) * 1e3:.1f})")


if __name__ == "__main__":
    main()
