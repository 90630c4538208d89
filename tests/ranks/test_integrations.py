"""Framework hooks for real: HF Trainer, Lightning and accelerate on 2 CPU ranks (DDP over
gloo), each with its failing twin (hash seeds 0 and 1: the planted set-order buffers differ)
and its clean twin (seed 1 on both ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch

WORKERS = {
    "hf": ("hf_trainer_worker.py", "Trainer on_train_begin"),
    "lightning": ("lightning_worker.py", "Lightning on_fit_start"),
    "accelerate": ("accelerate_worker.py", "after accelerator.prepare"),
}
HEADLINE = "buffer order differs on rank 1 (construction-time)"


def _run(worker: str, out: Path, seeds: tuple[int, int]) -> list[dict]:
    result = launch(
        [str(REPO / "tests" / "workers" / worker), str(out)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": str(seeds[r])},
        timeout=240,
        cwd=str(REPO),
    )
    assert result.codes == [0, 0], result.output(0)[-3000:] + result.output(1)[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("framework", list(WORKERS))
def test_hook_warns_or_raises_on_every_rank_when_models_differ(tmp_path: Path, framework) -> None:
    worker, where = WORKERS[framework]
    for record in _run(worker, tmp_path, seeds=(0, 1)):
        warn, fail = record["warn"], record["raise"]
        # warn: one warning naming the difference, and training went on.
        assert warn["raised"] is None and warn["returned"] is not None
        assert len(warn["warned"]) == 1 and where in warn["warned"][0]
        assert HEADLINE in warn["warned"][0] and "ddp-sync → silent-corruption" in warn["warned"][0]
        # raise: the exception carries the headline and the exit code, on both ranks.
        assert fail["raised"]["exit_code"] == 1 and HEADLINE in fail["raised"]["message"]
        assert fail["returned"] is None and fail["warned"] == []
    report = json.loads((tmp_path / "raise.json").read_text())  # rank 0's full report
    assert report["verdict"] == "inconsistent"
    assert report["findings"][0]["kind"] == "buffer-order"


@pytest.mark.parametrize("framework", list(WORKERS))
def test_hook_is_silent_when_models_agree(tmp_path: Path, framework) -> None:
    worker, _ = WORKERS[framework]
    for record in _run(worker, tmp_path, seeds=(1, 1)):
        for mode in ("warn", "raise"):
            assert record[mode]["raised"] is None and record[mode]["warned"] == []
            assert record[mode]["returned"] is not None
    assert json.loads((tmp_path / "raise.json").read_text())["verdict"] == "consistent"
