"""The framework hooks' edge cases on 2 real CPU ranks (the HF Trainer hook, called as the
Trainer calls it; every hook shares ``integrations.common.CheckSettings.check``), all in one job: an
unwritable ``json_path`` fails every rank the same way before any collective, and a slow peer in
``on_failure="warn"`` mode ends no rank: every rank warns with the same result."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

TIMEOUT, DELAY = 5, 12  # the slow rank is late by more than twice the check's own timeout
WHERE = "Trainer on_train_begin"


def test_unwritable_json_path_and_slow_peer(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("a file where the report's folder should be")
    args = ["--timeout", str(TIMEOUT), "--delay", str(DELAY)]
    result = launch(
        [str(REPO / "tests" / "workers" / "hook_paths_worker.py"), str(tmp_path), *args],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        timeout=240,
        cwd=str(REPO),
    )
    assert result.codes == [0, 0], result.output(0)[-3000:] + result.output(1)[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # Unwritable json_path: in both modes every rank raises the same input error (exit 2),
    # at once, before any collective; no rank trains on alone (the barrier after it was met).
    for mode in ("warn", "raise"):
        failed = [r[f"unwritable-{mode}"] for r in records]
        assert failed[0]["raised"] == failed[1]["raised"], failed
        raised = failed[0]["raised"]
        assert raised is not None and raised["exit_code"] == 2, failed
        assert str(tmp_path / "not-a-folder") in raised["message"]
        assert WHERE in raised["message"] and "json_path" in raised["message"]
        for rank_outcome in failed:
            assert rank_outcome["returned"] is None and rank_outcome["warned"] == []
            assert rank_outcome["seconds"] < TIMEOUT, rank_outcome
        assert not (tmp_path / "not-a-folder").is_dir()
    # Its clean twin: a folder the write can make; the check ran, rank 0 wrote the report.
    for record in records:
        assert record["new-folder"] == {**record["new-folder"], "raised": None, "returned": 0}
    report = json.loads((tmp_path / "made-by-the-write" / "report.json").read_text())
    assert report["verdict"] == "consistent"

    # A slow peer in warn mode: every rank is still alive (the barrier), warned once and
    # returned the same result: a runtime error (exit 3) naming the slow rank.
    slow = [r["slow-peer"] for r in records]
    for rank_outcome in slow:
        assert rank_outcome["raised"] is None and rank_outcome["returned"] == 3, slow
        assert len(rank_outcome["warned"]) == 1 and WHERE in rank_outcome["warned"][0]
    assert slow[0]["warned"] == slow[1]["warned"]
    assert "rank 1" in slow[0]["warned"][0]
    # Its clean twin: the same model, no delay, no warning.
    for record in records:
        assert record["fast-peer"] == {**record["fast-peer"], "raised": None, "returned": 0}
        assert record["fast-peer"]["warned"] == []
