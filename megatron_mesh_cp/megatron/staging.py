"""A directory written in one move: built under a temporary name beside its place, renamed there when complete.

A conversion or export that fails half-way must not leave a directory that looks finished (a Megatron
checkpoint with its ``latest_checkpointed_iteration.txt``, a Hugging Face directory with its
``config.json``): :func:`staged` yields a temporary directory in the same parent (same file system, so
the final ``os.replace`` is atomic) and removes it if the block raises.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

__all__ = ["staged"]


@contextlib.contextmanager
def staged(path: str) -> Iterator[str]:
    """Yield a temporary directory that becomes ``path`` when the block completes (``path`` must be absent or an
    empty directory); on an exception the temporary directory is removed and ``path`` is left as it was."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"{path} exists and is not an empty directory: remove it or choose another path")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 -> what a plain mkdir would have made
    if os.path.isdir(path):
        os.rmdir(path)  # empty, checked above
    os.replace(tmp, path)
