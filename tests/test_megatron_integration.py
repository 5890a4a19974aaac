"""Megatron integration: loss/gradient parity through the real training loop, bad arguments, specs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import BASE, run_bad_args, train  # noqa: E402

from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def parity_runs(work):
    runs = {
        "cp1": train(work, "cp1", 1, context_parallel_size=1),
        "mesh2x2": train(work, "mesh2x2", 4, context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2"),
        "ring1x4": train(work, "ring1x4", 4, context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="1x4"),
        "cp2": train(work, "cp2", 2, context_parallel_size=2, context_parallel_algo="mesh", mesh_shape="auto"),
        "a2a_mesh2x2x2": train(work, "a2a_mesh2x2x2", 8, context_parallel_size=8, context_parallel_algo="a2a+mesh",
                               mesh_shape="2x2x2"),
    }
    return runs


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", ["mesh2x2", "ring1x4", "cp2", "a2a_mesh2x2x2"])
def test_loss_parity_through_megatron_loop(parity_runs, name):
    ref = parity_runs["cp1"]["losses"]
    got = parity_runs[name]["losses"]
    assert [it for it, _ in got] == list(range(1, 11)) == [it for it, _ in ref]
    for (it, a), (_, b) in zip(got, ref):
        assert _rel(a, b) <= 1e-5, (name, it, a, b)
    assert ref[-1][1] < ref[0][1]  # it learns


@pytest.mark.parametrize("name", ["mesh2x2", "ring1x4", "cp2", "a2a_mesh2x2x2"])
def test_gradient_parity_of_one_step(parity_runs, name):
    ref = torch.load(parity_runs["cp1"]["grads_path"])
    got = torch.load(parity_runs[name]["grads_path"])
    assert set(ref) == set(got) and len(ref) > 10
    for key in ref:
        err = float((got[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30))
        assert err <= 1e-5, (name, key, err)


def test_mesh_runs_report_bytes_and_shape(parity_runs):
    mesh = parity_runs["mesh2x2"]
    assert mesh["mesh_shape"] == "2x2" and mesh["algo"] == "mesh"
    assert mesh["attention_calls"] == 2 * 10 * 1  # 2 layers x 10 iterations x 1 micro-batch
    assert 0 < mesh["attention_bytes_sent_per_rank"]
    ring = parity_runs["ring1x4"]
    # the 1x4 mesh is Ring: it sends exactly what the Ring estimate says
    assert ring["attention_bytes_sent_per_rank"] == ring["ring_bytes_per_rank"]
    assert "[mesh-cp] final lm loss" in mesh["stdout"] and "Ring (1x4) would have sent" in mesh["stdout"]
    assert "mesh_shape=auto" in parity_runs["cp2"]["shape_explanation"]
    hybrid = parity_runs["a2a_mesh2x2x2"]
    assert hybrid["mesh_shape"] == "2x2x2" and hybrid["algo"] == "a2a+mesh" and hybrid["attention_calls"] == 20
    assert 0 < hybrid["attention_bytes_sent_per_rank"] < hybrid["ring_bytes_per_rank"]
    # CP = 1 ran through the same spec: MeshCoreAttention handed off to Megatron's local attention
    assert parity_runs["cp1"]["attention_calls"] == 0 and parity_runs["cp1"]["losses"]


BAD = [
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x3"], "has 6 ranks but the CP group has 4"),
    (["--context-parallel-size", "1", "--context-parallel-algo", "mesh"], "needs --context-parallel-size > 1"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--cp-comm-type", "p2p"], "contradicts --cp-comm-type p2p"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "a2a", "--cp-comm-type", "p2p"], "contradicts --cp-comm-type p2p"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--seq-length", "100",
      "--max-position-embeddings", "100"], "not divisible by 2 * context-parallel-size = 8"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--attention-dropout", "0.1"], "attention dropout"),
    (["--context-parallel-size", "4", "--mesh-shape", "2x2"], "--mesh-shape needs --context-parallel-algo mesh"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--num-attention-heads", "5"],
     "Megatron's argument check refused these arguments: assert args.hidden_size % args.num_attention_heads == 0"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "p2p", "--mesh-shape", "2x2"], "only applies to --context-parallel-algo mesh"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2",
      "--hierarchical-context-parallel-sizes", "4", "1"], "contradicts mesh shape 2x2"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--attention-backend", "local"], "--attention-backend local"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-cluster", "nope"], "unknown cluster 'nope'"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "four"], "AxB"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-kernel", "te"],
     "--mesh-kernel te: attention kernel 'te' cannot run here"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--hybrid-context-parallel"],
     "mesh CP needs one fixed CP group"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--cuda-graph-impl", "local"],
     "CUDA graphs (--cuda-graph-impl"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "a2a+mesh", "--mesh-shape", "2x1x4"],
     "2x1x4 = 8 ranks but --context-parallel-size is 4"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "a2a+mesh", "--mesh-shape", "4x1x1",
      "--num-attention-heads", "6", "--num-query-groups", "2"], "use U in [1, 2]"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "a2a+mesh", "--cp-comm-type", "a2a+p2p"],
     "contradicts --cp-comm-type a2a+p2p"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-packed-data"],
     "needs --calculate-per-token-loss"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-packed-data", "--mesh-pack-multiple",
      "4", "--calculate-per-token-loss"], "--mesh-pack-multiple 4 is not a multiple of 2 * CP = 8"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "p2p", "--mesh-packed-data"],
     "--mesh-packed-data runs with --context-parallel-algo mesh or a2a+mesh"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--dataloader-inter-document-masking"],
     "do not pad documents to a multiple of 2 * CP = 8"),
    (["--yaml-cfg", "megatron.yaml"], "--yaml-cfg: Megatron's experimental YAML path fails inside megatron-core's own"),
]


def test_bad_arguments_exit_before_training(work):
    from megatron_runs import write_config

    cfg = write_config(work, "bad-base")
    results = run_bad_args([["--config", str(cfg)] + argv for argv, _ in BAD], work)
    for (argv, needle), res in zip(BAD, results):
        assert res["code"] == 2, (argv, res)
        assert needle in res["stderr"], (argv, res["stderr"])
        assert "iteration" not in res["stderr"]


def test_p2p_without_transformer_engine_fails_loudly(work):
    with pytest.raises(AssertionError, match="needs Transformer Engine.*--context-parallel-algo mesh"):
        train(work, "p2p-no-te", 2, context_parallel_size=2, context_parallel_algo="p2p", train_iters=3)


# --- argument mapping in-process (flat and Megatron --yaml-cfg namespaces) ---------------------


def _flat(**kw):
    base = dict(context_parallel_algo=None, mesh_shape=None, context_parallel_size=1, cp_comm_type=["p2p"],
                seq_length=1024, attention_dropout=0.0, attention_backend=None, sft=False,
                dataloader_inter_document_masking=False, window_size=None, hierarchical_context_parallel_sizes=None,
                mesh_kernel="auto", mesh_partial_dtype="fp32", mesh_planner="greedy", mesh_cluster=None,
                tensor_model_parallel_size=1, num_attention_heads=32, num_query_groups=8, group_query_attention=True,
                kv_channels=None, hidden_size=4096, micro_batch_size=1, bf16=True, fp16=False, rank=0, yaml_cfg=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_apply_maps_mesh_onto_megatron_settings():
    args = apply_mesh_args(_flat(context_parallel_size=8, context_parallel_algo="mesh", mesh_shape="2x4"), argv=[])
    assert args.cp_comm_type == ["mesh"] and args.hierarchical_context_parallel_sizes == [2, 4]
    args = apply_mesh_args(_flat(context_parallel_size=8, context_parallel_algo="a2a+p2p"), argv=[])
    assert args.cp_comm_type == ["a2a+p2p"] and args.hierarchical_context_parallel_sizes is None
    args = apply_mesh_args(_flat(context_parallel_size=8, cp_comm_type=["mesh"], mesh_shape="4x2"), argv=["--cp-comm-type", "mesh"])
    assert args.hierarchical_context_parallel_sizes == [4, 2]
    untouched = apply_mesh_args(_flat(context_parallel_size=8), argv=[])
    assert untouched.cp_comm_type == ["p2p"] and untouched.hierarchical_context_parallel_sizes is None


def test_mesh_only_flags_are_refused_where_nothing_reads_them():
    """--mesh-kernel, --mesh-partial-dtype, --mesh-planner and --mesh-check-finite set mesh CP's attention: at CP = 1
    or under a TE algorithm they were accepted and ignored, as were --mesh-pack-multiple / --mesh-pack-doc-tokens
    without --mesh-packed-data; refused now, naming why. Their defaults, and the same flags under mesh CP, pass."""
    runs = {"CP = 1": dict(context_parallel_size=1), "p2p": dict(context_parallel_size=4, context_parallel_algo="p2p"),
            "a2a+p2p": dict(context_parallel_size=4, context_parallel_algo="a2a+p2p")}
    flags = {"--mesh-kernel torch": dict(mesh_kernel="torch"), "--mesh-partial-dtype bf16": dict(mesh_partial_dtype="bf16"),
             "--mesh-planner in-order": dict(mesh_planner="in-order"), "--mesh-check-finite": dict(mesh_check_finite=True)}
    for run, base in runs.items():
        apply_mesh_args(_flat(**base), argv=[])  # the defaults: nothing given
        for flag, kw in flags.items():
            with pytest.raises(MeshArgumentError, match=f"{flag} sets mesh CP's attention.*does not use.*drop it"):
                apply_mesh_args(_flat(**base, **kw), argv=[])
    # --cp-comm-type a2a alone (no --context-parallel-algo): the refusal names a2a, not the default p2p
    with pytest.raises(MeshArgumentError, match=r"it runs --context-parallel-algo a2a\)"):
        apply_mesh_args(_flat(context_parallel_size=4, cp_comm_type=["a2a"], mesh_kernel="torch"), argv=[])
    mesh = dict(context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2")
    for kw in flags.values():
        apply_mesh_args(_flat(**mesh, **kw), argv=[])
    for kw, flag in ((dict(mesh_pack_multiple=16), "--mesh-pack-multiple"), (dict(mesh_pack_doc_tokens=64),
                                                                             "--mesh-pack-doc-tokens")):
        with pytest.raises(MeshArgumentError, match=f"{flag} shapes --mesh-packed-data's packing.*add --mesh-packed-data"):
            apply_mesh_args(_flat(**mesh, **kw), argv=[])


def test_apply_maps_a2a_mesh_onto_hierarchical_sizes():
    args = apply_mesh_args(_flat(context_parallel_size=8, context_parallel_algo="a2a+mesh", mesh_shape="2x2x2"), argv=[])
    assert args.cp_comm_type == ["a2a+mesh"] and args.hierarchical_context_parallel_sizes == [2, 2, 2]
    assert args.mesh_shape == "2x2x2"
    args = apply_mesh_args(_flat(context_parallel_size=8, cp_comm_type=["a2a+mesh"], mesh_shape="4x1x2"),
                           argv=["--cp-comm-type", "a2a+mesh"])
    assert args.context_parallel_algo == "a2a+mesh" and args.hierarchical_context_parallel_sizes == [4, 1, 2]
    # auto: a Ulysses group inside a node (h100-ib400: 8 GPUs, TP 2 -> u <= 4), the mesh over n/u
    args = apply_mesh_args(_flat(context_parallel_size=32, context_parallel_algo="a2a+mesh", seq_length=32 * 4096,
                                 tensor_model_parallel_size=2), argv=[])
    u, a, b = args.hierarchical_context_parallel_sizes
    assert u * 2 <= 8 and u * a * b == 32 and args.mesh_shape == f"{u}x{a}x{b}"
    from megatron_mesh_cp.megatron.settings import options

    assert options().shape_explanation.startswith("mesh_shape=auto (a2a+mesh) -> ")


A2A_BAD = [
    (dict(mesh_shape="2x2x4"), "2x2x4 = 16 ranks but --context-parallel-size is 8"),
    (dict(mesh_shape="2x4"), "must look like UxAxB"),
    (dict(context_parallel_algo="mesh", mesh_shape="2x2x2"), "three factors (UxAxB); use --context-parallel-algo a2a+mesh"),
    (dict(mesh_shape="2x2x2", hierarchical_context_parallel_sizes=[2, 4]), "contradicts mesh shape 2x2x2 (they must be [2, 2, 2])"),
    (dict(mesh_shape="8x1x1", num_attention_heads=12, num_query_groups=4), "use U in [1, 2, 4]"),
    (dict(mesh_shape="2x2x2", tensor_model_parallel_size=8, num_attention_heads=64, mesh_cluster="h100-ib400"),
     "2 ranks x TP 8 = 16 GPUs spans more than one node of h100-ib400 (8 GPUs); use U in [1]"),
    (dict(context_parallel_size=1), "a2a+mesh needs --context-parallel-size > 1"),
]


@pytest.mark.parametrize("kw,needle", A2A_BAD, ids=[n[:24] for _, n in A2A_BAD])
def test_apply_rejects_inconsistent_a2a_mesh(kw, needle):
    args = _flat(**dict(dict(context_parallel_size=8, context_parallel_algo="a2a+mesh"), **kw))
    with pytest.raises(MeshArgumentError) as info:
        apply_mesh_args(args, argv=[])
    assert needle in str(info.value)


def test_apply_auto_shape_uses_the_model(caplog):
    caplog.set_level("INFO", logger="megatron_mesh_cp")
    args = apply_mesh_args(_flat(context_parallel_size=16, context_parallel_algo="mesh", seq_length=16 * 4096), argv=[])
    a, b = args.hierarchical_context_parallel_sizes
    assert a * b == 16 and args.mesh_shape == f"{a}x{b}"
    assert "mesh_shape=auto" in caplog.text


def test_apply_on_megatron_yaml_namespace():
    """--yaml-cfg: Megatron keeps parallel settings under model_parallel; mesh keys may live there."""
    mp = SimpleNamespace(context_parallel_size=4, cp_comm_type="p2p", hierarchical_context_parallel_sizes=None,
                         context_parallel_algo="mesh", mesh_shape="2x2")
    args = _flat(yaml_cfg="x.yaml", context_parallel_size=None)
    del args.context_parallel_algo, args.mesh_shape
    args.model_parallel = mp
    apply_mesh_args(args, argv=[])
    assert mp.cp_comm_type == ["mesh"] and mp.hierarchical_context_parallel_sizes == [2, 2]
    mp.mesh_shape, mp.hierarchical_context_parallel_sizes = "3x3", None
    with pytest.raises(MeshArgumentError, match="has 9 ranks but the CP group has 4"):
        apply_mesh_args(args, argv=[])
    mp.context_parallel_algo, mp.mesh_shape, mp.cp_comm_type = "a2a+mesh", "2x1x2", "p2p"
    mp.hierarchical_context_parallel_sizes = None
    apply_mesh_args(args, argv=[])
    assert mp.cp_comm_type == ["a2a+mesh"] and mp.hierarchical_context_parallel_sizes == [2, 1, 2]


def test_megatron_yaml_config_file_parses_with_mesh(tmp_path):
    """A Megatron-format YAML (nested sections) goes through Megatron's own loader and our mapping. The launcher
    refuses --yaml-cfg (Megatron's own parse_args fails on it); this keeps apply_mesh_args' namespace support true."""
    from megatron.training.yaml_arguments import load_yaml

    path = tmp_path / "megatron.yaml"
    path.write_text("language_model:\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n"
                    "model_parallel:\n  tensor_model_parallel_size: 1\n  pipeline_model_parallel_size: 1\n"
                    "  context_parallel_size: 4\n  context_parallel_algo: mesh\n  mesh_shape: 2x2\n"
                    "  cp_comm_type: p2p\nseq_length: 256\n")
    args = load_yaml(str(path))
    apply_mesh_args(args, argv=[])
    assert args.model_parallel.cp_comm_type == ["mesh"]
    assert args.model_parallel.hierarchical_context_parallel_sizes == [2, 2]


# --- core attention and specs without process groups -------------------------------------------


def _config(cp=1, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, **kw)


def test_core_attention_validates_at_construction():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh_cp.megatron.attention import MeshCoreAttention

    kw = dict(layer_number=1, attention_type="self", cp_comm_type="mesh")
    with pytest.raises(ValueError, match="attention dropout.*--attention-dropout 0"):
        MeshCoreAttention(_config(4), attn_mask_type=AttnMaskType.causal, attention_dropout=0.1, **kw)
    with pytest.raises(ValueError, match="causal and no-mask attention, not padding"):
        MeshCoreAttention(_config(4), attn_mask_type=AttnMaskType.padding, **kw)


def test_specs_swap_core_attention_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh_cp.megatron.attention import MeshCoreAttention
    from megatron_mesh_cp.megatron.specs import gpt_local_mesh_spec, gpt_mesh_spec, with_mesh_attention

    stock = get_gpt_layer_local_spec()
    swapped = with_mesh_attention(stock)
    assert swapped.submodules.self_attention.submodules.core_attention is MeshCoreAttention
    assert stock.submodules.self_attention.submodules.core_attention is not MeshCoreAttention  # a copy
    assert repr(swapped.submodules.mlp) == repr(stock.submodules.mlp)
    assert gpt_local_mesh_spec.submodules.self_attention.submodules.core_attention is MeshCoreAttention
    spec = gpt_mesh_spec(_config(1, normalization="RMSNorm", transformer_impl="local"))
    assert spec.submodules.self_attention.submodules.core_attention is MeshCoreAttention
    from megatron_mesh_cp.megatron.attention import _te_attention

    if _te_attention() is None:
        with pytest.raises(ValueError, match="needs Transformer Engine.*--transformer-impl local"):
            gpt_mesh_spec(_config(1, transformer_impl="transformer_engine"))
    with pytest.raises(ValueError, match="standard GPT layer spec"):
        with_mesh_attention(SimpleNamespace(submodules=SimpleNamespace()))


# --- the main job and the shipped configs -----------------------------------------------------


def test_main_job_config_trains_and_plots(work):
    """What the README's run command runs (fewer iterations), with the CP=1 loss plot."""
    import subprocess
    import sys

    from megatron_runs import LAUNCHER, ROOT, _port, env

    png = work / "loss.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(_port()),
           str(LAUNCHER), "--config", str(ROOT / "configs" / "gpt_tiny_cpu.yaml"), "--train-iters", "6",
           "--plot-loss", str(png)]
    out = subprocess.run(cmd, env=env(work, full=True), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "iteration        6/       6" in out.stdout and "lm loss:" in out.stdout
    assert "[mesh-cp] final lm loss" in out.stdout and "(CP=4, mesh 2x2)" in out.stdout
    assert "less with mesh" in out.stdout and png.stat().st_size > 10_000
    import json

    ref = json.loads(png.with_suffix(".cp1.json").read_text())
    assert ref["context_parallel_size"] == 1 and len(ref["losses"]) == 6


def test_launcher_help_lists_its_own_options_then_megatrons(work):
    from megatron_runs import LAUNCHER, env, run_script

    code, stdout, stderr = run_script(work, "help", LAUNCHER, ["--help"], env(work))
    assert code == 0, stderr[-2000:]
    ours, megatron = stdout.split("Megatron-LM Arguments", 1) if "Megatron-LM Arguments" in stdout else (stdout, "")
    assert "launcher options (megatron-mesh-cp)" in ours
    for flag in ("--config FILE.yaml", "--summary-json FILE", "--plot-loss FILE.png", "--dump-grads FILE", "--dry-run",
                 "--gpu-memory-gib", "--data-cache-dir"):
        assert flag in ours, flag
    assert "--context-parallel-algo" in megatron and "--mesh-shape" in megatron and "--seq-length" in megatron
    assert "--mesh-check-finite" in stdout  # Megatron's help despite stray % in its strings (test_stock_megatron)


_MOE_SPEC = r"""
import torch
from megatron_mesh_cp.megatron import cpu_compat
cpu_compat.activate()
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.models.gpt import default_layer_spec
from megatron_mesh_cp.megatron.attention import MeshCoreAttention
from megatron_mesh_cp.megatron.pretrain import parse_megatron_args
from megatron_mesh_cp.megatron.specs import gpt_mesh_spec

argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "256", "--attention-dropout", "0", "--transformer-impl", "local", "--bf16",
        "--context-parallel-size", "2", "--context-parallel-algo", "mesh", "--mesh-shape", "1x2",
        "--num-experts", "4", "--moe-layer-freq", "[0,1,1,1]", "--moe-router-topk", "2"]
args = parse_megatron_args(argv, set_globals=False)
args.moe_grouped_gemm = True  # Megatron's validation asks the GPU's compute capability for it
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % PORT, world_size=1, rank=0)
mpu.initialize_model_parallel(1, 1)
cfg = gpt_config_from_args(args)
ours, stock = gpt_mesh_spec(cfg), default_layer_spec(cfg, None)
for mine, theirs in zip(ours.layer_specs, stock.layer_specs):
    assert repr(mine.submodules.mlp) == repr(theirs.submodules.mlp)  # MoE exactly as stock Megatron builds it
    assert mine.submodules.self_attention.submodules.core_attention is MeshCoreAttention
moe = ["MoELayer" in repr(l.submodules.mlp) for l in ours.layer_specs]
direct = gpt_mesh_spec(TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                                         moe_layer_freq=[1, 0, 1, 0], moe_router_topk=2, add_bias_linear=False,
                                         transformer_impl="local"))
print("RESULT", moe, ["MoELayer" in repr(l.submodules.mlp) for l in direct.layer_specs],
      all(l.submodules.self_attention.submodules.core_attention is MeshCoreAttention for l in direct.layer_specs))
"""


def test_default_spec_builds_moe_layers_as_megatron_does(work):
    """num_experts / moe_layer_freq / grouped GEMM are honoured: the launcher's default spec is Megatron's own
    default_layer_spec for the config (MoE block spec included) with mesh core attention, not a dense layer."""
    from megatron_runs import _port, env, run_script

    e = env(work)
    e.update(WORLD_SIZE="2", RANK="0")
    script = work / "moe_spec.py"
    script.write_text(_MOE_SPEC.replace("PORT", str(_port())))
    code, stdout, stderr = run_script(work, "moe_spec", script, [], e)
    assert code == 0, stderr[-3000:]
    assert stdout.split("RESULT", 1)[1].split() == ["[False,", "True,", "True,", "True]", "[True,", "False,",
                                                         "True,", "False]", "True"]


def test_cpu_compat_fails_loudly_when_a_pinned_name_moves():
    from megatron_mesh_cp.megatron import cpu_compat

    owner, name = cpu_compat._resolve("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork")
    assert name == "fork"
    with pytest.raises(RuntimeError, match=r"megatron.core.tensor_parallel.random.NoSuchTracker.fork no longer exists"):
        cpu_compat._resolve("megatron.core.tensor_parallel.random", "NoSuchTracker.fork")
    with pytest.raises(RuntimeError, match="cannot import megatron.no_such_module"):
        cpu_compat._resolve("megatron.no_such_module", "x")
    for module, attr, _ in cpu_compat.PATCHES:  # every pinned name exists in this megatron-core
        cpu_compat._resolve(module, attr)


def test_cpu_compat_refuses_when_cuda_is_present(monkeypatch):
    """The CPU stand-ins (recompute's RNG state included) are never installed next to a real GPU."""
    from megatron_mesh_cp.megatron import cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be activated on a machine with CUDA"):
        cpu_compat.activate()
    assert not cpu_compat.is_active()


def test_loss_plot_reference_run_drops_mesh_only_flags(tmp_path, monkeypatch):
    """--plot-loss's CP = 1 reference run keeps the run's other arguments; mesh CP's attention settings
    (--mesh-kernel, --mesh-partial-dtype, --mesh-planner, --mesh-check-finite) must go with the CP flags, since a
    CP = 1 run refuses them (_check_mesh_only_flags): kept, the reference run exited 2 after the whole CP run."""
    import argparse
    import json
    import subprocess

    from megatron_mesh_cp.megatron import pretrain
    from megatron_mesh_cp.megatron.arguments import _check_mesh_only_flags, add_mesh_args

    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        with open(cmd[cmd.index("--summary-json") + 1], "w") as f:
            json.dump({"losses": []}, f)

    monkeypatch.setattr(subprocess, "run", run)
    argv = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2",
            "--mesh-kernel", "torch", "--mesh-partial-dtype=bf16", "--mesh-check-finite", "--mesh-planner", "in-order",
            "--mesh-cluster", "h100-ib400", "--seq-length", "256"]
    pretrain._reference_run(argv, str(tmp_path / "ref.json"))
    cmd = seen["cmd"][2:]
    assert "--mesh-cluster" in cmd and cmd[cmd.index("--seq-length") + 1] == "256", cmd
    parser = add_mesh_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.add_argument("--context-parallel-size", type=int, default=1)
    args, _ = parser.parse_known_args(cmd)
    assert args.context_parallel_size == 1
    _check_mesh_only_flags(args)  # refused before: --mesh-kernel torch sets mesh CP's attention ... (it runs CP = 1)
