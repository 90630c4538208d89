"""A 2-D FSDP x TP model builder for ``fsdpcheck audit --builder``: copy it, and replace the body
with what your script does before its first step.

    torchrun --nproc-per-node 4 -m fsdpcheck audit --mesh dp_shard=2,tp=2 \\
        --builder examples/builders/llama_fsdp_tp.py:build --json report.json

Every rank calls ``build(ctx)``. This one builds a small Llama the way 2-D trainers do
(torchtitan's ``parallelize_llama``): tensor parallel inside each decoder layer on the mesh's
``tp`` dim (attention and MLP projections column-wise in, row-wise out), then ``fully_shard``
per layer and on the root over the data dims (``dp_shard``, or ``dp_replicate`` and
``dp_shard`` for HSDP). ``ctx.mesh`` is the audit's ``--mesh`` (or ``--tp``); without one it
builds ``dp_shard=WORLD/2, tp=2``. It returns the wrapped model and rank 0's full state dict
(its initial weights), which fsdpcheck then loads with its sorted loader and verifies on every
rank: each TP rank's slice, and each FSDP shard of it.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from transformers import LlamaConfig, LlamaForCausalLM

# What the model's own config.base_model_tp_plan says for each decoder layer, as torch styles.
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def build(ctx):
    mesh = ctx.mesh
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // 2, 2), mesh_dim_names=("dp_shard", "tp")
        )
    data = tuple(n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # the heads and KV heads must divide by the tp size
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full = {k: v.clone() for k, v in model.state_dict().items()} if ctx.rank == 0 else None
    for layer in model.model.layers:
        plan = {name: style() for name, style in LAYER_PLAN.items()}
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh[data])
    fully_shard(model, mesh=mesh[data])
    return model, full
