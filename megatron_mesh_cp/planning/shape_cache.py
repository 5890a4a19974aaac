"""A disk cache of ``mesh_shape="auto"``'s choices, so a job's ranks do not each plan and simulate every shape.

Under Megatron every rank resolves ``auto`` in argument validation, before any process group exists
(measured at CP = 256, Llama-3.1 8B at 1M tokens on h100-ib400: ~35 CPU-s for ``mesh``). The choice is a
pure function of its inputs, so it is stored as JSON under ``$MESH_CP_CACHE_DIR`` (default
``~/.cache/megatron-mesh-cp/shapes``; empty: no cache), one file per key: the CP size, the cluster
description, the workload, the TP stride, the live-chunk limit, the memory budget, whether only meshes with both
sides even may be chosen (``--mesh-layout split-half``), the package
version and a digest of the planner's and runtime's sources (a changed planner never reads an old
answer). A file is written to a temporary name and renamed into place, so ranks filling the same
entry at once each write a complete file and a reader sees a whole one or none; an unreadable or
mismatching entry is recomputed, and a directory that cannot be written only costs the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from ..runtime.topology import MeshShape
from . import autoshape
from .autoshape import HybridChoice, ShapeChoice

__all__ = ["cache_dir", "cached_choice", "source_digest"]

log = logging.getLogger("megatron_mesh_cp")

Choice = Union[ShapeChoice, HybridChoice]


def cache_dir() -> Optional[Path]:
    """``$MESH_CP_CACHE_DIR`` (empty: caching off), else ``~/.cache/megatron-mesh-cp/shapes``."""
    env = os.environ.get("MESH_CP_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    return Path.home() / ".cache" / "megatron-mesh-cp" / "shapes"


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the package version and the planning and runtime sources (what the answer depends on)."""
    try:
        version = importlib.metadata.version("megatron-mesh-cp")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed: the sources say it
        version = "source"
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(version.encode())
    for path in sorted(list((root / "planning").rglob("*.py")) + list((root / "runtime").rglob("*.py"))):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _key(kind: str, n, cluster, workload, stride, max_live, memory_budget, even=False) -> dict:
    return {"kind": kind, "n": n, "stride": stride, "max_live": max_live, "memory_budget": memory_budget, "even": even,
            "cluster": dataclasses.asdict(cluster), "workload": dataclasses.asdict(workload), "source": source_digest()}


def _to_json(choice: Choice) -> dict:
    d = {f.name: getattr(choice, f.name) for f in dataclasses.fields(choice)}
    d["shape"] = [choice.shape.a, choice.shape.b]
    d["table"] = [[list(k), t, note] for k, t, note in choice.table]
    return d


def _from_json(kind: str, d: dict) -> Choice:
    d = dict(d, shape=MeshShape(*d["shape"]), table=tuple((tuple(k), t, note) for k, t, note in d["table"]))
    return (ShapeChoice if kind == "mesh" else HybridChoice)(**d)


def _read(path: Path, key: dict, kind: str) -> Optional[Choice]:
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != json.loads(json.dumps(key)):
            return None
        return _from_json(kind, entry["choice"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("mesh_shape=auto: ignoring unreadable cache entry %s (%s)", path, exc)
        return None


def _write(path: Path, key: dict, choice: Choice) -> None:
    text = json.dumps({"key": key, "choice": _to_json(choice)}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; others of a shared cache may read it
            os.replace(tmp, path)  # atomic: concurrent writers each put a complete file in place
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("mesh_shape=auto: cannot write the shape cache in %s (%s); set MESH_CP_CACHE_DIR to a "
                    "writable directory, or to empty to switch it off", path.parent, exc)


def cached_choice(kind: str, n: int, cluster, workload, *, stride: int = 1, max_live: Optional[int] = None,
                  memory_budget: Optional[float] = None, directory: Optional[Path] = None,
                  even: bool = False) -> Choice:
    """``autoshape.choose_shape`` (``kind="mesh"``) or ``choose_hybrid_shape`` (``"a2a+mesh"``), read from
    ``directory`` (default :func:`cache_dir`) when an earlier call stored the same key, else computed and stored;
    ``even``: only meshes with both sides even (``--mesh-layout split-half``)."""
    if kind not in ("mesh", "a2a+mesh"):
        raise ValueError(f"kind must be 'mesh' or 'a2a+mesh', got {kind!r}")
    choose = autoshape.choose_shape if kind == "mesh" else autoshape.choose_hybrid_shape
    directory = cache_dir() if directory is None else directory
    if directory is None or workload.packing is not None:  # packed layouts are not cached
        return choose(n, cluster, workload, stride=stride, max_live=max_live, memory_budget=memory_budget, even=even)
    key = _key(kind, n, cluster, workload, stride, max_live, memory_budget, even)
    path = Path(directory) / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")
    choice = _read(path, key, kind)
    if choice is not None:
        log.info(choice.explanation)
        log.info("mesh_shape=auto: read from the shape cache %s", path)
        return choice
    choice = choose(n, cluster, workload, stride=stride, max_live=max_live, memory_budget=memory_budget, even=even)
    _write(path, key, choice)
    return choice
