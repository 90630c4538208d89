"""The architecture scan: one real child per hash seed, each building every selected model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from fsdpcheck.children.probe import SeedError
from fsdpcheck.children.scan import ScanResult, ScanTarget, _row, matches, scan
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


def test_filters_are_case_insensitive_substrings_or_globs() -> None:
    target = ScanTarget("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "causal-lm")
    assert matches(target, [])
    assert matches(target, ["QWEN3"]) and matches(target, ["moeforcausal"])
    assert matches(target, ["qwen3_*"]) and matches(target, ["*MoeFor*"])
    assert not matches(target, ["qwen4"]) and not matches(target, ["qwen3_moe?x"])


def test_a_build_failure_is_a_skipped_row_with_its_reason() -> None:
    target = ScanTarget("broken", "broken", "BrokenForCausalLM", "causal-lm")
    failed = {"arch": "broken", "ok": False, "reason": "build failed: TypeError: nope"}
    row = _row(target, {0: failed, 1: failed}, (0, 1), [])
    assert (row.verdict, row.reason) == ("skipped", "build failed: TypeError: nope")
    assert row.label == "skipped: build failed: TypeError: nope"
    lost = _row(target, {}, (0, 1), [SeedError(0, "timeout", "timed out after 5 s (killed)")])
    assert lost.verdict == "skipped" and "timed out" in lost.reason
