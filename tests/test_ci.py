"""fsdpcheck in CI: --junit, --annotations, scan --sarif, output paths checked up front, and
progress only on a terminal. In-process where no rank is needed, real ranks where they are."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import run_cli, run_ranks
from rich.console import Console
from typer.testing import CliRunner

from fsdpcheck.cli import _Progress, app
from fsdpcheck.formats.junit import failures

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
    with _Progress("probe", console=console) as bar:
        bar.update(1, 2, "PYTHONHASHSEED=0")
        bar.update(2, 2, "PYTHONHASHSEED=1")
    drawn = out.getvalue()  # the last frame is drawn when the bar stops, then erased
    assert "probe" in drawn and "2/2" in drawn and "PYTHONHASHSEED=1" in drawn


def test_progress_is_silent_off_a_terminal() -> None:
    out = io.StringIO()
    with _Progress("scan", console=Console(file=out, width=100)) as bar:
        bar.update(1, 4, "llama (seed 0)")
    assert out.getvalue() == ""


# ---------------------------------------------------------------- real runs


def test_probe_junit_annotations_and_no_progress_in_logs(tmp_path: Path) -> None:
    junit, report = tmp_path / "probe.xml", tmp_path / "probe.json"
    result = run_cli(
        ["probe", "--model", "hazard", "--seeds", "2", "--junit", str(junit),
         "--json", str(report)],
        env={"GITHUB_ACTIONS": "true"},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "::error title=fsdpcheck probe%3A buffer order::hazard: buffers" in result.stdout
    (failed,) = failures(junit.read_text())
    assert failed[:2] == ("fsdpcheck.probe.orders", "buffer order")
    assert json.loads(report.read_text())["verdict"] == "latent"
    # stderr is a pipe here, as in CI: no progress bar, no spinner frames.
    assert result.stderr.strip() == "", result.stderr


def test_scan_sarif_and_junit(tmp_path: Path) -> None:
    sarif_path, junit = tmp_path / "scan.sarif", tmp_path / "scan.xml"
    result = run_cli(
        ["scan", "--filter", "cohere_compass", "--preset", "hazard", "--seeds", "2",
         "--sarif", str(sarif_path), "--junit", str(junit), "--annotations", "none"],
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "::" not in result.stdout
    log = json.loads(sarif_path.read_text())
    assert log["version"] == "2.1.0"
    results = log["runs"][0]["results"]
    by_rule = {r["ruleId"]: r for r in results}
    hang = by_rule["FSDPCHECK001"]["locations"][0]["physicalLocation"]
    assert hang["artifactLocation"]["uri"].endswith("/fsdpcheck/hazard.py")
    # transformers 5.24's cohere_compass_text reorders under the scan's mixed layer types (equal
    # sizes: silent corruption); the result points at the loop, and the set's line is related.
    seen = by_rule["FSDPCHECK002"]
    where = seen["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"].endswith("cohere_compass/modeling_cohere_compass.py")
    assert where["region"]["snippet"]["text"] == "for layer_type in self.layer_types:"
    source = Path(where["artifactLocation"]["uri"].removeprefix("file://")).read_text()
    origin = seen["relatedLocations"][0]["physicalLocation"]["region"]["startLine"]
    assert "list(set(config.layer_types))" in source.splitlines()[origin - 1]
    assert seen["properties"]["verdict"] == "silent-corruption"
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["preset:hazard"].find("failure").get("type") == "hang"
    assert result.stderr.strip() == "", result.stderr


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
