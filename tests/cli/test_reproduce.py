"""The unsafe named-buffers-order loader (verl's before its fix), run on purpose in isolated child
ranks: what it does to the buffers, value by value, in that loader's row."""

from __future__ import annotations

import json

import pytest

from fsdpcheck.checks.observed import Observation
from fsdpcheck.children.jobs import ChildSpec
from fsdpcheck.children.observe import observe_loaders

ROTARY = "model.rotary_emb"
FULL, SLIDING = f"{ROTARY}.full_attention_inv_freq", f"{ROTARY}.sliding_attention_inv_freq"
LOADER = "named-buffers-order"


def _inv_freq(base: float, dim: int) -> list[float]:
    return [1.0 / base ** (i / dim) for i in range(0, dim, 2)]


def run(model: str, seeds: tuple[int, int], budget: float = 90.0) -> Observation:
    seen = observe_loaders(ChildSpec(model), seeds=seeds, budget=budget, loaders=[LOADER])
    return seen[LOADER]


def test_equal_sizes_swap_silently() -> None:
    seen = run("hazard-equal", (0, 1))
    assert seen.verdict == "silent-corruption", dict(seen.detail)
    assert [r["exit"] for r in seen.detail["ranks"]] == ["exit 0", "exit 0"]
    assert [r["hash_seed"] for r in seen.detail["ranks"]] == [0, 1]
    rank0, rank1 = seen.detail["buffers"]
    assert rank0["swapped"] == [] and rank0["corrupted"] == []
    assert rank0["order"] == list(reversed(rank1["order"]))
    assert {s["buffer"]: s["holds"] for s in rank1["swapped"]} == {SLIDING: FULL, FULL: SLIDING}
    sliding = rank1["buffers"][SLIDING]
    assert (sliding["state"], sliding["holds"]) == ("swapped", FULL)
    # The real values: rank 1's sliding-window RoPE (base 1e4) now has the global base 1e6.
    assert sliding["values"] == pytest.approx(_inv_freq(1e6, 16), rel=1e-6)
    assert sliding["expected_values"] == pytest.approx(_inv_freq(1e4, 16), rel=1e-6)
    assert sliding["values"] == rank0["buffers"][FULL]["values"]
    json.dumps(dict(seen.detail), allow_nan=False)  # plain, strict JSON


def test_different_sizes_hang_within_the_bound() -> None:
    seen = run("hazard", (0, 1), budget=60.0)
    # gloo aborts the receiver of a mismatched broadcast (SIGABRT); NCCL would block: a hang.
    assert seen.verdict == "hang", dict(seen.detail)
    assert seen.detail["elapsed"] < 60
    assert "buffers" not in seen.detail  # no rank got through the loader to say what it holds


def test_same_hash_seeds_are_ok() -> None:
    seen = run("hazard", (1, 1))
    assert seen.verdict == "ok", dict(seen.detail)
    assert all(r["swapped"] == [] and r["corrupted"] == [] for r in seen.detail["buffers"])


def test_a_model_that_does_not_build_says_nothing_about_the_loader() -> None:
    seen = run("no-such-model-anywhere", (0, 1), budget=60.0)
    assert seen.verdict is None
    assert "did not get through the loader" in seen.detail["summary"]
