"""Mesh CP composed with the Megatron features a large job turns on, through Megatron's real loop.

Each mesh run is compared with the same run without CP (same TP / PP / DP, so initialisation and
data match): per-iteration lm loss and every parameter's first-step reduced gradient to 1e-5.
Several features share one run to keep CI short (a run is launched only when a test asks for it):

* TP 2 x CP 2, mesh 2x1, selective recompute (core attention re-run, with its communication, in
  the backward); GQA with 4 heads / 2 kv groups, so each TP rank holds one kv head; saving at
  iteration 5, then 5 + load + 5 against the 10 straight iterations (identical losses);
* TP 2 x CP 2, mesh 1x2, sequence parallel (SP-aware norm, see ``sp_norm_spec``), ``--mesh-layout
  split`` (documents cut into pieces over the chunks, RoPE at each token's own position);
* PP 2 x VPP 2 x CP 2, mesh 2x1, full recompute (uniform, 1 layer);
* PP 2 x CP 2, mesh 1x2 (the non-interleaved 1F1B schedule), ``--mesh-layout split`` (every stage
  lays the micro-batch out the same);
* DP 2 x CP 2, mesh 2x1, distributed optimizer + overlapped grad reduce.

Every run masks documents (Megatron's ``--reset-attention-mask --reset-position-ids --eod-mask-loss``
on the stdlib corpus cut into documents of 40 bytes, several per sequence): the baselines through
Megatron's dense mask, the mesh runs from the EOD tokens with pruned plans (one sequence per
micro-batch, per-token loss so unequal loss-token counts across CP ranks weigh as at CP = 1).

Resuming a distributed-optimizer checkpoint is not run here: without apex or TE, megatron-core
0.19.2's DistributedOptimizer.state_dict asserts on the not-yet-stepped torch Adam while building
the state dict to load into (distrib_optimizer.py:839), with or without CP. The resume passes
``--no-load-rng``: without a CUDA device Megatron never seeds its model-parallel RNG tracker, so the
checkpoint holds no tracker states and loading them exits (dropout is off; nothing else draws).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import run_bad_args, train, write_config  # noqa: E402

ITERS = 10
#: document masking, for the baselines (Megatron's dense mask) and the mesh runs alike
DOCS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True, calculate_per_token_loss=True,
            micro_batch_size=1, global_batch_size=2)
DOC_DATA = ["--stdlib-doc-bytes", "40"]
MESH = dict(context_parallel_size=2, context_parallel_algo="mesh", create_attention_mask_in_dataloader=False)
TP2 = dict(DOCS, tensor_model_parallel_size=2, train_iters=ITERS)
PP2 = dict(DOCS, pipeline_model_parallel_size=2, num_layers=4, train_iters=ITERS)
VPP = dict(PP2, num_layers_per_virtual_pipeline_stage=1)
DP2 = dict(DOCS, use_distributed_optimizer=True, overlap_grad_reduce=True, train_iters=ITERS)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SP = dict(sequence_parallel=True, spec=["sp_norm_spec", "gpt_mesh_sp_spec"])

#: name -> (ranks, overrides); baselines have no CP
RUNS: Dict[str, tuple] = {
    "tp2": (2, TP2),
    "tp2_cp2_sel": (4, dict(TP2, **MESH, mesh_shape="2x1", **SELECTIVE, save_interval=5)),
    "tp2_cp2_sp": (4, dict(TP2, **MESH, mesh_shape="1x2", mesh_layout="split", mesh_plan_search=20, **SP)),
    "pp2vpp2": (2, VPP),
    "pp2vpp2_cp2_full": (4, dict(VPP, **MESH, mesh_shape="2x1", **FULL)),
    "pp2": (2, PP2),
    "pp2_cp2": (4, dict(PP2, **MESH, mesh_shape="1x2", mesh_layout="split", mesh_plan_search=20)),
    "dp2": (2, DP2),
    "dp2_cp2_distopt": (4, dict(DP2, **MESH, mesh_shape="2x1")),
}
#: mesh run -> its baseline without CP
MATRIX = {
    "tp2_cp2_sel": "tp2",
    "tp2_cp2_sp": "tp2",
    "pp2vpp2_cp2_full": "pp2vpp2",
    "pp2_cp2": "pp2",
    "dp2_cp2_distopt": "dp2",
}


class Runs:
    """Launches each named run once, on first use."""

    def __init__(self, work: Path) -> None:
        self.work, self.done = work, {}

    def __getitem__(self, name: str) -> Dict:
        if name not in self.done:
            nproc, overrides = RUNS[name]
            if "save_interval" in overrides:
                overrides = dict(overrides, save=str(self.work / f"{name}.ckpt"))
            try:
                self.done[name] = train(self.work, name, nproc, extra=DOC_DATA, timeout=900, **overrides)
            except AssertionError as exc:  # a failed run fails every test that uses it, once
                self.done[name] = exc
        if isinstance(self.done[name], AssertionError):
            raise self.done[name]
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("composition"))


def loss_diff(got, ref) -> float:
    assert [it for it, _ in got] == [it for it, _ in ref] and len(ref) >= 5
    return max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, ref))


def grad_diff(got_path, ref_path) -> float:
    ref, got = torch.load(ref_path), torch.load(got_path)
    assert set(got) == set(ref) and len(ref) > 10
    return max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref)


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_mesh_composes_with_megatron_feature(runs, name):
    got, ref = runs[name], runs[MATRIX[name]]
    dl, dg = loss_diff(got["losses"], ref["losses"]), grad_diff(got["grads_path"], ref["grads_path"])
    print(f"[matrix] {name} vs {MATRIX[name]}: max rel loss diff {dl:.2e}, max rel grad diff {dg:.2e}")
    assert dl <= 1e-5 and dg <= 1e-5, (name, dl, dg)
    assert got["attention_calls"] > 0 and got["mesh_shape"] == RUNS[name][1]["mesh_shape"]
    assert got["document_attention_calls"] == got["attention_calls"]  # every call masked documents
    lay = got["layouts"]  # each micro-batch's layout chosen by the data loader (TP: broadcast with the documents)
    assert lay["chosen_ahead"] == sum(lay["micro_batches"].values()) > 0, lay
    if RUNS[name][1].get("mesh_layout") == "split":  # the documents ran cut into pieces
        assert any(k.startswith("split:") for k in got["layouts"]["micro_batches"]), got["layouts"]
    if RUNS[name][1].get("mesh_plan_search"):  # searched in the loader; TP: the orders broadcast with the documents
        assert got["plan_searches_ahead"] > 0 and got["plan_searches_in_step"] == 0, got
    assert ref["losses"][-1][1] < ref["losses"][0][1]  # it learns


def test_recompute_reruns_mesh_attention_in_the_backward(runs):
    """Selective recompute runs each mesh forward twice per layer and micro-batch (forward + recompute)."""
    sel, plain = runs["tp2_cp2_sel"], runs["tp2_cp2_sp"]
    assert sel["attention_calls"] == 2 * plain["attention_calls"] == 2 * 2 * 2 * ITERS  # 2 layers, 2 micro-batches


def test_checkpoint_resume_matches_straight_run(runs):
    straight = runs["tp2_cp2_sel"]
    ckpt = Path(straight["grads_path"]).parent / "tp2_cp2_sel.ckpt"
    assert (ckpt / "iter_0000005").is_dir() and (ckpt / "iter_0000010").is_dir()
    resumed = train(ckpt.parent, "tp2_cp2_resume", 4, extra=DOC_DATA, timeout=900, **dict(RUNS["tp2_cp2_sel"][1], load=str(ckpt),
                                                                          ckpt_step=5, save=None, save_interval=None,
                                                                          no_load_rng=True))
    assert [it for it, _ in resumed["losses"]] == list(range(6, ITERS + 1))
    tail = {it: loss for it, loss in straight["losses"] if it > 5}
    diff = max(abs(loss - tail[it]) for it, loss in resumed["losses"])
    print(f"[matrix] checkpoint resume: max |loss diff| {diff:.2e}")
    assert diff == 0.0, (resumed["losses"], straight["losses"])
