"""Hugging Face weights back out of a run, and the long-context check on them.

A tiny random Llama-3.1-style ``transformers`` model (tests/hf_llama.py's) is converted as the README
says (``bridge_cpu``), trained 2 iterations through the launcher under mesh CP 2x2 on 4 ranks with the RoPE
base raised as stage 2 raises it, and exported (``hf_export``, Megatron-Bridge's exporter): the export's
``transformers`` logits equal Megatron's of the trained checkpoint (fp32, <= 1e-5 relative) and differ from
the untrained model's, and the passkey-retrieval script runs on the export. The session's one conversion
(shared with test_hf_import.py), one training run and one export feed every test; the input checks of both
directions run without them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from hf_llama import LAUNCH, LLAMA  # noqa: E402
from megatron_runs import ROOT, train  # noqa: E402

STAGE2_BASE = 1011063  # the 8B recipe's stage 2 RoPE base (the HF model's is 500000)


def _python(*args, timeout=900):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def exported(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_export")
    (hf, ckpt), run, out = tiny_llama, work / "run", work / "exported"
    kw = dict(LAUNCH, context_parallel_algo="mesh", mesh_shape="2x2", save=str(run), load=str(run),
              pretrained_checkpoint=str(ckpt), train_iters=2, lr_warmup_iters=1, save_interval=2,
              rotary_base=STAGE2_BASE)
    trained = train(work, "run", 4, timeout=900, **kw)
    assert [it for it, _ in trained["losses"]] == [1, 2]
    rc, text = _python("-m", "megatron_mesh_cp.megatron.hf_export", "--megatron-path", str(run), "--hf-model", str(hf),
                       "--out", str(out))
    assert rc == 0, f"export failed:\n{text[-5000:]}"
    assert f"exported {run}/iter_0000002 -> {out}" in text
    return work, hf, run, out


def test_exported_logits_equal_megatrons_after_training(exported, pools):
    from transformers import LlamaForCausalLM

    _, hf, run, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == STAGE2_BASE and config["rope_parameters"]["rope_type"] == "llama3"
    assert (out / "tokenizer.json").exists() and not list(out.parent.glob(".exported.partial-*"))
    tokens = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits.double()
        before = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(tokens).logits.double()
    llama = dict(LLAMA, rotary_base=STAGE2_BASE)
    want = pools.get(4).run("rank_tasks_megatron:llama_from_checkpoint", str(run), tokens, (2, 2), iteration=2,
                            **llama)[0]["logits"].double()
    err = float((got - want).norm() / want.norm())
    moved = float((before - want).norm() / want.norm())
    print(f"[hf-export] exported vs Megatron logits after 2 iterations under mesh 2x2: {err:.2e} relative "
          f"(the untrained model: {moved:.2e})")
    assert err <= 1e-5, err
    assert moved > 1e-3, moved  # training moved the weights: the export holds the trained ones


def _passkey():
    spec = importlib.util.spec_from_file_location("passkey_retrieval", ROOT / "scripts" / "passkey_retrieval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_passkey_check_runs_on_the_export(exported, tmp_path):
    """The path, not the skill: the tiny random model's accuracy means nothing; the prompts must be the asked
    length with the key at the asked depth, and every answer recorded."""
    from transformers import AutoTokenizer

    _, _, _, out = exported
    passkey = _passkey()
    report = tmp_path / "passkey.json"
    assert passkey.main(["--model", str(out), "--length", "600", "--depths", "0,0.5,1", "--trials", "1",
                         "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert [row["depth"] for row in r["rows"]] == [0.0, 0.5, 1.0]
    assert set(r["accuracy_per_depth"]) == {"0.0", "0.5", "1.0"}
    tok = AutoTokenizer.from_pretrained(out)
    filler = len(tok(passkey.FILLER, add_special_tokens=False)["input_ids"])
    for row in r["rows"]:
        assert 600 - filler < row["tokens"] <= 600 and isinstance(row["correct"], bool) and row["answer"] is not None
        ids, at = passkey.build_prompt(tok, 600, row["depth"], row["key"])
        assert len(ids) == row["tokens"] and at == row["key_at"]
        assert tok.decode(ids[at:]).startswith(passkey.KEY.format(key=row["key"]))
    assert r["rows"][0]["key_at"] < r["rows"][1]["key_at"] < r["rows"][2]["key_at"]
    assert passkey.answer_key(" 12345. Remember") == 12345 and passkey.answer_key(" none") is None


def test_conversion_checks_its_inputs_before_building_anything(tmp_path):
    from megatron_mesh_cp.megatron.bridge_cpu import check_inputs

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")  # a model directory without a tokenizer
    with pytest.raises(ValueError, match=r"no tokenizer loads from .*hf .*save it into the Hugging Face directory "
                                         r"\(tokenizer.save_pretrained\) or pass --hf-tokenizer DIR"):
        check_inputs(str(hf), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="has no config.json"):
        check_inputs(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="no such directory"):
        check_inputs(str(tmp_path / "missing" / "model"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_failed_write_leaves_nothing_that_looks_finished(tmp_path):
    from megatron_mesh_cp.megatron.staging import staged

    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="save failed"):
        with staged(str(target)) as tmp:
            Path(tmp, "latest_checkpointed_iteration.txt").write_text("0")
            raise RuntimeError("save failed")
    assert not target.exists() and os.listdir(tmp_path) == []
    with staged(str(target)) as tmp:
        Path(tmp, "latest_checkpointed_iteration.txt").write_text("0")
    assert (target / "latest_checkpointed_iteration.txt").read_text() == "0" and os.listdir(tmp_path) == ["ckpt"]
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        with staged(str(target)):
            pass


def test_export_checks_its_inputs(tmp_path):
    from megatron_mesh_cp.megatron.hf_export import check_inputs

    with pytest.raises(ValueError, match="holds no checkpoint"):
        check_inputs(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "iter_0000003").mkdir()
    with pytest.raises(ValueError, match="not a torch_dist checkpoint"):
        check_inputs(str(tmp_path), str(tmp_path / "out"))
