"""Which ranks must agree comes from the real device meshes, and NaN/Inf is never silent: a
training script's own layouts (tests/workers/mesh_worker.py) under check_model, each failure
with its clean twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

MESH_CASES = ("ep", "ep-drift", "ep-collapsed", "hsdp", "hsdp-drift", "tp", "tp-drift")


def _run(out: Path, ranks: int, cases: tuple[str, ...]) -> dict:
    argv = [str(REPO / "tests" / "workers" / "mesh_worker.py"), "--out", str(out)]
    result = launch(
        argv + [a for case in cases for a in ("--case", case)],
        ranks,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": "0"},
        timeout=300,
        cwd=str(REPO),
    )
    everything = "".join(result.output(r) for r in range(ranks))
    assert not result.timed_out and result.codes == [0] * ranks, everything
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 4-rank job (gloo) for every mesh case: check_model once per case."""
    return _run(tmp_path_factory.mktemp("meshes") / "reports.json", 4, MESH_CASES)


def _findings(report: dict) -> list[tuple]:
    return [
        (f["kind"], f["ranks"], f["reference_rank"], f["tensors"], f["details"].get("compared"))
        for f in report["findings"]
    ]


def test_expert_groups_with_fsdp2_over_each_dp_sub_mesh_are_consistent(meshes: dict) -> None:
    # (ep=2, dp=2): ranks 0,1 and 2,3 hold different experts and routers, by design.
    assert meshes["ep"]["verdict"] == "consistent", meshes["ep"]["findings"]


def test_a_rank_that_differs_from_its_dp_peer_is_named_within_its_group(meshes: dict) -> None:
    report = meshes["ep-drift"]
    assert report["verdict"] == "inconsistent"
    assert _findings(report) == [("value", [3], 2, ["router.weight"], [2, 3])]


def test_every_ep_group_holding_one_groups_experts_is_an_expert_finding(meshes: dict) -> None:
    # Its clean twin is "ep" above: each EP group its own experts.
    report = meshes["ep-collapsed"]
    assert report["verdict"] == "inconsistent"
    assert _findings(report) == [
        ("expert", [2, 3], 0, ["experts.up.weight", "experts.down.weight"], None)
    ]
    details = report["findings"][0]["details"]
    assert details["collapsed"] == [[0, 2], [1, 3]] and details["slots"] == [[0, 1], [2, 3]]


def test_hsdp_on_four_ranks_compares_each_shard_with_its_replica_only(meshes: dict) -> None:
    assert meshes["hsdp"]["verdict"] == "consistent", meshes["hsdp"]["findings"]
    report = meshes["hsdp-drift"]
    assert _findings(report) == [("value", [3], 1, ["experts.up.weight"], [1, 3])]
    assert report["findings"][0]["details"]["replicas"] == [1, 3]


def test_tensor_parallel_compares_only_what_is_replicated(meshes: dict) -> None:
    # Colwise shards differ by design; the Replicate norm must agree on every rank of the mesh.
    assert meshes["tp"]["verdict"] == "consistent", meshes["tp"]["findings"]
    assert _findings(meshes["tp-drift"]) == [("value", [1], 0, ["norm.weight"], [0, 1, 2, 3])]


def test_nan_left_in_one_ranks_shard_after_the_load_is_a_finding(tmp_path: Path) -> None:
    reports = _run(tmp_path / "reports.json", 2, ("nan", "finite"))
    assert reports["finite"]["verdict"] == "consistent", reports["finite"]["findings"]
    report = reports["nan"]
    assert report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["tensors"]) == (
        "non-finite",
        [1],
        ["experts.down.weight"],
    )
    assert finding["details"]["tensors"] == [
        {"name": "experts.down.weight", "kind": "param", "snapshot": "post-wrap", "count": 3}
    ]
