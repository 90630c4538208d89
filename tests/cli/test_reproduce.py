"""The unsafe loader, run on purpose in isolated child ranks."""

from __future__ import annotations

import json

import pytest

from fsdpcheck.children.reproduce import run_reproduction
from fsdpcheck.errors import InputError
from fsdpcheck.records import to_dict

ROTARY = "model.rotary_emb"


def _inv_freq(base: float, dim: int) -> list[float]:
    return [1.0 / base ** (i / dim) for i in range(0, dim, 2)]


def test_equal_sizes_swap_silently() -> None:
    result = run_reproduction("hazard-equal", seeds=(0, 1), timeout=60)
    assert result.outcome == "silent-corruption", result
    assert [e.returncode for e in result.exits] == [0, 0]
    rank0, rank1 = result.details["ranks"]
    assert rank0["swapped"] == [] and rank0["corrupted"] == []
    assert rank0["order"] == list(reversed(rank1["order"]))
    sliding = rank1["buffers"][f"{ROTARY}.sliding_attention_inv_freq"]
    assert sliding["state"] == "swapped"
    assert sliding["holds"] == f"{ROTARY}.full_attention_inv_freq"
    # The real values: rank 1's sliding-window RoPE (base 1e4) now has the global base 1e6.
    assert sliding["values"] == pytest.approx(_inv_freq(1e6, 16), rel=1e-6)
    assert sliding["expected_values"] == pytest.approx(_inv_freq(1e4, 16), rel=1e-6)
    assert sliding["values"] != pytest.approx(sliding["expected_values"], rel=1e-3)
    full = rank0["buffers"][f"{ROTARY}.full_attention_inv_freq"]
    assert sliding["values"] == full["values"]
    json.dumps(to_dict(result))  # the result is plain data


def test_different_sizes_crash_or_hang_within_the_bound() -> None:
    result = run_reproduction("hazard", seeds=(0, 1), timeout=60)
    assert result.outcome in ("crash", "hang"), result
    assert result.elapsed < 60
    if result.outcome == "crash":
        died = [e for e in result.exits if e.returncode not in (0, None)]
        assert died and all(e.last_error for e in died)
        assert f"rank {died[0].rank}" in result.summary or any(e.signal for e in died)


def test_same_hash_seeds_are_ok() -> None:
    result = run_reproduction("hazard", seeds=(1, 1), timeout=60)
    assert result.outcome == "ok", result
    assert all(r["swapped"] == [] for r in result.details["ranks"])


def test_bad_input_is_refused_before_launching() -> None:
    with pytest.raises(InputError, match="not a preset"):
        run_reproduction("no-such-model-anywhere")
    with pytest.raises(InputError, match="one hash seed per rank"):
        run_reproduction("hazard", nprocs=3, seeds=(0, 1))
