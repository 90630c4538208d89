"""``--builder`` functions for tests/ranks/test_builder.py, each a training script's own model
builder with (or without) a per-rank difference: FUNCTION(ctx) -> model | (model, state_dict)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def plain(ctx):
    """Every rank builds the same weights (one seed) and loads nothing: fsdpcheck wraps it."""
    return _llama()


def seeded_per_rank(ctx):
    """Each rank seeds with its rank and loads nothing: training would start from different
    weights on every rank."""
    return _llama(seed=ctx.rank)


def frozen_on_rank_1(ctx):
    model = _llama()
    if ctx.rank == 1:
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    return model


def raises_on_rank_1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1's data path is not mounted")
    return _llama()


def not_a_model(ctx):
    return 42


def _checkpointed(model: LlamaForCausalLM) -> LlamaForCausalLM:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    return model


def _compiled(model: LlamaForCausalLM) -> LlamaForCausalLM:
    # Per block, as torchtitan compiles; "eager" wraps as inductor does (an OptimizedModule,
    # names under _orig_mod.) without a C++ compile.
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend="eager")
    return model


def checkpointed(ctx):
    """Activation checkpointing on every decoder layer, on every rank."""
    return _checkpointed(_llama())


def checkpointed_on_rank_0(ctx):
    """A flag read on one node only: rank 0 checkpoints, rank 1 does not."""
    model = _llama()
    return _checkpointed(model) if ctx.rank == 0 else model


def compiled(ctx):
    """torch.compile on every decoder layer, on every rank."""
    return _compiled(_llama())


def compiled_on_rank_1(ctx):
    model = _llama()
    return _compiled(model) if ctx.rank == 1 else model
