"""``--ep``'s pure parts (fsdpcheck/model/parallel.py): the model's EP plan as concrete names,
the mesh layout each part of the model shards over, and the one-paragraph refusals. The
multi-rank behaviour is in tests/ranks/test_meshes.py."""

from __future__ import annotations

import pytest

from fsdpcheck.model.parallel import (
    FLAT_DIM,
    EpLayout,
    ep_layout,
    ep_plan,
    ep_problem,
    expand_plan,
    wildcard,
)
from fsdpcheck.model.presets import PRESETS


def _meta(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_layer_numbers_read_as_the_plans_wildcard_and_nothing_else() -> None:
    assert wildcard("model.layers.12.mlp.experts") == "model.layers.*.mlp.experts"
    assert wildcard("model.layers.0") == "model.layers.*"
    assert wildcard("experts.w1") == "experts.w1"  # a number in a name is not an index


def test_the_plan_expands_as_transformers_expands_it() -> None:
    model = _meta(PRESETS["tiny-qwen3-moe"].make_config())
    plan = ep_plan(model)
    # transformers' own expansion of the same plan: the same names, styles and order.
    assert list(plan.items()) == list(model._expand_parallel_plan(model.ep_plan).items())
    assert list(plan) == [
        f"model.layers.{i}.mlp.experts{p}"
        for i in range(2)
        for p in (".gate_up_proj", ".down_proj", "")
    ]
    assert plan["model.layers.1.mlp.experts"] == "ep_dispatch_experts"
    assert plan["model.layers.0.mlp.experts.down_proj"] == "grouped_gemm"


def test_a_parameter_without_its_own_rule_takes_its_modules_style() -> None:
    modules = [("", []), ("layers.0.experts", ["w", "bias"]), ("layers.0.gate", ["weight"])]
    plan = {"layers.*.experts": "ep_dispatch_experts", "layers.*.experts.w": "grouped_gemm"}
    assert expand_plan(plan, modules) == {
        "layers.0.experts.w": "grouped_gemm",
        "layers.0.experts.bias": "ep_dispatch_experts",
        "layers.0.experts": "ep_dispatch_experts",
    }


def test_ep_borrows_its_ranks_from_dp_shard_as_torchtitan_lays_it_out() -> None:
    assert ep_layout(("dp_shard", "tp")) is None
    assert ep_layout(("dp_shard", "ep")) == EpLayout(
        flatten=("dp_shard", "ep"), dense=(FLAT_DIM,), experts=("dp_shard",)
    )
    assert ep_layout(("dp_replicate", "dp_shard", "ep")) == EpLayout(
        flatten=("dp_shard", "ep"),
        dense=("dp_replicate", FLAT_DIM),
        experts=("dp_replicate", "dp_shard"),
    )


@pytest.mark.parametrize(
    ("preset", "ep", "tp", "words"),
    [
        ("tiny-qwen3-moe", 2, 1, ""),
        ("tiny-qwen3-moe", 4, 1, ""),
        ("tiny-qwen3-moe", 3, 1, "holds 4 experts, which 3 expert-parallel ranks cannot split"),
        ("tiny-qwen3-moe", 2, 2, "--ep 2 with --tp 2: fsdpcheck's own wrap applies expert"),
        ("tiny-llama", 2, 1, "LlamaConfig has no expert-parallel plan"),
    ],
)
def test_what_ep_cannot_apply_is_one_paragraph_naming_the_fix(
    preset: str, ep: int, tp: int, words: str
) -> None:
    said = ep_problem(_meta(PRESETS[preset].make_config()), ep, tp=tp)
    assert (words in said) if words else said == ""
    assert said.count("\n") == 0
    if said:
        assert "--builder" in said or "pick an --ep" in said


def test_a_transformers_without_expert_parallelism_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    model = _meta(PRESETS["tiny-qwen3-moe"].make_config())
    # As on transformers 4.5x, which has no transformers.distributed.expert_parallel.
    monkeypatch.setitem(sys.modules, "transformers.distributed.expert_parallel", None)
    said = ep_problem(model, 2)
    assert "has no expert parallelism (transformers.distributed.expert_parallel" in said
    assert "upgrade transformers, or pass a --builder" in said
