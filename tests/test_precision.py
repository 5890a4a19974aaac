"""FP8 under mesh CP (megatron/precision.py): --fp8-format runs TE's FP8 GEMMs and mesh attention
stays in the model's dtype, which the dry run and the attention's log say; TE's FP8 attention
(fp8_dot_product_attention / fp8_multi_head_attention: config fields, no CLI flag in megatron-core
0.19.2) is refused under mesh CP at start-up and at construction, naming the fix."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import LAUNCHER, env, run_script, write_config  # noqa: E402

from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args  # noqa: E402
from megatron_mesh_cp.megatron.precision import precision_line  # noqa: E402

MESH = dict(context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2")


def test_precision_line_says_what_runs_in_low_precision():
    get = lambda **kw: (lambda name, default=None: kw.get(name, default))  # noqa: E731
    assert precision_line(get()) is None
    line = precision_line(get(fp8="e4m3", fp8_recipe="tensorwise", bf16=True))
    assert line.startswith("precision: Transformer Engine's FP8 GEMMs (--fp8-format e4m3, --fp8-recipe tensorwise) in "
                           "the linear layers; attention under mesh CP stays in bf16")
    assert "FP4 GEMMs (--fp4-format e2m1, --fp4-recipe nvfp4)" in precision_line(get(fp4="e2m1", fp16=True))


def test_fp8_attention_is_refused_under_mesh_at_start_up():
    from test_megatron_integration import _flat

    apply_mesh_args(_flat(**MESH, fp8="e4m3"), argv=[])  # FP8 GEMMs: fine
    for field in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        with pytest.raises(MeshArgumentError, match=f"{field} asks for Transformer Engine's FP8 attention .*set "
                                                    f"{field}=False .*--fp8-format alone keeps TE's FP8 GEMMs"):
            apply_mesh_args(_flat(**MESH, fp8="e4m3", **{field: True}), argv=[])
    te_cp = _flat(context_parallel_size=4, context_parallel_algo="p2p", fp8_dot_product_attention=True)
    apply_mesh_args(te_cp, argv=[])  # TE's CP runs TE's FP8 attention: not ours to refuse


def test_fp8_attention_is_refused_by_mesh_core_attention_and_fp8_gemms_are_logged(monkeypatch, caplog):
    """A config built in code (or by Megatron-Bridge's mixed_precision) reaches MeshCoreAttention
    directly: fp8_dot_product_attention is refused before any group is touched; --fp8-format alone
    logs what stays in bf16, once."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mesh_cp.megatron import attention

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=4, bf16=True, fp8="e4m3",
                attention_dropout=0.0)
    with pytest.raises(ValueError, match="fp8_dot_product_attention asks for Transformer Engine's FP8 attention"):
        attention.MeshCoreAttention(TransformerConfig(**base, fp8_dot_product_attention=True), 1, AttnMaskType.causal,
                                    "self", cp_comm_type="mesh")

    class Built(Exception):
        pass

    def no_groups(*a, **k):
        raise Built

    monkeypatch.setattr(attention, "mesh_groups_for", no_groups)
    monkeypatch.setattr(attention, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="megatron_mesh_cp")
    for _ in range(2):
        with pytest.raises(Built):
            attention.MeshCoreAttention(TransformerConfig(**base), 1, AttnMaskType.causal, "self", cp_comm_type="mesh")
    assert caplog.text.count("FP8 GEMMs (--fp8-format e4m3, --fp8-recipe delayed) in the linear layers; attention "
                             "under mesh CP stays in bf16") == 1


def test_dry_run_states_that_attention_stays_in_the_model_dtype_under_fp8(tmp_path):
    cfg = write_config(tmp_path, "fp8-dry", **MESH, fp8_format="e4m3")
    e = env(tmp_path)
    e.update(WORLD_SIZE="4", RANK="0")
    code, stdout, stderr = run_script(tmp_path, "fp8-dry", LAUNCHER, ["--config", str(cfg), "--dry-run"], e)
    assert code == 0, stderr[-3000:]
    text = stdout + stderr
    assert ("precision: Transformer Engine's FP8 GEMMs (--fp8-format e4m3, --fp8-recipe delayed) in the linear "
            "layers; attention under mesh CP stays in fp32, the model's dtype (no FP8 attention") in text
