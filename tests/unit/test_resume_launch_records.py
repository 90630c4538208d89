"""Resume and launch provenance (issue 21): what a rank records about the checkpoint it resumed
from and how it was started, and the pure ``checkpoint`` and ``launch`` checks over synthetic
records, each failing case with its clean twin."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from synthetic import state_record, tensor

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.distributed.environment import launch_argv, launch_env, launch_record
from fsdpcheck.model.resume import checkpoint_record, resume_problem, step_of
from fsdpcheck.records import CheckpointRecord, LaunchRecord, RankRecord, from_dict, to_dict
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import Verdict

# ---------------------------------------------------------------- what a rank records


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-100", 100),
        ("step_100", 100),
        ("global_step100", 100),
        ("checkpoint-100", 100),
        ("iter_0000100", 100),
        ("epoch=1-step=250", 250),
        ("step100", 100),
        ("final", None),
        ("run-7b", None),
    ],
)
def test_the_step_a_checkpoint_directory_names(name: str, step: int | None) -> None:
    assert step_of(name) == step


def _save(path: Path, value: float) -> Path:
    """A real DCP checkpoint of a two-tensor state dict, saved by this process alone."""
    state = {"w": torch.full((4, 2), value), "b": torch.zeros(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    _save(root / "step-100", 1.0)
    _save(root / "step-200", 2.0)
    (root / "LATEST").write_text("step-200\n")
    (root / "by-number").mkdir()
    (root / "by-number" / "latest").write_text("100")
    os.symlink(root / "step-100", root / "by-number" / "global_step100")
    return root


def test_a_dcp_directory_is_recorded_by_path_step_metadata_and_shards(saved: Path) -> None:
    before = sorted(p.name for p in (saved / "step-100").iterdir())
    record = checkpoint_record(saved / "step-100")
    assert record.path == os.path.realpath(saved / "step-100")
    assert (record.step, record.shard_files, record.saved_ranks, record.problem) == (
        100,
        1,
        1,
        None,
    )
    assert record.metadata is not None and len(record.metadata) == 32
    assert sorted(p.name for p in (saved / "step-100").iterdir()) == before  # nothing written
    assert resume_problem(record, rank=0) == ""
    # Another save has another .metadata (DCP writes a save id into it), the same one the same.
    assert checkpoint_record(saved / "step-200").metadata != record.metadata
    assert checkpoint_record(str(saved / "step-100")).metadata == record.metadata


def test_a_latest_file_resolves_to_the_directory_it_names(saved: Path) -> None:
    latest = checkpoint_record(saved)
    assert latest.given == str(saved)
    assert (latest.path, latest.step) == (os.path.realpath(saved / "step-200"), 200)
    # A step number in `latest`: the subdirectory whose name says that step (a symlink here).
    numbered = checkpoint_record(saved / "by-number")
    assert (numbered.path, numbered.step) == (os.path.realpath(saved / "step-100"), 100)


def test_a_missing_or_unreadable_checkpoint_is_recorded_not_raised(tmp_path: Path) -> None:
    missing = checkpoint_record(tmp_path / "nope")
    assert missing.path is None and "does not exist on this rank" in missing.problem
    (tmp_path / "file").write_text("x")
    single = checkpoint_record(tmp_path / "file")  # a single-file checkpoint: read, not refused
    assert (single.problem, single.index) == (None, "file bytes")
    assert "not a torch.distributed.checkpoint directory" in resume_problem(single, rank=0)
    assert "rank 1 cannot read it" in resume_problem(missing, rank=1)
    empty = checkpoint_record(tmp_path)
    assert empty.problem is None and empty.metadata is None
    assert "not a torch.distributed.checkpoint directory" in resume_problem(empty, rank=0)


def test_argv_is_recorded_with_secrets_redacted_and_per_rank_values_masked() -> None:
    argv = [
        "/opt/venv-node-3/bin/train.py",
        "--hf-token",
        "hf_abcdefghijklmnopqrstu",
        "--api_key=s3cr3t",
        "--lr",
        "3e-4",
        "--local-rank=3",
        "sk-abcdefghijklmnopqrstuvwx",
    ]
    assert launch_argv(argv) == [
        "train.py",
        "--hf-token",
        "<redacted>",
        "--api_key=<redacted>",
        "--lr",
        "3e-4",
        "--local-rank=<per-rank>",
        "<redacted>",
    ]


def test_only_allowlisted_variables_are_recorded() -> None:
    environ = {
        "NCCL_ALGO": "Ring",
        "NCCL_SOCKET_IFNAME": "eth0",  # per host by design
        "NCCL_DEBUG": "INFO",  # logging only
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "OMP_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "4,5",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_HUB_TOKEN": "hf_abcdefghijklmnopqrstu",
        "HF_TOKEN": "hf_abcdefghijklmnopqrstu",
        "AWS_SECRET_ACCESS_KEY": "x",
        "PATH": "/usr/bin",
        "RANK": "3",
    }
    assert launch_env(environ) == {
        "ACCELERATE_HUB_TOKEN": "<redacted>",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "CUDA_VISIBLE_DEVICES": "2",
        "NCCL_ALGO": "Ring",
        "OMP_NUM_THREADS": "4",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
    }
    record = launch_record(["x.py"], environ)
    assert "hf_" not in repr(to_dict(record)) and "/usr/bin" not in repr(to_dict(record))


def test_both_records_round_trip_through_json() -> None:
    record = replace(
        state_record(0, pre=([], [tensor("w", (2,))])),
        checkpoint=CheckpointRecord("ckpt", "/c/step-5", 5, "ab" * 16, 2, 2),
        launch=LaunchRecord(("t.py", "--x"), {"NCCL_ALGO": "Tree"}),
    )
    assert from_dict(RankRecord, to_dict(record)) == record


# ---------------------------------------------------------------- the checks

CKPT = CheckpointRecord("/ckpt/step-100", "/ckpt/step-100", 100, "aa" * 16, 2, 2)
ARGV = ("train.py", "--model", "llama", "--lr", "3e-4")


def _rank(rank: int, **fields) -> RankRecord:
    base = replace(
        state_record(rank, pre=([], [tensor("w", (4,))])),
        checkpoint=CKPT,
        launch=LaunchRecord(ARGV, {"NCCL_ALGO": "Ring"}),
    )
    return replace(base, **fields)


def _report(records: dict[int, RankRecord]):
    return assemble(AuditOutcome(gathered_from(records)), None)


def _only(report, kind: str):
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, [f.summary for f in report.findings]
    return found[0]


def test_ranks_resumed_from_one_checkpoint_are_consistent() -> None:
    # The clean twin: rank 1 named the same directory through a LATEST root.
    twin = _rank(1, checkpoint=replace(CKPT, given="/ckpt"))
    report = _report({0: _rank(0), 1: twin})
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]
    assert report.checkpoint == CKPT and report.warnings == ()


def test_a_rank_that_resumed_another_step_is_named_with_what_differs() -> None:
    stale = replace(CKPT, given="/ckpt", path="/ckpt/step-50", step=50, metadata="bb" * 16)
    report = _report({0: _rank(0), 1: _rank(1), 2: _rank(2, checkpoint=stale)})
    finding = _only(report, "checkpoint")
    assert (finding.ranks, finding.reference_rank, finding.cause) == ((2,), 0, "launch")
    [group] = finding.details["groups"]
    assert [d["field"] for d in group["differences"]] == ["path", "step", "metadata"]
    assert (
        "rank 2 resumed from /ckpt/step-50 (step 50, .metadata bbbbbbbbbbbb) but rank 0 from "
        "/ckpt/step-100 (step 100, .metadata aaaaaaaaaaaa) (they differ in path, step, metadata)"
    ) in finding.summary
    assert "diverge silently" in finding.summary
    assert report.verdict == Verdict.INCONSISTENT


def test_a_save_that_differs_only_in_its_metadata_is_another_save() -> None:
    other = replace(CKPT, metadata="cc" * 16)
    finding = _only(_report({0: _rank(0), 1: _rank(1, checkpoint=other)}), "checkpoint")
    assert finding.ranks == (1,) and "(they differ in metadata)" in finding.summary


def test_a_rank_that_cannot_read_its_checkpoint_is_a_finding() -> None:
    missing = CheckpointRecord("/ckpt/step-100", problem="/ckpt/step-100 does not exist")
    finding = _only(_report({0: _rank(0), 1: _rank(1, checkpoint=missing)}), "checkpoint")
    assert finding.ranks == (1,) and finding.details["unreadable"] == [1]
    assert "rank 1 cannot read its checkpoint (/ckpt/step-100 does not exist)" in finding.summary
    # Missing on every rank alike: still a finding (the script did not resume from it).
    both = _report({0: _rank(0, checkpoint=missing), 1: _rank(1, checkpoint=missing)})
    assert _only(both, "checkpoint").ranks == (0, 1)


def test_a_checkpoint_saved_by_another_world_size_is_a_warning_not_a_finding() -> None:
    resharded = replace(CKPT, shard_files=4, saved_ranks=4)
    report = _report({0: _rank(0, checkpoint=resharded), 1: _rank(1, checkpoint=resharded)})
    assert report.verdict == Verdict.CONSISTENT
    assert report.warnings == (
        "the resume checkpoint was saved by 4 ranks, this job has 2: DCP reshards on load "
        "(expected for an elastic resume; otherwise check that this is the checkpoint you "
        "meant)",
    )


def test_ranks_started_alike_are_consistent_and_an_extra_flag_is_named() -> None:
    assert _report({0: _rank(0), 1: _rank(1)}).verdict == Verdict.CONSISTENT
    extra = LaunchRecord((*ARGV[:3], "--enforce-eager", *ARGV[3:]), {"NCCL_ALGO": "Ring"})
    finding = _only(_report({0: _rank(0), 1: _rank(1, launch=extra)}), "launch")
    assert finding.ranks == (1,)
    [group] = finding.details["groups"]
    # One difference at the flag's own position, not a shift of every argument after it.
    assert group["argv"] == [{"position": 3, "reference": [], "other": ["--enforce-eager"]}]
    assert "[3] --enforce-eager (rank 0: nothing)" in finding.summary


def test_a_launch_variable_set_on_one_rank_only_is_named_by_key() -> None:
    skewed = LaunchRecord(ARGV, {"NCCL_ALGO": "Tree", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    finding = _only(_report({0: _rank(0), 1: _rank(1, launch=skewed)}), "launch")
    [group] = finding.details["groups"]
    assert [d["key"] for d in group["env"]] == ["NCCL_ALGO", "TORCH_NCCL_BLOCKING_WAIT"]
    assert group["env"][1] == {
        "key": "TORCH_NCCL_BLOCKING_WAIT",
        "reference": "<unset>",
        "other": "1",
    }
    assert "environment NCCL_ALGO, TORCH_NCCL_BLOCKING_WAIT" in finding.summary


def test_records_without_launch_or_checkpoint_are_not_compared_by_these_checks() -> None:
    plain = {r: replace(_rank(r), launch=None, checkpoint=None) for r in (0, 1)}
    assert _report(plain).verdict == Verdict.CONSISTENT


# ---------------------------------------------------------------- the load of --resume, one process


def _linear_checkpoint(path: Path, *, nested: bool) -> torch.nn.Module:
    torch.manual_seed(3)
    source = torch.nn.Linear(4, 3)
    state = source.state_dict()
    dcp.save({"model": state} if nested else state, checkpoint_id=str(path), no_dist=True)
    return source


@pytest.mark.parametrize("nested", [True, False], ids=["under-model", "top-level"])
def test_resume_loads_a_meta_model_from_dcp_and_reads_rank0s_full_copy(
    tmp_path: Path, nested: bool
) -> None:
    from fsdpcheck.loader.resume import full_state_from, load_checkpoint

    source = _linear_checkpoint(tmp_path / "step-7", nested=nested)
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    record = checkpoint_record(tmp_path / "step-7")
    assert load_checkpoint(model, record, rank=0) == 2
    assert torch.equal(model.weight, source.weight) and torch.equal(model.bias, source.bias)
    full = full_state_from(model, record)
    assert sorted(full) == ["bias", "weight"] and torch.equal(full["weight"], source.weight)


def test_resume_from_another_models_checkpoint_is_bad_input_naming_the_rank(
    tmp_path: Path,
) -> None:
    from fsdpcheck.errors import InputError
    from fsdpcheck.loader.resume import load_checkpoint

    _linear_checkpoint(tmp_path / "step-7", nested=True)
    other = torch.nn.Linear(5, 5)
    with pytest.raises(InputError, match="could not load this model's state dict .* on rank 1"):
        load_checkpoint(other, checkpoint_record(tmp_path / "step-7"), rank=1)
    with pytest.raises(InputError, match="rank 1 cannot read it"):
        load_checkpoint(other, checkpoint_record(tmp_path / "nope"), rank=1)


def test_a_failed_resume_is_named_as_the_resume() -> None:
    from fsdpcheck.checks.loaded import load_errors
    from fsdpcheck.records import LoadOutcome
    from fsdpcheck.vocab import LoadMethod, LoadStatus

    [error] = load_errors(LoadOutcome(True, LoadStatus.FAILED, "boom", method=LoadMethod.RESUME))
    assert error.message == "the resume (dcp.load) failed: boom"


def test_an_hf_trainer_checkpoint_is_recorded_by_its_trainer_state(tmp_path: Path) -> None:
    """An HF Trainer checkpoint-N is no DCP directory: its trainer_state.json (plain JSON, the
    bytes each save writes once) identifies the save, and says the step its name does not."""
    named = tmp_path / "checkpoint-7"
    named.mkdir()
    (named / "trainer_state.json").write_text(json.dumps({"global_step": 7, "log_history": []}))
    (named / "model.safetensors").write_bytes(b"\0" * 64)
    before = sorted(p.name for p in named.iterdir())
    record = checkpoint_record(named)
    assert (record.step, record.index, record.problem) == (7, "trainer_state.json", None)
    assert record.metadata is not None and record.shard_files == 0
    assert sorted(p.name for p in named.iterdir()) == before  # nothing written
    assert "not a torch.distributed.checkpoint directory" in resume_problem(record, rank=0)
    unnamed = tmp_path / "resume-here"
    unnamed.mkdir()
    (unnamed / "trainer_state.json").write_text(json.dumps({"global_step": 9}))
    other = checkpoint_record(unnamed)
    assert other.step == 9 and other.metadata != record.metadata
    (unnamed / "trainer_state.json").write_text("[not a TrainerState")
    assert checkpoint_record(unnamed).step is None  # unreadable JSON: no step, no crash


def test_a_torch_save_file_is_recorded_by_its_zip_directory(tmp_path: Path) -> None:
    """A Lightning .ckpt (torch.save: a zip) is digested from its entries' names, CRC-32s and
    sizes, read from the zip's directory: equal contents equal, a changed tensor not."""
    first = tmp_path / "epoch=0-step=3.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(4)}}, first)
    copy = tmp_path / "copy" / first.name
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    other = tmp_path / "epoch=0-step=4.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}}, other)
    record = checkpoint_record(first)
    assert (record.step, record.index, record.problem) == (3, "zip directory", None)
    assert checkpoint_record(copy).metadata == record.metadata
    assert checkpoint_record(other).metadata != record.metadata


def test_a_resume_a_rank_cannot_read_is_bad_input_on_that_rank_not_a_runtime_failure() -> None:
    """dcp.load raises a rank's own read failure on every rank alike; the load names that rank
    with a ``- rank N:`` line and says it is the checkpoint's fault (exit 2), where a load that
    failed at run time stays exit 3."""
    from fsdpcheck.checks.loaded import load_errors
    from fsdpcheck.records import Gathered, LoadOutcome
    from fsdpcheck.vocab import ErrorKind, LoadMethod

    message = "--resume /ckpt: dcp.load could not load ... on rank 1:\n  - rank 1: RuntimeError: x"
    bad = LoadOutcome(True, "failed", message, method=LoadMethod.RESUME, error_kind=ErrorKind.INPUT)
    [error] = load_errors(bad)
    assert (error.rank, error.stage, error.kind) == (1, "load", "input")
    gathered = Gathered({0: "d", 1: "d"}, {0: "h", 1: "h"}, {0: state_record(0)}, 81)
    assert assemble(AuditOutcome(gathered, load=bad), None).exit_code == 2
    failed = replace(bad, error_kind=None)
    assert assemble(AuditOutcome(gathered, load=failed), None).exit_code == 3


def test_a_hook_forwards_only_a_checkpoint_a_rank_can_find_on_its_filesystem() -> None:
    from fsdpcheck.integrations.common import local_checkpoint

    assert local_checkpoint("/ckpt/step-1") == "/ckpt/step-1"
    assert local_checkpoint(Path("/ckpt")) == Path("/ckpt")
    for marker in (None, True, False, "", "s3://bucket/ckpt"):
        assert local_checkpoint(marker) is None
