"""Megatron's attention variants under mesh CP: sliding windows per layer, sinks, MLA, qk-clip.

Through Megatron's real training loop (CP = 4 mesh 2x2 vs CP = 1, Megatron's own local
DotProductAttention, which applies window_size and softmax_offset itself; 10 iterations, lm loss
and every first-step gradient to 1e-5):

* a gpt-oss-like GPT: a 7-token causal window on layer 1, full attention on layer 2
  (``--window-attn-skip-freq 2``), learnable sinks (``--softmax-type learnable``), run with the
  per-layer list ``--cp-comm-type mesh mesh`` (window-pruned plans and full plans on one mesh);
* a DeepSeek-like MLA GPT (``--multi-latent-attention``, q/k head dim 16 + 8, value head dim 16).

On a GPTModel built directly (gloo ranks, no loop): the same models under a2a+mesh 2x1x2 and Ring
1x4 vs CP = 1 (the window layer sends fewer bytes than the full one), the sinks' parameter and
checkpoint names equal to CP = 1's, the max logit of ``qk_clip`` against the float64 reference on
every rank, and Megatron's own ``clip_qk`` consuming it. Refusals exit before training.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import run_bad_args, train, write_config  # noqa: E402
from test_megatron_composition import ITERS, grad_diff, loss_diff  # noqa: E402

from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args  # noqa: E402
from megatron_mesh_cp.reference import variant_reference  # noqa: E402

SWA = dict(window_size="7,0", window_attn_skip_freq=2, softmax_type="learnable", train_iters=ITERS)
MLA = dict(multi_latent_attention=True, group_query_attention=False, num_query_groups=None, kv_lora_rank=32,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope", train_iters=ITERS)
MESH4 = dict(context_parallel_size=4, mesh_shape="2x2")
RUNS = {
    "swa_cp1": (1, SWA),
    "swa_mesh": (4, dict(SWA, **MESH4, cp_comm_type=["mesh", "mesh"])),
    "mla_cp1": (1, MLA),
    "mla_mesh": (4, dict(MLA, **MESH4, context_parallel_algo="mesh")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("variants")
    return {name: train(work, name, nproc, **kw) for name, (nproc, kw) in RUNS.items()}


@pytest.mark.parametrize("model", ["swa", "mla"])
def test_variants_through_megatron_loop_match_cp1(runs, model):
    got, ref = runs[f"{model}_mesh"], runs[f"{model}_cp1"]
    dl, dg = loss_diff(got["losses"], ref["losses"]), grad_diff(got["grads_path"], ref["grads_path"])
    print(f"[variants] {model} mesh 2x2 vs CP=1: max rel loss diff {dl:.2e}, max rel grad diff {dg:.2e}")
    assert len(got["losses"]) == ITERS and dl <= 1e-5 and dg <= 1e-5, (model, dl, dg)
    assert got["attention_calls"] > 0 and got["mesh_shape"] == "2x2"
    assert ref["losses"][-1][1] < ref["losses"][0][1]  # it learns
    grads = torch.load(got["grads_path"])
    sinks = [k for k in grads if k.endswith("core_attention.inner.softmax_offset")]
    if model == "swa":  # both layers' sinks, named as at CP = 1 (grad_diff compared the names), and learning
        assert len(sinks) == 2 and all(float(grads[k].norm()) > 0 for k in sinks), sinks
    else:
        assert not sinks and any("linear_kv_up_proj" in k for k in grads)


# --- a GPTModel built directly (gloo ranks) -----------------------------------------------------

DIRECT = {"swa": dict(window_size=(7, 0), window_attn_skip_freq=2, softmax_type="learnable"), "mla": dict(mla=True)}
TASK = "rank_tasks_megatron_variants:gpt_variants"


@pytest.fixture(scope="module")
def direct_cp1(pools):
    return {m: pools.get(4).run(TASK, 1, (1, 1), seed=3, seq=128, **kw)[0] for m, kw in DIRECT.items()}


@pytest.mark.parametrize("model,shape", [("swa", (2, 1, 2)), ("swa", (1, 4)), ("mla", (2, 1, 2))],
                         ids=["swa-a2a+mesh-2x1x2", "swa-ring-1x4", "mla-a2a+mesh-2x1x2"])
def test_variants_on_gpt_model_match_cp1(pools, direct_cp1, model, shape):
    got, ref = pools.get(4).run(TASK, 4, shape, seed=3, seq=128, **DIRECT[model])[0], direct_cp1[model]
    loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 10
    errs = {n: float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref["grads"].items()}
    print(f"[variants] direct {model} {shape}: rel loss diff {loss_err:.1e}, max rel grad diff {max(errs.values()):.1e}, "
          f"forward bytes per layer {[x['bytes'] for x in got['layers']]}")
    assert loss_err <= 1e-5 and max(errs.values()) <= 1e-5, (max(errs, key=errs.get), max(errs.values()))
    assert got["sinks"] == ref["sinks"] and got["sharded"] == ref["sharded"]  # a checkpoint moves between them
    if model == "swa":
        assert [x["window"] for x in got["layers"]] == [(7, 0), None]
        assert len(got["sharded"]) == 2 and all(v == ((2, 4), (2, 1)) for v in got["sharded"].values())
        if shape == (1, 4):  # the window layer's pruned plan sends only the neighbours' chunks
            assert got["layers"][0]["bytes"] < got["layers"][1]["bytes"]


@pytest.mark.parametrize("shape", [(2, 2), (2, 1, 2)], ids=["mesh-2x2", "a2a+mesh-2x1x2"])
def test_qk_clip_max_logit_equals_reference_on_every_rank(pools, shape):
    """current_max_attn_logits after two forwards = the float64 reference's max of scale*q.k over the
    allowed pairs of both batches (the window layer's window respected), per head, on every rank."""
    res = pools.get(4).run(TASK, 4, shape, seed=3, seq=128, steps=2, qk_clip=True, **DIRECT["swa"])
    for i, layer in enumerate(res[0]["layers"]):
        tops = [m[0] for m in layer["max_logits"]]
        assert all(torch.equal(tops[0], t) for t in tops) and not any(m[1] for m in layer["max_logits"])
        ref, unwindowed = None, None
        for q, k, v in layer["qkv"]:
            for b in range(q.shape[1]):
                qb, kb, vb = (x[:, b].double() for x in (q, k, v))
                r = variant_reference(qb, kb, vb, None, window=layer["window"], softmax_scale=layer["scale"])
                ref = r["max_logit"] if ref is None else torch.maximum(ref, r["max_logit"])
                r = variant_reference(qb, kb, vb, None, softmax_scale=layer["scale"])["max_logit"]
                unwindowed = r if unwindowed is None else torch.maximum(unwindowed, r)
        err = float(((tops[0].double() - ref).abs() / ref.abs()).max())
        print(f"[variants] {shape} layer {i + 1} window {layer['window']}: max logit rel err {err:.1e}")
        assert tops[0].shape == (4,) and tops[0].dtype == torch.float32 and err <= 1e-5
        if layer["window"] is not None:
            assert not torch.allclose(ref, unwindowed)  # the window changes the max: it was applied


def test_megatrons_clip_qk_consumes_mesh_max_logits(pools):
    res = pools.get(4).run("rank_tasks_megatron_variants:qk_clip_consumes_max_logits", (2, 2), seed=3, seq=128,
                           **DIRECT["swa"])
    for r in res:
        assert r["logged"] == r["max"] == res[0]["logged"] and all(r["changed"]) and all(r["reset"]), r


# --- refusals -------------------------------------------------------------------------------------

BAD = [
    (["--cp-comm-type", "mesh", "p2p"], "mixes mesh with Transformer Engine's CP algorithms (p2p) per layer"),
    (["--cp-comm-type", "mesh", "a2a+mesh"], "mixes mesh and a2a+mesh per layer"),
    (["--cp-comm-type", "mesh", "mesh", "mesh"], "lists 3 algorithms for 2 layers"),
    (["--context-parallel-algo", "mesh", "--window-size", "7,3"], "a causal query sees no key to its right"),
    (["--context-parallel-algo", "mesh", "--window-size", "7,0", "--mesh-packed-data", "--calculate-per-token-loss"],
     "a sliding window over padded THD documents is not built"),
]


def test_variants_a_path_would_drop_are_refused_before_training(tmp_path):
    cfg = write_config(tmp_path, "variants-bad", context_parallel_size=4, mesh_shape="2x2")
    cases = [["--config", str(cfg)] + argv for argv, _ in BAD]
    needles = [n for _, n in BAD]
    cp1 = write_config(tmp_path, "variants-bad-cp1", micro_batch_size=1, global_batch_size=2)
    cases.append(["--config", str(cp1), "--window-size", "7,0", "--reset-attention-mask"])
    needles.append("Megatron's local attention replaces the dataloader's document mask by its window mask")
    for argv, needle, res in zip(cases, needles, run_bad_args(cases, tmp_path)):
        assert res["code"] == 2, (argv, res)
        assert needle in res["stderr"], (argv, res["stderr"])


def test_per_layer_mesh_list_is_kept():
    from test_megatron_integration import _flat

    args = apply_mesh_args(_flat(context_parallel_size=4, cp_comm_type=["a2a+mesh"] * 3, num_layers=3,
                                 mesh_shape="2x1x2"), argv=["--cp-comm-type", "a2a+mesh"])
    assert args.cp_comm_type == ["a2a+mesh"] * 3 and args.context_parallel_algo == "a2a+mesh"
    assert args.hierarchical_context_parallel_sizes == [2, 1, 2]
    with pytest.raises(MeshArgumentError, match="mixes a2a\\+mesh with Transformer Engine's CP algorithms \\(a2a\\)"):
        apply_mesh_args(_flat(context_parallel_size=4, cp_comm_type=["a2a+mesh", "a2a"], num_layers=2), argv=[])


def _config(cp=1, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, **kw)


def test_core_attention_refuses_what_its_path_cannot_honour():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh_cp.megatron.attention import MeshCoreAttention

    kw = dict(layer_number=1, attention_type="self", attn_mask_type=AttnMaskType.causal)
    with pytest.raises(ValueError, match="--window-size 7,2 \\(layer 1\\).*pass window=\\(7, 0\\)"):
        MeshCoreAttention(_config(4, window_size=(7, 2)), cp_comm_type="mesh", **kw)
    # CP = 1 without TE is Megatron's local DotProductAttention: no max logit, one head dim for its output
    with pytest.raises(ValueError, match="does not return; install TE"):
        MeshCoreAttention(_config(1, log_max_attention_logit=True), **kw)
    with pytest.raises(ValueError, match="pass --kv-channels 24"):
        MeshCoreAttention(_config(1), k_channels=16, v_channels=24, **kw)


def test_start_up_kernel_check_covers_mla_windows_and_the_max_logit(monkeypatch):
    """On CUDA the start-up kernel check sees MLA's two head dims, and asks the kernel for the window
    and the max logit: a kernel without them is refused before any process group."""
    import contextlib

    from test_megatron_integration import _flat

    import megatron_mesh_cp.runtime as runtime

    seen = {}

    def select(kernel, needs):
        seen["dims"] = (needs.q.shape[-1], needs.k.shape[-1], needs.v.shape[-1])
        seen["max_logit"] = needs.max_logit
        if needs.window:
            raise ValueError("no sliding window here; use --mesh-kernel torch")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(runtime, "select_kernel", select)
    mla = dict(context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2", multi_latent_attention=True,
               qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_clip=True)
    apply_mesh_args(_flat(**mla), argv=[])
    assert seen == {"dims": (192, 192, 128), "max_logit": True}
    with pytest.raises(MeshArgumentError, match="--mesh-kernel auto: no sliding window here"):
        apply_mesh_args(_flat(**mla, window_size=(128, 0)), argv=[])


def test_max_logit_with_padded_packed_data_is_refused_at_start_up():
    """--qk-clip / --log-max-attention-logit with --mesh-packed-data under mesh CP: the launcher pads
    every document, and padding rows would enter the max logit; refused before any process group,
    naming --reset-attention-mask (unpadded documents: exact)."""
    from test_megatron_integration import _flat

    packed = dict(context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2", mesh_packed_data=True,
                  calculate_per_token_loss=True, seq_length=1024)
    apply_mesh_args(_flat(**packed), argv=[])
    for flag in ("qk_clip", "log_max_attention_logit"):
        with pytest.raises(MeshArgumentError, match=r"--qk-clip / --log-max-attention-logit with --mesh-packed-data.*"
                                                    r"--reset-attention-mask --no-create-attention-mask-in-dataloader"):
            apply_mesh_args(_flat(**packed, **{flag: True}), argv=[])
