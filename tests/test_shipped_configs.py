"""Every shipped config as its job runs it: the launcher's dry run at the job's real world size,
no dense dataloader mask anywhere, A/B partners that differ only in the CP algorithm, stages that differ
only in what a stage changes and start from the previous one, and the README naming every config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import fake_dataset  # noqa: E402

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
#: the world size of the job that runs each config (run_main_job.sh: 4 CPU ranks; smoke_2node.sbatch: 16 GPUs;
#: pretrain_256gpu.sbatch: 256 GPUs)
WORLD = {"gpt_tiny_cpu": 4, "gpt_smoke_128k_16gpu_mesh": 16}
#: what the configs' ${VAR}s name on a cluster (a dry run reads none of them)
ENV = {"DATA_PATH": "/data/x_text_document", "TOKENIZER_MODEL": "/models/llama31", "RUNS_DIR": "/runs",
       "LLAMA31_8B_CKPT": "/ckpt/llama31-8b", "LLAMA31_70B_CKPT": "/ckpt/llama31-70b"}

_DRY_RUNS = r"""
import contextlib, io, json, logging, os, sys, time
from megatron_mesh_cp.megatron.pretrain import main

lines = []
class Grab(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
out = []
for path, world in json.loads(sys.argv[1]):
    os.environ["WORLD_SIZE"] = str(world)
    lines.clear()
    logging.getLogger("megatron_mesh_cp").addHandler(grab := Grab())
    t, code, err = time.time(), 0, io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as std, contextlib.redirect_stderr(err):
        try:
            main(["--config", path, "--dry-run"])
        except SystemExit as exc:
            code = exc.code
    logging.getLogger("megatron_mesh_cp").removeHandler(grab)
    out.append(dict(path=path, seconds=time.time() - t, code=code, lines=list(lines), stderr=err.getvalue()[-2000:],
                    stdout=std.getvalue()[-20000:]))
print("RESULT " + json.dumps(out))
"""


def _argv(name):
    from megatron_mesh_cp.megatron.config import config_to_argv

    return config_to_argv(str(ROOT / "configs" / f"{name}.yaml"), ENV)


def _parsed(name) -> dict:
    """The config's settings as Megatron's parser resolves them (include expanded; before the mesh mapping)."""
    from megatron_mesh_cp.megatron.config import megatron_parser

    return vars(megatron_parser().parse_known_args(_argv(name))[0])


def _diff(a, b):
    pa, pb = _parsed(a), _parsed(b)
    return {k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k)}


def test_every_shipped_config_dry_runs_at_its_jobs_world_size(tmp_path):
    """The launcher's --dry-run of each config, all in one process (Megatron imported once): it parses and
    validates through Megatron, checks the data files, resolves the mesh shape, prints the memory estimate,
    which for the Llama configs fits an 80 GiB GPU, and the layout and simulated step on the data's documents
    (a blend of long and short ones here). The per-config seconds are printed (``pytest -s``)."""
    cases = [[str(ROOT / "configs" / f"{c}.yaml"), WORLD.get(c, 256)] for c in CONFIGS]
    long = fake_dataset.write(tmp_path / "books_text_document", [1_500_000, 3_000_000, 700_000] * 10)
    short = fake_dataset.write(tmp_path / "web_text_document", [1024, 3000, 9000, 16000] * 200)
    data = dict(ENV, DATA_PATH=f"0.5 {long} 0.5 {short}")
    env = dict(os.environ, RANK="0", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1", **data)
    res = subprocess.run([sys.executable, "-c", _DRY_RUNS, json.dumps(cases)], capture_output=True, text=True,
                         timeout=900, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.split("RESULT ", 1)[1])
    for r, (path, world) in zip(rows, cases):
        name = Path(path).stem
        print(f"dry run {name}: {r['seconds']:.1f} s")
        assert r["code"] in (0, None), f"{name}: {r['stderr']}"
        assert any(line.startswith(f"world {world}: TP ") for line in r["lines"]), (name, r["lines"])
        memory = [line for line in r["lines"] if line.startswith("memory per GPU (estimate):")]
        assert memory, (name, r["lines"])
        if name.startswith("llama31_"):
            assert not any("exceeds the GPU" in line for line in r["lines"]), (name, memory)
            masked = not name.endswith("_nodocmask")
            layout = [line for line in r["lines"] if line.startswith("layout: ")]
            assert layout and ("busiest chunk" in layout[0]) == masked, (name, layout)
            assert layout[0].startswith("layout: --mesh-layout " if masked else "layout: zigzag"), (name, layout)
            step = [line for line in r["lines"] if line.startswith("step time (estimate: attention simulated")]
            assert step and ("without document masking" in step[0]) == masked, (name, step)
            assert any(line.startswith(f"save_interval {_parsed(name)['save_interval']}: a save every ")
                       for line in r["lines"]), name
        # our summary comes last; Megatron's argument dump is behind --show-megatron-args
        assert r["lines"][-1] == "(Megatron's own resolved arguments: add --show-megatron-args)", (name, r["lines"])
        assert "------------------------ arguments ------------------------" not in r["stdout"], name


@pytest.mark.parametrize("name", CONFIGS)
def test_no_config_builds_a_dense_attention_mask(name):
    args = _parsed(name)
    assert args["create_attention_mask_in_dataloader"] is False  # Megatron's default is True: 4 TiB at 1M
    if name.startswith("llama31_"):
        assert args["micro_batch_size"] == 1 and args["exit_on_missing_checkpoint"] and args["pretrained_checkpoint"]
        te = args["context_parallel_algo"] in ("p2p", "a2a", "a2a+p2p", "all_gather")
        # document masking only on the mesh family (TE's causal CP attention ignores Megatron's document mask)
        assert args["reset_attention_mask"] == args["reset_position_ids"] == args["eod_mask_loss"] == (
            not name.endswith("_nodocmask"))
        assert not (te and args["reset_attention_mask"]) and (name.endswith("_nodocmask") or not te)


ALGO = {"context_parallel_algo", "mesh_shape"}
PAIRS = [  # (a, b, the only settings that differ)
    ("llama31_8b_cpt_s4_1m", "llama31_8b_1m_ring", ALGO),
    ("llama31_8b_cpt_s4_1m", "llama31_8b_1m_usp", {"mesh_shape"}),
    ("llama31_8b_1m_a2a_mesh_nodocmask", "llama31_8b_1m_p2p_nodocmask", ALGO),
    ("llama31_8b_1m_a2a_mesh_nodocmask", "llama31_8b_1m_a2a_p2p_nodocmask", ALGO | {"hierarchical_context_parallel_sizes"}),
    ("llama31_70b_cpt_s4_1m", "llama31_70b_1m_ring", {"mesh_shape"}),
    ("llama31_70b_1m_tp4pp2_a2a_mesh", "llama31_70b_1m_tp4pp2_usp", {"mesh_shape"}),
    ("llama31_70b_1m_mesh_nodocmask", "llama31_70b_1m_p2p_nodocmask", ALGO),
    ("llama31_70b_1m_tp4pp2_a2a_mesh_nodocmask", "llama31_70b_1m_tp4pp2_a2a_p2p_nodocmask",
     ALGO | {"hierarchical_context_parallel_sizes"}),
]
#: what document masking changes; mesh_plan_search searches the masked plans (refused without masking)
MASKING = {"reset_attention_mask", "reset_position_ids", "eod_mask_loss", "mesh_plan_search"}


@pytest.mark.parametrize("a,b,keys", PAIRS, ids=[p[1] for p in PAIRS])
def test_ab_partners_differ_only_in_the_cp_algorithm(a, b, keys):
    assert _diff(a, b) == keys


def test_document_masking_partners_differ_only_in_masking_and_the_70b_ulysses_layout_keeps_stages_busy():
    # and in how often they save: the masked step is shorter (save intervals follow the step each one runs)
    assert _diff("llama31_8b_cpt_s4_1m", "llama31_8b_1m_a2a_mesh_nodocmask") == MASKING | {"save_interval"}
    assert _diff("llama31_70b_cpt_s4_1m", "llama31_70b_1m_mesh_nodocmask") == MASKING | {"save_interval"}
    tp4pp2 = ("llama31_70b_1m_tp4pp2_a2a_mesh", "llama31_70b_1m_tp4pp2_a2a_mesh_nodocmask")
    assert _diff(*tp4pp2) == MASKING | {"save_interval"}
    args = _parsed("llama31_70b_1m_tp4pp2_a2a_mesh")
    dp = 256 // (args["tensor_model_parallel_size"] * args["pipeline_model_parallel_size"] * args["context_parallel_size"])
    micro_batches = args["global_batch_size"] // (args["micro_batch_size"] * dp)
    assert args["pipeline_model_parallel_size"] == 2 and micro_batches >= 4 * args["pipeline_model_parallel_size"]


STAGE_KEYS = {"pretrained_checkpoint", "seq_length", "max_position_embeddings", "rotary_base", "context_parallel_size",
              "global_batch_size", "train_iters", "lr_warmup_iters", "eval_interval", "save_interval",
              "mesh_plan_search"}  # the 1M stage searches its plans' order (in the data loader)


@pytest.mark.parametrize("model,base", [("8b", "${LLAMA31_8B_CKPT}"), ("70b", "${LLAMA31_70B_CKPT}")])
def test_stages_start_from_the_previous_one_and_change_only_stage_settings(model, base):
    stages = [f"llama31_{model}_cpt_s{i}_{s}" for i, s in enumerate(("128k", "256k", "512k", "1m"), 1)]
    assert set(stages) <= set(CONFIGS)
    first = _parsed(stages[0])
    assert first["pretrained_checkpoint"] == ENV[base[2:-1]]
    assert first["use_rope_scaling"] and first["rope_scaling_factor"] == 8.0 and first["rotary_base"] == 500000
    tokens = first["global_batch_size"] * first["seq_length"]
    for prev, stage in zip(stages, stages[1:]):
        assert _diff(stages[0], stage) <= STAGE_KEYS, stage
        args = _parsed(stage)
        assert args["pretrained_checkpoint"] == f"{ENV['RUNS_DIR']}/{prev}/checkpoints"
        assert args["seq_length"] == 2 * _parsed(prev)["seq_length"] == args["max_position_embeddings"]
        s = args["seq_length"] / first["seq_length"]  # NTK-aware base from Llama-3.1's 128K point, d = 128
        assert args["rotary_base"] == int(500000 * s ** (128 / 126))
        assert args["global_batch_size"] * args["seq_length"] == tokens  # the same tokens per step at every stage
        assert args["seq_length"] // args["context_parallel_size"] == first["seq_length"] // first["context_parallel_size"]
    assert _parsed(stages[-1])["seq_length"] == 2**20


def test_readme_names_every_shipped_config_and_no_retired_one():
    text = (ROOT / "README.md").read_text()
    missing = [c for c in CONFIGS if c not in text]
    assert not missing, missing
    assert "llama3_8b_1m_256gpu" not in text and "llama3_70b_1m_256gpu" not in text


def test_save_intervals_follow_the_estimated_step_time():
    """The stage configs save about every 30 min of the estimated step under document masking, on the recipe's
    length mix (scripts/recipe_step_times.py, capped at the stage's length; the unmasked step for the _nodocmask
    partners); a cost-model change that moves the estimate by more than 1.5x should regenerate them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_step_times", ROOT / "scripts" / "recipe_step_times.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    for name in ("llama31_8b_cpt_s4_1m", "llama31_70b_cpt_s4_1m", "llama31_70b_1m_mesh_nodocmask"):
        row = steps.step_time(name, "h100-ib400", 450.0)
        args = _parsed(name)
        assert row["masked"] == (not name.endswith("_nodocmask")) and row["step_s"] <= row["unmasked_s"]
        derived = min(row["save_every"], args["train_iters"])
        assert derived / 1.5 <= args["save_interval"] <= derived * 1.5, (name, row, args["save_interval"])
        assert row["step_s"] * args["save_interval"] <= 3600  # never more than an hour of work between saves
        if row["masked"]:  # the unmasked step would save far less often than the 30 min the recipe wants
            assert args["save_interval"] * row["unmasked_s"] > 1.5 * 1800, (name, row)
