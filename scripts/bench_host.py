#!/usr/bin/env python
"""Host cost of the executor per rank and layer (forward + backward), on virtual ranks.

    python scripts/bench_host.py                      # n = 16, 64, 256: mesh, a2a+mesh, Ring (1 x n)
    python scripts/bench_host.py --n 32 --json x.json # one size; raw numbers as JSON
    python scripts/bench_host.py --compare old.json new.json   # two runs as a before -> after table

Method (docs/DESIGN.md, "Host cost per kernel call"): all ranks of a mesh in one process (``run_virtual``, the
executor every rank runs, with warm buffer pools), tiny CPU tensors (batch 1, 2 tokens per zigzag
piece, 8 heads, head dim 16, fp32), so kernel compute is negligible and what is left is the
algorithm's host work. The plans are the ones the greedy planner makes for a real layer (128K
tokens, 32 heads / 8 kv, d 128, h100-ib400), so grouping and chains are those a run would use.
Counts come from the torch profiler: top-level aten events (no aten parent), split into views
(the event and its whole subtree only alias), launching ops (everything else; on a GPU each is a
kernel launch or at least a dispatcher round trip; a multi-tensor ``_foreach_*`` op is one: on a GPU it is
one launch when its tensors share dtype and strides, as the executor's do with fp32 partials) and allocations
(``aten::empty*``, included in the launching count), divided by the
ranks; of the launching ops, the in-memory transport's one ``_foreach_copy_`` per delivered
transfer stands for the wire (NCCL: one grouped launch per transfer), the rest is the executor's own. For a2a+mesh the mesh part
runs on the super-ranks and the Ulysses part (pack, all-to-all, reorder; the all-to-all stood in
for by an ``empty_like`` + ``copy_``) is counted on one rank's tensors and added; the profiler
runs piece by piece (:func:`lockstep`), so 256 ranks fit in memory. Times are the main thread's
CPU time (``time.thread_time``: on a shared machine wall clock also counts other people's work)
without the profiler, best of ``--repeats``: per kernel call and per block, and the same less the
block-kernel calls themselves (the executor's own host work). CPU measurements, not GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop chatter
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_mesh_cp.planning import Workload  # noqa: E402
from megatron_mesh_cp.planning import build_plans, default_cluster  # noqa: E402
from megatron_mesh_cp.runtime import UlyssesIn, UlyssesOut  # noqa: E402
from megatron_mesh_cp.runtime import Traffic, VirtualHub  # noqa: E402
from megatron_mesh_cp.runtime import run_virtual  # noqa: E402
from megatron_mesh_cp.runtime import TorchKernel  # noqa: E402
from megatron_mesh_cp.runtime import MeshShape  # noqa: E402

#: (label, u, a, b) per n: square-ish meshes, the a2a+mesh shapes auto picks at 128K MHA, Ring
CONFIGS = {
    16: [("mesh", 1, 4, 4), ("a2a+mesh", 4, 2, 2), ("ring", 1, 1, 16)],
    32: [("mesh", 1, 8, 4), ("a2a+mesh", 4, 4, 2), ("ring", 1, 1, 32)],
    64: [("mesh", 1, 8, 8), ("a2a+mesh", 8, 4, 2), ("ring", 1, 1, 64)],
    256: [("mesh", 1, 16, 16), ("a2a+mesh", 8, 8, 4), ("ring", 1, 1, 256)],
}
#: composite ops that return their input (or a view) when no copy is needed
_MAYBE_VIEW = {"aten::reshape", "aten::contiguous", "aten::to", "aten::flatten", "aten::unflatten",
               "aten::expand_as", "aten::view_as", "aten::movedim", "aten::type_as", "aten::lift_fresh",
               "aten::chunk", "aten::split", "aten::unbind", "aten::numpy_T"}
_ALLOC = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty")
_VIEW_CACHE: dict = {}


def _is_alias_op(name: str) -> bool:
    """Whether aten op ``name`` returns a view of an input (its schema's return aliases, unwritten)."""
    if name not in _VIEW_CACHE:
        try:
            schemas = torch._C._jit_get_schemas_for_operator(name)
        except RuntimeError:
            schemas = []
        _VIEW_CACHE[name] = any(  # some overload (e.g. slice.Tensor, not slice.str) returns an alias
            s.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in s.returns)
            and not any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments)
            for s in schemas)
    return _VIEW_CACHE[name]


def _only_views(ev) -> bool:
    if not (ev.name in _MAYBE_VIEW or _is_alias_op(ev.name)):
        return False
    return all(_only_views(c) for c in ev.cpu_children)


def count_ops(fns):
    """Top-level aten events of running ``fns`` in order, each profiled on its own (so the
    profiler never holds more than one of them): ``(launching, views, allocations)``."""
    from torch.profiler import ProfilerActivity, profile

    launch = views = alloc = 0
    for fn in fns:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        for ev in prof.events():
            if not ev.name.startswith("aten::"):
                continue
            parent = ev.cpu_parent
            if parent is not None and parent.name.startswith("aten::"):
                continue
            if _only_views(ev):
                views += 1
            else:
                launch += 1
                alloc += ev.name in _ALLOC
        del prof
    return launch, views, alloc


def lockstep(plan, shape, per, kern, hub, scale, chunk):
    """``run_virtual``'s loop (every rank steps each op in turn, then finishes) cut into pieces of
    ``chunk`` plan ops, each a callable, so a 256-rank run can be profiled piece by piece."""
    from megatron_mesh_cp.runtime import Executor

    execs = [Executor(plan, hub.ranks[g], kern, causal=True, scale=scale, tensors=per[g], buffers=hub.ranks[g].buffers)
             for g in range(shape.n)]
    ops = list(plan.ops)

    def piece(part):
        def run():
            for op in part:
                for ex in execs:
                    ex.step(op)
        return run

    yield from (piece(ops[i:i + chunk]) for i in range(0, len(ops), chunk))

    def finish():
        for ex in execs:
            ex.finish()
        hub.clear()
    yield finish


class CountingHub(VirtualHub):
    """The in-memory transport, counting its deliveries: each is one multi-tensor copy and stands
    for the wire (on NCCL a transfer is one grouped send/recv launch)."""

    def __init__(self, shape) -> None:
        super().__init__(shape)
        self.copies = 0

    def _deliver(self, src_key, dst_key) -> None:
        if src_key in self._posted and dst_key in self._posted and dst_key not in self._delivered:
            self.copies += 1  # one multi-tensor copy per delivered transfer
        super()._deliver(src_key, dst_key)


class CountingKernel(TorchKernel):
    """The torch kernel, counting its calls and the CPU time spent inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.seconds = 0, 0.0

    def forward(self, *args, **kw):
        t0 = time.thread_time()
        try:
            return super().forward(*args, **kw)
        finally:
            self.calls += 1
            self.seconds += time.thread_time() - t0

    def backward(self, *args, **kw):
        t0 = time.thread_time()
        try:
            return super().backward(*args, **kw)
        finally:
            self.calls += 1
            self.seconds += time.thread_time() - t0


def _inputs(n: int, heads: int, kv_heads: int, seq: int, d: int):
    g = torch.Generator().manual_seed(n)
    mk = lambda h: torch.randn(seq, 1, h, d, generator=g)  # noqa: E731
    return [dict(q=mk(heads), k=mk(kv_heads), v=mk(kv_heads)) for _ in range(n)]


def mesh_layer(a: int, b: int, plans, heads: int, seq: int, d: int = 16):
    """``(layer, pieces, kernel, ranks)``: ``layer()`` runs one layer (forward then backward) of all
    a x b virtual ranks, warm; ``pieces()`` the same as profiling pieces (:func:`lockstep`)."""
    shape = MeshShape(a, b)
    hub = CountingHub(shape)
    kern = CountingKernel()
    per = _inputs(shape.n, heads, heads, seq, d)
    scale = d ** -0.5
    res, _ = run_virtual(plans[0], shape, per, kern, causal=True, scale=scale, hub=hub)  # warm-up
    bwd = [dict(x, out=o, lse=lse, dout=torch.ones_like(o), delta=o.sum(-1)) for x, (o, lse) in zip(per, res)]

    def layer():  # the backward's inputs are the forward's (the same every run): made once, outside
        run_virtual(plans[0], shape, per, kern, causal=True, scale=scale, hub=hub)
        run_virtual(plans[1], shape, bwd, kern, causal=True, scale=scale, hub=hub)

    def pieces():
        chunk = max(1, 8192 // shape.n)  # about 8K rank-steps per profile: a few hundred MB at most
        yield from lockstep(plans[0], shape, per, kern, hub, scale, chunk)
        yield from lockstep(plans[1], shape, bwd, kern, hub, scale, chunk)

    layer()  # warm: pools sized for both phases
    return layer, pieces, kern, hub, shape.n


def ulysses_layer(u: int, heads: int, seq: int, d: int = 16):
    """One rank's Ulysses part of an a2a+mesh layer: QKV in, O out; dO in, dQ/dK/dV out."""
    mesh = type("M", (), {"ulysses": u, "traffic": Traffic()})()
    g = torch.Generator().manual_seed(u)
    q, k, v = (torch.randn(seq, 1, heads, d, generator=g) for _ in range(3))

    def fake_exchange(mesh, send, phase, category):  # the all-to-all's local part: a buffer and one op
        recv = torch.empty_like(send)
        return recv.copy_(send)

    def layer():
        with mock.patch.object(hybrid, "exchange", fake_exchange):
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            qs, ks, vs = UlyssesIn.apply(*x, mesh, 1, None)
            out, _ = UlyssesOut.apply(qs + ks + vs, torch.zeros(1, heads // u, qs.shape[0]), mesh, False, None)
            out.sum().backward()

    # what the layer adds beyond the two autograd functions (the add and the loss) is subtracted
    def extra():
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (x[0] + x[1] + x[2]).sum().backward()

    return layer, extra


def measure(n: int, repeats: int):
    cluster = default_cluster()
    rows = []
    for label, u, a, b in CONFIGS[n]:
        w = Workload(seq_local=131072 * u // n, heads=32 // u, kv_heads=max(1, 8 // u), head_dim=128)
        plans = build_plans(a, b, "greedy", cluster=cluster, workload=w)
        heads, seq = 8 // u, 4 * u  # tiny: 2 tokens per piece of every rank's share
        layer, pieces, kern, hub, ranks = mesh_layer(a, b, plans, heads, seq)
        hub.copies = 0
        launch, views, alloc = count_ops(pieces())
        copies = hub.copies
        best = None
        for _ in range(repeats):
            kern.calls, kern.seconds = 0, 0.0
            t0 = time.thread_time()
            layer()
            wall = time.thread_time() - t0
            if best is None or wall < best[0]:
                best = (wall, kern.seconds, kern.calls)
        wall, inside, calls = best
        blocks = 2 * a * b * ranks  # every rank computes its a x b tile forward and backward
        row = dict(algo=label, n=n, shape=f"{u}x{a}x{b}" if u > 1 else f"{a}x{b}", ranks=ranks,
                   launching=launch / ranks, views=views / ranks, allocations=alloc / ranks,
                   transport_copies=copies / ranks, executor_launching=(launch - copies) / ranks,
                   transfers=sum(len(p.transfers) for p in plans),
                   kernel_calls=calls / ranks, blocks=blocks / ranks,
                   us_per_call=wall / calls * 1e6, us_per_block=wall / blocks * 1e6,
                   host_us_per_call=(wall - inside) / calls * 1e6, kernel_us_per_call=inside / calls * 1e6)
        if u > 1:
            ul, extra = ulysses_layer(u, 8, 4)
            ul()
            l1, v1, a1 = count_ops([ul])
            l0, v0, a0 = count_ops([extra])
            row.update(launching=row["launching"] + l1 - l0, views=row["views"] + v1 - v0,
                       executor_launching=row["executor_launching"] + l1 - l0,  # its copy_ = the all-to-all
                       allocations=row["allocations"] + a1 - a0, ulysses_launching=l1 - l0)
        rows.append(row)
        print(f"  {label} {row['shape']}: {row['launching']:.0f} launching ops, {row['views']:.0f} views, "
              f"{row['allocations']:.0f} allocations per rank; {row['us_per_call']:.0f} us per kernel call",
              flush=True)
    return rows


def table(rows) -> str:
    head = ("algorithm", "n", "shape", "launching ops", "of which transport (one per transfer)", "views", "aten::empty*",
            "transfers", "kernel calls", "blocks", "CPU us / kernel call", "CPU us / block", "host us / call (less kernel)")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([r["algo"], str(r["n"]), r["shape"], f"{r['launching']:.0f}",
                                      f"{r['transport_copies']:.0f}", f"{r['views']:.0f}",
                                      f"{r['allocations']:.0f}", str(r["transfers"]), f"{r['kernel_calls']:.0f}",
                                      f"{r['blocks']:.0f}",
                                      f"{r['us_per_call']:.0f}", f"{r['us_per_block']:.0f}",
                                      f"{r['host_us_per_call']:.0f}"]) + " |")
    return "\n".join(out)


def compare(before, after) -> str:
    """Rows of two runs (``--json``) side by side, ``before -> after``. Launching ops are given as
    each run counted them and with the transport as one op per transfer in both (what a wire's
    grouped launch is: earlier versions counted one copy per tensor)."""
    head = ("algorithm", "n", "shape", "launching ops as counted", "launching ops, one per transfer",
            "executor's own", "views", "aten::empty*", "kernel calls", "CPU us / kernel call",
            "host us / call (less kernel)")
    old = {(r["algo"], r["n"], r["shape"]): r for r in before}
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in after:
        b = old.get((r["algo"], r["n"], r["shape"]))
        if b is None:
            continue
        wire = lambda x: x["executor_launching"] + x["transfers"]  # noqa: E731
        cell = lambda x, y, f="{:.0f}": f"{f.format(x)} -> {f.format(y)}"  # noqa: E731
        out.append("| " + " | ".join([
            r["algo"], str(r["n"]), r["shape"], cell(b["launching"], r["launching"]), cell(wire(b), wire(r)),
            cell(b["executor_launching"], r["executor_launching"]), cell(b["views"], r["views"]),
            cell(b["allocations"], r["allocations"]), f"{r['kernel_calls']:.0f}",
            cell(b["us_per_call"], r["us_per_call"]), cell(b["host_us_per_call"], r["host_us_per_call"])]) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="*", default=[16, 64, 256], choices=sorted(CONFIGS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="print two runs' rows (--json files) as a before -> after table; measures nothing")
    args = p.parse_args(argv)
    if args.compare:
        print(compare(*(json.loads(Path(x).read_text()) for x in args.compare)))
        return 0
    torch.set_num_threads(1)
    rows = []
    for n in args.n:
        print(f"n = {n}", flush=True)
        rows += measure(n, args.repeats)
    print("\nPer rank and layer (forward + backward), CPU, virtual ranks, tiny tensors:\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
