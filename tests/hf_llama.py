"""The tiny random Llama-3.1-style model the Hugging Face round trips use, and its Megatron-Bridge conversion.

Saved with a byte-level tokenizer and converted once per session (``python -m megatron_mesh_cp.megatron.bridge_cpu``,
the README's command; conftest.py's ``tiny_llama`` fixture): test_hf_import.py and test_hf_export.py read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

#: the tiny Llama, in Hugging Face's terms; vocab 384 = the launcher's byte corpus (257) padded to 128
HF = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
          rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
#: the same model in Megatron's terms (megatron-core's Llama-3.1 scaling is fixed at low 1, high 4, original 8192)
LLAMA = dict(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
             norm_epsilon=1e-5, vocab_size=384, rotary_base=500000, rope_scaling_factor=8.0)
#: launcher flags for it (on top of megatron_runs.BASE); the fusion switches only save CPU compile time
LAUNCH = dict(ffn_hidden_size=160, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
              untie_embeddings_and_output_weights=True, disable_bias_linear=True, rotary_base=500000,
              use_rope_scaling=True, rope_scaling_factor=8.0, no_bias_swiglu_fusion=True, no_bias_dropout_fusion=True,
              context_parallel_size=4, context_parallel_algo="mesh", train_iters=4, save_interval=1)


def _save_tiny_llama(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(path)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eod>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eod>").save_pretrained(path)


def convert(work: Path):
    """(hf dir, Megatron checkpoint dir): the model saved under ``work`` and converted by Megatron-Bridge."""
    hf, ckpt = work / "hf", work / "mcore"
    _save_tiny_llama(hf)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "megatron_mesh_cp.megatron.bridge_cpu", "--hf-model", str(hf),
                          "--megatron-path", str(ckpt)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"conversion failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return hf, ckpt
