"""``hazard``: a small causal LM of our own that reproduces the upstream buffer-order bug.

Its rotary module registers one buffer per attention type while iterating a ``set`` of type
names, as several transformers releases did. ``set`` iteration order follows the per-process
string hash seed (``PYTHONHASHSEED``), so two ranks can register the same buffers in a different
order. The sizes differ per type (as in Gemma4: 16 vs 8 elements), so a loader that broadcasts in
``named_buffers()`` order pairs tensors of different sizes. ``equal_sizes=True`` gives the
Gemma3-like variant: same sizes, different bases, so a reorder corrupts silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class HazardConfig:
    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention")
    head_dims: dict[str, int] = field(
        default_factory=lambda: {"sliding_attention": 16, "full_attention": 32}
    )
    rope_bases: dict[str, float] = field(
        default_factory=lambda: {"sliding_attention": 1e4, "full_attention": 1e6}
    )
    dtype: str = "float32"
    model_type: str = "hazard"

    @classmethod
    def equal_sizes(cls) -> HazardConfig:
        return cls(head_dims={"sliding_attention": 16, "full_attention": 16})


class HazardRotaryEmbedding(nn.Module):
    def __init__(self, config: HazardConfig):
        super().__init__()
        # The upstream bug, on purpose: iterating a set of str follows PYTHONHASHSEED.
        for layer_type in set(config.layer_types):
            dim = config.head_dims[layer_type]
            exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            inv_freq = 1.0 / (config.rope_bases[layer_type] ** exponent)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)


class HazardRMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HazardMLP(nn.Module):
    def __init__(self, config: HazardConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class HazardDecoderLayer(nn.Module):
    def __init__(self, config: HazardConfig):
        super().__init__()
        self.input_layernorm = HazardRMSNorm(config.hidden_size)
        self.mlp = HazardMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.input_layernorm(x))


class HazardModel(nn.Module):
    def __init__(self, config: HazardConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HazardDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = HazardRMSNorm(config.hidden_size)
        self.rotary_emb = HazardRotaryEmbedding(config)


class HazardForCausalLM(nn.Module):
    _no_split_modules = ["HazardDecoderLayer"]

    def __init__(self, config: HazardConfig):
        super().__init__()
        self.config = config
        self.model = HazardModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden)
        return self.lm_head(self.model.norm(hidden))
