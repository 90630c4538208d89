"""fsdpcheck probe and scan as CI runs them: JUnit, SARIF and annotations from real runs, and
no progress output when stderr is not a terminal."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
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
    assert hang["artifactLocation"]["uri"].endswith("/fsdpcheck/model/hazard.py")
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
