"""CP attention algorithms in one simulator, each with its honest traffic and overlap.

* ``ring`` -- Ring-Attention as Megatron/TE's ``p2p`` and ring-flash-attn run it: the 1 x n plan
  with one-way rings (KV forward; KV and dKV backward), compute overlapped hop by hop.
* ``passq`` -- the n x 1 plan (Q travels, partial outputs reduce back).
* ``mesh`` -- the auto-chosen tile shape with the greedy plan; ``mesh:AxB`` a fixed shape.
* ``mesh-naive`` -- the same shape as ``mesh`` with the naive in-order plan.
* ``allgather`` -- Llama-3 style: all-gather K/V, then compute; backward re-gathers K/V and
  reduce-scatters dK/dV. Communication is not overlapped.
* ``ulysses`` -- DeepSpeed-Ulysses all-to-all: Q/K/V to head-sharded full sequences and O back
  (dO forward, dQ/dK/dV back in backward); needs heads >= n; K/V heads are replicated up to n.
* ``usp`` -- Ulysses inside a node x Ring across nodes (yunchang USP / TE ``a2a+p2p``); the best
  Ulysses degree (a divisor of the GPUs per node) is chosen; ``usp:U`` a fixed degree.
* ``a2a+mesh`` -- Ulysses inside a node x the greedy mesh across the Ulysses groups (docs/hybrid.md), the
  fastest (u, a, b) by :func:`~megatron_mesh_cp.planning.autoshape.choose_hybrid_shape`; ``a2a+mesh:UxAxB`` fixed.

The shared costs (one kernel call, a collective, the all-to-all, peak memory) are in ``costs``.

Packed sequences (a :class:`~megatron_mesh_cp.planning.packing.Packing` on the workload) change no
byte: the all-to-alls and ring or mesh transfers move the same chunks. They change the compute: every
ring or mesh step is priced by its block's real work, as the replay does; a Ulysses group of u ranks
holds the union of its ranks' pieces, which is pieces G and 2(n/u)-1-G of every document in the
coarser 2(n/u)-piece split (the runtime keeps each document's tokens together after the all-to-all),
so the inner ring or mesh over the n/u groups is the same per-document zigzag and is priced the same
way; Ulysses alone and all-gather run one call over whole documents.

Unpadded documents (``documents`` on the workload, the ordinary layout) are run only by our own plans:
``mesh``, ``mesh:AxB``, ``mesh-naive``, ``passq``, ``a2a+mesh`` (``:UxAxB``) and ``ring-pruned`` (our
Ring 1 x n) replay the runtime's pruned plans (:func:`~megatron_mesh_cp.planning.schedule.document_plans`)
with each block priced by its own calls; TE's algorithms and the all-gather / Ulysses baselines refuse
them (TE pads every document to 2*CP: price them with a ``packing``, see ``doc_baselines``).

A sliding window (``window``, alone or with documents) runs on our pruned plans as documents do, on
``ulysses`` (TE's a2a) and ``allgather`` (TE slices the gathered K/V to the window) with the band
cutting the compute; ``ring`` and ``usp`` refuse it, as TE's p2p and a2a+p2p assert (``window_baselines``).
MLA (``head_dim_v``) sets V, O, dO, dV bytes and the kernels' FLOPs for every algorithm alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from .layouts import resolve_layout
from .autoshape import choose_hybrid_shape, choose_shape, ulysses_degrees
from .cluster import Cluster, Workload
from .documents import UnpaddedDocuments
from .costs import (collective_time, monolithic_time, plan_peak_bytes, te_ring_peak_bytes, ulysses_a2a_steps,
                    ulysses_buffer_bytes, ulysses_inner, whole_sequence_pairs)
from ..runtime.layout import BlockCase
from ..runtime.topology import MeshShape
from .schedule import build_plans, document_plans
from .replay import PhaseResult, replay
from .windows import row_pairs

__all__ = ["ALGORITHMS", "PRUNED", "WINDOWLESS", "SimResult", "simulate_algorithm", "takes_max_live", "compare", "check_algorithms", "format_table",
           "format_packed_table", "plot_timelines"]

ALGORITHMS = ("ring", "passq", "mesh", "mesh-naive", "allgather", "ulysses", "usp", "a2a+mesh", "ring-pruned")
#: the algorithms (and prefixes) that run unpadded documents: our plans, pruned
PRUNED = ("passq", "mesh", "mesh-naive", "a2a+mesh", "ring-pruned", "mesh:", "a2a+mesh:")
#: TE's algorithms that refuse sliding windows (p2p, a2a+p2p; also ``usp:U``)
WINDOWLESS = ("ring", "usp")


@dataclass
class SimResult:
    algo: str
    time: float  # forward + backward of one attention layer, seconds
    compute: float  # compute-stream busy time of the critical rank
    bytes_sent: float  # per rank, forward + backward
    bytes_inter: float  # of which across nodes
    shape: str = ""
    note: str = ""
    timeline: List[Tuple[str, float, float, str]] = field(default_factory=list)
    bytes_by_phase: Dict[str, float] = field(default_factory=dict)  # forward / backward, per rank
    time_by_phase: Dict[str, float] = field(default_factory=dict)  # forward / backward, seconds
    peak_bytes: float = 0.0  # attention memory a rank holds at its peak (buffers beyond q, k, v, out)
    host_bound: Tuple[str, ...] = ()  # phases whose replay the host paced (PhaseResult.host_bound)
    layout: str = ""  # unpadded documents: the token layout they ran in (auto: the one chosen for the mesh)

    @property
    def exposed(self) -> float:
        return max(0.0, self.time - self.compute)


def _from_phases(algo: str, fwd: PhaseResult, bwd: PhaseResult, shape: str, note: str = "") -> SimResult:
    shift = fwd.time
    timeline = list(fwd.timeline) + [(lane, s + shift, e + shift, lab) for lane, s, e, lab in bwd.timeline]
    return SimResult(
        algo,
        fwd.time + bwd.time,
        float(fwd.busy[fwd.critical] + bwd.busy[bwd.critical]),
        float(sum(v[0] for v in fwd.sent.values()) + sum(v[0] for v in bwd.sent.values())),
        float(fwd.sent["inter"].mean() + bwd.sent["inter"].mean()),  # mean over ranks
        shape,
        note,
        timeline,
        {ph: float(sum(v[0] for v in r.sent.values())) for ph, r in (("forward", fwd), ("backward", bwd))},
        {"forward": fwd.time, "backward": bwd.time},
        host_bound=tuple(ph for ph, r in (("forward", fwd), ("backward", bwd)) if r.host_bound),
    )


def _plan_algo(algo, a, b, cluster, w, stride, planner="greedy", chains="auto", max_live=None, note="", search=0):
    w = resolve_layout(w, a, b, cluster, stride)  # documents laid out by auto: the layout chosen for this mesh
    if w.pruned:  # the runtime's plans for documents, chunks or a window: full, chains both ways, pruned
        fwd, bwd = document_plans(a, b, planner, cluster=cluster, workload=w, stride=stride, max_live=max_live,
                                  search=search)
    else:
        fwd, bwd = build_plans(a, b, planner, cluster=cluster, workload=w, stride=stride, max_live=max_live,
                               chains=chains)
    res = _from_phases(algo, replay(fwd, cluster, w, stride=stride), replay(bwd, cluster, w, stride=stride),
                       f"{a}x{b}", note)
    res.peak_bytes = te_ring_peak_bytes(w) if algo == "ring" else plan_peak_bytes(fwd, bwd, w)
    res.layout = _layout_of(w)
    return res


def _layout_of(w: Workload) -> str:
    """The token layout of ``w``'s unpadded documents ('' for other masks)."""
    return w.mask.layout if isinstance(w.mask, UnpaddedDocuments) else ""


def _phased(algo, steps: List[Tuple[str, str, float, float, float]], shape="", note="") -> SimResult:
    """Sequential steps (phase, lane, seconds, bytes sent, bytes across nodes) -> result with a timeline."""
    t, compute, sent, inter, timeline = 0.0, 0.0, 0.0, 0.0, []
    by_phase: Dict[str, float] = {"forward": 0.0, "backward": 0.0}
    bytes_by_phase: Dict[str, float] = {"forward": 0.0, "backward": 0.0}
    for phase, lane, dur, nbytes, nbytes_inter in steps:
        timeline.append((lane, t, t + dur, lane))
        t += dur
        sent += nbytes
        inter += nbytes_inter
        by_phase[phase] += dur
        bytes_by_phase[phase] += nbytes
        if lane == "compute":
            compute += dur
    return SimResult(algo, t, compute, sent, inter, shape, note, timeline, bytes_by_phase, by_phase)


def _allgather(n: int, cluster: Cluster, w: Workload, stride: int) -> SimResult:
    e, p = w.bytes_per_element, w.partial_bytes
    kv = float(w.batch * w.seq_local * w.kv_heads * (w.head_dim + w.dv))  # K and V
    spans = n * stride > cluster.gpus_per_node
    gather = (n - 1) * kv * e
    rs = (n - 1) * kv * p
    # each rank's zigzag rows attend over the whole sequence (causal halves the pairs); packed, the
    # slowest rank's row of blocks (its rows' pairs inside their documents); windowed, its rows' band
    # (TE's all_gather slices the gathered K/V to the window: the gather still moves all of it)
    pairs = None if w.packing is None else float(w.packing.block_work(n, w.causal).sum(axis=1).max())
    if pairs is not None:
        w.check_packing(n)
    if w.window is not None:
        pairs = float(row_pairs(w.span(n), n, w.causal).max())
    f_comp = monolithic_time(cluster, w, w.seq_local, w.seq_local * n, w.heads, False, pairs)
    b_comp = monolithic_time(cluster, w, w.seq_local, w.seq_local * n, w.heads, True, pairs)
    x = 1.0 if spans else 0.0
    steps = [
        ("forward", "all-gather", collective_time(cluster, n, stride, gather), gather, gather * x),
        ("forward", "compute", f_comp, 0, 0),
        ("backward", "all-gather", collective_time(cluster, n, stride, gather), gather, gather * x),
        ("backward", "compute", b_comp, 0, 0),
        ("backward", "reduce-scatter", collective_time(cluster, n, stride, rs), rs, rs * x),
    ]
    res = _phased("allgather", steps, f"1x{n}")
    res.peak_bytes = gather + (n - 1) * kv * p  # the gathered K/V and their gradients
    return res


def _ulysses(n: int, cluster: Cluster, w: Workload, stride: int) -> SimResult:
    if w.heads < n:
        raise ValueError(f"Ulysses needs at least as many heads as CP ranks ({w.heads} < {n}); use usp or mesh")
    before, after_fwd, before_bwd, after_bwd, kv_heads = ulysses_a2a_steps(n, cluster, w, stride)
    seq = w.seq_local * n
    h = w.heads // n
    f_comp = monolithic_time(cluster, w, seq, seq, h, False, whole_sequence_pairs(w, n))
    b_comp = monolithic_time(cluster, w, seq, seq, h, True, whole_sequence_pairs(w, n))
    steps = (before + [("forward", "compute", f_comp, 0, 0)] + after_fwd
             + before_bwd + [("backward", "compute", b_comp, 0, 0)] + after_bwd)
    note = f"kv heads replicated to {kv_heads}" if kv_heads != w.kv_heads else ""
    res = _phased("ulysses", steps, f"a2a {n}", note)
    res.peak_bytes = ulysses_buffer_bytes(n, w)
    return res


def _ulysses_around(u: int, inner: Optional[SimResult], cluster: Cluster, w: Workload, stride: int,
                    algo: str, shape: str) -> SimResult:
    """All-to-all in, the inner CP algorithm over the n/u Ulysses groups (or one call), all-to-all out."""
    before, after_fwd, before_bwd, after_bwd, kv_heads = ulysses_a2a_steps(u, cluster, w, stride)
    if inner is None:  # one Ulysses group: a single kernel call per phase
        iw = resolve_layout(ulysses_inner(u, w), 1, 1, cluster, stride * u)  # one chunk: any layout's work
        pairs = whole_sequence_pairs(iw, 1)
        fwd = monolithic_time(cluster, iw, iw.seq_local, iw.seq_local, iw.heads, False, pairs)
        bwd = monolithic_time(cluster, iw, iw.seq_local, iw.seq_local, iw.heads, True, pairs)
        inner = SimResult("compute", fwd + bwd, fwd + bwd, 0.0, 0.0, time_by_phase={"forward": fwd, "backward": bwd},
                          bytes_by_phase={"forward": 0.0, "backward": 0.0}, layout=_layout_of(iw))
    lane = inner.algo
    steps = (before + [("forward", lane, inner.time_by_phase["forward"], inner.bytes_by_phase["forward"], 0)]
             + after_fwd + before_bwd
             + [("backward", lane, inner.time_by_phase["backward"], inner.bytes_by_phase["backward"], 0)] + after_bwd)
    res = _phased(algo, steps, shape, f"kv heads replicated to {kv_heads}" if kv_heads != w.kv_heads else "")
    res.timeline = _splice(res.timeline, lane, inner)
    res.bytes_inter += inner.bytes_inter
    res.compute = inner.compute
    res.peak_bytes = inner.peak_bytes + ulysses_buffer_bytes(u, w)
    res.host_bound = inner.host_bound
    res.layout = inner.layout
    return res


def _splice(timeline, lane: str, inner: SimResult):
    """The inner algorithm's own lanes (compute, row/col rings) in place of its one bar per phase."""
    bars = sorted((x for x in timeline if x[0] == lane), key=lambda x: x[1])
    if not inner.timeline or len(bars) != 2:
        return timeline
    f_end = inner.time_by_phase["forward"]
    out = [x for x in timeline if x[0] != lane]
    for ln, s, e, lab in inner.timeline:
        off = bars[0][1] if s < f_end else bars[1][1] - f_end
        out.append((ln, s + off, e + off, lab))
    return sorted(out, key=lambda x: x[1])


def _usp_with(u: int, n: int, cluster: Cluster, w: Workload, stride: int, algo: str = "usp") -> SimResult:
    """Ulysses over u consecutive ranks x a one-way Ring over the n/u Ulysses groups."""
    r = n // u
    ring = _plan_algo("ring", 1, r, cluster, ulysses_inner(u, w), stride * u, chains="one-way") if r > 1 else None
    return _ulysses_around(u, ring, cluster, w, stride, algo, f"a2a {u} x ring {r}")


def a2a_mesh(u: int, a: int, b: int, cluster: Cluster, w: Workload, stride: int = 1,
             max_live: Optional[int] = None, algo: str = "a2a+mesh", search: int = 0) -> SimResult:
    """Ulysses over u consecutive ranks x the greedy a x b mesh over the u-rank groups (docs/hybrid.md);
    ``search``: the order search's replays per phase (``PlanOptions.search``)."""
    mesh = (_plan_algo("mesh", a, b, cluster, ulysses_inner(u, w), stride * u, max_live=max_live, search=search)
            if a * b > 1 else None)
    return _ulysses_around(u, mesh, cluster, w, stride, algo, f"{u}x{a}x{b}")


def _usp(n: int, cluster: Cluster, w: Workload, stride: int) -> SimResult:
    best: Optional[SimResult] = None

    for u in ulysses_degrees(n, cluster, w.heads, w.kv_heads, max(1, stride)):
        res = _usp_with(u, n, cluster, w, stride)
        if best is None or res.time < best.time:
            best = res
    if best is None:
        raise ValueError(f"no Ulysses degree divides both CP={n} and heads={w.heads} within a node")
    return best


def even_sides(w: Workload, n: int) -> bool:
    """Whether the auto shapes (mesh, a2a+mesh) of ``w`` on ``n`` ranks choose only among meshes with both sides
    even: split:K:H rows (documents over half rows), as the launcher's split-half with --mesh-shape auto, where
    the CP size has such a mesh (a multiple of 4; else the row runs as split:K)."""
    return bool(getattr(w.mask, "halves", 0)) and n % 4 == 0


def searches(algo: str) -> bool:
    """Whether ``algo`` takes the order search (``search=``): our greedy plans pruned for a mask."""
    return algo.startswith(PRUNED) and algo != "mesh-naive"


def takes_max_live(algo: str) -> bool:
    """Whether a ``max_live`` budget (simulate ``--max-live``) shapes ``algo``'s row: the mesh plans (mesh, mesh:AxB,
    a2a+mesh, a2a+mesh:UxAxB) are built within it, and mesh-naive runs on the shape mesh's auto chooses within it
    (its in-order plans are not bounded); passq, ring, ring-pruned and TE's run their own plans' memory."""
    return algo in ("mesh", "a2a+mesh", "mesh-naive") or algo.startswith(("mesh:", "a2a+mesh:"))


def simulate_algorithm(
    algo: str, n: int, cluster: Cluster, w: Workload, *, tp: int = 1, max_live: Optional[int] = None,
    search: int = 0,
) -> SimResult:
    """One algorithm's simulated forward+backward of one attention layer on ``n`` CP ranks; ``search``: the
    order search's replays per phase for the pruned plans of the mesh family (``PlanOptions.search``; the
    shape is chosen on the plans without it, as the launcher's ``--mesh-shape auto``)."""
    if search and not (w.pruned and searches(algo)):
        raise ValueError(f"search re-orders the pruned plans of mesh, mesh:AxB, a2a+mesh and ring-pruned under a "
                         f"mask (documents, a window); {algo}{'' if w.pruned else ' without a mask'} has none")
    if w.pruned and w.mask.cuts_documents and not algo.startswith(PRUNED):
        raise ValueError(f"{algo} cannot run unpadded documents (TE's THD pads every document to 2*CP and sends "
                         f"every chunk): price it on the padded packing of the same documents (doc_baselines, "
                         f"--doc-layout), or use passq, mesh, mesh:AxB, mesh-naive, a2a+mesh, a2a+mesh:UxAxB or "
                         f"ring-pruned")
    if w.window is not None and (algo in WINDOWLESS or algo.startswith("usp:")):
        raise ValueError(f"{algo} cannot run a sliding window (TE asserts it away on p2p and a2a+p2p); price the "
                         f"layer without it, labelled (window_baselines), or use ring-pruned, mesh, a2a+mesh, "
                         f"ulysses (TE's a2a) or allgather")
    if algo == "ring-pruned":
        if not w.pruned:
            raise ValueError("ring-pruned is our Ring 1xn with plans pruned for unpadded documents or a window; give "
                             "documents (--docs / --doc-lengths with --doc-layout unpadded) or --window, or use "
                             "ring / mesh:1xN")
        return _plan_algo("ring-pruned", 1, n, cluster, w, tp, search=search)
    if algo == "ring":
        return _plan_algo("ring", 1, n, cluster, w, tp, chains="one-way") if n > 1 else _plan_algo("ring", 1, 1, cluster, w, tp)
    if algo == "passq":
        return _plan_algo("passq", n, 1, cluster, w, tp, chains="one-way", search=search)
    even = even_sides(w, n)
    if algo in ("mesh", "mesh-naive"):
        choice = choose_shape(n, cluster, w, stride=tp, max_live=max_live, even=even)
        a, b = choice.shape.a, choice.shape.b
        if algo == "mesh":  # the plans auto chose: built with the live-chunk limit that fits its budget
            return _plan_algo("mesh", a, b, cluster, w, tp, max_live=choice.max_live, note="auto", search=search)
        return _plan_algo("mesh-naive", a, b, cluster, w, tp, planner="in-order")
    if algo.startswith("mesh:"):

        shape = MeshShape.for_size(algo.split(":", 1)[1], n)
        return _plan_algo(algo, shape.a, shape.b, cluster, w, tp, max_live=max_live, search=search)
    if algo == "allgather":
        return _allgather(n, cluster, w, tp)
    if algo == "ulysses":
        return _ulysses(n, cluster, w, tp)
    if algo == "usp":
        return _usp(n, cluster, w, tp)
    if algo == "a2a+mesh":

        ch = choose_hybrid_shape(n, cluster, w, stride=tp, max_live=max_live, even=even)
        return a2a_mesh(ch.u, ch.shape.a, ch.shape.b, cluster, w, tp, ch.max_live, search=search)
    if algo.startswith("a2a+mesh:"):
    
        parts = algo.split(":", 1)[1].lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{algo}: the shape must look like UxAxB, e.g. a2a+mesh:2x4x32")
        u, a, b = (int(p) for p in parts)
        if u * a * b != n:
            raise ValueError(f"{algo}: u*a*b = {u * a * b} != CP = {n}")
        if u not in ulysses_degrees(n, cluster, w.heads, w.kv_heads, tp):
            raise ValueError(f"{algo}: Ulysses degree {u} is not valid here; choose one of "
                             f"{ulysses_degrees(n, cluster, w.heads, w.kv_heads, tp)}")
        return a2a_mesh(u, a, b, cluster, w, tp, max_live, algo, search=search)
    if algo.startswith("usp:"):
        u = int(algo.split(":", 1)[1])
        if u < 1 or n % u or w.heads % u:
            raise ValueError(f"{algo}: the Ulysses degree must divide CP={n} and heads={w.heads}")
        return _usp_with(u, n, cluster, w, tp, algo)
    raise ValueError(f"unknown algorithm {algo!r}; choose from {', '.join(ALGORITHMS)}, mesh:AxB, usp:U "
                     "or a2a+mesh:UxAxB")


def check_algorithms(names: List[str]) -> None:
    """ValueError naming the choices unless every name is an algorithm of this module."""
    for a in names:
        if a not in ALGORITHMS and not a.startswith(("mesh:", "usp:", "a2a+mesh:")):
            raise ValueError(f"unknown algorithm {a!r}; choose from {', '.join(ALGORITHMS)}, mesh:AxB, usp:U "
                             "or a2a+mesh:UxAxB")


def compare(algos: List[str], n: int, cluster: Cluster, w: Workload, *, tp: int = 1, max_live=None) -> List[SimResult]:
    """Simulate each algorithm (Ring always included as the reference, first)."""
    names = ["ring"] + [a for a in algos if a != "ring"]
    check_algorithms(names)
    return [simulate_algorithm(a, n, cluster, w, tp=tp, max_live=max_live) for a in names]


def format_table(results: List[SimResult]) -> str:
    ring = results[0]
    head = f"{'algorithm':<18}{'shape':<18}{'time ms':>10}{'vs ring':>9}{'MiB/rank':>11}{'traffic cut':>13}{'exposed':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        cut = 1 - r.bytes_sent / ring.bytes_sent if ring.bytes_sent else 0.0
        lines.append(
            f"{r.algo:<17} {r.shape:<17} {r.time * 1e3:>10.2f}{ring.time / r.time:>8.2f}x"
            f"{r.bytes_sent / 2**20:>11.1f}{cut:>12.1%}{r.exposed / r.time:>9.1%}"
            + (f"  ({r.note})" if r.note and r.note != "auto" else "")
        )
    return "\n".join(lines)


def format_packed_table(unpacked: List[SimResult], packed: List[SimResult]) -> str:
    """Each algorithm unpacked vs packed: shape, step time, compute and exposed communication, bytes."""
    head = (f"{'algorithm':<12}{'shape unpacked -> packed':<33}{'time ms':>22}{'compute ms':>22}"
            f"{'exposed ms (share)':>33}{'MiB sent/rank':>15}")
    lines = [head, "-" * len(head)]
    for u, p in zip(unpacked, packed):
        shape = f"{u.shape} -> {p.shape}" if u.shape != p.shape else u.shape
        lines.append(
            f"{p.algo:<11} {shape:<33}{u.time * 1e3:>10.2f} ->{p.time * 1e3:>9.2f}"
            f"{u.compute * 1e3:>10.2f} ->{p.compute * 1e3:>9.2f}"
            f"{u.exposed * 1e3:>9.2f} ({u.exposed / u.time:>4.0%}) ->{p.exposed * 1e3:>8.2f} ({p.exposed / p.time:>4.0%})"
            f"{p.bytes_sent / 2**20:>15.1f}"
        )
    return "\n".join(lines)


LANE_LEGEND = {
    "compute": "the compute stream (block kernels, partial folds)",
    "row+": "row ring, +1 direction (Q, O; backward Q, dO, dQ)",
    "row-": "row ring, -1 direction",
    "col+": "column ring, +1 direction (KV; backward KV, dKV)",
    "col-": "column ring, -1 direction",
    "all-to-all": "Ulysses all-to-all (heads <-> sequence)",
    "all-gather": "all-gather of K/V",
    "reduce-scatter": "reduce-scatter of dK/dV",
}


def timeline_lanes(r: SimResult) -> List[str]:
    """The lanes with any busy time in ``r``'s timeline, compute first (empty lanes are not drawn)."""
    busy = {lane for lane, s, e, _ in r.timeline if e > s}
    return sorted(busy, key=lambda l: (l != "compute", l))


def plot_timelines(results: List[SimResult], path: str, caption: str = "") -> None:
    """One rank's simulated timeline per algorithm: the compute stream and every communication lane
    that carries bytes, the forward/backward boundary, a legend of the lanes and the workload caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.4 + 1.2 * len(results)), squeeze=False)
    palette = ["#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
    all_lanes = sorted({ln for r in results for ln in timeline_lanes(r)}, key=lambda l: (l != "compute", l))
    colors = {ln: "#4c72b0" if ln == "compute" else palette[i % len(palette)] for i, ln in enumerate(all_lanes)}
    for ax, r in zip(axes[:, 0], results):
        lanes = timeline_lanes(r)
        for y, lane in enumerate(lanes):
            spans = [(s * 1e3, (e - s) * 1e3) for ln, s, e, _ in r.timeline if ln == lane and e > s]
            ax.broken_barh(spans, (y - 0.4, 0.8), color=colors[lane])
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlim(0, max(x.time for x in results) * 1e3)
        f = r.time_by_phase.get("forward")
        if f:
            ax.axvline(f * 1e3, color="k", linestyle="--", linewidth=0.8)
            ax.text(f * 1e3, len(lanes) - 0.45, " backward \u2192", fontsize=7, va="bottom")
            ax.text(f * 1e3, len(lanes) - 0.45, "\u2190 forward ", fontsize=7, va="bottom", ha="right")
        ax.set_ylim(-0.6, len(lanes) + 0.2)
        ax.set_title(f"{r.algo} {r.shape}: {r.time * 1e3:.1f} ms, exposed comm {r.exposed / r.time:.0%}", fontsize=9)
    axes[-1, 0].set_xlabel("ms on rank 0, forward then backward (simulated)")
    fig.legend(handles=[Patch(color=colors[ln], label=f"{ln}: {LANE_LEGEND.get(ln, ln)}") for ln in all_lanes],
               loc="lower center", ncol=2, fontsize=7, frameon=False)
    if caption:
        fig.suptitle(caption, fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(all_lanes) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
