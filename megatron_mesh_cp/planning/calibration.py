"""Published CP measurements and the simulator's prediction of each, side by side (docs/calibration.md).

Other people measured Ring, Ulysses and USP on real clusters (sources S1-S6, described in
docs/calibration.md). Each :class:`Case` describes one compared ratio: the source's hardware, the shape,
the two algorithms and the measured ratio (time of ``algo`` over time of ``ref``). :func:`compare`
simulates every case with the given overlap costs, so a fit (``scripts/calibrate_simulator.py``)
and a test can both hold the model to the published ratios. Only ratios are compared, never
absolute times: the sources' kernels, software versions and clocks are not ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .baselines import simulate_algorithm
from .cluster import CALIBRATED, Cluster, Workload, cluster_presets
from .costs import monolithic_time

__all__ = ["Case", "CASES", "SOURCES", "HARDWARE", "Row", "compare", "summary", "format_table", "TOLERANCE"]

#: A ratio within this relative error of the measured one counts as reproduced.
TOLERANCE = 0.10
#: No ratio of S1, S2, S5, S6 may be off by more than this.
WORST = 0.25

SOURCES = {
    "S1": "USP tech report (arXiv 2405.07719) Table 3: 8xA100-SXM4 NVLink, LLaMA3-8B attention, forward",
    "S2": "yunchang README benchmark (2024-04): 8xA100 NVLink, batch 2, forward",
    "S3": "USP tech report Table 4: 8xL20 PCIe (no NVLink), 32/8 heads, d 128, forward",
    "S5": "ring-flash-attn README: zigzag ring vs one GPU's flash-attn on the same per-GPU work, 8 GPUs",
    "S6": "USP tech report Table 6: end-to-end LLaMA3-8B training, 2 nodes x 8 A800, 1.6 Tbps RDMA per node",
}

# Each source's hardware as the vendors specify it (achievable ~80% of nominal link rates) and the
# attention kernel it ran (FlashAttention-2 in all five sources). Only the overlap costs are fitted.
_FA2_A100 = {"forward_tflops": 190, "backward_tflops": 150, "half_efficiency_tokens": 256}
HARDWARE: Dict[str, object] = {
    "a100-nvlink": {
        "name": "a100-nvlink", "gpus_per_node": 8, "hbm_GBps": 1800, "attention": _FA2_A100,
        "intra_node": {"bandwidth_GBps": 240, "latency_us": 5}, "inter_node": {"bandwidth_GBps": 22, "latency_us": 15},
    },
    "h800-nvlink": {  # NVLink cut to 400 GB/s both ways
        "name": "h800-nvlink", "gpus_per_node": 8, "hbm_GBps": 3000,
        "attention": {"forward_tflops": 330, "backward_tflops": 250, "half_efficiency_tokens": 256},
        "intra_node": {"bandwidth_GBps": 160, "latency_us": 4}, "inter_node": {"bandwidth_GBps": 45, "latency_us": 12},
    },
    "a800-2node": {  # NVLink cut to 400 GB/s both ways; 1.6 Tbps of RDMA per node = 25 GB/s per GPU
        "name": "a800-2node", "gpus_per_node": 8, "hbm_GBps": 1800, "attention": _FA2_A100,
        "intra_node": {"bandwidth_GBps": 160, "latency_us": 5}, "inter_node": {"bandwidth_GBps": 22, "latency_us": 15},
    },
    "l20-pcie": "preset",  # the PCIe preset itself: its host-bridge figures are what S3 fits
}


@dataclass(frozen=True)
class Case:
    """One published ratio: time(algo) / time(ref) on the source's hardware and shape."""

    source: str
    label: str
    hardware: str
    n: int
    seq: int  # global tokens
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    algo: str  # ring | ulysses | usp:U | ideal (one GPU's flash-attn on the per-GPU work)
    ref: str
    phases: Tuple[str, ...]
    measured: float
    weak: bool = False  # the source itself is doubtful (reported, not used in the fit or the verdict)


K = 1024
_FWD, _BOTH = ("forward",), ("forward", "backward")


def _s1() -> List[Case]:
    rows = [(32 * K, "ulysses", 0.834, False), (32 * K, "usp:4", 0.856, False), (32 * K, "usp:2", 0.856, False),
            (128 * K, "ulysses", 1.045, True), (128 * K, "usp:2", 1.007, True)]
    return [Case("S1", f"{s // K}K {a} / ring", "a100-nvlink", 8, s, 32, 8, 128, 1, a, "ring", _FWD, m, weak)
            for s, a, m, weak in rows]


def _s2() -> List[Case]:
    rows = [(32 * K, 32, 32, 32, "ulysses", 0.679), (32 * K, 32, 32, 32, "usp:4", 0.669),
            (128 * K, 32, 32, 32, "ulysses", 0.828), (128 * K, 32, 32, 32, "usp:4", 0.822),
            (128 * K, 8, 8, 32, "ulysses", 0.884), (128 * K, 8, 8, 128, "ulysses", 0.868),
            (128 * K, 8, 8, 128, "usp:4", 0.831), (128 * K, 64, 8, 32, "ulysses", 0.934),
            (128 * K, 4, 4, 32, "usp:4", 0.978)]
    return [Case("S2", f"{s // K}K {h}/{kv} d{d} {a} / ring", "a100-nvlink", 8, s, h, kv, d, 2, a, "ring", _FWD, m)
            for s, h, kv, d, a, m in rows]


def _s3() -> List[Case]:
    rows = {8 * K: (6.34, 2.38, 0.80), 32 * K: (4.09, 1.78, 0.93), 128 * K: (2.01, 1.23, 0.95)}
    return [Case("S3", f"{s // K}K {a} / ring", "l20-pcie", 8, s, 32, 8, 128, 1, a, "ring", _FWD, m)
            for s, ms in rows.items() for a, m in zip(("ulysses", "usp:4", "usp:2"), ms)]


def _s5() -> List[Case]:
    rows = [("h800-nvlink", _FWD, 0.852), ("h800-nvlink", _BOTH, 0.902),
            ("a100-nvlink", _FWD, 0.817), ("a100-nvlink", _BOTH, 0.898)]

    def label(hw: str, ph: Tuple[str, ...]) -> str:
        return f"{hw.split('-')[0].upper()} {'fwd+bwd' if len(ph) == 2 else 'fwd'} ideal / ring"

    return [Case("S5", label(hw, ph), hw, 8, 64 * K, 32, 8, 128, 1, "ideal", "ring", ph, m) for hw, ph, m in rows]


#: S6: TFLOPS per GPU by (Ulysses u, ring r) and sequence; step-time ratios are taken against u4 r4.
S6_FLOPS = {64 * K: {8: 220.3, 4: 222.2, 2: 209.2, 1: 196.9}, 80 * K: {8: 245.4, 4: 247.8, 2: 233.2, 1: 221.1}}
S6_LAYERS, S6_PARAMS, S6_HIDDEN = 32, 8.03e9, 4096


def _s6() -> List[Case]:
    out = []
    for s, flops in S6_FLOPS.items():
        for u in (8, 2, 1):
            algo = "ring" if u == 1 else f"usp:{u}"
            out.append(Case("S6", f"{s // K}K u{u} r{16 // u} / u4 r4", "a800-2node", 16, s, 32, 8, 128, 1, algo,
                            "usp:4", _BOTH, flops[4] / flops[u]))
    return out


CASES: Tuple[Case, ...] = tuple(_s1() + _s2() + _s3() + _s5() + _s6())


def hardware(name: str) -> Dict:
    """A source's hardware description (a preset's YAML where the source's machine is a preset)."""
    d = HARDWARE[name]
    if d == "preset":
        import yaml

        with open(cluster_presets()[name]) as f:
            return yaml.safe_load(f)
    return d


def cluster_for(name: str, overlap: Optional[Dict[str, float]] = None, **bridge) -> Cluster:
    """The source's hardware with the given overlap costs (default: the calibrated ones)."""
    d = dict(hardware(name))
    d["overlap"] = {**CALIBRATED, **(overlap or {})}
    if bridge:
        d["intra_node"] = {**d["intra_node"], **bridge}
    return Cluster.from_dict(d)


def _phase_time(algo: str, case: Case, cluster: Cluster) -> float:

    w = Workload(seq_local=case.seq // case.n, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                 batch=case.batch, causal=True, bytes_per_element=2, partial_bytes=2)
    if algo == "ideal":  # n calls of one GPU's flash-attn on the per-GPU token count
        return sum(case.n * monolithic_time(cluster, w, w.seq_local, w.seq_local, w.heads, ph == "backward")
                   for ph in case.phases)
    res = simulate_algorithm(algo, case.n, cluster, w)
    return sum(res.time_by_phase[ph] for ph in case.phases)


def _s6_step_ratio(case: Case, cluster: Cluster) -> float:
    """Training step time ratio: attention simulated, the rest of the step taken from the measurement."""
    flops_per_gpu = (6 * S6_PARAMS * case.seq + 6 * S6_LAYERS * case.seq ** 2 * S6_HIDDEN) / case.n
    step_ref = flops_per_gpu / (S6_FLOPS[case.seq][4] * 1e12)
    attn = {a: S6_LAYERS * _phase_time(a, case, cluster) for a in (case.algo, case.ref)}
    other = step_ref - attn[case.ref]
    return (other + attn[case.algo]) / (other + attn[case.ref])


@dataclass(frozen=True)
class Row:
    case: Case
    simulated: float

    @property
    def error(self) -> float:
        """Relative error of the simulated ratio against the measured one."""
        return self.simulated / self.case.measured - 1.0


def simulate_case(case: Case, cluster: Cluster) -> float:
    if case.source == "S6":
        return _s6_step_ratio(case, cluster)
    return _phase_time(case.algo, case, cluster) / _phase_time(case.ref, case, cluster)


def compare(overlap: Optional[Dict[str, float]] = None, cases: Sequence[Case] = CASES,
            bridge: Optional[Dict] = None) -> List[Row]:
    """Every case simulated with ``overlap`` (default: calibrated) and ``bridge`` (PCIe overrides)."""
    clusters: Dict[str, Cluster] = {}
    rows = []
    for c in cases:
        if c.hardware not in clusters:
            extra = (bridge or {}) if hardware(c.hardware)["intra_node"].get("shared_GBps") else {}
            clusters[c.hardware] = cluster_for(c.hardware, overlap, **extra)
        rows.append(Row(c, simulate_case(c, clusters[c.hardware])))
    return rows


def summary(rows: Sequence[Row]) -> Dict[str, object]:
    """The calibration verdict: S1/S2/S5/S6 within tolerance, S3's Ulysses-8 slower than Ring everywhere."""
    judged = [r for r in rows if r.case.source in ("S1", "S2", "S5", "S6") and not r.case.weak]
    within = sum(abs(r.error) <= TOLERANCE for r in judged)
    s3 = [r for r in rows if r.case.source == "S3" and r.case.algo == "ulysses"]
    return {
        "judged": len(judged),
        "within": within,
        "share_within": within / len(judged) if judged else 1.0,
        "worst": max((abs(r.error) for r in judged), default=0.0),
        "s3_ulysses_slower": all(r.simulated > 1.0 for r in s3) and bool(s3),
        "ok": bool(judged) and within / len(judged) >= 0.8 and max(abs(r.error) for r in judged) <= WORST
        and all(r.simulated > 1.0 for r in s3),
    }


def format_table(rows: Sequence[Row], before: Optional[Sequence[Row]] = None) -> str:
    """Markdown: measured vs simulated ratio per case (and the uncalibrated model's, if given)."""
    head = "| source | case | measured | simulated | error |" + (" uncalibrated | error |" if before else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows):
        mark = " (weak source)" if r.case.weak else ""
        line = f"| {r.case.source} | {r.case.label}{mark} | {r.case.measured:.3f} | {r.simulated:.3f} | {r.error:+.1%} |"
        if before:
            b = before[i]
            line += f" {b.simulated:.3f} | {b.error:+.1%} |"
        lines.append(line)
    return "\n".join(lines)

