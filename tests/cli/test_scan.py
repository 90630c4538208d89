"""The architecture scan: one real child per hash seed, each building every selected model."""

from __future__ import annotations

import json
import subprocess
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
    args = ["scan", "--filter", "llama", "--filter", "qwen3", "--filter", "gemma3_text"]
    args += ["--preset", "hazard", "--preset", "hazard-equal", "--seeds", "2", "--json", str(out)]
    result = _cli(args)
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


def test_a_filter_matching_nothing_is_bad_input() -> None:
    with pytest.raises(InputError) as caught:
        scan(["no-such-architecture-*"], seeds=2)
    assert caught.value.exit_code == 2
