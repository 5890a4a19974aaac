"""Cross-rank agreement: the ranks of a CP group must run the same attention call, or all stop.

Mesh attention is SPMD: if one rank runs a different sequence length, head count, mask or plan,
the ring exchanges pair up wrong messages (a silently wrong result, a size-mismatch abort, or a
hang). :func:`agree` runs one tiny ``all_gather`` of every rank's call signature (a few int64 per
rank) and raises the *same* ``ValueError`` on every rank, naming the first field that differs and
the ranks, or the error a rank found in its own inputs. Callers cache agreed signatures, so the
steady state pays nothing. :func:`any_rank` does the same for a per-call flag (``check_finite``).
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["agree", "any_rank", "encode", "plan_digest", "collective_failure"]


def encode(value) -> int:
    """A stable int64 for a signature field (ints as is, floats by their bits, the rest hashed)."""
    if isinstance(value, bool) or value is None:
        return {None: -1, False: 0, True: 1}[value]
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


_DIGESTS: Dict[int, Tuple[object, str]] = {}


def plan_digest(plan) -> str:
    """A short content digest of a plan (computed once per plan object)."""
    hit = _DIGESTS.get(id(plan))
    if hit is None or hit[0] is not plan:
        if len(_DIGESTS) > 256:
            _DIGESTS.clear()
        text = repr((plan.phase, plan.a, plan.b, plan.ops))
        hit = _DIGESTS[id(plan)] = (plan, hashlib.blake2b(text.encode(), digest_size=6).hexdigest())
    return hit[1]


def _group_ranks(group) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def collective_failure(what: str, group, started: float, exc: BaseException) -> RuntimeError:
    """A readable error for a collective that failed (usually: a rank stalled past the timeout)."""
    return RuntimeError(
        f"{what}: the collective on the CP group (global ranks {_group_ranks(group)}) failed after "
        f"{time.monotonic() - started:.1f} s; another rank of the group did not join it (it stalled, "
        f"raised, or runs a different op). Cause: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    )


def _gather(row: Sequence[int], group, device, what: str) -> torch.Tensor:
    """All ranks' int64 rows as an [n, len(row)] tensor (one all_gather)."""
    n = dist.get_world_size(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(n)]
    started = time.monotonic()
    try:
        dist.all_gather(out, mine, group=group)
    except RuntimeError as exc:
        raise collective_failure(what, group, started, exc) from None
    return torch.stack(out).cpu()


def _gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _who(cp_rank: int, ranks: List[int]) -> str:
    return f"CP rank {cp_rank} (global rank {ranks[cp_rank]})"


def agree(what: str, fields: Dict[str, object], group, device="cpu", error: Optional[BaseException] = None) -> None:
    """Check that every rank of ``group`` passes equal ``fields`` (same names, same order) and no
    ``error``; otherwise raise the same ``ValueError`` on every rank. One all_gather of
    ``len(fields) + 1`` int64 per rank; a second, of the readable values, only on failure.
    """
    names = list(fields)
    row = [0 if error is None else 1] + [encode(v) for v in fields.values()]
    table = _gather(row, group, device, f"{what} (agreement check)")
    ranks = _group_ranks(group)
    failed = [r for r in range(table.shape[0]) if table[r, 0]]
    differs = next(((j, r) for j in range(1, table.shape[1]) for r in range(1, table.shape[0])
                    if table[r, j] != table[0, j]), None)
    if not failed and differs is None:
        return
    info = _gather_objects((None if error is None else str(error), [repr(v) for v in fields.values()]), group)
    if failed:
        first = failed[0]
        also = f" (also CP ranks {failed[1:]})" if len(failed) > 1 else ""
        raise ValueError(f"{what}: {_who(first, ranks)}{also} rejected its inputs: {info[first][0]}")
    j, r = differs
    raise ValueError(
        f"{what}: the ranks of the CP group disagree on {names[j - 1]}: {info[0][1][j - 1]} on {_who(0, ranks)} "
        f"but {info[r][1][j - 1]} on {_who(r, ranks)}; every rank of the CP group must make the same call "
        "(same shapes, heads, mask, scale, dtypes, plans and mesh)"
    )


def any_rank(what: str, flag: bool, group, device="cpu", message: str = "") -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if ``flag`` is set on any of them."""
    table = _gather([int(bool(flag))], group, device, what)
    bad = [r for r in range(table.shape[0]) if table[r, 0]]
    if bad:
        ranks = _group_ranks(group)
        where = ", ".join(_who(r, ranks) for r in bad)
        raise ValueError(f"{what}: {message} on {where}")

