"""``fsdpcheck fingerprint`` as a user runs it: in-process (wrapping on a private one-rank
group), recording its own failure, and as two launched ranks with no process group."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli, run_ranks
from typer.testing import CliRunner

from fsdpcheck.cli import app
from fsdpcheck.offline.diff import diff_fingerprints


def test_fingerprint_command_in_process_then_diff_of_the_clean_twin(tmp_path: Path) -> None:
    """Two records of one interpreter (one hash seed) agree, wrapped on a private group each
    time; rank 1 is built on meta, as --init rank0 asks."""
    runner = CliRunner()
    for rank in (0, 1):
        out = str(tmp_path / "fp" / "rank{rank}.json")
        result = runner.invoke(
            app, ["fingerprint", "--model", "hazard", "--rank", str(rank), "--out", out]
        )
        assert result.exit_code == 0, result.output
        assert f"rank {rank} (pre-wrap 2 buffers, 11 params; post-wrap" in result.output
    import torch.distributed as dist

    assert not dist.is_initialized()  # the private group is gone again
    record = json.loads((tmp_path / "fp" / "rank1.json").read_text())["record"]
    assert {b["device"] for b in record["pre_wrap"]["buffers"]} == {"meta"}
    assert all(p["placements"] == ["S(0)"] for p in record["post_wrap"]["params"])
    result = runner.invoke(app, ["diff", str(tmp_path / "fp")])
    assert result.exit_code == 0, result.output
    assert "verdict: consistent" in result.output


def test_fingerprint_command_records_its_own_failure(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    result = CliRunner().invoke(app, ["fingerprint", "--model", "tiny-nonesuch", "--out", str(out)])
    assert result.exit_code == 2
    assert "tiny-nonesuch" in result.output and "recorded in" in result.output
    error = json.loads(out.read_text())["record"]["error"]
    assert error["stage"] == "resolve" and error["kind"] == "input"


def test_fingerprint_under_a_launcher_needs_no_process_group(tmp_path: Path) -> None:
    """Two ranks (RANK/WORLD_SIZE set, no rendezvous) with hash seeds 0 and 1 each write their
    own file; diff shows the real divergence."""
    out = tmp_path / "fp" / "rank{rank}.json"
    run = run_ranks(["fingerprint", "--model", "hazard", "--out", str(out)], seeds=[0, 1])
    assert run.codes == [0, 0], run.output(0) + run.output(1)
    report = diff_fingerprints([tmp_path / "fp"])
    assert report.verdict == "inconsistent"
    finding = report.findings[0]
    assert (finding.kind, finding.ranks, finding.snapshot) == ("buffer-order", (1,), "pre-wrap")
    assert [env.hash_seed for env in report.environment] == ["0", "1"]


def test_inside_a_job_the_fingerprint_leaves_the_jobs_group_alone() -> None:
    """With a default group already there, no private group is made: pre-wrap only, a note."""
    from datetime import timedelta

    import torch.distributed as dist

    from fsdpcheck.offline.standalone import StandaloneOptions, fingerprint_standalone

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        group = dist.group.WORLD
        content = fingerprint_standalone(StandaloneOptions(model="hazard"))
        assert dist.is_initialized() and dist.group.WORLD is group
    finally:
        dist.destroy_process_group()
    assert content.record.pre_wrap is not None and content.record.post_wrap is None
    assert content.record.error is None and content.wrap is None
    assert any("already belongs to a process group" in note for note in content.notes)


def _fingerprint(tmp_path: Path, seed: int, rank: int) -> Path:
    out = tmp_path / f"seed{seed}-rank{rank}.json"
    args = ["fingerprint", "--model", "hazard", "--init", "all", "--seed", str(seed)]
    done = run_cli([*args, "--rank", str(rank), "--out", str(out)], env={"PYTHONHASHSEED": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_diff_of_two_seeds_compares_values_as_the_audit_does(tmp_path: Path) -> None:
    """Two `fingerprint --init all` processes with different --seed: every rank built its own
    random weights, so the parameters differ (a `value` finding); the same seed is consistent."""
    first, other = _fingerprint(tmp_path, 1, 0), _fingerprint(tmp_path, 2, 1)
    record = json.loads(first.read_text())["record"]
    assert all(p["digest"] for p in record["pre_wrap"]["params"])  # --init all: values recorded
    done = run_cli(["diff", str(first), str(other), "--json", str(tmp_path / "diff.json")])
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "diff.json").read_text())
    assert [(f["kind"], f["ranks"], f["snapshot"]) for f in report["findings"]] == [
        ("value", [1], "pre-wrap")
    ]
    same = run_cli(["diff", str(first), str(_fingerprint(tmp_path, 1, 1))])
    assert same.returncode == 0 and "verdict: consistent" in same.stdout, same.stdout
