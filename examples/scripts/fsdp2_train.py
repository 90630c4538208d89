"""A plain FSDP2 training script, in the style of PyTorch's own examples: a small decoder built on
the meta device, ``fully_shard`` per block and on the root, ``to_empty`` and
``reset_parameters``, resume from and save to a DCP checkpoint, AdamW.

It knows nothing of fsdpcheck. Run it alone, or checked:

    torchrun --nproc-per-node 2 examples/scripts/fsdp2_train.py --steps 4
    torchrun --nproc-per-node 2 -m fsdpcheck run examples/scripts/fsdp2_train.py --steps 4

``--checkpoint-dir`` resumes from its ``latest`` step when there is one and saves there at the
end; ``--out`` writes the losses and the final full weights (rank 0).
"""

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ModelArgs:
    vocab_size: int = 128
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 16


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, d))

    def reset_parameters(self):
        for linear in (self.wqkv, self.wo):
            nn.init.normal_(linear.weight, std=0.02)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, 4 * args.dim)
        self.w2 = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self):
        for linear in (self.w1, self.w2):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def reset_parameters(self):
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("positions", torch.arange(args.max_seq_len), persistent=False)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(self.positions[: tokens.shape[1]])
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        with torch.no_grad():
            self.positions.copy_(torch.arange(self.args.max_seq_len))
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        nn.init.normal_(self.pos_embeddings.weight, std=0.02)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=0.02 / math.sqrt(2 * self.args.n_layers))


def parse_args():
    parser = argparse.ArgumentParser(description="FSDP2 training on a small decoder")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--checkpoint-dir", default="")
    parser.add_argument("--out", default="", help="losses and final weights (rank 0)")
    return parser.parse_args()


def main():
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)

    model_args = ModelArgs(n_layers=args.n_layers, dim=args.dim)
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs = {"mesh": mesh}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    model.to_empty(device=device)
    model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    latest = os.path.join(args.checkpoint_dir, "latest")
    if args.checkpoint_dir and os.path.exists(latest):
        with open(latest) as f:
            start = int(f.read())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{start}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if rank == 0:
            print(f"resumed from step {start}")

    data = torch.Generator().manual_seed(1234 + rank)
    losses = []
    for step in range(start, start + args.steps):
        began = time.perf_counter()
        for _ in range(args.grad_accum):
            tokens = torch.randint(
                0,
                model_args.vocab_size,
                (args.batch_size, model_args.max_seq_len + 1),
                generator=data,
            ).to(device)
            logits = model(tokens[:, :-1])
            loss = (
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                / args.grad_accum
            )
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            took = time.perf_counter() - began
            print(f"step {step + 1} loss {loss.item():.6f} ({took:.4f} s, at {time.time():.3f})")

    end = start + args.steps
    if args.checkpoint_dir:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{end}"),
        )
        dist.barrier()
        if rank == 0:
            with open(latest, "w") as f:
                f.write(str(end))
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if args.out and rank == 0:
        from safetensors.torch import save_file

        os.makedirs(args.out, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in full.items()},
            os.path.join(args.out, "weights.safetensors"),
        )
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
