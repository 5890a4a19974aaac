#!/usr/bin/env python
"""Passkey retrieval on a Hugging Face model: a number hidden at several depths of filler text, asked for at the end.

    python scripts/passkey_retrieval.py --model /ckpt/llama31-8b-s1-hf --length 131072 [--depths 0,0.25,0.5,0.75,1]
        [--trials 2] [--device cuda] [--dtype bfloat16] [--json passkey.json]

The long-context check after each stage of the recipe (README, "Long-context recipe"): the task of
Mohtashami and Jaggi, "Landmark Attention" (arXiv 2305.16300, section 4.2), as the context-extension
papers since use it. A prompt of ``--length`` tokens repeats a filler sentence and, at a fraction
``depth`` of the way in, says "The pass key is N. Remember it. N is the pass key."; it ends with
"What is the pass key? The pass key is" and the model's greedy continuation must start with N.
Each (depth, trial) draws its own 5-digit key (seeded). Prints the accuracy per depth and writes
every answer to ``--json``. ``transformers`` runs the model (``--device-map auto`` spreads a large
one over the node's GPUs with ``accelerate``); the prompt is fed as token ids, built piece by piece,
so its length is exact up to one filler sentence.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from typing import Dict, List, Sequence, Tuple

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def _ids(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(tokenizer, length: int, depth: float, key: int) -> Tuple[List[int], int]:
    """(token ids of about ``length`` tokens, the index of the key sentence's first token): the key sentence after
    ``round(depth * n)`` of the ``n`` filler sentences that fit."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must lie in [0, 1]")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    intro, filler, needle, question = (_ids(tokenizer, t) for t in (INTRO, FILLER, KEY.format(key=key), QUESTION))
    room = length - len(bos) - len(intro) - len(needle) - len(question)
    n = room // len(filler)
    if n < 1:
        raise ValueError(f"--length {length} leaves no room for filler: it needs more than "
                         f"{length - room + len(filler)} tokens with this tokenizer")
    before = round(depth * n)
    head = bos + intro + filler * before
    return head + needle + filler * (n - before) + question, len(head)


def answer_key(text: str):
    """The first whole number of a continuation (None when there is none)."""
    m = re.search(r"\d+", text)
    return int(m.group(0)) if m else None


def run(model, tokenizer, length: int, depths: Sequence[float], trials: int, seed: int = 0,
        max_new_tokens: int = 10) -> Dict:
    """Every (depth, trial): the key, the answer and whether it matches; the accuracy per depth and overall."""
    import torch

    rng = random.Random(seed)
    device = next(model.parameters()).device
    rows = []
    for depth in depths:
        for trial in range(trials):
            key = rng.randint(10000, 99999)
            ids, at = build_prompt(tokenizer, length, depth, key)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id)
            text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            rows.append(dict(depth=depth, trial=trial, key=key, tokens=len(ids), key_at=at, answer=text,
                             correct=answer_key(text) == key))
    per_depth = {str(d): sum(r["correct"] for r in rows if r["depth"] == d) / trials for d in depths}
    return dict(length=length, trials=trials, rows=rows, accuracy_per_depth=per_depth,
                accuracy=sum(r["correct"] for r in rows) / len(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (e.g. megatron_mesh_cp's export)")
    p.add_argument("--length", type=int, required=True, help="prompt length in tokens (the stage's sequence length)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="where the key sits, as fractions of the filler")
    p.add_argument("--trials", type=int, default=2, help="keys per depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (ignored with --device-map)")
    p.add_argument("--device-map", default=None, help="e.g. auto: spread the model over the GPUs (needs accelerate)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--attn-implementation", default=None, help="e.g. sdpa or flash_attention_2")
    p.add_argument("--json", default=None, help="write every answer here")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    depths = [float(d) for d in args.depths.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    kw = dict(dtype=getattr(torch, args.dtype))
    if args.device_map:
        kw["device_map"] = args.device_map
    if args.attn_implementation:
        kw["attn_implementation"] = args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw).eval()
    if not args.device_map:
        model = model.to(args.device)
    report = run(model, tokenizer, args.length, depths, args.trials, args.seed)
    for d, acc in report["accuracy_per_depth"].items():
        print(f"passkey at depth {d}: {acc:.0%} of {args.trials} ({report['rows'][0]['tokens']} tokens)")
    print(f"passkey retrieval at {args.length} tokens: {report['accuracy']:.0%} of {len(report['rows'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
