"""Library calls never end their host process (issue 30): a training script's peer that dies or
stalls before or inside ``check_model`` makes every rank still alive return exit 3 naming it,
within the check's timeout, and the script goes on. The CLI's own bounded exit (the abort watch
ends a stuck rank) is in test_faults.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

TIMEOUT, DELAY = 5, 10  # the stalled rank is late by twice the check's timeout
WORKER = str(REPO / "tests" / "workers" / "peer_gone_worker.py")


def run(tmp_path: Path, scenario: str) -> list[dict | None]:
    out = tmp_path / scenario
    result = launch(
        [WORKER, str(out), scenario, str(TIMEOUT), str(DELAY)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
        timeout=180,
        cwd=str(REPO),
    )
    assert not result.timed_out, result.output(0)[-3000:] + result.output(1)[-3000:]
    records = []
    for r in range(2):
        path = out / f"rank{r}.json"
        records.append(json.loads(path.read_text()) if path.exists() else None)
    return records


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict | None]]:
    """The three jobs at once: they mostly wait out timeouts and stalls."""
    root = tmp_path_factory.mktemp("peer-gone")
    scenarios = ("stalls", "exit-1", "exit-0")
    with ThreadPoolExecutor(len(scenarios)) as pool:
        return dict(zip(scenarios, pool.map(lambda s: run(root, s), scenarios), strict=True))


@pytest.fixture(scope="module")
def stalls(jobs) -> list[dict]:
    records = jobs["stalls"]
    assert None not in records, f"a rank did not live on past its check: {records}"
    return records


def test_clean_twin_is_consistent(stalls) -> None:
    for record in stalls:
        assert record["clean"]["exit_code"] == 0, record["clean"]


def test_a_rank_stalled_inside_the_check_is_named_and_left_alive(stalls) -> None:
    first, late = (r["stall-inside"] for r in stalls)
    assert first["exit_code"] == 3 and first["seconds"] < DELAY, first
    [error] = first["errors"]
    assert error[:2] == [1, "fingerprint"] and "rank 1 is stuck" in error[2], first
    # The stalled rank was not ended: it returned the same conclusion once its work was done,
    # at once (it read the others' abort mark, it did not wait out a gather of its own).
    assert late["exit_code"] == 3 and "rank 1 is stuck" in late["headline"], late
    assert late["seconds"] < DELAY + TIMEOUT, late


def test_a_rank_stalled_before_the_check_never_arrived(stalls) -> None:
    first, late = (r["stall-before"] for r in stalls)
    assert first["exit_code"] == 3 and first["seconds"] < TIMEOUT + 5, first
    [error] = first["errors"]
    assert error[:2] == [1, "launch"] and "rank 1 never arrived" in error[2], first
    # Arriving after the others gave up, it is told so at once.
    assert late["exit_code"] == 3 and "rank 1 never arrived" in late["headline"], late
    assert late["seconds"] < TIMEOUT, late


def test_a_peer_that_exits_before_the_check(jobs) -> None:
    alive, gone = jobs["exit-1"]
    assert gone is None
    done = alive["exit-1"]
    assert done["exit_code"] == 3 and done["seconds"] < TIMEOUT + 5, done
    [error] = done["errors"]
    assert error[:2] == [1, "launch"] and "rank 1 never arrived" in error[2], done
    assert done["headline"] == error[2]


def test_the_store_host_that_exits_before_the_check(jobs) -> None:
    gone, alive = jobs["exit-0"]
    assert gone is None
    done = alive["exit-0"]  # rank 1 holds no report: the headline says what can be known
    assert done["exit_code"] == 3 and done["seconds"] < TIMEOUT + 5, done
    assert done["errors"] is None
    assert "rendezvous store's host (rank 0" in done["headline"], done
    assert "unreachable" in done["headline"]
