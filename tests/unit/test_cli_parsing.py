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


def test_reproduce_with_nothing_to_load_is_bad_usage() -> None:
    result = runner.invoke(app, ["audit", "--init", "meta", "--reproduce"])
    assert result.exit_code == 2
    assert "--init meta" in _said(result) and "no loader has anything to load" in _said(result)


def test_a_builder_with_a_model_or_a_child_job_is_bad_usage() -> None:
    both = runner.invoke(app, ["audit", "--builder", "x.py:build", "--model", "tiny-llama"])
    assert both.exit_code == 2 and "drop --model" in _said(both)
    for extra in (["--reproduce"], ["--probe", "2"]):
        result = runner.invoke(app, ["audit", "--builder", "x.py:build", *extra])
        assert result.exit_code == 2 and "cannot call a builder" in _said(result)


def test_resume_with_what_it_cannot_go_with_is_bad_usage() -> None:
    for extra, why in (
        (["--reproduce"], "a resumed audit has none (every rank loads its own shards)"),
        (["--init", "all"], "a resume builds every rank on meta"),
    ):
        result = runner.invoke(app, ["audit", "--resume", "/ckpt/step-100", *extra])
        assert result.exit_code == 2, result.output
        assert why in _said(result)


def test_a_malformed_mesh_is_bad_usage() -> None:
    result = runner.invoke(app, ["audit", "--mesh", "two,four"])
    assert result.exit_code == 2
    assert "REPLICATE,SHARD" in result.output


def test_a_mesh_fsdpcheck_cannot_build_is_bad_usage_that_says_why() -> None:
    for mesh, why in (("2,2,2", "3 sizes"), ("-1,-2", "positive number of ranks, not -1, -2")):
        result = runner.invoke(app, ["audit", "--model", "hazard", "--mesh", mesh])
        assert result.exit_code == 2, result.output
        assert why in " ".join(result.output.replace("│", " ").split()), result.output


def test_an_unknown_choice_is_bad_usage() -> None:
    for args in (["audit", "--init", "sometimes"], ["audit", "--backend", "mpi"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, args
