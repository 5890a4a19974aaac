"""Rank functions for the direct-GPTModel test (megatron-core 0.16.x and 0.19.x, no training loop)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mesh_cp import zigzag_shard
from rank_groups import megatron_task


@megatron_task
def gpt_direct(ctx, cp, shape, seed=0, seq=64, batch=2, vocab=128, **config_kw):
    """Build a tiny GPT (RoPE, GQA) with the mesh spec, run one forward/backward on this rank's share.

    ``config_kw`` overrides TransformerConfig fields (recompute, hidden dropout). Returns the global
    loss sum and, on rank 0, the CP-summed gradients of every parameter.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mesh_cp.megatron import cpu_compat
    from megatron_mesh_cp.megatron.attention import _MESHES
    from megatron_mesh_cp.megatron.specs import gpt_mesh_spec

    cpu_compat.activate(training=False)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _MESHES.clear()
    parallel_state.initialize_model_parallel(
        1, 1, context_parallel_size=cp, hierarchical_context_parallel_sizes=list(shape) if cp > 1 else None
    )
    torch.manual_seed(seed)
    settings = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        context_parallel_size=cp, cp_comm_type=("mesh" if len(shape) == 2 else "a2a+mesh") if cp > 1 else None,
        hierarchical_context_parallel_sizes=list(shape) if cp > 1 else None,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, transformer_impl="local",
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False,
    )
    config = TransformerConfig(**dict(settings, **config_kw))
    model = GPTModel(config, transformer_layer_spec=gpt_mesh_spec(config), vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type="rope")
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()
    if cp > 1:
        r = parallel_state.get_context_parallel_rank()
        inputs, labels, positions = (zigzag_shard(x, cp, r, dim=1) for x in (inputs, labels, positions))
        mask = None
    losses = model(inputs, positions, mask, labels=labels)
    loss = losses.float().sum()
    loss.backward()
    total = loss.detach().clone()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    if cp > 1:
        group = parallel_state.get_context_parallel_group()
        dist.all_reduce(total, group=group)
        for v in grads.values():
            dist.all_reduce(v, group=group)
    return {"loss": float(total), "grads": grads if dist.get_rank() == 0 else None}


def cuda_rng_under_checkpoint(ctx):
    """Megatron's activation checkpointing on CPU: the CUDA RNG state it saves and restores is the
    stand-in generator's, so a recomputed function that draws "cuda" randomness draws the same numbers.

    Returns (state round-trip ok, forward output, recomputed-gradient error vs the analytic one).
    """
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_mesh_cp.megatron import cpu_compat

    cpu_compat.activate(training=False)
    torch.cuda.manual_seed(ctx.rank + 7)
    state = mrandom._get_cuda_rng_state()
    first = torch.rand(4, device="cuda")
    mrandom._set_cuda_rng_state(state)
    roundtrip = bool(torch.equal(first, torch.rand(4, device="cuda")))

    x = torch.randn(8, requires_grad=True)
    noise = []

    def f(t):
        n = torch.rand(8, device="cuda")  # drawn again in the recompute: must be the same numbers
        noise.append(n)
        return t * n

    out = mrandom.checkpoint(f, False, x)
    torch.rand(8, device="cuda")  # moves the generator on between forward and backward
    out.sum().backward()
    same_noise = bool(torch.equal(noise[0], noise[1]))
    grad_err = float((x.grad - noise[0]).abs().max())
    return {"roundtrip": roundtrip, "same_noise": same_noise, "grad_err": grad_err}


@megatron_task
def llama_from_checkpoint(ctx, ckpt_dir, tokens, shape=(2, 2), iteration=0, **llama):
    """Load a converted Llama checkpoint into a GPTModel built as the launcher builds it (mesh spec), under
    mesh CP = a*b; return (rank 0) the full-sequence logits and the state-dict keys of this model and of a
    GPTModel built with stock megatron-core's local spec and the same config."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mesh_cp import zigzag_gather
    from megatron_mesh_cp.megatron import cpu_compat
    from megatron_mesh_cp.megatron.attention import _MESHES
    from megatron_mesh_cp.megatron.specs import gpt_mesh_spec

    cpu_compat.activate(training=False)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _MESHES.clear()
    cp = shape[0] * shape[1]
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp, hierarchical_context_parallel_sizes=list(shape))
    config = TransformerConfig(
        num_layers=llama["num_layers"], hidden_size=llama["hidden_size"], ffn_hidden_size=llama["ffn_hidden_size"],
        num_attention_heads=llama["num_attention_heads"], num_query_groups=llama["num_query_groups"],
        normalization="RMSNorm", layernorm_epsilon=llama["norm_epsilon"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, context_parallel_size=cp, cp_comm_type="mesh", hierarchical_context_parallel_sizes=list(shape),
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, transformer_impl="local",
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, bias_activation_fusion=False,
    )
    kw = dict(vocab_size=llama["vocab_size"], max_sequence_length=tokens.shape[1], position_embedding_type="rope",
              rotary_base=llama["rotary_base"], rope_scaling=True, rope_scaling_factor=llama["rope_scaling_factor"],
              share_embeddings_and_output_weights=False)
    model = GPTModel(config, transformer_layer_spec=gpt_mesh_spec(config), **kw)
    # stock local DotProductAttention refuses CP > 1; the keys do not depend on it
    stock_config = dataclasses.replace(config, context_parallel_size=1, cp_comm_type=None,
                                       hierarchical_context_parallel_sizes=None)
    stock = GPTModel(stock_config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kw)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, f"{ckpt_dir}/iter_{iteration:07d}")
    model.load_state_dict(loaded["model"])

    def sharded_keys(m):
        return sorted({t.key for t in nested_values(m.sharded_state_dict()) if hasattr(t, "key")})

    r = parallel_state.get_context_parallel_rank()
    inputs = zigzag_shard(tokens, cp, r, dim=1)
    positions = zigzag_shard(torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens), cp, r, dim=1)
    with torch.no_grad():
        logits = model(inputs, positions, None).contiguous()
    shards = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(shards, logits, group=parallel_state.get_context_parallel_group())
    if dist.get_rank() != 0:
        return None
    return {"logits": zigzag_gather(shards, dim=1), "keys": sorted(model.state_dict()), "stock_keys": sorted(stock.state_dict()),
            "sharded_keys": sharded_keys(model), "stock_sharded_keys": sharded_keys(stock)}
