"""Launcher YAML configs: strict environment substitution and Megatron-shaped multi-value flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mesh_cp.megatron.config import ConfigError, config_to_argv, multi_value_flags

ROOT = Path(__file__).resolve().parent.parent


def _cfg(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_blend_splits_into_megatron_tokens_and_paths_keep_spaces(tmp_path):
    path = _cfg(tmp_path, "data_path: ${DATA_PATH}\ntokenizer_model: $TOK\nlr: 3.0e-4\nbf16: true\nfp16: false\n"
                          "split: 99,1,0\nmock_data: null\n")
    env = {"DATA_PATH": "0.3 /data/a_text_document 0.7 /data/b_text_document", "TOK": "/models/my tokenizer"}
    assert config_to_argv(path, env) == [
        "--data-path", "0.3", "/data/a_text_document", "0.7", "/data/b_text_document",
        "--tokenizer-model", "/models/my tokenizer", "--lr", "0.0003", "--bf16", "--split", "99,1,0"]


def test_unset_variable_is_an_error_naming_it(tmp_path):
    path = _cfg(tmp_path, "tokenizer_model: ${TOKENIZER_MODEL}\n")
    with pytest.raises(ConfigError, match=r"tokenizer_model: environment variable TOKENIZER_MODEL is not set"):
        config_to_argv(path, {})
    with pytest.raises(ConfigError, match=r"data_path: .* is empty"):
        config_to_argv(_cfg(tmp_path, "data_path: ${D}\n"), {"D": "  "})
    with pytest.raises(ConfigError, match=r"\$\$ for a literal"):
        config_to_argv(_cfg(tmp_path, "save: /ckpt/$1\n"), {})
    assert config_to_argv(_cfg(tmp_path, "save: /ckpt/$$HOME\n"), {}) == ["--save", "/ckpt/$HOME"]


def test_multi_value_flags_come_from_megatrons_parser():
    flags = multi_value_flags()
    assert {"--data-path", "--train-data-path", "--hierarchical-context-parallel-sizes"} <= flags
    assert "--tokenizer-model" not in flags and "--save" not in flags


def test_launcher_dry_run_fails_naming_the_unset_variable(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("DATA_PATH", "TOKENIZER_MODEL")}
    env.update(WORLD_SIZE="256", RANK="0", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config",
                          str(ROOT / "configs" / "llama3_8b_1m_256gpu_mesh.yaml"), "--dry-run"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "environment variable" in res.stderr and "is not set" in res.stderr
    assert "TOKENIZER_MODEL is not set" in res.stderr and "DATA_PATH is not set" in res.stderr


def test_false_maps_onto_megatrons_negating_flag_or_is_refused(tmp_path):
    """``false`` is never a silent default: off by default -> nothing; a ``--no-...`` flag exists ->
    that flag; a switch on by default with no way to turn it off -> an error."""
    switches = {"fp16": (False, None), "create_attention_mask_in_dataloader": (True, "--no-create-attention-mask-in-dataloader"),
                "always_on": (True, None)}
    path = _cfg(tmp_path, "fp16: false\ncreate_attention_mask_in_dataloader: false\n")
    assert config_to_argv(path, {}, switches=switches) == ["--no-create-attention-mask-in-dataloader"]
    with pytest.raises(ConfigError, match="always_on: false cannot be passed to Megatron"):
        config_to_argv(_cfg(tmp_path, "always_on: false\n"), {}, switches=switches)
    # and Megatron's own parser has that flag
    assert config_to_argv(_cfg(tmp_path, "create_attention_mask_in_dataloader: false\nbf16: false\n"), {}) == [
        "--no-create-attention-mask-in-dataloader"]
