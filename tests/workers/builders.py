"""``--builder`` functions for tests/ranks/test_builder.py, each a training script's own model
builder with (or without) a per-rank difference: FUNCTION(ctx) -> model | (model, state_dict)
| {"model": ..., "state_dict": ..., "step": ..., "batch": ...}."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _llama(seed: int = 0, kv_heads: int = 1) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
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


def _fsdp_tp(ctx, *, skip_down_proj_on=None, norm_drift_on=None):
    """FSDP2 x TP on ``ctx.mesh`` (dp_shard, tp) as the example builds it, nothing to load;
    rank ``skip_down_proj_on`` leaves layer 0's down_proj out of its TP plan, rank
    ``norm_drift_on`` holds another final norm (which tensor parallelism leaves whole)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = ctx.mesh
    model = _llama(kv_heads=2)  # both heads split over tp=2
    if ctx.rank == norm_drift_on:
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
    for i, layer in enumerate(model.model.layers):
        plan = {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        if ctx.rank == skip_down_proj_on and i == 0:
            del plan["mlp.down_proj"]
        # Each rank's own values (no scatter): rank 3's plan issues fewer collectives.
        parallelize_module(layer, mesh["tp"], plan, src_data_rank=None)
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def tp_skipped_on_rank_3(ctx):
    """FSDP2 x TP, except that rank 3 leaves layer 0's down_proj out of its TP plan: FSDP2 then
    shards that weight over dp_shard alone on rank 3 (other placements, another mesh) and over
    (dp_shard, tp) everywhere else."""
    return _fsdp_tp(ctx, skip_down_proj_on=3)


def tp_prewrapped(ctx):
    """FSDP2 x TP, the same weights on every rank, returned wrapped with nothing to load."""
    return _fsdp_tp(ctx)


def tp_prewrapped_norm_drift_on_rank_1(ctx):
    """As :func:`tp_prewrapped`, but rank 1 (TP rank 1 of data shard 0) holds another final
    norm: after wrapping, its dp_shard shard is rank 0's (TP rank 0 of the same data shard)."""
    return _fsdp_tp(ctx, norm_drift_on=1)


def plain_for_tp(ctx):
    """The same weights on every rank, not wrapped, nothing to load: ``--tp`` shards it."""
    return _llama(kv_heads=2)


def norm_drift_on_rank_1(ctx):
    """As :func:`plain_for_tp`, but rank 1 (TP rank 1 of data shard 0 on dp_shard=2,tp=2)
    holds another final norm: tensor parallelism replicates it, so every rank must agree."""
    model = _llama(kv_heads=2)
    if ctx.rank == 1:
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
    return model


def _moe(seed: int = 0):
    """The ``tiny-qwen3-moe`` preset (4 experts, top-2, with an expert-parallel plan)."""
    from transformers import Qwen3MoeForCausalLM

    from fsdpcheck.model.presets import PRESETS

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(PRESETS["tiny-qwen3-moe"].make_config())


def moe_plain(ctx):
    """The same MoE weights on every rank, not wrapped, nothing to load: ``--ep`` shards it."""
    return _moe()


def moe_collapsed(ctx):
    """As :func:`moe_plain`, but every layer's experts 2 and 3 are copies of experts 0 and 1:
    the full model a resume leaves when every EP rank saved its local experts as experts 0 and
    1 (KempnerForge #202). On ep=2 each EP slot then holds the same experts."""
    model = _moe()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param[2:].copy_(param[:2])
    return model


def torchtitan_style_rope_on_rank_1(ctx):
    """examples/builders/torchtitan_style.py, rank 1 configured with another rope_theta (its
    RoPE table then differs, and the table is in no checkpoint)."""
    example = _torchtitan_example()
    return example.build(ctx, example.ModelArgs(rope_theta=20000.0 if ctx.rank == 1 else 10000.0))


def _torchtitan_example():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "builders" / "torchtitan_style.py"
    spec = importlib.util.spec_from_file_location("torchtitan_style_example", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    return example


def torchtitan_style_no_state_dict(ctx):
    """The torchtitan-style example with its own step and nothing to load: the step still runs,
    on each rank's own (equal) weights."""
    built = _torchtitan_example().build(ctx)
    return {"model": built["model"], "step": built["step"]}


def torchtitan_style_extra_micro_batch(ctx):
    """The torchtitan-style example whose step runs a second micro-batch on rank 1 (a data
    loader that hands one rank two): rank 1 issues another forward's collectives."""
    example = _torchtitan_example()
    args = example.ModelArgs()
    built = example.build(ctx, args)
    model, tokens = built["model"], example.batch(ctx, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = 0.0
        for _ in range(2 if ctx.rank == 1 else 1):
            logits = model(tokens[:, :-1])
            micro = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
            micro.backward()
            loss = loss + micro.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return {"model": model, "state_dict": built["state_dict"], "step": step}


def torchtitan_style_without_step(ctx):
    """The torchtitan-style example returned without its step: --step has no step to run
    (its forward takes tokens, not input_ids and labels)."""
    built = _torchtitan_example().build(ctx)
    return built["model"], built["state_dict"]


def step_not_callable_on_rank_1(ctx):
    """A step that is not a function, on rank 1: bad input there."""
    return {"model": _llama(), "step": "train_step" if ctx.rank == 1 else None}


def step_raises_on_rank_1(ctx):
    """A transformers model whose own step raises on rank 1 after its forward and backward,
    before the optimizer step: rank 0 goes on to the collectives rank 1 never issues."""
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if ctx.rank == 1:
            raise ValueError("rank 1's data loader ran dry")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return {"model": model, "step": step}


def llama_with_step_and_batch(ctx):
    """A transformers model with its own step taking a batch: ``step(batch)``."""
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(ctx.rank)
    ids = torch.randint(0, 128, (2, 8), generator=generator)

    def step(batch):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return {"model": model, "step": step, "batch": ids}
