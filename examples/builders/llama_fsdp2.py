"""A training script's model builder for ``fsdpcheck audit --builder``: copy it, and replace the
body with what your script does before its first step.

    torchrun --nproc-per-node 2 -m fsdpcheck audit \\
        --builder examples/builders/llama_fsdp2.py:build --json report.json

Every rank calls ``build(ctx)``. This one builds a small Llama the way FSDP2 trainers do:
activation checkpointing on every decoder layer, then ``fully_shard`` per layer and on the
root with a bfloat16 mixed-precision policy, over ``ctx.mesh`` (the audit's ``--mesh``) or all
ranks. It returns the wrapped model and rank 0's full state dict (its initial weights), which
fsdpcheck then loads with its sorted loader and verifies on every rank.
"""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def build(ctx):
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full = {k: v.clone() for k, v in model.state_dict().items()} if ctx.rank == 0 else None
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    mesh = ctx.mesh or init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, full
