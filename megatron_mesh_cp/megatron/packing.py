"""The launcher's packed batches: documents padded to a multiple of 2·CP, split per document.

``--mesh-packed-data`` turns each sample of Megatron's GPT dataset (built with
``inter_document_masking``, so it reports the document boundaries inside the sample) into a packed
sequence whose documents -- the stdlib files, optionally cut into pieces of at most
``--mesh-pack-doc-tokens`` -- each start on a multiple of ``--mesh-pack-multiple`` (default 2·CP):
the tokens of a document, then padding (loss mask 0) up to the multiple; what no longer fits the
sequence is dropped. Under CP > 1 the micro-batch is flattened to one THD sequence, split with the
per-document zigzag (:func:`~megatron_mesh_cp.runtime.packed.thd_partition_indices`, the same partition as
TE's ``thd_get_partitioned_indices``) and described by a ``PackedSeqParams``; at CP = 1 the same
documents are kept as ``[b, s]`` rows with a block-diagonal causal mask, so Megatron's own local
attention is the reference the mesh run is compared with.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..runtime import thd_partition_indices

__all__ = ["pack_sample", "packed_batch", "STATS"]

#: sequences and documents this process packed (the launcher's summary reports documents per sequence)
STATS = {"sequences": 0, "documents": 0}


def _documents(cu: torch.Tensor, seq: int, max_doc: Optional[int]) -> List[Tuple[int, int]]:
    """(start, stop) of each document in a sample (the dataset pads ``cu`` with copies of ``seq``),
    long ones cut into pieces of at most ``max_doc`` tokens."""
    bounds = cu.tolist()
    stop = bounds.index(seq) if seq in bounds else len(bounds) - 1
    docs = []
    for a, b in zip(bounds[:stop], bounds[1:stop + 1]):
        step = max_doc or (b - a)
        docs += [(x, min(x + step, b)) for x in range(a, b, step)]
    return docs


def pack_sample(tokens, labels, loss_mask, cu, multiple: int, max_doc: Optional[int] = None) -> Dict:
    """One sample re-packed: every document padded to a multiple of ``multiple`` (padding: token 0,
    loss mask 0), in order, until the sequence is full. Returns the new tensors, per-document
    positions, and the real and padded document lengths."""
    seq = tokens.shape[0]
    if seq % multiple:
        raise ValueError(f"sequence length {seq} is not a multiple of the packing multiple {multiple}")
    out = {name: torch.zeros_like(x) for name, x in (("tokens", tokens), ("labels", labels), ("loss_mask", loss_mask))}
    position_ids = torch.zeros_like(tokens)
    real, padded, pos = [], [], 0
    for a, b in _documents(cu, seq, max_doc):
        room = seq - pos
        if room == 0:
            break
        length = min(b - a, room)
        span = min(-(-length // multiple) * multiple, room)
        for name, x in (("tokens", tokens), ("labels", labels), ("loss_mask", loss_mask)):
            out[name][pos:pos + length] = x[a:a + length]
        position_ids[pos:pos + span] = torch.arange(span)
        real.append(length)
        padded.append(span)
        pos += span
    if pos < seq:  # a sample shorter than its documents claim (never from GPTDataset): all padding
        real.append(0)
        padded.append(seq - pos)
        position_ids[pos:] = torch.arange(seq - pos)
    out.update(position_ids=position_ids, real=real, padded=padded)
    return out


def _offsets(lengths: List[int], device) -> torch.Tensor:
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def packed_batch(batch: Dict[str, torch.Tensor], multiple: int, max_doc: Optional[int], cp_size: int,
                 cp_rank: int) -> Dict:
    """A micro-batch (``tokens``, ``labels``, ``loss_mask``, ``cu_seqlens`` as the dataset collates
    them) -> what the GPT forward takes: CP > 1: this rank's per-document share of the flattened
    sequence and ``packed_seq_params`` (THD); CP = 1: ``[b, s]`` rows and a block-diagonal causal
    ``attention_mask`` (True = masked, Megatron's convention)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    samples = [pack_sample(batch["tokens"][i], batch["labels"][i], batch["loss_mask"][i], batch["cu_seqlens"][i],
                           multiple, max_doc) for i in range(batch["tokens"].shape[0])]
    device = batch["tokens"].device
    STATS["sequences"] += len(samples)
    STATS["documents"] += sum(sum(1 for x in s["real"] if x) for s in samples)
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    if cp_size == 1:
        out = {k: torch.stack([s[k] for s in samples]) for k in keys}
        seq = out["tokens"].shape[1]
        masks = []
        for s in samples:
            doc = torch.repeat_interleave(torch.arange(len(s["padded"]), device=device),
                                          torch.tensor(s["padded"], device=device))
            keep = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
            masks.append(~keep)
        out["attention_mask"] = torch.stack(masks).unsqueeze(1)
        out["packed_seq_params"] = None
        return out
    real = [x for s in samples for x in s["real"]]
    padded = [x for s in samples for x in s["padded"]]
    cu, cu_padded = _offsets(real, device), _offsets(padded, device)
    total = sum(padded)
    index = thd_partition_indices(cu_padded, total, cp_size, cp_rank)
    out = {k: torch.cat([s[k] for s in samples]).index_select(0, index).unsqueeze(0) for k in keys}
    out["attention_mask"] = None
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )
    return out
