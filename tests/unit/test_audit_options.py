"""``AuditOptions`` holds the audit's option rules: every combination ``fsdpcheck audit`` refuses,
``run_audit(AuditOptions(...))`` refuses too, with the same paragraph; their twins pass both."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from fsdpcheck.cli import app
from fsdpcheck.errors import InputError, OptionError
from fsdpcheck.options import DEFAULT_MODEL, AuditOptions
from fsdpcheck.vocab import ExitCode, Init, Loader

runner = CliRunner()
NAMED_TP = {"mesh": (2, 2), "mesh_dims": ("dp_shard", "tp")}

# (the CLI's arguments, the same as AuditOptions fields, the flag the CLI names) -- each refused.
REFUSED = [
    (["--timeout", "0.5"], {"timeout": 0.5}, "--timeout"),
    (["--probe", "-1"], {"probe": -1}, "--probe"),
    (["--tp", "0"], {"tp": 0}, "--tp"),
    (["--ep", "0"], {"ep": 0}, "--ep"),
    (
        ["--builder", "x.py:b", "--model", "tiny-llama"],
        {"builder": "x.py:b", "model": "tiny-llama"},
        "--builder",
    ),
    (["--builder", "x.py:b", "--reproduce"], {"builder": "x.py:b", "reproduce": True}, "--builder"),
    (["--mesh", "2,2,2"], {"mesh": (2, 2, 2)}, "--mesh"),
    (["--mesh", "-1,-2"], {"mesh": (-1, -2)}, "--mesh"),
    (
        ["--mesh", "dp_replicate=2,tp=2"],
        {"mesh": (2, 2), "mesh_dims": ("dp_replicate", "tp")},
        "--mesh",
    ),
    (["--mesh", "dp_shard=0,tp=2"], {"mesh": (0, 2), "mesh_dims": ("dp_shard", "tp")}, "--mesh"),
    (["--mesh", "dp_shard=2,pp=2"], {"mesh": (2, 2), "mesh_dims": ("dp_shard", "pp")}, "--mesh"),
    (["--mesh", "2,2", "--tp", "2"], {"mesh": (2, 2), "tp": 2}, "--mesh"),
    (
        ["--mesh", "dp_shard=2,tp=4", "--tp", "2"],
        {"mesh": (2, 4), "mesh_dims": ("dp_shard", "tp"), "tp": 2},
        "--mesh",
    ),
    (
        ["--mesh", "dp_shard=4", "--ep", "2"],
        {"mesh": (4,), "mesh_dims": ("dp_shard",), "ep": 2},
        "--mesh",
    ),
    (["--tp", "2", "--reproduce"], {"tp": 2, "reproduce": True}, "--reproduce"),
    (["--mesh", "dp_shard=2,tp=2", "--probe", "2"], {**NAMED_TP, "probe": 2}, "--probe"),
    (["--loader", "ddp-sync"], {"loaders": (Loader("ddp-sync"),)}, "--loader"),
    (["--resume", "/ckpt/s", "--reproduce"], {"resume": "/ckpt/s", "reproduce": True}, "--resume"),
    (["--resume", "/ckpt/s", "--init", "all"], {"resume": "/ckpt/s", "init": Init.ALL}, "--resume"),
    (["--init", "meta", "--reproduce"], {"init": Init.META, "reproduce": True}, "--reproduce"),
]

# Each refusal's clean twin: the nearest combination that runs.
ACCEPTED = [
    {"timeout": 1.0},
    {"probe": 0},
    {"tp": 1},
    {"builder": "x.py:b", "probe": 8},  # --probe works with --builder
    {"mesh": (2, 4)},
    NAMED_TP,
    {**NAMED_TP, "tp": 2},
    {"mesh": (2, 2), "mesh_dims": ("dp_shard", "ep"), "ep": 2},
    {"loaders": (Loader("ddp-sync"),), "reproduce": True},
    {"resume": "/ckpt/s", "init": Init.META},
    {"init": Init.ALL, "reproduce": True},
    {"probe": 8, "reproduce": True},
]


def _words(text: str) -> str:
    """Text as one line of words, without rich's box around an error."""
    return " ".join(text.replace("│", " ").split())


@pytest.mark.parametrize(("args", "fields", "flag"), REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_the_cli_and_audit_options_refuse_the_same_combinations_alike(args, fields, flag) -> None:
    with pytest.raises(OptionError) as refused:
        AuditOptions(**fields)
    assert isinstance(refused.value, InputError) and refused.value.exit_code == ExitCode.BAD_INPUT
    assert refused.value.option == flag
    result = runner.invoke(app, ["audit", *args])
    assert result.exit_code == 2, (args, result.output)
    said = _words(result.output)
    assert f"Invalid value for '{flag}': {_words(str(refused.value))}" in said, (args, said)
    assert flag in str(refused.value)  # the paragraph names the input it is about


@pytest.mark.parametrize("fields", ACCEPTED, ids=str)
def test_each_refusals_clean_twin_is_accepted(fields) -> None:
    options = AuditOptions(**fields)
    assert {k: getattr(options, k) for k in fields} == fields | (
        {"init": Init.META} if "resume" in fields else {}
    )


def test_audit_options_fill_in_what_the_cli_implied() -> None:
    assert AuditOptions().model == DEFAULT_MODEL  # neither model nor builder: the preset
    assert AuditOptions(builder="x.py:b").model is None  # the builder's own model
    assert AuditOptions(resume="/ckpt/s").init == Init.META  # a resume builds on meta
    # A copy is checked as it is made: replace() cannot slip a refused combination past.
    with pytest.raises(OptionError, match="cannot call a builder"):
        replace(AuditOptions(builder="x.py:b"), reproduce=True)
