"""The command layer in-process (Typer's CliRunner): help, parsing and bad usage, no ranks."""

from __future__ import annotations

from typer.testing import CliRunner

from fsdpcheck.cli import app

runner = CliRunner()


def _said(result) -> str:
    """The output as one line of words, without rich's box around an error."""
    return " ".join(result.output.replace("│", " ").split())


def test_audit_help_shows_examples_and_exit_codes() -> None:
    result = runner.invoke(app, ["audit", "--help"])
    assert result.exit_code == 0
    assert "torchrun --nproc-per-node 2 -m fsdpcheck audit" in result.output
    assert "Exit codes" in result.output
    assert "--vary-hash-seed" in result.output


def test_every_command_has_help_with_examples() -> None:
    for command in ("probe", "scan"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Examples" in result.output and "Exit codes" in result.output


def test_presets_lists_the_built_in_models() -> None:
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0
    for name in ("tiny-gemma4", "tiny-gemma3", "tiny-llama", "tiny-qwen3", "hazard"):
        assert name in result.output


# The combinations the audit refuses: tests/unit/test_audit_options.py (CLI and library alike).


def test_a_loader_of_an_unknown_name_is_bad_usage() -> None:
    unknown = runner.invoke(app, ["audit", "--reproduce", "--loader", "megatron"])
    assert unknown.exit_code == 2 and "'megatron' is not one of" in _said(unknown)
    assert "'dcp-broadcast'" in _said(unknown)  # the names to choose from


def test_a_malformed_mesh_is_bad_usage() -> None:
    result = runner.invoke(app, ["audit", "--mesh", "two,four"])
    assert result.exit_code == 2
    assert "REPLICATE,SHARD" in result.output


def test_an_unknown_choice_is_bad_usage() -> None:
    for args in (["audit", "--init", "sometimes"], ["audit", "--backend", "mpi"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, args


def test_a_named_mesh_is_parsed_in_torchtitans_dim_order() -> None:
    from fsdpcheck.options import MeshSpec, parse_mesh, resolve_mesh

    assert parse_mesh("tp=2,dp_replicate=2,dp_shard=2") == MeshSpec(
        (2, 2, 2), ("dp_replicate", "dp_shard", "tp")
    )
    assert parse_mesh("2,4") == MeshSpec((2, 4))  # the positional form stays HSDP
    # --tp N alone: the data dim takes the rest of the world.
    assert resolve_mesh(None, None, tp=2, world=8) == MeshSpec((4, 2), ("dp_shard", "tp"))
    assert resolve_mesh(None, None, ep=2, tp=2, world=8) == MeshSpec(
        (2, 2, 2), ("dp_shard", "ep", "tp")
    )
    named = resolve_mesh((2, 2), ("dp_shard", "tp"), tp=2, world=4)
    assert named == MeshSpec((2, 2), ("dp_shard", "tp"))
    assert resolve_mesh(None, None, world=4) is None


def test_a_named_mesh_that_does_not_parse_is_bad_usage_that_says_why() -> None:
    for args, why in (
        (["--mesh", "dp_shard=2,pp=2"], "no dim 'pp'"),
        (["--mesh", "dp_shard=2,dp_shard=2"], "dp_shard is given twice"),
        (["--mesh", "dp_shard=2,tp"], "'tp' is not NAME=SIZE"),
    ):
        result = runner.invoke(app, ["audit", "--model", "tiny-llama", *args])
        assert result.exit_code == 2, (args, result.output)
        assert why in _said(result), (args, _said(result))


def test_tp_that_does_not_divide_the_world_is_refused_before_any_rendezvous() -> None:
    import pytest

    from fsdpcheck.options import resolve_mesh

    with pytest.raises(ValueError, match="--tp 3: 3 ranks per data-parallel group do not divide"):
        resolve_mesh(None, None, tp=3, world=4)
    with pytest.raises(ValueError, match="covers 4 ranks but WORLD_SIZE is 8"):
        resolve_mesh((2, 2), ("dp_shard", "tp"), world=8)


def _meta(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_models_own_tp_plan_maps_to_torch_styles_and_a_plan_that_cannot_is_refused() -> None:
    import pytest
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fsdpcheck.errors import InputError
    from fsdpcheck.model.parallel import ep_problem, tp_plan
    from fsdpcheck.model.presets import PRESETS

    model = _meta(PRESETS["tiny-llama"].make_config())
    plan = tp_plan(model, 2)
    assert len(plan) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert isinstance(plan["model.layers.1.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel)
    with pytest.raises(InputError, match="num_attention_heads is 4, which 3 tensor-parallel"):
        tp_plan(model, 3)
    assert "has no expert-parallel plan" in ep_problem(model, 2)

    from transformers import MixtralConfig

    mixtral = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=2,
    )
    moe = _meta(mixtral)
    from fsdpcheck.model.parallel import _REPLICATED, _styles

    # By what this transformers plans, not by its version: up to 5.24 Mixtral's TP plan shards
    # its experts in transformers' own MoE styles (refused, not approximated); 5.25 plans only
    # the attention in torch's styles and leaves the experts to its EP plan (issue 37).
    styles = set(mixtral.base_model_tp_plan.values())
    own = sorted(styles - set(_styles()) - set(_REPLICATED))
    if own:
        with pytest.raises(InputError, match=", ".join(map(repr, own))):
            tp_plan(moe, 2)
    else:
        planned = tp_plan(moe, 2)
        assert set(planned) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"}
    assert ep_problem(moe, 2) == ""  # transformers' own EP styles: applied by --ep
    assert "cannot split evenly" in ep_problem(moe, 4)  # 2 experts
