"""CI options in-process (Typer's CliRunner, no ranks): an output path that cannot be written is
bad input before any work; progress draws on a terminal only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fsdpcheck.cli import app
from fsdpcheck.console import CountProgress

RUNNER = CliRunner()


@pytest.fixture()
def not_a_folder(tmp_path: Path) -> Path:
    """A regular file: any output path below it cannot be written (root included)."""
    path = tmp_path / "plain-file"
    path.write_text("x")
    return path


# ---------------------------------------------------------------- in-process: bad input


@pytest.mark.parametrize(
    "args",
    [
        ["probe", "--model", "hazard", "--json", "{bad}/probe.json"],
        ["probe", "--model", "hazard", "--junit", "{bad}/probe.xml"],
        ["scan", "--filter", "llama", "--sarif", "{bad}/scan.sarif"],
        ["scan", "--filter", "llama", "--junit", "{bad}/a/b/scan.xml"],
    ],
)
def test_unwritable_output_is_bad_input_before_any_work(args: list[str], not_a_folder) -> None:
    args = [a.replace("{bad}", str(not_a_folder)) for a in args]
    result = RUNNER.invoke(app, args, env={"GITHUB_ACTIONS": ""})
    assert result.exit_code == 2, result.output
    assert str(not_a_folder) in result.output and "is a file, not a folder" in result.output
    assert "Nothing was run" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_output_path_that_is_a_folder(tmp_path: Path) -> None:
    result = RUNNER.invoke(app, ["probe", "--model", "hazard", "--junit", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in result.output


def test_unwritable_output_under_github_actions_is_an_annotation(not_a_folder: Path) -> None:
    path = f"{not_a_folder}/x.json"
    result = RUNNER.invoke(
        app, ["probe", "--model", "hazard", "--json", path], env={"GITHUB_ACTIONS": "true"}
    )
    assert result.exit_code == 2
    assert "::error title=fsdpcheck probe::--json " in result.output


def test_unknown_annotations_mode_is_bad_usage() -> None:
    result = RUNNER.invoke(app, ["probe", "--model", "hazard", "--annotations", "gitlab"])
    assert result.exit_code == 2 and "gitlab" in result.output


def test_ci_options_in_help() -> None:
    for command, options in {
        "audit": ["--junit", "--annotations"],
        "probe": ["--junit", "--annotations"],
        "scan": ["--junit", "--sarif", "--annotations"],
    }.items():
        result = RUNNER.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        for option in options:
            assert option in result.output, (command, option)


# ---------------------------------------------------------------- progress


def test_progress_draws_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with CountProgress("probe", console=console) as bar:
        bar.update(1, 2, "PYTHONHASHSEED=0")
        bar.update(2, 2, "PYTHONHASHSEED=1")
    drawn = out.getvalue()  # the last frame is drawn when the bar stops, then erased
    assert "probe" in drawn and "2/2" in drawn and "PYTHONHASHSEED=1" in drawn


def test_progress_is_silent_off_a_terminal() -> None:
    out = io.StringIO()
    with CountProgress("scan", console=Console(file=out, width=100)) as bar:
        bar.update(1, 4, "llama (seed 0)")
    assert out.getvalue() == ""


def test_ranks_checking_one_missing_folder_at_once_both_find_it_writable(tmp_path: Path) -> None:
    # Every rank checks its fingerprint path before work; ranks writing into one folder that
    # does not exist yet make and remove it at once (tests/cli/test_offline_cli.py failed on
    # "File exists"). Threads race here as the ranks' processes do.
    import threading

    from fsdpcheck.output import unwritable

    problems: list[OSError] = []

    def check(rank: int) -> None:
        for round_ in range(300):
            problem = unwritable(tmp_path / f"r{round_}" / "fp" / f"rank{rank}.json")
            if problem is not None:
                problems.append(problem)

    threads = [threading.Thread(target=check, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A folder one check made while the other was using it stays (the write makes it anyway).
    assert problems == []


def test_a_folder_removed_under_the_write_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sibling rank's check removes a folder it made (unwritable) right between this write's
    # mkdir and its temporary file: too narrow a window for threads to hit on purpose, so the
    # folder is removed at that moment, for real, before the temporary file is made.
    import os
    import tempfile

    from fsdpcheck import output

    real_mkstemp, removed = tempfile.mkstemp, []

    def sibling_removes_the_folder_first(*args, **kwargs):
        folder = Path(kwargs["dir"])
        if not removed:
            os.rmdir(folder)
            removed.append(folder)
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", sibling_removes_the_folder_first)
    target = tmp_path / "new" / "report.json"
    output.write_text('{"ok": true}', target)
    assert removed == [target.parent] and target.read_text() == '{"ok": true}'
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]  # no temporary left
    # Without the second look the write fails as it did.
    removed.clear()
    monkeypatch.setattr(output, "_FOLDER_RACES", 1)
    with pytest.raises(FileNotFoundError):
        output.write_text("{}", tmp_path / "other" / "report.json")
