"""fsdpcheck probe and scan as CI runs them: JUnit, SARIF and annotations from real runs, and
no progress output when stderr is not a terminal."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

from fsdpcheck.formats.junit import failures


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
