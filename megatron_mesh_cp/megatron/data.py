"""A real-text corpus every machine has: the Python standard library's own sources, byte-level.

Each ``.py`` file of the running interpreter's standard library (sorted, so the corpus is
deterministic for a given Python) becomes one document of byte tokens 0..255 followed by the
end-of-document token 256; the result is written in Megatron's indexed-dataset format with
megatron.core's own ``IndexedDatasetBuilder``. Use ``--tokenizer-type NullTokenizer --vocab-size 257``.
``doc_bytes`` cuts every file into documents of at most that many bytes (each with its EOD), so a
short training sequence holds several documents (document-masking tests and demos).
"""

from __future__ import annotations

import itertools
import os
import sysconfig
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

__all__ = ["EOD", "VOCAB_SIZE", "build_stdlib_corpus", "ensure_stdlib_corpus"]

EOD = 256
VOCAB_SIZE = 257


def build_stdlib_corpus(prefix: str, max_bytes: int = 8 << 20, doc_bytes=None) -> str:
    """Write ``prefix.bin`` / ``prefix.idx`` (at most ``max_bytes`` of source; files cut into documents
    of at most ``doc_bytes`` when given: an int, or sizes used in turn, e.g. a long one then short ones);
    returns ``prefix``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    sizes = None if not doc_bytes else itertools.cycle((doc_bytes,) if isinstance(doc_bytes, int) else tuple(doc_bytes))
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    total = 0
    for path in files:
        data = path.read_bytes()
        if not data.strip():
            continue
        tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        at = 0
        while at < len(tokens):
            step = next(sizes) if sizes is not None else len(tokens)
            builder.add_item(torch.from_numpy(np.append(tokens[at:at + step], EOD)))
            builder.end_document()
            at += step
        total += len(data)
        if total >= max_bytes:
            break
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")  # .bin first: readers wait for the .idx
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return prefix


def ensure_stdlib_corpus(prefix: str, local_rank: Optional[int] = None, timeout_s: float = 600,
                         doc_bytes=None) -> str:
    """Build the corpus once per machine (local rank 0); other ranks wait for it to appear."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    if os.path.exists(f"{prefix}.idx"):
        return prefix
    if local_rank == 0:
        return build_stdlib_corpus(prefix, doc_bytes=doc_bytes)
    deadline = time.time() + timeout_s
    while not os.path.exists(f"{prefix}.idx"):
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for local rank 0 to build {prefix}.idx")
        time.sleep(0.2)
    return prefix
