"""The audit's CI outputs on two real ranks: an unwritable output path is bad input on every
rank, and JUnit and annotations come from rank 0 only."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_ranks

from fsdpcheck.formats.junit import failures


@pytest.fixture()
def not_a_folder(tmp_path: Path) -> Path:
    """A regular file: any output path below it cannot be written (root included)."""
    path = tmp_path / "plain-file"
    path.write_text("x")
    return path


def test_two_ranks_unwritable_json_exit_2_on_every_rank(tmp_path: Path, not_a_folder) -> None:
    junit = tmp_path / "junit.xml"
    bad = not_a_folder / "report.json"
    result = run_ranks(
        ["audit", "--model", "hazard", "--json", str(bad), "--junit", str(junit)], timeout=150
    )
    assert result.codes == [2, 2], result.output(0) + result.output(1)
    rank0 = result.output(0)
    assert "rank 0 failed at launch" in rank0 and str(bad) in rank0
    assert "is a file, not a folder" in rank0 and "Pass paths in a folder" in rank0
    assert "Traceback" not in rank0 + result.output(1)
    assert result.output(1).strip() == ""  # one paragraph, from rank 0 only
    # The writable output still tells CI what happened.
    ((classname, name, message),) = failures(junit.read_text())
    assert (classname, name) == ("fsdpcheck.audit.ranks", "rank 0") and str(bad) in message


def test_two_ranks_junit_and_annotations_from_rank_0_only(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    args = ["audit", "--model", "hazard", "--no-load", "--junit", str(junit)]
    divergent = run_ranks(args, seeds=[0, 1], env={"GITHUB_ACTIONS": "true"}, timeout=150)
    assert divergent.codes == [1, 1], divergent.output(0) + divergent.output(1)
    assert "::error title=fsdpcheck audit%3A buffer-order::" in divergent.ranks[0].stdout
    assert "::" not in divergent.output(1)
    names = {(c, n) for c, n, _ in failures(junit.read_text())}
    assert ("fsdpcheck.audit.checks", "buffer-order") in names
    assert ("fsdpcheck.audit.loaders", "named-buffers-order") in names

    twin = run_ranks(args, seeds=[0, 0], env={"GITHUB_ACTIONS": "true"}, timeout=150)
    assert twin.codes == [0, 0], twin.output(0)
    assert "::error" not in twin.ranks[0].stdout
    assert failures(junit.read_text()) == []
