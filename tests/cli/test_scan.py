"""The architecture scan: one real child per hash seed, each building every selected model."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import run_cli

from fsdpcheck.children.scan import ScanResult, scan
from fsdpcheck.errors import InputError
from fsdpcheck.records import from_dict


def _cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(args, timeout=timeout)


def test_scan_over_a_few_architectures_plus_the_fixtures(tmp_path: Path) -> None:
    out = tmp_path / "scan.json"
    sarif_path, junit = tmp_path / "scan.sarif", tmp_path / "scan.xml"
    args = ["scan", "--filter", "llama", "--filter", "qwen3", "--filter", "gemma3_text"]
    args += ["--filter", "cohere_compass", "--preset", "hazard", "--preset", "hazard-equal"]
    args += ["--seeds", "2", "--json", str(out), "--sarif", str(sarif_path), "--junit", str(junit)]
    result = _cli([*args, "--annotations", "none"])
    # The fixtures are found, so the scan reports findings (exit 1) — and does not crash.
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(out.read_text())
    rows = {row["id"]: row for row in data["rows"]}
    for name in ("llama", "qwen3", "gemma3_text"):
        assert rows[name]["verdict"] == "ok", rows[name]
        assert rows[name]["seeds_built"] == [0, 1]
    # Gemma3 text mixes sliding and full attention in the small config (and sorts its set).
    assert rows["gemma3_text"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert rows["preset:hazard"]["verdict"] == "hang"
    assert rows["preset:hazard-equal"]["verdict"] == "silent-corruption"
    assert set(rows["preset:hazard"]["tensors"]) == {
        "model.rotary_emb.full_attention_inv_freq",
        "model.rotary_emb.sliding_attention_inv_freq",
    }
    assert data["counts"]["ok"] == sum(r["verdict"] == "ok" for r in data["rows"])
    assert data["transformers"] and data["seeds"] == [0, 1]
    parsed = {row.id: row for row in from_dict(ScanResult, data).rows}
    assert parsed["preset:hazard"].reorders[0].tensors[0].shape == (16,)  # typed, not lists
    assert "silent-corruption" in result.stdout and "hang" in result.stdout

    # The same scan's SARIF (code scanning) and JUnit, with annotations off.
    assert "::" not in result.stdout
    log = json.loads(sarif_path.read_text())
    assert log["version"] == "2.1.0"
    by_rule = {r["ruleId"]: r for r in log["runs"][0]["results"]}
    hang = by_rule["FSDPCHECK001"]["locations"][0]["physicalLocation"]
    assert hang["artifactLocation"]["uri"].endswith("/fsdpcheck/model/hazard.py")
    # transformers 5.24's cohere_compass_text reorders under the scan's mixed layer types (equal
    # sizes: silent corruption); the result points at the loop, and the set's line is related.
    [seen] = [
        r
        for r in log["runs"][0]["results"]
        if r["ruleId"] == "FSDPCHECK002"
        and "cohere_compass" in r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    ]
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


def test_a_filter_matching_nothing_is_bad_input() -> None:
    with pytest.raises(InputError) as caught:
        scan(["no-such-architecture-*"], seeds=2)
    assert caught.value.exit_code == 2
