"""Built-in models: tiny configs of real transformers architectures, and the ``hazard`` fixture.

Configs are built lazily so that listing presets never imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdpcheck.errors import InputError

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_MIXED_LAYERS = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Preset:
    name: str
    architecture: str
    description: str
    make_config: Callable[[], Any]


def _transformers_config(class_name: str, preset: str, **kwargs: Any) -> Any:
    import transformers  # not for listing presets (the module docstring)

    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        raise InputError(
            f"preset {preset!r} needs transformers.{class_name}, which transformers "
            f"{transformers.__version__} does not have. Upgrade transformers or pick another "
            "preset (`fsdpcheck presets`)."
        )
    return config_class(**kwargs)


def _gemma4() -> Any:
    return _transformers_config(
        "Gemma4TextConfig",
        "tiny-gemma4",
        **_TINY,
        head_dim=16,
        global_head_dim=32,
        layer_types=_MIXED_LAYERS,
        sliding_window=16,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
    )


def _gemma3() -> Any:
    return _transformers_config(
        "Gemma3TextConfig",
        "tiny-gemma3",
        **_TINY,
        head_dim=16,
        layer_types=_MIXED_LAYERS,
        sliding_window=16,
    )


def _llama() -> Any:
    return _transformers_config("LlamaConfig", "tiny-llama", **_TINY)


def _qwen3() -> Any:
    return _transformers_config("Qwen3Config", "tiny-qwen3", **_TINY, head_dim=16)


def _qwen3_moe() -> Any:
    # Every layer sparse: 4 experts, top-2, with transformers' own expert-parallel plan.
    return _transformers_config(
        "Qwen3MoeConfig",
        "tiny-qwen3-moe",
        **_TINY,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )


def _hazard() -> Any:
    from fsdpcheck.model.hazard import HazardConfig  # torch: not for listing presets

    return HazardConfig()


def _hazard_equal() -> Any:
    from fsdpcheck.model.hazard import HazardConfig  # torch: not for listing presets

    return HazardConfig.equal_sizes()


def _fixture(variant: str) -> Callable[[], Any]:
    def make() -> Any:
        from fsdpcheck.model.fixtures import FixtureConfig  # torch: not for listing presets

        return FixtureConfig.of(variant)

    return make


# fsdpcheck.model.fixtures builds these; listed here so that listing presets needs no torch.
FIXTURE_VARIANTS: dict[str, str] = {
    "param-shape": "ranks other than 0 build layer 0's MLP 96 wide instead of 64",
    "tied": "lm_head shares embed_tokens' weight; ranks other than 0 register lm_head first, "
    "so the tied pair comes first in their state dict",
    "missing-key": "rank 0's final norm has a bias parameter, the other ranks' has none",
    "dtype": "ranks other than 0 build the final norm's weight in bfloat16 (same shape)",
    "persistence": "buffer model.norm.scale is persistent on rank 0, non-persistent elsewhere",
    "extra-buffer": "ranks other than 0 register one more non-persistent buffer",
    "bucket-swap": "ranks other than 0 register layer 0's equal-sized gate and up projections "
    "in swapped order, and a bfloat16 buffer of 4 elements where rank 0 has 8",
    "buffer-values": "ranks other than 0 compute RoPE with another base: same names and shapes, "
    "other values",
}


def _fixtures() -> tuple[Preset, ...]:
    return tuple(
        Preset(f"fixture-{variant}", "FixtureForCausalLM", f"fixture: {why}", _fixture(variant))
        for variant, why in FIXTURE_VARIANTS.items()
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "hazard",
            "HazardForCausalLM",
            "fsdpcheck's fixture: RoPE buffers registered from a set, sizes 16 vs 8 "
            "(order follows PYTHONHASHSEED; a mismatch hangs the loader)",
            _hazard,
        ),
        Preset(
            "hazard-equal",
            "HazardForCausalLM",
            "the fixture with equal RoPE sizes and different bases (a mismatch corrupts silently)",
            _hazard_equal,
        ),
        Preset(
            "tiny-gemma4",
            "Gemma4ForCausalLM",
            "Gemma4 text, sliding + global layers, RoPE 8 vs 16 elements",
            _gemma4,
        ),
        Preset(
            "tiny-gemma3",
            "Gemma3ForCausalLM",
            "Gemma3 text, sliding + global layers, same RoPE sizes, bases 1e4 vs 1e6",
            _gemma3,
        ),
        Preset("tiny-llama", "LlamaForCausalLM", "Llama, 2 layers", _llama),
        Preset("tiny-qwen3", "Qwen3ForCausalLM", "Qwen3, 2 layers", _qwen3),
        Preset(
            "tiny-qwen3-moe",
            "Qwen3MoeForCausalLM",
            "Qwen3 MoE, 2 layers of 4 experts (top-2), with an expert-parallel plan (--ep)",
            _qwen3_moe,
        ),
        *_fixtures(),  # one per-rank difference each (docs/loaders.md)
    )
}
