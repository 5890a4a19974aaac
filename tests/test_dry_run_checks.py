"""What the launcher's --dry-run catches before a job is queued: a data prefix whose files are missing, a config
key that is no setting (one line naming it and its file), a world size (WORLD_SIZE) the parallel sizes do not
divide (one line naming WORLD_SIZE, not Megatron's traceback), a --mesh-layout that is none (one line, not
Megatron's usage), an LR warmup not below the decay (Megatron asserts it only after building the model), and the vocabulary read from the tokenizer (or, when
it does not load here, how to give it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import ROOT, run_bad_args  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import fake_dataset  # noqa: E402

TINY = str(ROOT / "configs" / "gpt_tiny_cpu.yaml")


def test_dry_run_refuses_missing_data_and_unknown_keys(tmp_path):
    prefix = fake_dataset.write(tmp_path / "corpus_text_document", [100, 300, 700] * 10)
    (tmp_path / "typo.yaml").write_text(f"include: {TINY}\nseq_lenght: 128\n")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
    cases = [["--config", TINY, "--dry-run", "--data-path", str(tmp_path / "nope_text_document"), *null],
             ["--config", str(tmp_path / "typo.yaml"), "--dry-run"],
             ["--config", TINY, "--dry-run", "--data-path", prefix, *null],
             ["--config", TINY, "--dry-run", "--data-path", prefix, *null, "--context-parallel-size", "8", "--mesh-shape", "2x4"],
             ["--config", TINY, "--dry-run", "--mesh-layout", "tiled", "--mesh-layout=split:2"],
             ["--config", TINY, "--dry-run", "--train-iters", "2"]]  # the config warms up for 2 iterations
    missing, typo, present, world, layout, warmup = run_bad_args(cases, tmp_path, world_size=4)
    assert missing["code"] == 2, missing
    assert (f"error: --data-path: missing data_path: {tmp_path}/nope_text_document.bin, data_path: "
            f"{tmp_path}/nope_text_document.idx (a dataset prefix PREFIX names PREFIX.bin and PREFIX.idx"
            ) in missing["stderr"]
    assert typo["code"] == 2 and len(typo["stderr"].strip().splitlines()) == 1, typo
    assert f"error: {tmp_path / 'typo.yaml'}: seq_lenght: not a Megatron or mesh-CP setting" in typo["stderr"]
    assert present["code"] in (0, None), present
    assert world["code"] == 2 and len(world["stderr"].strip().splitlines()) == 1, world  # one line, not a traceback
    assert "error: world size (4) is not divisible" in world["stderr"]
    assert "the world size is WORLD_SIZE (4 here" in world["stderr"] and "WORLD_SIZE=256 ... --dry-run" in world["stderr"]
    assert layout["code"] == 2 and len(layout["stderr"].strip().splitlines()) == 1, layout  # not Megatron's usage
    assert "error: argument --mesh-layout: invalid choice: 'split:2' (choose from 'auto', 'zigzag'" in layout["stderr"]
    assert "a fixed split:K is the simulator's --layout only" in layout["stderr"]
    assert warmup["code"] == 2, warmup  # Megatron's scheduler would assert it after building the model
    assert ("error: --lr-warmup-iters 2 is not below the LR decay's 2 iterations (--lr-decay-iters, or --train-iters "
            "where it is unset)") in warmup["stderr"] and "raise --train-iters or lower --lr-warmup-iters" in warmup["stderr"]


def test_the_estimate_reads_the_tokenizers_vocabulary_or_says_how_to_give_it(tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_mesh_cp.megatron.memory import tokenizer_vocab

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eod>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eod>").save_pretrained(tmp_path / "tok")
    args = SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"),
                           vocab_size=None)
    assert tokenizer_vocab(args) == (257, "")
    args.tokenizer_model = str(tmp_path / "absent")
    vocab_size, hint = tokenizer_vocab(args)
    assert vocab_size is None and f"the tokenizer {tmp_path / 'absent'} did not load here" in hint
    assert "make it readable on this machine (TOKENIZER_MODEL: a local directory) or pass --vocab-size N" in hint
    assert tokenizer_vocab(SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=257)) == (None, "")
