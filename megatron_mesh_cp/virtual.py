"""Virtual ranks: mesh attention for all n ranks in one process, on one device.

``virtual_mesh_attention`` is the in-memory adapter of the call pipeline (call.py): it shards
full-sequence inputs the way Megatron does (zigzag; per document for packed THD), resolves and
prepares the call exactly as ``mesh_attention`` does for one rank's share, runs the same forward
and backward plans for every rank in lockstep through an in-memory transport, and gathers the
results back. It exercises the executor, the plans, the masks and the block kernels (with real GPU
kernels on one GPU) without a process group. A shape ``(u, a, b)`` runs ``a2a+mesh``: the Ulysses
all-to-all in memory (the same packing and reorder as on process groups, runtime/hybrid.py) around
one a x b mesh per Ulysses slot.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from .call import call_mask, prepare, resolve, sequence_major, sink_slot, user_layout
from .runtime.comm import Traffic, VirtualHub
from .runtime.execute import run_virtual
from .runtime.hybrid import members_of_super, super_of_members
from .runtime.kernels import BlockKernel, lse_dtype
from .runtime.layout import seq_dim, zigzag_gather, zigzag_shard
from .runtime.masks import Mask
from .runtime.merge import sink_grad
from .runtime.mesh import DEFAULT_PLAN_OPTIONS, CallCache, PlanOptions
from .runtime.packed import thd_gather, thd_shard
from .runtime.plan import BACKWARD, FORWARD, Plan
from .runtime.topology import MeshShape
from .runtime.ulysses import a2a_bytes, fold_replicas, heads_to_members, kv_repeats, members_to_heads, replicate_kv

__all__ = ["virtual_mesh_attention", "VirtualMesh"]


class VirtualMesh:
    """Every rank of an a x b mesh (times u for ``a2a+mesh``) in one process: the mesh protocol
    (runtime/mesh.py) over in-memory transports, one per Ulysses slot, whose buffer pools stay warm
    across calls as a real mesh's do."""

    def __init__(self, shape, plan_options: Optional[PlanOptions] = None) -> None:
        if isinstance(shape, MeshShape):
            u, mesh_shape = 1, shape
        else:
            dims = tuple(shape)
            u, mesh_shape = (int(dims[0]), MeshShape(int(dims[1]), int(dims[2]))) if len(dims) == 3 else (
                1, MeshShape(*dims))
        self.shape, self.ulysses = mesh_shape, u
        self.plan_options = plan_options if plan_options is not None else DEFAULT_PLAN_OPTIONS
        self.calls = CallCache()
        self.hubs = [VirtualHub(mesh_shape) for _ in range(u)]

    @property
    def size(self) -> int:
        """CP size: u * a * b."""
        return self.ulysses * self.shape.n

    def slots(self) -> List[List[int]]:
        """CP ranks per Ulysses slot: rank g = super-rank G * u + slot j; each slot runs its own mesh."""
        u = self.ulysses
        return [list(range(j, self.size, u)) for j in range(u)]

    def __repr__(self) -> str:
        u = f"ulysses={self.ulysses}, " if self.ulysses > 1 else ""
        return f"VirtualMesh({self.shape}, {u}size={self.size})"


def _a2a(xs: List[torch.Tensor], u: int, pack, unpack, traffic: List[Traffic], phase: str,
         category: str) -> List[torch.Tensor]:
    """The all-to-all of every Ulysses group in memory: ``xs[g]`` is CP rank g's tensor."""
    if u == 1:
        return xs
    out: List[torch.Tensor] = []
    for start in range(0, len(xs), u):
        packs = [pack(x) for x in xs[start:start + u]]
        for j in range(u):  # member j receives entry j of every member's send buffer
            out.append(unpack(torch.stack([p[j] for p in packs])))
            nbytes = a2a_bytes(packs[j])
            traffic[start + j].add(phase, category, nbytes, nbytes)
    return out


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
    mask: Optional[Mask] = None,
    sink: Optional[torch.Tensor] = None,
    return_max_logit: bool = False,
) -> Dict[str, object]:
    """Full-sequence ``q, k, v`` (and ``dout`` for a backward) -> gathered results.

    ``shape``: ``(a, b)`` for a mesh, ``(u, a, b)`` for ``a2a+mesh`` (Ulysses degree u), or a
    :class:`VirtualMesh` (passing the same one to every call keeps its buffer pools warm).
    Every other argument is :func:`~megatron_mesh_cp.attention.mesh_attention`'s, for the whole
    sequence. Returns ``{"out", "lse" ([b, h, s]; thd: [h, t]), "dq", "dk", "dv" (with dout),
    "traffic" (per CP rank), "plans" (the (forward, backward) plans that ran)}``; ``sink`` adds
    ``"dsink"`` (with dout), ``return_max_logit`` adds ``"max_logit"`` (fp32 ``[h]``).
    """
    mesh = shape if isinstance(shape, VirtualMesh) else VirtualMesh(shape)
    u, n = mesh.ulysses, mesh.size
    m = call_mask(layout, cu_seqlens, cu_seqlens_padded, window, mask)
    # the sharding adapter: every rank's share of the whole sequence, in the caller's layout
    sd = 0 if layout == "thd" else seq_dim(layout)
    if layout == "thd":
        shard = lambda x, g: thd_shard(x, m.cu_padded, n, g, dim=0)  # noqa: E731
        gather = lambda xs: thd_gather(xs, m.cu_padded, dim=0)  # noqa: E731
    else:
        shard = lambda x, g: zigzag_shard(x, n, g, dim=sd)  # noqa: E731
        gather = lambda xs: zigzag_gather(xs, dim=sd)  # noqa: E731
    local = [[shard(x, g) for x in (q, k, v)] for g in range(n)]
    spec = resolve(*local[0], mesh, causal=causal, softmax_scale=softmax_scale, layout=layout, kernel=kernel,
                   plans=plans, partial_dtype=partial_dtype, deterministic=deterministic, mask=m, sink=sink,
                   return_max_logit=return_max_logit)
    call = prepare(spec)
    ranks = [call.for_rank(g // u, g, q.device) for g in range(n)]
    r = kv_repeats(spec.heads, spec.kv_heads, u) if u > 1 else 1
    traffic = [Traffic() for _ in range(n)]

    def a2a_in(xs, phase, category):  # local tokens, every head -> the super-rank's tokens, one head group
        if u == 1:
            return [x if rk.packed is None else rk.packed.into_mesh(x) for x, rk in zip(xs, ranks)]
        return _a2a(xs, u, lambda x: heads_to_members(x, u), lambda recv: super_of_members(recv, u, ranks[0].packed),
                    traffic, phase, category)

    def a2a_out(ys, phase, category):  # the inverse
        if u == 1:
            return [y if rk.packed is None else rk.packed.out_of_mesh(y) for y, rk in zip(ys, ranks)]
        return _a2a(ys, u, lambda y: members_of_super(y, u, ranks[0].packed), lambda recv: members_to_heads(recv, u),
                    traffic, phase, category)

    def run(plan, per_rank, forward=False):
        results: List[object] = [None] * n
        for j, slot in enumerate(mesh.slots()):
            for c in mesh.hubs[j].ranks:  # count this run's bytes only
                c.traffic.reset()
            extra = dict(sinks=None if sink is None else [sink_slot(sink, u, j)] * len(slot),
                         max_logit=spec.max_logit) if forward else {}
            res, counts = run_virtual(plan, spec.shape, [per_rank[g] for g in slot], call.kernel, causal=spec.causal,
                                      scale=spec.scale, hub=mesh.hubs[j], partial_dtype=spec.partial_dtype,
                                      parts=[ranks[g].parts for g in slot], **extra)
            for g, x, t in zip(slot, res, counts):
                results[g] = x
                for (p, c), nbytes in t.sent.items():
                    traffic[g].add(p, c, nbytes, t.received[(p, c)])
        return results

    seq = [[sequence_major(x, layout).contiguous() for x in xs] for xs in local]  # as _MeshAttention takes them
    lq = a2a_in([x[0] for x in seq], FORWARD, "a2a-Q")
    lk = a2a_in([replicate_kv(x[1], r) for x in seq], FORWARD, "a2a-KV")
    lv = a2a_in([replicate_kv(x[2], r) for x in seq], FORWARD, "a2a-KV")
    res = run(call.plans[0], [dict(q=lq[g], k=lk[g], v=lv[g]) for g in range(n)], forward=True)
    result: Dict[str, object] = {"plans": call.plans}
    if spec.max_logit:  # slot j's ranks hold head group j; the max over every rank of each head
        result["max_logit"] = torch.stack([torch.stack([res[g][2] for g in slot]).amax(0)
                                           for slot in mesh.slots()]).flatten()
    outs = a2a_out([x[0] for x in res], FORWARD, "a2a-O")
    lses = a2a_out([x[1] for x in res], FORWARD, "a2a-LSE")  # [s, b, h]
    per_out, per_lse = [], []
    for g, (o, lse) in enumerate(zip(outs, lses)):
        pad = ranks[g].padding
        if pad is not None:  # padding rows: no output, lse = -inf (packed.py)
            o = o.masked_fill(pad.view(-1, 1, 1, 1), 0)
            lse = lse.masked_fill(pad.view(-1, 1, 1), float("-inf"))
        o, lse = user_layout(o, lse.permute(1, 2, 0), layout)
        per_out.append(o)
        per_lse.append(lse)
    result["out"] = gather(per_out)
    result["lse"] = zigzag_gather(per_lse, dim=2) if layout != "thd" else thd_gather(per_lse, m.cu_padded, dim=1)
    if dout is not None:
        ldo = []
        for g in range(n):
            do = sequence_major(shard(dout, g), layout)
            if ranks[g].padding is not None:
                do = do.masked_fill(ranks[g].padding.view(-1, 1, 1, 1), 0)
            ldo.append(do.contiguous())
        ldo = a2a_in(ldo, BACKWARD, "a2a-dO")
        acc = lse_dtype(q.dtype)
        per, dsink = [], None
        if sink is not None:
            dsink = torch.zeros(u, sink.numel() // u, dtype=sink.dtype, device=sink.device)
        for g in range(n):
            o, lse_g = res[g][:2]
            delta = (ldo[g].to(acc) * o.to(acc)).sum(-1)
            per.append(dict(q=lq[g], k=lk[g], v=lv[g], out=o, lse=lse_g, dout=ldo[g], delta=delta))
            if dsink is not None:
                dsink[g % u] += sink_grad(sink_slot(sink, u, g % u), lse_g, delta)
        if dsink is not None:
            result["dsink"] = dsink.flatten()
        grads = run(call.plans[1], per)
        for i, (name, cat) in enumerate((("dq", "a2a-dQ"), ("dk", "a2a-dKV"), ("dv", "a2a-dKV"))):
            local_g = a2a_out([x[i] for x in grads], BACKWARD, cat)
            if name != "dq":
                local_g = [fold_replicas(x, r) for x in local_g]
            result[name] = gather([user_layout(x, x.new_empty(0), layout)[0] for x in local_g])
    result["traffic"] = traffic
    return result
