"""Fixtures that differ on purpose between rank 0 and the other ranks, one difference each.

Each is the ``hazard`` model with a single RoPE layer type (so PYTHONHASHSEED plays no part) and
one change on every rank other than 0, decided at construction from ``RANK`` as a launcher sets
it: the same way real per-rank differences arise (a config, a library or an env that differs).
``docs/loaders.md`` runs every known loader on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM, HazardModel


@dataclass
class FixtureConfig(HazardConfig):
    variant: str = "param-shape"
    model_type: str = "hazard-fixture"

    @classmethod
    def of(cls, variant: str) -> FixtureConfig:
        """``variant``: one of ``fsdpcheck.model.presets.FIXTURE_VARIANTS``."""
        base = 5e5 if variant == "buffer-values" and _differs() else 1e4
        return cls(
            variant=variant,
            layer_types=("full_attention",),
            head_dims={"full_attention": 16},
            rope_bases={"full_attention": base},
        )

    def build_model(self) -> nn.Module:
        return FixtureForCausalLM(self)


def _differs() -> bool:
    """True on every rank but 0: the side of the fixture that differs."""
    try:
        return int(os.environ.get("RANK", "0") or 0) != 0
    except ValueError:
        return False


class FixtureForCausalLM(HazardForCausalLM):
    def __init__(self, config: FixtureConfig):
        nn.Module.__init__(self)
        self.config = config
        other = _differs()
        variant = config.variant
        if variant == "tied" and other:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.model = HazardModel(config)
        else:
            self.model = HazardModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if variant == "tied":
            self.tie_weights()
        norm = self.model.norm
        if variant == "param-shape" and other:
            mlp = self.model.layers[0].mlp
            mlp.gate_proj = nn.Linear(config.hidden_size, 96, bias=False)
            mlp.up_proj = nn.Linear(config.hidden_size, 96, bias=False)
            mlp.down_proj = nn.Linear(96, config.hidden_size, bias=False)
        elif variant == "missing-key" and not other:
            norm.bias = nn.Parameter(torch.zeros(config.hidden_size))
        elif variant == "dtype" and other:
            norm.weight = nn.Parameter(norm.weight.detach().to(torch.bfloat16))
        elif variant == "persistence":
            norm.register_buffer("scale", torch.full((8,), 2.0), persistent=not other)
        elif variant == "extra-buffer" and other:
            extra = 1.0 / (1e5 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
            self.model.rotary_emb.register_buffer("extra_inv_freq", extra, persistent=False)
        elif variant == "bucket-swap":
            if other:
                mlp = self.model.layers[0].mlp
                gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
                del mlp.gate_proj, mlp.up_proj, mlp.down_proj
                mlp.up_proj, mlp.gate_proj, mlp.down_proj = up, gate, down
            table = torch.linspace(0, 1, 4 if other else 8, dtype=torch.bfloat16)
            self.model.rotary_emb.register_buffer("bf16_table", table, persistent=False)

    def tie_weights(self) -> None:
        """As transformers models do (accelerate calls it after loading)."""
        if self.config.variant == "tied":
            self.lm_head.weight = self.model.embed_tokens.weight
