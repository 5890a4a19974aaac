"""Virtual ranks: mesh attention for all n ranks in one process, on one device.

``virtual_mesh_attention`` shards full-sequence inputs in Megatron's zigzag layout, runs the same
forward and backward plans the real executor runs for every rank in lockstep through an in-memory
communicator, and gathers the results back. It exercises the executor, the plans and the block
kernels (with real GPU kernels on one GPU) without a process group. A shape ``(u, a, b)`` runs
``a2a+mesh``: the Ulysses all-to-all in memory (the same packing and reorder as on process groups,
:mod:`megatron_mesh_cp.runtime.ulysses`) around one a x b mesh per Ulysses slot. Packed sequences
(``layout="thd"`` with ``cu_seqlens``/``cu_seqlens_padded``) are split per document
(:mod:`megatron_mesh_cp.runtime.packed`) and reordered into the mesh's half-major order. Documents
on the ordinary layout (``cu_seqlens`` alone, batch 1) run the pruned plans and each rank's
sub-blocks (:mod:`megatron_mesh_cp.runtime.documents`), as :func:`mesh_attention` does.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .attention import plans_for
from .runtime.comm import Traffic, VirtualHub
from .runtime.documents import DocumentMask, check_window, documents_of
from .runtime.execute import run_virtual
from .runtime.kernels import BlockKernel, lse_dtype, select_kernel
from .runtime.layout import seq_dim, zigzag_gather, zigzag_shard
from .runtime.packed import PackedLayout, packed_spec, thd_gather, thd_shard
from .runtime.plan import BACKWARD, FORWARD, Plan
from .runtime.prune import prune
from .runtime.topology import MeshShape
from .runtime.ulysses import (
    a2a_bytes, check_ulysses_heads, fold_replicas, heads_to_members, kv_repeats, members_to_heads,
    members_to_super, replicate_kv, super_to_members,
)

__all__ = ["virtual_mesh_attention"]


def _split_shape(shape) -> Tuple[int, MeshShape]:
    """``(a, b)``, a MeshShape or ``(u, a, b)`` -> (u, a x b MeshShape)."""
    if isinstance(shape, MeshShape):
        return 1, shape
    dims = tuple(shape)
    if len(dims) == 3:
        return int(dims[0]), MeshShape(int(dims[1]), int(dims[2]))
    return 1, MeshShape(*dims)


def _a2a(xs: List[torch.Tensor], u: int, pack: Callable, unpack: Callable, traffic: List[Traffic],
         phase: str, category: str) -> List[torch.Tensor]:
    """The all-to-all of every Ulysses group in memory: ``xs[g]`` is CP rank g's tensor."""
    if u == 1:
        return xs
    out: List[torch.Tensor] = []
    for start in range(0, len(xs), u):
        packs = [pack(x, u) for x in xs[start:start + u]]
        for j in range(u):  # member j receives entry j of every member's send buffer
            out.append(unpack(torch.stack([p[j] for p in packs]), u))
            nbytes = a2a_bytes(packs[j])
            traffic[start + j].add(phase, category, nbytes, nbytes)
    return out


def _padding(spec, total: int, device) -> Optional[torch.Tensor]:
    """Bool ``[total]``: which tokens of the packed sequence are padding (None: none are)."""
    if spec.cu_real is None:
        return None
    pos = torch.arange(total, device=device)
    start = torch.tensor(spec.cu_padded, device=device)
    doc = torch.searchsorted(start[1:], pos, right=True)
    real = torch.tensor(spec.cu_real, device=device)
    return (pos - start[doc]) >= (real[1:] - real[:-1])[doc]


def virtual_mesh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shape,
    *,
    dout: Optional[torch.Tensor] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    layout: str = "bshd",
    kernel: Union[str, BlockKernel] = "auto",
    plans: Optional[Tuple[Plan, Plan]] = None,
    partial_dtype: Optional[torch.dtype] = None,
    deterministic: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_padded: Optional[torch.Tensor] = None,
    window: Optional[Tuple[int, int]] = None,
    sink: Optional[torch.Tensor] = None,
    return_max_logit: bool = False,
    hubs: Optional[List[VirtualHub]] = None,
) -> Dict[str, object]:
    """Full-sequence ``q, k, v`` (and ``dout`` for a backward) -> gathered results.

    ``shape``: ``(a, b)`` for a mesh, ``(u, a, b)`` for ``a2a+mesh`` (Ulysses degree u).
    Returns ``{"out", "lse" ([b, h, s]), "dq", "dk", "dv" (with dout), "traffic" (per CP rank)}``.
    Packed: ``layout="thd"`` (q ``[t, h, d]``), causal, the documents' offsets as in
    :func:`~megatron_mesh_cp.attention.mesh_attention`; lse is ``[h, t]``, padding rows give 0 and -inf.
    Documents on the ordinary layout: ``cu_seqlens`` alone with ``bshd``/``sbhd`` (batch 1); a
    sliding ``window`` (left, right) as in ``mesh_attention``; ``result["plans"]`` then holds the
    pruned (forward, backward) plans that ran. ``sink`` (fp32 ``[h]``) adds ``result["dsink"]`` (with
    ``dout``); ``return_max_logit`` adds ``result["max_logit"]`` (fp32 ``[h]``).
    ``hubs``: a list the in-memory transports (one per Ulysses slot) are kept in; passing the same
    list to every call keeps their buffer pools warm, as a real mesh's are (an empty list is filled).
    """
    from .attention import plans_for, sink_grad

    u, mesh_shape = _split_shape(shape)
    n_mesh = mesh_shape.n
    n = u * n_mesh
    docs = None
    if layout != "thd" and cu_seqlens is not None and cu_seqlens_padded is None:
        docs, cu_seqlens = documents_of(cu_seqlens), None
    spec = packed_spec(cu_seqlens, cu_seqlens_padded)
    thd = layout == "thd"
    if thd != (spec is not None):
        raise ValueError("packed sequences take layout='thd' together with cu_seqlens / cu_seqlens_padded")
    if thd:
        spec.check(q.shape[0], n)
        if not causal:
            raise ValueError("packed sequences (THD) need causal=True")
        q, k, v = (x.unsqueeze(1) for x in (q, k, v))
        dout = dout.unsqueeze(1) if dout is not None else None
        layout = "sbhd"
    sd = seq_dim(layout)
    if q.shape[sd] % (2 * n):
        raise ValueError(f"sequence length {q.shape[sd]} is not divisible by 2*CP = {2 * n}")
    r = 1
    if u > 1:
        check_ulysses_heads(q.shape[2], k.shape[2], u, n)
        r = kv_repeats(q.shape[2], k.shape[2], u)
    seq_major = lambda x: x if layout == "sbhd" else x.transpose(0, 1)  # noqa: E731
    qs, ks, vs = (seq_major(x) for x in (q, k, v))
    if docs is not None:
        docs.check(qs.shape[0])
        if qs.shape[1] != 1:
            raise ValueError(f"document masking takes one sequence (batch 1), got batch {qs.shape[1]}")
    window = check_window(window, causal)
    if window is not None and thd:
        raise ValueError("a sliding window with packed THD (padded) documents is not built")
    blk = select_kernel(kernel, qs, ks, deterministic=deterministic, packed=thd or docs is not None, v=vs)
    if window is not None:
        blk.check_window(qs, ks, vs, documents=docs is not None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    traffic = [Traffic() for _ in range(n)]

    lay = PackedLayout(spec, n, u, q.device) if thd else None
    into = members_to_super if lay is None else (lambda recv, _u: lay.into_mesh(recv.reshape(-1, *recv.shape[2:])))
    out_of = super_to_members if lay is None else (lambda y, _u: lay.out_of_mesh(y).reshape(_u, -1, *y.shape[1:]))

    def a2a_in(xs, phase, category):
        if u == 1 and lay is not None:
            return [lay.into_mesh(x) for x in xs]
        return _a2a(xs, u, heads_to_members, into, traffic, phase, category)

    def a2a_out(xs, phase, category):
        if u == 1 and lay is not None:
            return [lay.out_of_mesh(x) for x in xs]
        return _a2a(xs, u, out_of, members_to_heads, traffic, phase, category)

    if thd:
        shard = lambda x: [thd_shard(x, spec.cu_padded, n, g, dim=0) for g in range(n)]  # noqa: E731
        gather = lambda xs: thd_gather(xs, spec.cu_padded, dim=0)  # noqa: E731
    else:
        shard = lambda x: [zigzag_shard(x, n, g, dim=0) for g in range(n)]  # noqa: E731
        gather = lambda xs: zigzag_gather(xs, dim=0)  # noqa: E731
    pad = _padding(spec, q.shape[0], q.device) if thd else None
    lq = a2a_in(shard(qs), FORWARD, "a2a-Q")
    lk = a2a_in([replicate_kv(x, r) for x in shard(ks)], FORWARD, "a2a-KV")
    lv = a2a_in([replicate_kv(x, r) for x in shard(vs)], FORWARD, "a2a-KV")
    if plans is None:
        fake = type("VirtualMesh", (), {"shape": mesh_shape, "cluster": None, "stride": 1, "ulysses": u})()
        plans = plans_for(lq[0], lk[0], fake, causal, "sbhd", partial_dtype, "greedy",
                          "both-ways" if docs is not None or window is not None else "auto", lv[0].shape[3])
    sub_blocks = None
    if docs is not None or window is not None:  # pruned plans; every super-rank's own calls per block
        mask = DocumentMask(docs, n_mesh, causal, window, total=qs.shape[0])
        keep = mask.needed(mesh_shape)
        plans = (prune(plans[0], keep), prune(plans[1], keep))
        sub_blocks = [mask.rank_parts(mesh_shape, G, q.device) for G in range(n_mesh)]
    # CP rank g = super-rank G * u + slot j; each slot runs its own a x b mesh over the super-ranks
    slots = [list(range(j, n, u)) for j in range(u)]

    if return_max_logit:
        if thd:
            spec.check_max_logit()
        blk.check_max_logit(qs, packed=thd or docs is not None)
    sinks = None if sink is None else [sink.view(u, -1)[j] for j in range(u)]  # per slot: its head group

    def run(plan, per_rank, forward=False):
        results: List[object] = [None] * n
        for j, ranks in enumerate(slots):
            if hubs is not None and len(hubs) <= j:
                hubs.append(VirtualHub(mesh_shape))
            hub = hubs[j] if hubs is not None else VirtualHub(mesh_shape)
            extra = dict(sinks=None if sinks is None else [sinks[j]] * len(ranks), max_logit=return_max_logit) \
                if forward else {}
            res, counts = run_virtual(plan, mesh_shape, [per_rank[g] for g in ranks], blk, causal=causal,
                                      scale=scale, hub=hub, partial_dtype=partial_dtype,
                                      varlen=lay.varlen if lay is not None else None, sub_blocks=sub_blocks, **extra)
            for g, x, t in zip(ranks, res, counts):
                results[g] = x
                for (p, c), nbytes in t.sent.items():
                    traffic[g].add(p, c, nbytes, t.received[(p, c)])
        return results

    res = run(plans[0], [dict(q=lq[g], k=lk[g], v=lv[g]) for g in range(n)], forward=True)
    result: Dict[str, object] = {}
    if return_max_logit:  # slot j's ranks hold head group j; the max over every rank of each head
        result["max_logit"] = torch.stack([torch.stack([res[g][2] for g in ranks]).amax(0) for ranks in slots]).flatten()
    out = gather(a2a_out([x[0] for x in res], FORWARD, "a2a-O"))
    lse = gather(a2a_out([x[1] for x in res], FORWARD, "a2a-LSE"))  # [s, b, h]
    if pad is not None:  # padding rows: no output, lse = -inf (packed.py)
        out = out.masked_fill(pad.view(-1, 1, 1, 1), 0)
        lse = lse.masked_fill(pad.view(-1, 1, 1), float("-inf"))
    result["out"] = out[:, 0] if thd else out if layout == "sbhd" else out.transpose(0, 1)
    result["lse"] = lse[:, 0].T if thd else lse.permute(1, 2, 0)
    if dout is not None:
        dout = seq_major(dout)
        if pad is not None:
            dout = dout.masked_fill(pad.view(-1, 1, 1, 1), 0)
        ldo = a2a_in(shard(dout.contiguous()), BACKWARD, "a2a-dO")
        acc = lse_dtype(q.dtype)
        per = []
        dsink = None if sink is None else torch.zeros(u, sink.numel() // u, dtype=sink.dtype, device=sink.device)
        for g in range(n):
            o, lse_g = res[g][:2]
            delta = (ldo[g].to(acc) * o.to(acc)).sum(-1)
            per.append(dict(q=lq[g], k=lk[g], v=lv[g], out=o, lse=lse_g, dout=ldo[g], delta=delta))
            if dsink is not None:
                dsink[g % u] += sink_grad(sinks[g % u], lse_g, delta)
        if dsink is not None:
            result["dsink"] = dsink.flatten()
        grads = run(plans[1], per)
        for i, (name, cat) in enumerate((("dq", "a2a-dQ"), ("dk", "a2a-dKV"), ("dv", "a2a-dKV"))):
            local = a2a_out([x[i] for x in grads], BACKWARD, cat)
            if name != "dq":
                local = [fold_replicas(x, r) for x in local]
            g = gather(local)
            result[name] = g[:, 0] if thd else g if layout == "sbhd" else g.transpose(0, 1)
    result["traffic"] = traffic
    if sub_blocks is not None:
        result["plans"] = plans
    return result
