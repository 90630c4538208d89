"""Each modelling fix of fsdpcheck.predict, proven against the real loader in a 2-rank child job.

The prediction comes from the fixture's per-rank fingerprints (built here, one rank at a time);
the observation from running torch's DDP, DCP, accelerate's own loader or ours for real on gloo.
"""

from __future__ import annotations

import psutil
from loader_cases import fixture_predictions

from fsdpcheck.children.jobs import ChildSpec
from fsdpcheck.children.observe import observe_loaders


def both(model: str, loaders: list[str], init: str = "rank0", budget: float = 150.0):
    """{loader: (prediction on gloo, observation)} after running ``loaders`` for real."""
    predicted = fixture_predictions(model, init)
    seen = observe_loaders(
        ChildSpec(model, init=init), seeds=(1, 1), budget=budget, loaders=loaders
    )
    return {n: (predicted[n], seen[n]) for n in loaders}


def agree(pair) -> str:
    prediction, observation = pair
    expected = prediction.on_gloo or prediction.verdict
    assert observation.verdict == expected, (prediction.summary, dict(observation.detail))
    return expected


def test_ddp_refuses_a_parameter_shape_difference_and_dcp_refuses_where_it_differs():
    out = both("fixture-param-shape", ["ddp-sync", "dcp-broadcast"])
    assert agree(out["ddp-sync"]) == "refused"
    ranks = out["ddp-sync"][1].detail["ranks"]
    assert "appears not to match sizes" in ranks[1]["error"]
    assert agree(out["dcp-broadcast"]) == "refused"
    prediction, observation = out["dcp-broadcast"]
    assert prediction.ranks == (1,)
    assert observation.detail["summary"].startswith("rank 1 raised")
    assert "must match the size" not in (observation.detail["ranks"][0]["error"] or "")


def test_ddp_takes_the_worst_bucket():
    # Bucket 0: an equal-size swap (silent); bucket 1: 16 bytes sent into 8 (gloo aborts).
    out = both("fixture-bucket-swap", ["ddp-sync"])
    assert agree(out["ddp-sync"]) == "hang"
    assert out["ddp-sync"][0].summary.startswith("bucket 1:")


def test_dcp_loads_a_key_missing_on_rank_1_and_a_dtype_only_difference():
    # --init all: no rank on meta, so nothing is left uninitialised and "ok" is all DCP did.
    missing = both("fixture-missing-key", ["dcp-broadcast"], init="all")
    assert agree(missing["dcp-broadcast"]) == "ok"
    dtype = both("fixture-dtype", ["dcp-broadcast"], init="all")
    assert agree(dtype["dcp-broadcast"]) == "ok"


def test_tied_weights_pair_by_both_names():
    out = both("fixture-tied", ["state-dict-order", "ddp-sync"])
    assert agree(out["state-dict-order"]) == "hang"
    assert "size unknown" not in out["state-dict-order"][0].summary
    assert agree(out["ddp-sync"]) == "ok"  # lm_head.weight on rank 1 is embed_tokens on rank 0


def test_accelerate_refuses_a_persistent_buffer_and_children_leave_nothing_behind():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = both("fixture-persistence", ["state-dict-order"])
    assert agree(out["state-dict-order"]) == "refused"
    assert "device_mesh" in out["state-dict-order"][1].detail["summary"]
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before
