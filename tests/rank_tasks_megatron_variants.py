"""Rank functions for Megatron's attention variants on a GPTModel built directly (no training loop):
sliding windows per layer, softmax sinks, MLA, the max logit of qk-clip (megatron-core 0.19.x)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_mesh_cp import zigzag_gather, zigzag_shard
from rank_groups import megatron_task

#: a tiny MLA: q/k head dim 16 + 8 (RoPE part), value head dim 16 (= kv_channels, which
#: Megatron's local DotProductAttention uses for its output at CP = 1)
MLA = dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, rope_type="rope", num_query_groups=None)


def _build(cp, shape, seed, seq, vocab, config_kw):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import MLATransformerConfig
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
    settings.update(config_kw)
    cls = MLATransformerConfig if settings.get("multi_latent_attention") else TransformerConfig
    config = cls(**settings)
    model = GPTModel(config, transformer_layer_spec=gpt_mesh_spec(config), vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type="rope")
    return model


def _batch(cp, seed, seq, batch, vocab):
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()
    if cp > 1:
        r = parallel_state.get_context_parallel_rank()
        inputs, labels, positions = (zigzag_shard(x, cp, r, dim=1) for x in (inputs, labels, positions))
        mask = None
    return inputs, labels, positions, mask


@megatron_task
def gpt_variants(ctx, cp, shape, seed=0, seq=64, batch=2, vocab=128, mla=False, steps=1, **config_kw):
    """Build a tiny GPT with the mesh spec and attention variants (``config_kw``: window_size,
    window_attn_skip_freq, softmax_type, qk_clip...; ``mla``: the MLA above), run ``steps``
    forwards (different batches) and one backward of their sum on this rank's share.

    Returns the global loss, the CP-summed grads (rank 0), parameter and sharded-checkpoint names of
    the sinks, and per layer: its window, the bytes its first forward sent, every rank's
    ``current_max_attn_logits`` and (rank 0) the gathered q, k, v of each forward, for a reference.
    """
    from megatron.core import parallel_state

    model = _build(cp, shape, seed, seq, vocab, dict(MLA, **config_kw) if mla else config_kw)
    layers = model.decoder.layers
    seen = [[] for _ in layers]
    sent = [[] for _ in layers]
    for i, layer in enumerate(layers):
        core = layer.self_attention.core_attention
        mesh = getattr(core, "mesh", None)

        def pre(mod, args, i=i, mesh=mesh):
            seen[i].append(tuple(a.detach().clone() for a in args[:3]))
            sent[i].append(mesh.traffic.total_sent() if mesh is not None else 0)

        def post(mod, args, out, i=i, mesh=mesh):
            sent[i][-1] = (mesh.traffic.total_sent() if mesh is not None else 0) - sent[i][-1]

        core.register_forward_pre_hook(pre)
        core.register_forward_hook(post)
    total = 0.0
    for step in range(steps):
        inputs, labels, positions, mask = _batch(cp, seed + 1 + step, seq, batch, vocab)
        total = total + model(inputs, positions, mask, labels=labels).float().sum()
    total.backward()
    loss = total.detach().clone()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    group = parallel_state.get_context_parallel_group() if cp > 1 else None
    if cp > 1:
        dist.all_reduce(loss, group=group)
        for v in grads.values():
            dist.all_reduce(v, group=group)
    per_layer = []
    for i, layer in enumerate(layers):
        core = layer.self_attention.core_attention
        top = core.current_max_attn_logits
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, None if top is None else (top.clone(), top.requires_grad))
        full = []
        for q, k, v in seen[i]:  # [s_local, b, h, d] shares -> the full sequence, in CP-rank order
            if cp > 1:
                parts = [[torch.empty_like(x) for _ in range(cp)] for x in (q, k, v)]
                for out, x in zip(parts, (q, k, v)):
                    dist.all_gather(out, x.contiguous(), group=group)
                q, k, v = (zigzag_gather(p, dim=0) for p in parts)
            full.append((q, k, v))
        per_layer.append({"window": getattr(core, "window", None), "bytes": sent[i][0], "max_logits": everyone,
                          "qkv": full, "scale": getattr(core, "softmax_scale", None)})
    sinks = sorted(n for n, _ in model.named_parameters() if "softmax_offset" in n)
    sharded = {k: (tuple(sh.global_shape), tuple(sh.axis_fragmentations)) for k, sh in model.sharded_state_dict().items()
               if "softmax_offset" in k}
    return {"loss": float(loss), "grads": grads if dist.get_rank() == 0 else None, "sinks": sinks,
            "sharded": sharded, "layers": per_layer if dist.get_rank() == 0 else
            [{"max_logits": p["max_logits"], "window": p["window"], "bytes": p["bytes"]} for p in per_layer]}


@megatron_task
def qk_clip_consumes_max_logits(ctx, shape, seed=0, seq=64, batch=2, vocab=128, **config_kw):
    """One forward/backward with ``qk_clip`` under mesh CP, then Megatron's own ``clip_qk`` (the
    optimizer hook: MAX all-reduce over DP x CP, then each layer's Attention.clip_qk). Returns the
    max logit it logged, whether every layer's query/key weights changed and its max was reset."""
    from megatron.core.optimizer.qk_clip import clip_qk

    cp = 1
    for x in shape:
        cp *= x
    model = _build(cp, shape, seed, seq, vocab, dict(config_kw, qk_clip=True, qk_clip_threshold=1e-3))
    inputs, labels, positions, mask = _batch(cp, seed + 1, seq, batch, vocab)
    model(inputs, positions, mask, labels=labels).float().sum().backward()
    before = [layer.self_attention.linear_qkv.weight.detach().clone() for layer in model.decoder.layers]
    tops = [layer.self_attention.core_attention.current_max_attn_logits.clone() for layer in model.decoder.layers]
    logged = clip_qk([SimpleNamespace(module=SimpleNamespace(module=model))])
    changed = [not torch.equal(b, layer.self_attention.linear_qkv.weight) for b, layer in zip(before, model.decoder.layers)]
    reset = [layer.self_attention.core_attention.current_max_attn_logits is None for layer in model.decoder.layers]
    return {"logged": logged, "max": max(float(t.max()) for t in tops), "changed": changed, "reset": reset}
