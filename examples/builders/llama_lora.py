"""A LoRA fine-tuning script's model builder for ``fsdpcheck audit --builder``: copy it, and
replace the body with what your script does before its first step.

    torchrun --nproc-per-node 2 -m fsdpcheck audit \\
        --builder examples/builders/llama_lora.py:build --json report.json

Every rank calls ``build(ctx)``. This one builds a small Llama from a config (no download),
adds LoRA adapters with peft's ``get_peft_model`` (the base weights frozen, the adapters
trainable), then shards with ``fully_shard`` per decoder layer and on the root over
``ctx.mesh`` (the audit's ``--mesh``) or all ranks, as FSDP2 LoRA trainers do. It returns the
wrapped model and rank 0's full state dict (base and adapter weights), which fsdpcheck loads
with its sorted loader and verifies on every rank. Needs ``pip install peft``.
"""

import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
    # One seed on every rank, before the adapters too: lora_A starts random, and FSDP2 has no
    # sync_module_states, so a rank seeded otherwise would train other adapters.
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
    )
    model = get_peft_model(base, lora)
    full = {k: v.clone() for k, v in model.state_dict().items()} if ctx.rank == 0 else None
    mesh = ctx.mesh or init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full
