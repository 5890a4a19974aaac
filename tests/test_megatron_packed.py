"""Packed sequences through Megatron's real training loop: CP = 4 mesh 2x2 (THD, per-document
split) vs CP = 1 (Megatron's own local attention with a block-diagonal causal mask) on the same
packed batches -- per-iteration loss and every first-step gradient agree to 1e-5. Also the
launcher's packing itself, without Megatron's loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import train  # noqa: E402

from megatron_mesh_cp.megatron.packing import pack_sample, packed_batch  # noqa: E402
from megatron_mesh_cp.runtime.packed import thd_partition_indices  # noqa: E402

#: documents = stdlib files cut into pieces of <= 37 bytes, each padded to a multiple of 8 (= 2 x CP 4)
PACKED = dict(train_iters=3, calculate_per_token_loss=True, mesh_packed_data=True, mesh_pack_multiple=8,
              mesh_pack_doc_tokens=37)


def test_pack_sample_pads_every_document_and_drops_the_overflow():
    tokens = torch.arange(1, 33)
    cu = torch.tensor([0, 5, 22, 32, 32, 32])  # documents of 5, 17, 10 tokens, then the dataset's fill
    out = pack_sample(tokens, tokens + 100, torch.ones(32), cu, multiple=8)
    assert out["real"] == [5, 17] and out["padded"] == [8, 24]  # the third document no longer fits
    assert out["tokens"][:5].tolist() == [1, 2, 3, 4, 5] and not out["tokens"][5:8].any()
    assert out["tokens"][8:25].tolist() == list(range(6, 23)) and out["labels"][8].item() == 106
    assert out["loss_mask"].tolist() == [1] * 5 + [0] * 3 + [1] * 17 + [0] * 7
    assert out["position_ids"][8:11].tolist() == [0, 1, 2]


def test_packed_batch_splits_per_document_and_masks_blocks():
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 250, (2, 32), generator=g), "labels": torch.randint(0, 250, (2, 32), generator=g),
             "loss_mask": torch.ones(2, 32), "cu_seqlens": torch.tensor([[0, 3, 20, 32, 32], [0, 32, 32, 32, 32]])}
    dense = packed_batch(batch, 8, None, 1, 0)
    assert dense["packed_seq_params"] is None
    mask = dense["attention_mask"][0, 0]  # True = masked: document 0 is rows 0..7, document 1 rows 8..31
    assert not mask[9, 8] and mask[9, 7] and mask[9, 10] and not mask[31, 8]
    flat = {k: torch.cat(list(dense[k])) for k in ("tokens", "labels", "loss_mask")}
    shares = [packed_batch(batch, 8, None, 4, r) for r in range(4)]
    p = shares[0]["packed_seq_params"]
    assert p.qkv_format == "thd" and p.cu_seqlens_q_padded.tolist() == [0, 8, 32, 64]
    assert p.cu_seqlens_q.tolist() == [0, 3, 20, 52] and p.max_seqlen_q == 32
    for r, share in enumerate(shares):
        index = thd_partition_indices(p.cu_seqlens_q_padded, 64, 4, r)
        for k in flat:
            assert torch.equal(share[k][0], flat[k][index]), (r, k)


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("megatron-packed")
    return {"cp1": train(work, "packed-cp1", 1, context_parallel_size=1, **PACKED),
            "mesh2x2": train(work, "packed-mesh2x2", 4, context_parallel_size=4, context_parallel_algo="mesh",
                             mesh_shape="2x2", **PACKED)}


def test_packed_loss_and_gradients_match_cp1(packed_runs):
    ref, got = packed_runs["cp1"], packed_runs["mesh2x2"]
    assert [it for it, _ in got["losses"]] == [1, 2, 3] == [it for it, _ in ref["losses"]]
    for (it, a), (_, b) in zip(got["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) <= 1e-5, (it, a, b)
    g_ref, g_got = torch.load(ref["grads_path"]), torch.load(got["grads_path"])
    assert set(g_ref) == set(g_got) and len(g_ref) > 10
    for key in g_ref:
        err = float((g_got[key] - g_ref[key]).norm() / g_ref[key].norm().clamp_min(1e-30))
        assert err <= 1e-5, (key, err)
    # the mesh run ran THD in every attention call, on several documents per sequence
    assert got["document_attention_calls"] == got["attention_calls"] == 2 * 3
    assert got["packed_documents_per_sequence"] > 3 and ref["packed_documents_per_sequence"] > 3
