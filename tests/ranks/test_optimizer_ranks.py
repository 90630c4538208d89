"""The optimizer check on real ranks (FSDP2 on gloo): a resume that reset AdamW's moments, a
per-rank lr and replicas whose optimizer state drifted, each with its clean twin (a training
script's own steps in tests/workers/optimizer_worker.py, one launch for every case)."""

from __future__ import annotations

import pytest
from conftest import run_worker_cases

CASES = ("reset", "restored", "lr", "lr-same", "replica-state", "replica-same")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{case: (each rank's exit code, rank 0's report)}."""
    root = tmp_path_factory.mktemp("optimizer")
    done = run_worker_cases(
        "optimizer_worker.py", root, {c: ["--case", c] for c in CASES}, timeout=300
    )
    for run, _ in done.values():
        assert not run.timed_out, run.output(0) + run.output(1)
    return {name: (run.codes, records[0]["report"]) for name, (run, records) in done.items()}


def test_a_resume_that_reset_adamw_is_found_on_every_rank(runs: dict) -> None:
    # KempnerForge#115: DCP loaded into optimizer state that did not exist yet; every rank
    # agrees with every other, so only the checkpoint tells.
    codes, report = runs["reset"]
    assert codes == [1, 1] and report["verdict"] == "inconsistent"
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("optimizer", [0, 1], "loading")
    assert "not restored from the checkpoint" in finding["summary"]
    found = {(m["param"], m["field"]): m for m in finding["details"]["mismatches"]}
    assert found["0.weight", "exp_avg"]["loaded"] == "absent"
    assert found["0.weight", "exp_avg"]["saved"] == "non-zero"
    assert found["2.bias", "step"] == {
        "param": "2.bias",
        "field": "step",
        "loaded": "absent",
        "saved": "3.0",
    }
    assert found["", "last_epoch"]["loaded"] == "0"  # the scheduler was not restored either
    assert set(finding["tensors"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_resume_that_restored_the_optimizer_is_consistent(runs: dict) -> None:
    codes, report = runs["restored"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]


def test_a_per_rank_lr_is_an_optimizer_finding(runs: dict) -> None:
    codes, report = runs["lr"]
    assert codes == [1, 1]
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"], finding["reference_rank"]) == ("optimizer", [1], 0)
    (diff,) = finding["details"]["differences"]
    assert diff == {
        "where": "param group 0",
        "field": "lr",
        "reference": "0.0001",
        "other": "0.0002",
    }
    codes, report = runs["lr-same"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]


def test_replicas_whose_adam_state_drifted_are_named(runs: dict) -> None:
    codes, report = runs["replica-state"]
    assert codes == [1, 1]
    (finding,) = report["findings"]
    assert (finding["kind"], finding["ranks"]) == ("optimizer", [1])
    assert finding["details"]["differences"] == [{"param": "2.weight", "key": "exp_avg"}]
    assert "between replicas" in finding["summary"]
    codes, report = runs["replica-same"]
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]
