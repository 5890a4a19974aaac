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
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("DATA_PATH", "TOKENIZER_MODEL", "RUNS_DIR")}
    env.update(WORLD_SIZE="256", RANK="0", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt_mesh.py"), "--config",
                          str(ROOT / "configs" / "llama31_8b_1m_ring.yaml"), "--dry-run"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "environment variable" in res.stderr and "is not set" in res.stderr
    assert "TOKENIZER_MODEL is not set" in res.stderr and "DATA_PATH is not set" in res.stderr
    assert "pretrained_checkpoint: environment variable RUNS_DIR is not set" in res.stderr  # from the included stage


def test_false_turns_off_a_setting_megatron_enables_by_default_and_never_drops_silently(tmp_path):
    path = _cfg(tmp_path, "create_attention_mask_in_dataloader: false\napply_rope_fusion: false\nbf16: false\n")
    assert config_to_argv(path, {}) == ["--no-create-attention-mask-in-dataloader", "--no-rope-fusion"]
    assert config_to_argv(_cfg(tmp_path, "create_attention_mask_in_dataloader: true\n"), {}) == []  # the default
    with pytest.raises(ConfigError, match=r"crate_attention_mask: not a Megatron or mesh-CP setting .* did you mean "
                                          r".*create_attention_mask_in_dataloader"):
        config_to_argv(_cfg(tmp_path, "crate_attention_mask: false\n"), {})


def test_an_unknown_key_names_itself_and_the_file_it_is_in(tmp_path):
    """A typo is one line naming the key, the file (the included one when it is there) and the nearest settings,
    not Megatron's usage text; a setting whose flag is spelled otherwise maps to that flag."""
    (tmp_path / "base.yaml").write_text("seq_lenght: 128\nrope_fusion_flag_that_does_not_exist: true\n")
    top = tmp_path / "top.yaml"
    top.write_text("include: base.yaml\nlr: 1.0e-4\n")
    with pytest.raises(ConfigError) as err:
        config_to_argv(str(top), {})
    text = str(err.value)
    assert f"{tmp_path / 'base.yaml'}: seq_lenght: not a Megatron or mesh-CP setting (Megatron has no --seq-lenght); " \
           "did you mean seq_length" in text
    assert "rope_fusion_flag_that_does_not_exist: not a Megatron or mesh-CP setting" in text
    assert config_to_argv(_cfg(tmp_path, "layernorm_epsilon: 1.0e-5\n"), {}) == ["--norm-epsilon", "1e-05"]


def test_include_reads_the_base_first_and_the_file_overrides_it(tmp_path):
    (tmp_path / "base.yaml").write_text("seq_length: 1024\nmesh_shape: 2x2\nlr: 1.0e-4\nmanual_gc: true\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mid.yaml").write_text("include: ../base.yaml\nlr: 2.0e-5\nmesh_shape: null\n")
    top = tmp_path / "sub" / "top.yaml"
    top.write_text("include: mid.yaml\nmanual_gc: false\nseed: 7\n")
    assert config_to_argv(str(top), {}) == ["--seq-length", "1024", "--lr", "2e-05", "--seed", "7"]
    (tmp_path / "loop.yaml").write_text("include: loop.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        config_to_argv(str(tmp_path / "loop.yaml"), {})
    with pytest.raises(ConfigError, match="cannot read it"):
        config_to_argv(_cfg(tmp_path, "include: nope.yaml\n"), {})
