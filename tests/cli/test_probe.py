"""The hash-seed probe: real child interpreters under fixed PYTHONHASHSEED values."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from fsdpcheck.checks.hash_seed import ProbeResult, probe_finding
from fsdpcheck.children.probe import DEFAULT_SEEDS, probe
from fsdpcheck.records import Finding, Fingerprint, TensorRecord, from_dict, to_dict
from fsdpcheck.vocab import FindingKind

FULL = "model.rotary_emb.full_attention_inv_freq"
SLIDING = "model.rotary_emb.sliding_attention_inv_freq"


def _cli(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli(args, timeout=timeout)


@pytest.fixture(scope="module")
def hazard_cli(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, dict]:
    """``fsdpcheck probe --model hazard --json``, the default seeds (0..7), once for the module:
    the command's output and the JSON it wrote."""
    out = tmp_path_factory.mktemp("probe") / "probe.json"
    result = _cli(["probe", "--model", "hazard", "--json", str(out)])
    return result, json.loads(out.read_text())


@pytest.fixture(scope="module")
def hazard(hazard_cli: tuple[subprocess.CompletedProcess, dict]) -> ProbeResult:
    return from_dict(ProbeResult, hazard_cli[1])  # what the library returned, as written


def test_default_seeds_find_the_hazard_every_time(hazard: ProbeResult) -> None:
    assert DEFAULT_SEEDS == 8 and hazard.seeds == tuple(range(8))
    assert hazard.verdict == "latent" and hazard.exit_code == 1
    assert hazard.errors == () and hazard.architecture == "HazardForCausalLM"
    [reorder] = hazard.reorders
    assert (reorder.kind, reorder.module) == ("buffer", "model.rotary_emb")
    assert {t.name: t.shape for t in reorder.tensors} == {FULL: (16,), SLIDING: (8,)}
    assert reorder.sizes_differ and reorder.outcome == "hang"
    # The fixed seeds make it deterministic: 0 iterates the set one way, 1 the other.
    by_first = {v.order[0]: v.seeds for v in reorder.variants}
    assert 0 in by_first[FULL] and 1 in by_first[SLIDING]
    assert sorted(s for v in reorder.variants for s in v.seeds) == list(range(8))
    assert hazard.orders == 2
    assert from_dict(ProbeResult, json.loads(json.dumps(to_dict(hazard)))) == hazard


def test_equal_sizes_mean_silent_corruption() -> None:
    result = probe("hazard-equal", seeds=2)
    assert result.verdict == "latent" and result.exit_code == 1
    [reorder] = result.reorders
    assert {t.shape for t in reorder.tensors} == {(8,)}
    assert not reorder.sizes_differ and reorder.outcome == "silent-corruption"
    assert [v.seeds for v in reorder.variants] == [(0,), (1,)]
    finding = probe_finding(result)
    assert finding is not None and finding.details["sizes_differ"] is False


def test_llama_order_does_not_depend_on_the_hash_seed() -> None:
    result = probe("tiny-llama", seeds=2)  # 0 and 1: the two orders of a 2-element set
    assert result.verdict == "consistent" and result.exit_code == 0, result.errors
    assert result.reorders == () and result.orders == 1
    assert result.architecture == "LlamaForCausalLM"
    assert probe_finding(result) is None


def test_cli_probe_hazard_writes_json_and_exits_1(
    hazard_cli: tuple[subprocess.CompletedProcess, dict],
) -> None:
    result, data = hazard_cli
    assert result.returncode == 1, result.stdout + result.stderr
    assert data["verdict"] == "latent" and data["exit_code"] == 1
    assert data["reorders"][0]["module"] == "model.rotary_emb"
    assert "latent" in result.stdout and "hang" in result.stdout
    assert "model.rotary_emb" in result.stdout


def test_cli_probe_unknown_preset_is_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    result = _cli(["probe", "--model", "no-such-preset", "--json", str(out)])
    assert result.returncode == 2, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "error"
    assert {e["kind"] for e in data["errors"]} == {"input"}
    assert "no-such-preset" in result.stdout


def test_bad_input_is_refused_before_any_child_starts(tmp_path: Path) -> None:
    """What resolve() refuses, each child would refuse after its start-up: found once, in the
    caller, with the same result a child's refusal gives (every seed, kind input, exit 2)."""
    reported: list[tuple[int, int, str]] = []
    result = probe(str(tmp_path), seeds=3, progress=lambda *done: reported.append(done))
    assert (result.verdict, result.exit_code) == ("error", 2)
    assert result.seeds == (0, 1, 2)
    assert [(e.seed, e.kind) for e in result.errors] == [(s, "input") for s in range(3)]
    assert all(f"{tmp_path} has no config.json" in e.message for e in result.errors)
    assert not result.errors[0].message.startswith("rank"), result.errors[0].message
    assert reported == []  # no child reported: none was started


def test_what_resolve_fails_on_otherwise_is_left_to_the_children() -> None:
    """An id that looks like a hub id but that huggingface_hub refuses to validate (not an
    InputError of resolve's): no refusal in the caller, so every child reports its own
    failure, as before the caller resolved."""
    from fsdpcheck.children.probe import _refused

    assert _refused("org/name..bad") is None


def test_cli_probe_help_explains_the_seed_count() -> None:
    result = _cli(["probe", "--help"])
    assert result.returncode == 0
    assert "1/128" in result.stdout and "fsdpcheck probe --model hazard" in result.stdout


# ---------------------------------------------------------------- compare_orders, no processes


def _fp(buffers=(), params=()) -> Fingerprint:
    def rec(item):
        name, shape = item
        return TensorRecord(name=name, shape=shape, dtype="float32", device="meta")

    return Fingerprint("pre-wrap", tuple(map(rec, buffers)), tuple(map(rec, params)))


def test_probe_finding_folds_into_an_audit_report(hazard: ProbeResult) -> None:
    assert FindingKind("hash-seed") is FindingKind.HASH_SEED
    finding = probe_finding(hazard)
    assert finding is not None
    assert (finding.kind, finding.snapshot) == ("hash-seed", "probe")
    assert finding.cause == "construction-time"
    assert finding.ranks == () and set(finding.tensors) == {FULL, SLIDING}
    assert finding.details["modules"] == ["model.rotary_emb"]
    assert finding.details["seeds"] == list(range(8))
    assert finding.details["sizes_differ"] is True
    assert {o["order"][0] for o in finding.details["orders"]} == {FULL, SLIDING}
    assert "hang" in finding.summary
    assert from_dict(Finding, json.loads(json.dumps(to_dict(finding)))) == finding


def test_the_library_probe_calls_a_builder_latent_and_consistent() -> None:
    import fsdpcheck

    latent = fsdpcheck.probe("examples/verl_worker.py:build_actor", seeds=2)
    assert latent.verdict == "latent" and sorted(latent.tensors) == sorted([FULL, SLIDING])
    stable = fsdpcheck.probe("examples/builders/llama_fsdp2.py:build", seeds=2)
    assert stable.verdict == "consistent" and stable.reorders == () and stable.errors == ()
    assert stable.architecture == "LlamaForCausalLM"
