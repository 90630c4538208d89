"""A state-dict key that is no tensor (``get_extra_state``) on one rank: 2 real ranks of a
training script's own model, then ``check_model`` (tests/workers/extra_state_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

EXTRA = "model.layers.0.mlp._extra_state"


def _worker(tmp_path: Path, where: str) -> tuple[list, dict]:
    out = tmp_path / f"{where}.json"
    worker = REPO / "tests" / "workers" / "extra_state_worker.py"
    result = launch(
        [str(worker), "--where", where, "--out", str(out)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": "0"},
        timeout=180,
        cwd=str(REPO),
    )
    assert not result.timed_out, result.output(0) + result.output(1)
    assert out.is_file(), result.output(0) + result.output(1)
    return result.codes, json.loads(out.read_text())


def test_extra_state_on_one_rank_is_a_state_dict_keys_finding(tmp_path: Path) -> None:
    codes, report = _worker(tmp_path, "rank1")
    assert codes == [1, 1] and report["verdict"] == "inconsistent", report["findings"]
    found = {f["kind"]: f for f in report["findings"]}  # the loader table: state-dict-order hangs
    # Rank 1's MLP is the worker's subclass that keeps the extra state: its class differs too.
    assert sorted(found) == ["module-state", "state-dict-keys"], report["findings"]
    finding = found["state-dict-keys"]
    assert finding["ranks"] == [1] and finding["tensors"] == [EXTRA]
    assert f"only rank 1 has {EXTRA}" in finding["summary"]
    assert found["module-state"]["ranks"] == [1]
    assert "WithExtraState on rank 1" in found["module-state"]["summary"]


def test_extra_state_on_every_rank_is_consistent(tmp_path: Path) -> None:
    codes, report = _worker(tmp_path, "all")
    assert codes == [0, 0] and report["verdict"] == "consistent", report["findings"]
