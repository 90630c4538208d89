"""Real model configs, built fresh each call as a trainer builds them in each process: a
torchtitan-style one (as torchtitan 0.3.0's llama3 builds it: nested dataclasses that hold
functions, partials, a class and a lambda, none of which has a stable ``str()``), and tiny
transformers LlamaConfig and Gemma3 text configs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def init_output(weight: torch.Tensor, std: float = 0.02) -> None:
    nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)


@dataclass
class RoPEConfig:
    theta: float = 500000.0
    scaling: str = "llama"
    factors: tuple[float, ...] = (8.0, 1.0, 4.0)


@dataclass
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int = 2
    use_flex: bool = False
    rope: RoPEConfig = field(default_factory=RoPEConfig)
    param_init: Callable = field(
        default_factory=lambda: functools.partial(nn.init.normal_, std=0.02)
    )


@dataclass
class ModelArgs:
    name: str = "llama3"
    dim: int = 64
    n_layers: int = 2
    vocab_size: int = 256
    norm_eps: float = 1e-5
    activation: Callable = F.silu
    norm_cls: type = nn.RMSNorm
    param_init: Callable = field(
        default_factory=lambda: functools.partial(nn.init.trunc_normal_, mean=0.0, std=0.02)
    )
    output_init: Callable = init_output
    depth_init: Callable = field(
        default_factory=lambda: lambda layer_id: 0.02 / (2 * (layer_id + 1)) ** 0.5
    )
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    layer_hooks: dict = field(default_factory=lambda: {"post": [F.gelu], "cast": torch.bfloat16})


TINY = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=64,
)


def titan(**changes) -> ModelArgs:
    return ModelArgs(**changes)


def llama(**changes):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **changes})


def gemma3(**changes):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**TINY, **changes})


BUILDERS = {"titan": titan, "llama": llama, "gemma3": gemma3}
