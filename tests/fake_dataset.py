"""A Megatron indexed dataset whose ``.idx`` lists documents of chosen lengths (its ``.bin`` is empty): what
the dry run's data check and step estimate read, for corpora of any size, written in milliseconds."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def write(prefix: Path, lengths: Sequence[int]) -> str:
    """``prefix.idx`` (one sequence per document, as ``preprocess_data.py --append-eod`` writes them) and an
    empty ``prefix.bin``; returns the prefix as a string."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    prefix.parent.mkdir(parents=True, exist_ok=True)
    with _IndexWriter(f"{prefix}.idx", np.int32) as w:
        w.write([int(x) for x in lengths], None, list(range(len(lengths) + 1)))
    Path(f"{prefix}.bin").write_bytes(b"")
    return str(prefix)
