"""A torchtitan-style builder for ``fsdpcheck audit --builder``: the model is torchtitan's
shape, not transformers'. Its config is a dataclass that holds functions (the weight
initialisers, as torchtitan 0.3's ``param_init`` fields do); each attention's q, k and v live
in one fused ``wqkv`` that the model's state-dict hooks split into ``wq``/``wk``/``wv`` (and
fuse back on load), so checkpoint names are not parameter names. Built as torchtitan's trainer
builds it: on ``meta``, ``fully_shard`` per block and on the root, ``to_empty``, then
``init_weights``; it returns the model, rank 0's checkpoint (another seed's weights, split
names), which fsdpcheck loads into every rank and verifies, and the trainer's own training
step for ``--step``: the forward is ``model(tokens)`` returning logits, not transformers'
``model(input_ids=, labels=).loss``, so fsdpcheck's synthetic step cannot drive it.

    torchrun --nproc-per-node 2 -m fsdpcheck audit \\
        --builder examples/builders/torchtitan_style.py:build --step --json report.json
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Functions in the config, as torchtitan's: recorded by name, never by address.
    param_init: Callable = field(default=functools.partial(nn.init.trunc_normal_, std=0.02))
    output_init: Callable = nn.init.normal_


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64, as torchtitan's


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.sizes = [d * self.head_dim for d in (args.n_heads, args.n_kv_heads, args.n_kv_heads)]
        self.wqkv = nn.Linear(args.dim, sum(self.sizes), bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_fuse_qkv)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = apply_rotary(q.view(b, s, self.n_heads, self.head_dim), freqs_cis)
        k = apply_rotary(k.view(b, s, self.n_kv_heads, self.head_dim), freqs_cis)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _split_qkv(module: Attention, state_dict: dict, prefix: str, _metadata) -> None:
    """Checkpoints name q, k and v apart (``wq.weight``…), as the unfused model did."""
    fused = state_dict.pop(f"{prefix}wqkv.weight")
    for name, part in zip(("wq", "wk", "wv"), fused.split(module.sizes, dim=0), strict=True):
        state_dict[f"{prefix}{name}.weight"] = part


def _fuse_qkv(module: Attention, state_dict: dict, prefix: str, *_args) -> None:
    names = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
    if all(n in state_dict for n in names):
        state_dict[f"{prefix}wqkv.weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = 2 * args.dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's: after ``to_empty``, every parameter and the RoPE table."""
        self.freqs_cis = precompute_freqs_cis(self.config).to(buffer_device or "cpu")
        for name, param in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(param)
            elif name.startswith("output"):
                self.config.output_init(param, std=self.config.dim**-0.5)
            else:
                self.config.param_init(param)


def checkpoint(args: ModelArgs) -> dict[str, torch.Tensor]:
    """The pretrained weights every rank loads (seeded), by checkpoint names."""
    torch.manual_seed(1234)
    reference = Transformer(args)
    reference.init_weights()
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


def train_step(model: Transformer, tokens: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One step as torchtitan's trainer takes it: next-token cross-entropy on the logits,
    backward, AdamW. The optimizer is made here, before the load, as torchtitan makes it:
    the load writes into the same parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def batch(ctx, args: ModelArgs, size: int = 2, length: int = 17) -> torch.Tensor:
    """This rank's own tokens (data parallel over every rank: another batch on each)."""
    generator = torch.Generator().manual_seed(ctx.rank)
    return torch.randint(0, args.vocab_size, (size, length), generator=generator).to(ctx.device)


def build(ctx, args: ModelArgs | None = None):
    args = args or ModelArgs()
    full = checkpoint(args) if ctx.rank == 0 else None
    with torch.device("meta"):
        model = Transformer(args)
    mesh = ctx.mesh or init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=ctx.device)
    torch.manual_seed(0)  # the weights the load must replace, every one of them
    model.init_weights(buffer_device=ctx.device)
    # "step" is what --step runs on this rank (without it, --step would call model(input_ids=)).
    return {"model": model, "state_dict": full, "step": train_step(model, batch(ctx, args))}
