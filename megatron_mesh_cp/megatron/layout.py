"""Each micro-batch's token layout under document masking, applied before Megatron's CP split.

``--mesh-layout`` (``auto`` by default): the launcher's ``get_batch`` reads the micro-batch's
documents (its EOD tokens), builds the layout (runtime/layouts.py) -- ``auto`` the one the cost
model predicts fastest for this mesh and layer (planning/layouts.py), never one it predicts slower
than the balanced document order; ``tiled`` balances the ranks of the configured (u, a, b) mesh,
``tiled-cut`` re-lays a few of that order's documents (and trades a few tokens between them) to balance them further --
and re-lays tokens, labels, loss mask and position ids with its order before
``get_batch_on_this_cp_rank`` splits them. Every rank of every pipeline stage computes the same
layout from the same offsets (the searches are seeded), and the CP group agrees on the resulting
mask once per micro-batch (``attention.agree_batch``).

A layout that cuts documents (``split``, ``split-half``, ``tiled-cut``) moves a document's pieces apart in the sequence, so RoPE
must rotate each token at its own position: :func:`install_rotary` makes Megatron's
``RotaryEmbedding`` take the current micro-batch's order (the embedding of the original positions,
re-laid, then sliced per CP rank as Megatron slices it) -- Llama-3.1's scaled frequencies included,
as they live in the embedding. Layouts that keep documents whole change no position a document sees
relative to itself and leave RoPE as it is. The mask of a cut layout reaches the attention on the
batch's ``PackedSeqParams`` (:class:`LaidOutParams`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger("megatron_mesh_cp")

__all__ = ["LAYOUT_CHOICES", "CUTTING_LAYOUTS", "LaidOutParams", "BatchLayout", "CURRENT", "lay_out", "install_rotary", "LayoutPolicy",
           "LaidOutDataset", "wrap_datasets", "AHEAD_FIELDS"]

#: --mesh-layout values: auto (chosen per micro-batch), or one layout every micro-batch
LAYOUT_CHOICES = ("auto", "zigzag", "balanced", "tiled", "tiled-cut", "split", "split-half")
#: the --mesh-layout values that cut documents into pieces (RoPE must follow each token's own position)
CUTTING_LAYOUTS = ("split", "split-half", "tiled-cut")
#: auto's report names a candidate by one number: ``LAYOUT_CHOICES.index(name) + LABEL_BASE * (k + COUNT_BASE * h)``
#: for ``name:k`` (k documents split) or ``name:k:h`` (the last h over half rows); room for this many layout
#: names, and for split counts below COUNT_BASE
LABEL_BASE, COUNT_BASE = 8, 64


def _check_label_base(choices=LAYOUT_CHOICES, base: int = LABEL_BASE) -> None:
    if len(choices) > base:
        raise RuntimeError(f"{len(choices)} layout names (LAYOUT_CHOICES) do not fit the report's label ids, "
                           f"{base} names per split count (LABEL_BASE): raise LABEL_BASE")


_check_label_base()


def _params_class():
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class LaidOutParams(PackedSeqParams):
        """Megatron's PackedSeqParams of a micro-batch whose documents a layout cut into pieces: the
        mask the mesh attention runs (``runtime.masks.Arranged``) rides along."""

        mesh_mask: object = None

    return LaidOutParams


class BatchLayout:
    """The current micro-batch's layout as the rotary embedding needs it: the original position of
    every re-laid token (None: positions as given)."""

    def __init__(self) -> None:
        self.positions: Optional[torch.Tensor] = None
        self.name = ""


#: set by the launcher's get_batch for each micro-batch, read by the rotary embedding in that forward
CURRENT = BatchLayout()
LaidOutParams = None  # made on first use (megatron-core is imported lazily)


def _mesh_dims(args):
    """(u, a, b) of the configured mesh (the launcher resolved --mesh-shape)."""
    sizes = [int(x) for x in (args.hierarchical_context_parallel_sizes or [])]
    if len(sizes) == 3:
        return tuple(sizes)
    if len(sizes) == 2:
        return (1,) + tuple(sizes)
    return 1, 1, int(args.context_parallel_size)


@dataclass(frozen=True)
class LayoutPolicy:
    """How this run lays out a micro-batch (``--mesh-layout``, the mesh, the cost model's layer and
    cluster): a picklable value, so the data loader's workers choose with it ahead of the step."""

    layout: str
    chunks: int
    shape: tuple  # (a, b) of the mesh
    cluster: object = None  # auto and tiled: the cost model's inputs
    inner: object = None
    stride: int = 1
    whole_documents: bool = False  # auto narrowed: documents stay whole
    search: object = None  # --mesh-plan-search N > 0: (N, planner, the attention's layer, cluster, stride, max_live)

    def orders(self, arr):
        """The searched orders of ``arr``'s plans (planning.schedule.orders_ahead; empty without a search)."""
        from ..planning import encode_orders, orders_ahead

        if self.search is None:
            return encode_orders(())
        budget, planner, layer, cluster, stride, max_live = self.search
        return orders_ahead(*self.shape, planner, workload=layer, mask=arr.mask, cluster=cluster, stride=stride,
                            max_live=max_live, budget=budget)

    def choose(self, lengths):
        """The Arrangement of documents ``lengths`` and, for auto, the choice's report."""
        from ..planning import choose_layout
        from ..planning import tile_weights
        from ..runtime import arrange

        chunks, layout = self.chunks, self.layout
        if layout in ("zigzag", "balanced"):
            return arrange(lengths, chunks, layout), None
        if layout in ("split", "split-half"):
            piece = sum(lengths) // (2 * chunks)
            count = max(1, sum(1 for x in lengths if x > 2 * piece))  # every document longer than a chunk
            # split-half: every split document over half of each mesh row's chunks, where they fit; then as split
            tries = [dict(split=k, shape=self.shape, halves=k) for k in range(count, 0, -1)] if layout == "split-half" else []
            for kw in tries + [dict(split=k) for k in range(count, 0, -1)]:
                try:
                    return arrange(lengths, chunks, "split", **kw), None
                except ValueError:
                    continue
            return arrange(lengths, chunks, "balanced"), None
        if layout in ("tiled", "tiled-cut"):  # this mesh's ranks balanced by the cost model's call weights
            # (tiled-cut: and a few documents re-laid, runtime/tile_cut.py)
            return arrange(lengths, chunks, layout, shape=self.shape,
                           weights=tile_weights(self.inner, self.cluster)), None
        narrowed = {"max_split": 0} if self.whole_documents else {}
        choice = choose_layout(lengths, *self.shape, self.cluster, self.inner, stride=self.stride, **narrowed)
        return choice.arrangement, choice


def policy(args) -> LayoutPolicy:
    """This run's :class:`LayoutPolicy` (its arguments resolved by the launcher)."""
    from ..planning import default_cluster
    from ..planning import load_cluster
    from ..planning import ulysses_inner
    from .cp_layer import attention_workload
    from .settings import options

    u, a, b = _mesh_dims(args)
    layout = options().layout
    w = attention_workload(args)
    inner = ulysses_inner(u, w) if u > 1 else w
    cluster = options().cluster or (load_cluster(args.mesh_cluster) if getattr(args, "mesh_cluster", None)
                                   else default_cluster())
    stride = args.tensor_model_parallel_size * u
    search = ((options().plan_search, options().planner, inner, options().cluster, stride, options().max_live)
              if options().plan_search else None)  # the attention's plan inputs (megatron/attention.py)
    if layout not in ("auto", "tiled", "tiled-cut"):
        return LayoutPolicy(layout, a * b, (a, b), search=search)
    return LayoutPolicy(layout, a * b, (a, b), cluster, inner, stride, options().whole_documents, search)


def choose(lengths, args):
    """The Arrangement this micro-batch runs (``--mesh-layout``) and, for auto, the choice's report."""
    return policy(args).choose(lengths)


#: the fields a :class:`LaidOutDataset` sample adds (runtime.layouts.encode, and auto's report)
AHEAD_FIELDS = ("mesh_layout", "mesh_layout_work", "mesh_layout_report", "mesh_plan_orders")


class LaidOutDataset(torch.utils.data.Dataset):
    """A Megatron dataset whose samples carry their token layout, chosen where the sample is loaded --
    in the data loader's worker processes, ahead of the step that trains on it (``--num-workers`` > 0)
    -- rather than on the step's critical path. Everything else is the wrapped dataset's."""

    def __init__(self, dataset, rule: LayoutPolicy, eod: int) -> None:
        self.dataset, self.rule, self.eod = dataset, rule, int(eod)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # split, index_split, config, ... (not while unpickling)
        if name in ("dataset", "rule", "eod") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, idx):
        from ..runtime import documents_from_eod
        from ..runtime import encode_layout as encode

        sample = dict(self.dataset[idx])
        t0 = time.perf_counter()
        cu = documents_from_eod(torch.as_tensor(sample["tokens"]).reshape(-1), self.eod)
        arr, choice = self.rule.choose((cu[1:] - cu[:-1]).tolist())
        code, work = encode(arr)
        sample["mesh_layout"], sample["mesh_layout_work"] = torch.from_numpy(code), torch.from_numpy(work)
        worker = torch.utils.data.get_worker_info() is not None  # else the main process, when the batch is fetched
        sample["mesh_plan_orders"] = torch.from_numpy(self.rule.orders(arr))  # --mesh-plan-search, found here
        sample["mesh_layout_report"] = torch.tensor(_report(choice, time.perf_counter() - t0, worker),
                                                    dtype=torch.float64)
        return sample


def _label_id(label: str) -> int:
    name, _, spec = label.partition(":")
    k, _, h = spec.partition(":")
    if int(k or 0) >= COUNT_BASE:
        raise ValueError(f"a layout label's split count {k} does not fit the report's label ids (< {COUNT_BASE})")
    return LAYOUT_CHOICES.index(name) + LABEL_BASE * (int(k or 0) + COUNT_BASE * int(h or 0))


def _label_of(i: int) -> str:
    i = int(i)
    name, rest = LAYOUT_CHOICES[i % LABEL_BASE], i // LABEL_BASE
    k, h = rest % COUNT_BASE, rest // COUNT_BASE
    return f"{name}:{k}:{h}" if h else f"{name}:{k}" if k else name


def _report(choice, seconds: float, worker: bool) -> list:
    """The choice's report as floats: [host seconds, 1 if a loader worker made it, then for auto its
    predicted seconds and (label id, seconds, balance) per candidate]."""
    head = [seconds, float(worker)]
    if choice is None:
        return head
    return head + [choice.seconds] + [v for n, s, bal in choice.candidates for v in (_label_id(n), s, bal)]


def _choice_of(arr, report):
    """The LayoutChoice a :func:`_report` describes (None: not auto's)."""
    from ..planning import LayoutChoice

    r = [float(v) for v in report]
    if len(r) < 3:
        return None
    cands = tuple((_label_of(r[i]), r[i + 1], r[i + 2]) for i in range(3, len(r), 3))
    return LayoutChoice(arr, r[2], cands, r[0])


def wrap_datasets(datasets, args, eod: int):
    """``datasets`` (train, valid, test; None where not built) as :class:`LaidOutDataset`s; a split that is a list
    of datasets (Megatron's ``multiple_validation_sets``: one validation set per prefix) has each one wrapped."""
    rule = policy(args)

    def wrap(d):
        if isinstance(d, (list, tuple)):
            return type(d)(wrap(x) for x in d)
        return None if d is None else LaidOutDataset(d, rule, eod)

    return tuple(wrap(d) for d in datasets)


def lay_out(batch: dict, params, args, ahead=None):
    """The micro-batch re-laid by its layout (before the CP split): ``(batch, params)`` with the tokens,
    labels, loss mask and position ids in the layout's order and the attention's documents. ``ahead``:
    the layout the data loader chose for it (:data:`AHEAD_FIELDS`' tensors), else chosen here."""
    t0 = time.perf_counter()
    batch, params, arr, choice, chose = _lay_out(batch, params, args, ahead)
    from .settings import COUNTERS

    host, worker = time.perf_counter() - t0, None
    if chose is not None:  # (seconds, in a loader worker); --num-workers 0: this process, when the batch was fetched
        worker = chose[0] if chose[1] else None
        host += 0.0 if chose[1] else chose[0]
    if COUNTERS.note_layout(arr, choice, host, ahead=worker):  # the first micro-batch: what runs
        where = (" (chosen by a data loader worker)" if worker is not None
                 else " (chosen when the batch was fetched)" if chose is not None else "")
        log.info("mesh layout of the first micro-batch%s: %s", where, choice.describe() if choice else arr.describe())
    _note_split_half(arr)
    return batch, params


def _note_split_half(arr) -> None:
    """``--mesh-layout split-half`` runs a micro-batch whose long documents fit no half rows as ``split`` would (over
    every chunk), as documented: said once in the log and counted in the summary, not left to the layout counts."""
    from .settings import COUNTERS, options

    if options().layout != "split-half" or arr.halves:
        return
    COUNTERS.over_every_chunk += 1
    if COUNTERS.over_every_chunk == 1:
        log.warning("--mesh-layout split-half: a micro-batch's long documents fit no half of each mesh row's chunks, "
                    "so it runs as %s (as --mesh-layout split: cut over every chunk where they fit); the summary counts such "
                    "micro-batches (layouts.split_half_over_every_chunk)", arr.label)


def _lay_out(batch: dict, params, args, ahead=None):
    global LaidOutParams
    from dataclasses import fields

    from ..runtime import Documents

    cu = params.cu_seqlens_q
    lengths = (cu[1:] - cu[:-1]).tolist()
    if ahead is not None:  # chosen in the data loader: this batch's documents, checked
        from ..runtime import decode_layout as decode

        from ..planning import remember_encoded

        code, work, report, orders = (t.reshape(-1).cpu().numpy() for t in ahead)
        u, a, b = _mesh_dims(args)
        arr = decode(code, work, lengths, a * b)
        remember_encoded(orders)  # the plans' searched orders (--mesh-plan-search), taken when the call plans
        choice, chose = _choice_of(arr, report), (float(report[0]), bool(report[1]))
    else:
        (arr, choice), chose = choose(lengths, args), None
    CURRENT.positions, CURRENT.name = None, arr.name
    if arr.order is None:
        return batch, params, arr, choice, chose
    index = torch.from_numpy(arr.order).to(cu.device)
    batch = {k: (v.index_select(1, index.to(v.device)) if v is not None else None) for k, v in batch.items()}
    if isinstance(arr.mask, Documents):  # whole documents in a new order: new offsets, RoPE as it is
        new = torch.tensor(arr.mask.cu, dtype=cu.dtype, device=cu.device)
        return batch, type(params)(**{f.name: getattr(params, f.name) for f in fields(params)} | {
            "cu_seqlens_q": new, "cu_seqlens_kv": new}), arr, choice, chose
    if LaidOutParams is None:
        LaidOutParams = _params_class()
    CURRENT.positions = index
    cuts = torch.tensor(arr.mask.cuts, dtype=cu.dtype, device=cu.device)
    kw = {f.name: getattr(params, f.name) for f in fields(params)}
    kw.update(cu_seqlens_q=cuts, cu_seqlens_kv=cuts, mesh_mask=arr.mask)
    return batch, LaidOutParams(**kw), arr, choice, chose


def install_rotary() -> None:
    """Make Megatron's RotaryEmbedding rotate each token at its own position under a layout that cuts
    documents (:data:`CURRENT`); without one it is Megatron's (cached) forward."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    cls = rope.RotaryEmbedding
    if getattr(cls, "_mesh_layout_forward", None) is not None:
        return
    inner = cls.forward

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        positions = CURRENT.positions
        if positions is None or packed_seq:
            return inner(self, max_seq_len, offset, packed_seq, cp_group)
        group = cp_group if cp_group is not None else self.cp_group
        # get_emb first: under --use-cpu-initialization inv_freq stays on the host until get_emb's first call
        # moves it to the GPU, so the positions go where the embedding is (not where inv_freq was)
        emb = self.get_emb(max_seq_len, offset)
        mine = positions.to(emb.device)
        if group is not None and group.size() > 1:  # this rank's positions first: the gather is 1/CP of the sequence
            mine = rope.get_pos_emb_on_this_cp_rank(mine, 0, group)
        return emb.index_select(0, mine)

    # Megatron's memo (lru_cache) stays reachable as RotaryEmbedding.forward.cache_clear, which Megatron-Bridge
    # (eval_context_parallel_rebinding) and the tests' teardown call to drop entries keyed on an old CP group
    for name in ("cache_clear", "cache_info"):
        if hasattr(inner, name):
            setattr(forward, name, getattr(inner, name))
    cls._mesh_layout_forward = inner
    cls.forward = forward
