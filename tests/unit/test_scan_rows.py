"""Scan rows and filters (pure)."""

from __future__ import annotations

from fsdpcheck.checks.hash_seed import SeedError
from fsdpcheck.children.scan import ScanTarget, matches, scan_row
from fsdpcheck.records import SeedBuild
from fsdpcheck.vocab import SeedFailure


def test_filters_are_case_insensitive_substrings_or_globs() -> None:
    target = ScanTarget("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "causal-lm")
    assert matches(target, [])
    assert matches(target, ["QWEN3"]) and matches(target, ["moeforcausal"])
    assert matches(target, ["qwen3_*"]) and matches(target, ["*MoeFor*"])
    assert not matches(target, ["qwen4"]) and not matches(target, ["qwen3_moe?x"])


def test_a_build_failure_is_a_skipped_row_with_its_reason() -> None:
    target = ScanTarget("broken", "broken", "BrokenForCausalLM", "causal-lm")
    why = "build failed: TypeError: nope"
    failed = SeedBuild("broken", failure=SeedFailure.RUNTIME, message=why)
    row = scan_row(target, {0: failed, 1: failed}, (0, 1), [])
    assert (row.verdict, row.reason) == ("skipped", "build failed: TypeError: nope")
    assert row.label == "skipped: build failed: TypeError: nope"
    lost = scan_row(target, {}, (0, 1), [SeedError(0, "timeout", "timed out after 5 s (killed)")])
    assert lost.verdict == "skipped" and "timed out" in lost.reason
