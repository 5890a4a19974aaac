"""Documents as each algorithm runs them: TE's padded (THD, every chunk sent), ours unpadded and pruned.

Megatron/TE run documents under CP only as THD: every document padded to a multiple of 2*CP,
partitioned per document, every chunk sent around the ring (``ring`` = TE ``p2p``, ``usp`` = TE
``a2a+p2p``; priced with a :class:`~megatron_mesh_cp.planning.packing.Packing`). Our plans run them on
the ordinary layout, unpadded, pruned to the blocks the documents leave
(:class:`~megatron_mesh_cp.planning.documents.UnpaddedDocuments`). Both are drawn from the same lengths
(the same distribution and seed, or the same file), each filling the same sequence length: TE's
padding leaves it fewer real tokens, reported beside the step times. ``ring-pruned`` is our Ring
1 x n on the pruned plans, so the gain from pruning alone is visible next to TE's Ring.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from .baselines import PRUNED, SimResult, check_algorithms, searches, simulate_algorithm
from .cluster import Cluster, Workload
from .documents import UnpaddedDocuments, read_documents, sample_documents
from .packing import Packing, read_packing, sample_packing

__all__ = ["runs_unpadded", "document_sets", "compare_documents", "format_documents_table"]


def runs_unpadded(algo: str) -> bool:
    """Whether ``algo`` runs documents unpadded with pruned plans (ours) or padded as THD (TE's)."""
    return algo.startswith(PRUNED)


def document_sets(seq: int, cp: int, *, lo_hi: Optional[Tuple[int, int]] = None, path=None, dist: str = "loguniform",
                  seed: int = 0, tile: int = 0) -> Tuple[Packing, UnpaddedDocuments]:
    """(TE's padded packing, our unpadded documents) of one draw (``lo_hi``) or one file (``path``),
    each filling ``seq`` tokens."""
    if (lo_hi is None) == (path is None):
        raise ValueError("give either a document length range or a document-length file")
    if path is not None:
        return read_packing(path, seq, cp, tile=tile), read_documents(path, seq, tile=tile)
    lo, hi = lo_hi
    return (sample_packing(seq, lo, hi, cp, dist=dist, seed=seed, tile=tile),
            sample_documents(seq, lo, hi, dist=dist, seed=seed, tile=tile))


def compare_documents(algos: List[str], n: int, cluster: Cluster, w: Workload, packing: Packing,
                      documents: UnpaddedDocuments, *, tp: int = 1, max_live=None,
                      layouts: Optional[Sequence[str]] = None, search: int = 0) -> List[SimResult]:
    """Each algorithm on the documents as it runs them; TE's Ring first, our pruned Ring second. Ours
    run once per token layout in ``layouts`` (``UnpaddedDocuments.with_layout`` names; None: the
    documents' own), TE's once (its THD partition balances every order). ``search``: the order search's
    replays per phase for ours (not mesh-naive, the in-order baseline)."""
    names = ["ring", "ring-pruned"] + [a for a in algos if a not in ("ring", "ring-pruned")]
    check_algorithms(names)
    padded = replace(w, mask=packing)
    variants = [documents] if layouts is None else [documents.with_layout(x) for x in layouts]
    out = []
    for a in names:
        for docs in (variants if runs_unpadded(a) else [None]):
            out.append(simulate_algorithm(a, n, cluster, padded if docs is None else replace(w, mask=docs), tp=tp,
                                          max_live=max_live, search=search if docs is not None and searches(a) else 0))
            if docs is not None and docs.auto:
                out[-1].layout = f"auto: {out[-1].layout}"
            elif docs is not None and docs.halves and out[-1].layout != docs.layout:  # a or b odd: ran as split:K
                out[-1].layout = f"{out[-1].layout} ({docs.layout} needs a, b even)"
    return out


def format_documents_table(results: List[SimResult], packing: Packing, documents: UnpaddedDocuments) -> str:
    """Step time, speed vs TE's Ring and USP (the first ``usp`` row), bytes, exposed communication and
    the real tokens each algorithm's step holds (TE's padding takes some)."""
    ring = results[0]
    usp = next((r for r in results if r.algo.startswith("usp")), None)
    width = max([18] + [len(f"unpadded, {r.layout}") + 1 for r in results if runs_unpadded(r.algo)])
    head = (f"{'algorithm':<17}{'shape':<18}{'documents':<{width}}{'time ms':>9}{'vs ring':>9}{'vs usp':>8}"
            f"{'MiB/rank':>10}{'exposed ms (share)':>20}{'real tokens':>13}")
    lines = [head, "-" * len(head)]
    for r in results:
        mine = runs_unpadded(r.algo)
        vs_usp = f"{usp.time / r.time:>7.2f}x" if usp else f"{'-':>8}"
        docs = (f"unpadded, {r.layout}" if r.layout else "unpadded, pruned") if mine else "padded THD (TE)"
        lines.append(
            f"{r.algo:<16} {r.shape:<17} {docs:<{width - 1}} {r.time * 1e3:>9.2f}"
            f"{ring.time / r.time:>8.2f}x{vs_usp}{r.bytes_sent / 2**20:>10.1f}"
            f"{r.exposed * 1e3:>12.2f} ({r.exposed / r.time:>4.0%})"
            f"{documents.total if mine else packing.real:>13}"
        )
    return "\n".join(lines)
