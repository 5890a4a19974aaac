"""Sliding windows as each algorithm runs them: ours pruned, TE's a2a and all_gather cut by the band,
TE's p2p and a2a+p2p refused.

TE (``attn_forward_func_with_cp``) asserts sliding windows away on ``p2p`` and ``a2a+p2p``
("Context parallelism does not support sliding window attention with cp_comm_type=..."); only
``a2a`` (one call over the whole sequence for heads/CP heads, which needs the query heads *and*
the kv heads divisible by CP: TE does not replicate KV heads) and ``all_gather`` (the whole K/V
gathered, each rank's call sliced to its rows' window) run them. :func:`compare_windows` prices
every algorithm as it runs a windowed layer: ours on the window-pruned plans, ``ulysses`` and
``allgather`` with the band cutting their compute, and ``ring`` / ``usp`` at their cost *without*
the window, marked "cannot window" (the full layer: not the model's attention, shown only as what
the layer would cost if it ran on them). Every figure is simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from .baselines import WINDOWLESS, SimResult, check_algorithms, searches, simulate_algorithm
from .cluster import Cluster, Workload

__all__ = ["WindowRow", "te_a2a_refusal", "compare_windows", "format_window_table"]

#: what a row's figures are
RUNS, CANNOT, REFUSED = "runs the window", "cannot window: full attention", "refused"


@dataclass
class WindowRow:
    """One algorithm on a windowed layer: its result (None when it cannot run at all) and what it is."""

    algo: str
    result: Optional[SimResult]
    status: str
    reason: str = ""


def te_a2a_refusal(n: int, w: Workload) -> str:
    """Why TE's ``a2a`` cannot run ``w`` on ``n`` CP ranks ("" when it can): it asserts
    ``num_heads % cp_size == 0`` for Q and for K/V (no KV-head replication)."""
    if w.heads % n or w.kv_heads % n:
        return (f"TE's a2a needs query and kv heads divisible by CP ({w.heads} and {w.kv_heads} at CP {n}): it "
                f"runs up to CP {_largest(w.heads, w.kv_heads)}")
    return ""


def _largest(heads: int, kv_heads: int) -> int:
    return max(d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0)


def compare_windows(algos: List[str], n: int, cluster: Cluster, w: Workload, *, tp: int = 1,
                    max_live=None, search: int = 0) -> List[WindowRow]:
    """Each algorithm on the windowed layer ``w`` (our pruned Ring first, TE's Ring second); ``search``:
    the order search's replays per phase for the algorithms that take it (``baselines.searches``)."""
    if w.window is None:
        raise ValueError("compare_windows prices a sliding window; give the workload a window")
    names = ["ring-pruned", "ring"] + [a for a in algos if a not in ("ring-pruned", "ring")]
    check_algorithms(names)
    rows = []
    for algo in names:
        if algo in WINDOWLESS or algo.startswith("usp:"):
            res = simulate_algorithm(algo, n, cluster, w.unmasked, tp=tp, max_live=max_live)
            rows.append(WindowRow(algo, res, CANNOT, "TE asserts sliding windows away on p2p and a2a+p2p"))
            continue
        try:
            res = simulate_algorithm(algo, n, cluster, w, tp=tp, max_live=max_live,
                                     search=search if searches(algo) else 0)
        except ValueError as exc:
            rows.append(WindowRow(algo, None, REFUSED, str(exc)))
            continue
        reason = te_a2a_refusal(n, w) if algo == "ulysses" else ""
        rows.append(WindowRow(algo, res, RUNS, reason and f"{reason}; priced with KV heads replicated"))
    return rows


def format_window_table(rows: List[WindowRow]) -> str:
    """Time, speed vs our pruned Ring, bytes, exposed communication and what each row's figures are."""
    ref = rows[0].result
    head = (f"{'algorithm':<17}{'shape':<18}{'time ms':>9}{'vs ring-pruned':>16}{'MiB/rank':>10}{'exposed':>9}"
            f"  figures")
    lines = [head, "-" * len(head)]
    for r in rows:
        x = r.result
        if x is None:
            lines.append(f"{r.algo:<16} {'-':<17}{'-':>9}{'-':>16}{'-':>10}{'-':>9}  {r.status}: {r.reason}")
            continue
        lines.append(f"{r.algo:<16} {x.shape:<17}{x.time * 1e3:>9.2f}{ref.time / x.time:>15.2f}x"
                     f"{x.bytes_sent / 2**20:>10.1f}{x.exposed / x.time:>9.1%}  {r.status}"
                     + (f" ({r.reason})" if r.reason else ""))
    return "\n".join(lines)
