"""Packed sequences (THD) in the cost model: how much attention work each block really does.

Long-context pretraining packs several documents into one sequence and masks attention across
document boundaries. Under context parallelism Megatron/TE partition such a batch per document
(``thd_get_partitioned_indices``): every document is padded to a multiple of 2*CP, split into
2*CP equal pieces, and CP rank g keeps pieces g and 2*CP-1-g of *every* document, the document's
two pieces side by side, documents in packing order. A rank's chunk therefore has exactly as many
tokens as without packing, so chunk payloads and byte counters do not change; only the mask does.

What changes is the work of a block (Q chunk of rank i, KV chunk of rank j). Per document, with
its pieces of p tokens, the three causal cases of DESIGN.md section 3 hold document by document:

* diagonal (i == j): the document's two pieces attend causally among themselves;
* below (j < i): both Q pieces of the document x the first KV piece of the document, no mask;
* above (j > i): the second Q piece of the document x both KV pieces, no mask;

and no pair crosses a document. A block's work is the sum of these over documents, about
sum_d 2 p_d^2 instead of 2 m^2 for m = (chunk length)/2: with D documents of similar length it
shrinks about D-fold, while the chunk sent over the wire stays the same size. Padding sits at the
end of each document's padded span (its last pieces), never attends and is never attended to.

This module holds the document-length distribution (:class:`Packing`, sampled by
:func:`sample_packing` or read from a file by :func:`read_packing`) and the work model
(:meth:`Packing.block_work`: unmasked (q, k) pairs per block, or whole kernel tiles when a tile size
is given). :class:`~megatron_mesh_cp.planning.cluster.Workload` carries a ``Packing`` and turns the work into
block times; the replay, the greedy planner, auto shape and the baselines all price blocks from it.

A varlen kernel call handles every document of a sub-block in one launch; the runtime splits a
causal packed block into 2-3 such sub-blocks (``runtime.packed.packed_slices``), and the cost model
charges each its call overhead and correction pass (``Workload.packed_call_costs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Tuple

import numpy as np

from ..runtime.masks import Mask, PackedDocuments

__all__ = ["Packing", "DISTRIBUTIONS", "parse_tokens", "parse_doc_range", "sample_packing", "read_packing",
           "length_draws"]

#: Length distributions :func:`sample_packing` draws documents from (``powerlaw``: a heavy tail,
#: P(length > x) falling as x^-1/2 between LO and HI, so most documents are short and a few very long).
DISTRIBUTIONS = ("loguniform", "uniform", "powerlaw")
POWERLAW_ALPHA = 0.5


def parse_tokens(text: str) -> int:
    """A token count such as ``4096``, ``4K`` (4096) or ``1M`` (1048576)."""
    t = str(text).strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(f"{text!r} is not a token count; write e.g. 4096, 4K or 1M") from None
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


def parse_doc_range(text: str) -> Tuple[int, int]:
    """``"4K-64K"`` -> (4096, 65536): the shortest and longest document length to draw."""
    parts = str(text).split("-")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ValueError(f"document range {text!r} must look like LO-HI, e.g. 4K-64K")
    lo, hi = (parse_tokens(p) for p in parts)
    if lo < 1:
        raise ValueError(f"document range {text!r}: the shortest document must have at least 1 token")
    if hi < lo:
        raise ValueError(f"document range {text!r}: LO must not exceed HI; write it as {parts[1]}-{parts[0]}")
    return lo, hi


def _ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Packing(Mask):
    """Documents packed into one sequence of ``total`` tokens, each padded to a multiple of ``multiple``.

    ``lengths`` are the real tokens of each document in packing order; ``multiple`` is 2*CP of the
    partition the data was cut with (Megatron/TE pad every document to it). ``tile`` chooses how a
    block's work is counted: 0 counts exactly the unmasked (q, k) pairs (an ideal varlen kernel);
    t > 0 counts whole t x t tiles per document segment (what flash-style kernels compute, masked
    or not), so short documents cost more than their pairs. Hashable: workloads carrying it are
    cache keys of the planner and auto shape.
    """

    lengths: Tuple[int, ...]
    multiple: int
    tile: int = 0
    label: str = field(default="", compare=False)  # how it was made, for reports

    name = "packed documents"
    per_batch = True
    padded = True
    span_error = PackedDocuments.span_error + " (a workload is either packed or unpadded documents, not both)"

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a packing needs at least one document; give a document range or a non-empty file")
        if any(int(x) != x or x < 1 for x in self.lengths):
            bad = next(x for x in self.lengths if int(x) != x or x < 1)
            raise ValueError(f"document length {bad} is not a positive whole number of tokens; drop empty documents")
        if self.multiple < 2 or self.multiple % 2:
            raise ValueError(f"documents must be padded to a multiple of 2*CP (an even number >= 2), got {self.multiple}")
        if self.tile < 0:
            raise ValueError(f"kernel tile {self.tile} must be >= 0 (0: count exact pairs)")
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))

    @property
    def padded(self) -> Tuple[int, ...]:
        """Each document's length after padding to a multiple of ``multiple`` (its span in the sequence)."""
        return tuple(_ceil_to(x, self.multiple) for x in self.lengths)

    @property
    def total(self) -> int:
        """Tokens of the packed sequence, padding included (what CP splits)."""
        return sum(self.padded)

    @property
    def real(self) -> int:
        return sum(self.lengths)

    def with_tile(self, tile: int) -> "Packing":
        return Packing(self.lengths, self.multiple, tile, self.label)

    def describe(self) -> str:
        """One line: how many documents, their spread, padding and the work left by the mask."""
        x = np.array(self.lengths)
        text = (f"{len(x)} documents{f' ({self.label})' if self.label else ''}: lengths {x.min()}-{x.max()}, "
                f"mean {x.mean():.0f}, median {np.median(x):.0f}; {self.real} real + {self.total - self.real} "
                f"padding tokens; causal attention work {self.work_fraction():.2%} of one unpacked sequence")
        return text + (f" (counted in {self.tile}x{self.tile} tiles)" if self.tile else "")

    # --- work ---------------------------------------------------------------------------------
    def pieces(self, ranks: int) -> np.ndarray:
        """Real tokens of each of the 2*ranks pieces of every document: int64 array [documents, 2*ranks].

        Padding fills the end of each padded span, so the last pieces of a document hold it.
        """
        parts = 2 * ranks
        if ranks < 1 or self.multiple % parts:
            raise ValueError(
                f"documents padded to multiples of {self.multiple} cannot be split into 2*{ranks} = {parts} equal "
                f"pieces; pad them to a multiple of 2*CP (a multiple of {parts})"
            )
        lengths = np.array(self.lengths, dtype=np.int64)[:, None]
        piece = (np.array(self.padded, dtype=np.int64) // parts)[:, None]
        start = piece * np.arange(parts, dtype=np.int64)[None, :]
        return np.clip(lengths - start, 0, piece)

    def block_work(self, ranks: int, causal: bool = True) -> np.ndarray:
        """Work of every block (Q chunk of rank i, KV chunk of rank j) on ``ranks`` CP ranks: int64 [ranks, ranks].

        Unmasked (q, k) pairs summed over documents (``tile == 0``), or whole tiles times tile^2.
        Read-only (cached per packing and rank count).
        """
        return _block_work(self, ranks, causal)

    def sequence_work(self, causal: bool = True) -> int:
        """Work of attention over the whole packed sequence in one call (Ulysses' kernel, one rank's view
        of all tokens): per document, its own causal triangle (or its full square)."""
        x = np.array(self.lengths, dtype=np.int64)
        return int(_tri(x, self.tile).sum() if causal else _rect(x, x, self.tile).sum())

    def work_fraction(self, causal: bool = True) -> float:
        """This packing's attention work over that of one unpacked sequence of the same total length."""
        s = self.total
        full = s * (s + 1) // 2 if causal else s * s
        if self.tile:
            t = -(-s // self.tile)
            full = (t * (t + 1) // 2 if causal else t * t) * self.tile ** 2
        return self.sequence_work(causal) / full


def _tri(rows: np.ndarray, tile: int) -> np.ndarray:
    """Causal work of a square segment of ``rows`` real tokens: r(r+1)/2 pairs, or tiles on or below
    the diagonal times tile^2."""
    if not tile:
        return rows * (rows + 1) // 2
    t = -(-rows // tile)
    return t * (t + 1) // 2 * tile * tile


def _rect(rows: np.ndarray, keys: np.ndarray, tile: int) -> np.ndarray:
    """Work of an unmasked rows x keys segment (broadcast): pairs, or whole tiles times tile^2."""
    if not tile:
        return rows * keys
    return (-(-rows // tile)) * (-(-keys // tile)) * tile * tile


@lru_cache(maxsize=64)
def _block_work(packing: Packing, ranks: int, causal: bool) -> np.ndarray:
    r = packing.pieces(ranks)  # [D, 2n]
    first = r[:, :ranks]  # piece g of each document, g = rank
    second = r[:, ranks:][:, ::-1]  # piece 2n-1-g
    both = first + second  # the document's real tokens on rank g (contiguous in its segment)
    t = packing.tile
    if not causal:
        work = _rect(both[:, :, None], both[:, None, :], t).sum(axis=0)
    else:
        lower = _rect(both[:, :, None], first[:, None, :], t).sum(axis=0)  # [i, j]: Q_i both x KV_j first
        upper = _rect(second[:, :, None], both[:, None, :], t).sum(axis=0)  # Q_i second x KV_j both
        i, j = np.indices((ranks, ranks))
        work = np.where(j < i, lower, upper)
        work[np.arange(ranks), np.arange(ranks)] = _tri(both, t).sum(axis=0)
    work = np.ascontiguousarray(work, dtype=np.int64)
    work.setflags(write=False)
    return work


def _fill(lengths, total: int, multiple: int, what: str) -> Tuple[int, ...]:
    """Pack ``lengths`` in order into ``total`` tokens; the document that does not fit is cut to the space left."""
    if total < 1 or total % multiple:
        raise ValueError(f"sequence length {total} is not a positive multiple of 2*CP = {multiple}; pad it")
    out, used = [], 0
    for x in lengths:
        room = total - used
        if room <= 0:
            break
        p = _ceil_to(x, multiple)
        if p > room:
            x = room  # a multiple of 2*CP: the cut document needs no padding
            p = room
        out.append(int(x))
        used += p
    if used < total:
        padding = f" after padding each to a multiple of 2*CP = {multiple}" if multiple > 1 else ""
        raise ValueError(f"{what} fill only {used} of {total} tokens{padding}; add documents or lower the "
                         "sequence length")
    return tuple(out)


def sample_packing(total: int, lo: int, hi: int, cp: int, *, dist: str = "loguniform", seed: int = 0,
                   tile: int = 0) -> Packing:
    """Documents of lo..hi tokens drawn i.i.d. (:func:`length_draws`),
    padded to multiples of 2*cp and packed in order until ``total`` tokens are full; the last one is cut
    to the space left (so it may be shorter than ``lo``)."""
    if cp < 1:
        raise ValueError(f"CP size must be >= 1, got {cp}")
    multiple = 2 * cp
    lengths = _fill(length_draws(lo, hi, dist, seed), total, multiple, "the documents")
    return Packing(lengths, multiple, tile, f"{dist} {lo}-{hi} tokens, seed {seed}")


def length_draws(lo: int, hi: int, dist: str, seed: int):
    """Endless i.i.d. document lengths in lo..hi (numpy ``default_rng(seed)``); the same draws pack
    padded (:func:`sample_packing`) and unpadded (``planning.documents.sample_documents``)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"document lengths must satisfy 1 <= LO <= HI, got {lo}-{hi}")
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown document length distribution {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed)
    tail = 1.0 - (lo / (hi + 1)) ** POWERLAW_ALPHA
    while True:
        if dist == "uniform":
            yield int(rng.integers(lo, hi + 1))
        elif dist == "powerlaw":  # inverse CDF of the truncated power law on [lo, hi + 1), floored
            yield min(hi, int(lo * (1.0 - rng.uniform() * tail) ** (-1.0 / POWERLAW_ALPHA)))
        else:  # log-uniform on [lo, hi + 1), floored: every length in range, short ones more often
            yield min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def read_packing(path, total: int, cp: int, *, tile: int = 0) -> Packing:
    """Document lengths from a text file (integers separated by whitespace or commas; ``#`` starts a
    comment), packed in file order into ``total`` tokens like :func:`sample_packing`."""
    lengths, name = _read_lengths(path)
    used = _fill(lengths, total, 2 * cp, f"the {len(lengths)} documents of {str(path)!r}")
    label = name + (f", first {len(used)} of {len(lengths)}" if len(used) < len(lengths) else "")
    return Packing(used, 2 * cp, tile, label)


def _read_lengths(path) -> Tuple[list, str]:
    """(document lengths, file name) of a document-length file; ValueError naming the fix."""
    p = Path(str(path))
    if not p.is_file():
        raise ValueError(f"document-length file {str(path)!r} does not exist; pass a text file of token counts")
    words = []
    for line in p.read_text().splitlines():
        words += line.split("#", 1)[0].replace(",", " ").split()
    if not words:
        raise ValueError(f"document-length file {str(path)!r} lists no documents; write one token count per document")
    try:
        lengths = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise ValueError(f"document-length file {str(path)!r}: {bad!r} is not a whole token count") from None
    if min(lengths) < 1:
        raise ValueError(f"document-length file {str(path)!r}: length {min(lengths)} < 1; drop empty documents")
    return lengths, p.name
