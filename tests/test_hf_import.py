"""From Hugging Face weights to a mesh-CP run: Megatron-Bridge's converter, then algorithm-independent checkpoints.

A tiny random ``transformers`` Llama (Llama-3.1 RoPE scaling, GQA, SwiGLU, RMSNorm, untied embeddings,
with a byte-level tokenizer) is saved locally and converted by Megatron-Bridge
(``python -m megatron_mesh_cp.megatron.bridge_cpu``, Bridge's own import on a machine without TE).
Loaded under mesh CP = 4 into a GPTModel built the way the launcher builds it, it gives the
``transformers`` logits (fp32, <= 1e-4 relative), and its keys are stock Megatron's. Then, through
the launcher (Megatron's real loop): a run from the converted weights under Ring (mesh 1x4) saving
every iteration, resumed under mesh 2x2, that run's checkpoint resumed under a2a+mesh 2x1x2, and
that one's under Ring again: each resumed run's losses are the straight run's (<= 1e-5 relative:
the CP algorithms differ only in rounding), and every checkpoint holds the same keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from hf_llama import LAUNCH, LLAMA  # noqa: E402
from megatron_runs import train  # noqa: E402


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    """(this module's run directory, hf dir, converted checkpoint): the session's one conversion."""
    return (tmp_path_factory.mktemp("hf_import"), *tiny_llama)


def _checkpoint_keys(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return {k for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata if "/shard_" not in k}


def test_converted_llama_under_mesh_cp4_gives_the_transformers_logits(converted, pools):
    from transformers import LlamaForCausalLM

    _, hf, ckpt = converted
    tokens = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(5))
    ref = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(tokens).logits.double()
    got = pools.get(4).run("rank_tasks_megatron:llama_from_checkpoint", str(ckpt), tokens, (2, 2), **LLAMA)[0]
    err = float((got["logits"].double() - want).norm() / want.norm())
    print(f"[hf-import] mesh 2x2 logits vs transformers: relative error {err:.2e}")
    assert err <= 1e-4, err
    # the keys are stock Megatron's, in the model and in the checkpoint (which uses the TE spec's names)
    assert got["keys"] == got["stock_keys"] and got["sharded_keys"] == got["stock_sharded_keys"]
    stored = _checkpoint_keys(ckpt / "iter_0000000")
    assert {k for k in got["stock_sharded_keys"] if "_extra_state" not in k} <= stored
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in stored and "output_layer.weight" in stored


def test_checkpoints_resume_across_cp_algorithms(converted):
    """Ring (from the HF weights) -> mesh 2x2 -> a2a+mesh 2x1x2 -> Ring, each resuming the previous one's save."""
    work, _, bridge_ckpt = converted
    chain = [("ring", "1x4", None), ("mesh", "2x2", 1), ("a2a_mesh", "2x1x2", 2), ("ring_again", "1x4", 3)]
    runs, previous = {}, None
    for name, shape, step in chain:
        algo = "a2a+mesh" if shape.count("x") == 2 else "mesh"
        kw = dict(LAUNCH, context_parallel_algo=algo, mesh_shape=shape, save=str(work / name))
        if step is None:  # README's keys: the run directory resumes; while it is empty, the converted weights load
            kw.update(load=str(work / name), pretrained_checkpoint=str(bridge_ckpt))
        else:
            kw.update(load=str(work / previous), ckpt_step=step, no_load_rng=True)
        runs[name] = train(work, name, 4, timeout=600, **kw)
        assert runs[name]["mesh_shape"] == shape and runs[name]["attention_calls"] > 0
        previous = name
    assert f"successfully loaded checkpoint from {bridge_ckpt} " in runs["ring"]["stdout"]  # the converted weights
    straight = dict(runs["ring"]["losses"])
    assert sorted(straight) == list(range(1, 5))
    for name, _, step in chain[1:]:
        got = runs[name]["losses"]
        assert [it for it, _ in got] == list(range(step + 1, 5)), (name, got)
        diff = max(abs(loss - straight[it]) / straight[it] for it, loss in got)
        print(f"[hf-import] {name} resumed at {step}: max rel loss diff vs the straight Ring run {diff:.1e}")
        assert diff <= 1e-5, (name, got, straight)
    keys = {name: _checkpoint_keys(work / name / "iter_0000004") for name, _, _ in chain}
    assert all(k == keys["ring"] for k in keys.values()) and "optimizer" in " ".join(keys["ring"])
