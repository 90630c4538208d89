"""``fsdpcheck explain`` on real Flight Recorder dumps: 2-rank gloo jobs that abort (per-buffer
broadcasts of different sizes), hang (one rank's extra all_reduce, either rank), corrupt silently
(same sizes), or complete (the clean twin), each dumped by tests/workers/fr_dump_worker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO, run_cli

from fsdpcheck.children.launch import LaunchResult, launch

WORKER = str(REPO / "tests" / "workers" / "fr_dump_worker.py")
SLIDING = "model.rotary_emb.sliding_attention_inv_freq"
FULL = "model.rotary_emb.full_attention_inv_freq"


def dump_job(out: Path, case: str, seeds: tuple[int, int], *extra: str) -> LaunchResult:
    """One bounded 2-rank job of the worker; its dumps are in ``out/fr`` (and ``out/fr-pickle``),
    its fingerprints in ``out/fp``."""
    result = launch(
        [WORKER, "--out", str(out), "--case", case, *extra],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        rank_env=lambda r: {"PYTHONHASHSEED": str(seeds[r])},
        timeout=90,
        cwd=str(REPO),
    )
    for rank in range(2):
        assert (out / "fr" / f"rank{rank}.json").is_file(), result.output(rank)
        assert (out / "fp" / f"rank{rank}.json").is_file(), result.output(rank)
    return result


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case's dumps, each job run once for the module."""
    cases = {
        "abort": ("buffers", (0, 1)),
        "swap": ("buffers-equal", (0, 1)),
        "extra1": ("extra-all-reduce", (1, 1), "--extra-rank", "1"),
        "extra0": ("extra-all-reduce", (1, 1), "--extra-rank", "0"),
        "clean": ("clean", (1, 1)),
    }
    folders = {}
    for name, (case, seeds, *extra) in cases.items():
        out = tmp_path_factory.mktemp(name)
        result = dump_job(out, case, seeds, *extra)
        if name == "abort":  # the job really died as users see it: gloo aborted the receiver
            assert result.ranks[1].signal == "SIGABRT", result.output(1)
            assert "op.preamble.length <= op.nbytes" in result.ranks[1].stderr
        folders[name] = out
    return folders


def explain(*args: str | Path) -> tuple[int, str, str]:
    done = run_cli(["explain", *map(str, args)])
    return done.returncode, done.stdout, done.stderr


def test_size_mismatch_names_each_ranks_buffer(jobs: dict[str, Path], tmp_path: Path) -> None:
    out = jobs["abort"]
    report_path, junit = tmp_path / "r.json", tmp_path / "r.xml"
    code, stdout, _ = explain(
        out / "fr", "--fingerprint", out / "fp", "--json", report_path, "--junit", junit
    )
    assert code == 1, stdout
    assert f"rank 1 broadcast `{SLIDING}` (8,) float32 while rank 0 broadcast `{FULL}` (16,)" in (
        stdout.replace("\n", " ")
    )
    report = json.loads(report_path.read_text())
    assert (report["verdict"], report["exit_code"]) == ("inconsistent", 1)
    (finding,) = report["findings"]
    assert finding["kind"] == "collective"
    assert (finding["ranks"], finding["reference_rank"]) == ([1], 0)
    assert finding["cause"] == "construction-time"  # the fingerprints differ in buffer order
    assert finding["details"]["reason"] == "size" and finding["details"]["seq"] == 1
    assert finding["details"]["issued"]["1"]["tensors"] == [SLIDING]
    assert finding["details"]["issued"]["1"]["named_by"] == "order"
    assert 'name="collective"' in junit.read_text() and "<failure" in junit.read_text()


def test_without_fingerprints_sizes_still_diverge(jobs: dict[str, Path]) -> None:
    code, stdout, _ = explain(jobs["abort"] / "fr")
    assert code == 1, stdout
    assert "rank 1 broadcast (8,) float32 while rank 0 broadcast (16,) float32" in stdout


def test_pickle_dumps_need_allow_pickle(jobs: dict[str, Path]) -> None:
    pickles = jobs["abort"] / "fr-pickle"
    code, stdout, stderr = explain(pickles)
    assert code == 2 and stdout == ""
    assert "--allow-pickle" in stderr and "nccl_trace_rank_0" in stderr
    code, stdout, _ = explain(pickles, "--allow-pickle", "--fingerprint", jobs["abort"] / "fp")
    assert code == 1, stdout
    assert f"`{SLIDING}`" in stdout and "fr_dump_worker.py:" in stdout  # pickle has the frames


@pytest.mark.parametrize(("job", "extra", "waiting"), [("extra1", 1, 0), ("extra0", 0, 1)])
def test_one_ranks_extra_all_reduce(
    jobs: dict[str, Path], tmp_path: Path, job: str, extra: int, waiting: int
) -> None:
    report_path = tmp_path / "r.json"
    code, stdout, _ = explain(jobs[job] / "fr", "--json", report_path)
    assert code == 1, stdout
    (finding,) = json.loads(report_path.read_text())["findings"]
    assert finding["details"]["reason"] == "missing"
    assert finding["details"]["seq"] == 4
    assert finding["details"]["issued"][str(waiting)] is None
    assert finding["details"]["issued"][str(extra)]["op"] == "all_reduce"
    assert finding["cause"] == "divergent"
    assert (
        f"rank {extra} issued all_reduce (1,) float32 as collective #4 of the default process "
        f"group, which rank {waiting} never issued"
    ) in stdout.replace("\n", " ")


def test_same_size_swap_is_named_only_with_fingerprints(jobs: dict[str, Path]) -> None:
    out = jobs["swap"]
    code, stdout, _ = explain(out / "fr")
    assert code == 0, stdout  # the sizes agree: Flight Recorder alone cannot tell
    assert "--fingerprint" in stdout  # and the report says so
    code, stdout, _ = explain(out / "fr", "--fingerprint", out / "fp")
    assert code == 1, stdout
    flat = stdout.replace("\n", " ")
    assert f"rank 1 broadcast `{SLIDING}` (8,) float32 while rank 0 broadcast `{FULL}` (8,)" in flat
    assert "silent corruption" in flat


def test_clean_twin_is_consistent(jobs: dict[str, Path], tmp_path: Path) -> None:
    out = jobs["clean"]
    report_path = tmp_path / "r.json"
    code, stdout, _ = explain(out / "fr", "--fingerprint", out / "fp", "--json", report_path)
    assert code == 0, stdout
    report = json.loads(report_path.read_text())
    assert (report["verdict"], report["findings"]) == ("consistent", [])
    assert [i["collectives"] for i in report["options"]["inputs"]] == [3, 3]


def test_bad_input_is_one_paragraph_and_exit_2(jobs: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    one = tmp_path / "one"
    one.mkdir()
    (one / "rank0.json").write_bytes((jobs["clean"] / "fr" / "rank0.json").read_bytes())
    unnamed = tmp_path / "unnamed.json"
    unnamed.write_bytes((jobs["clean"] / "fr" / "rank0.json").read_bytes())
    cases = {
        "at least two ranks": [empty],
        "only one dump": [one],
        "cannot tell which rank": [unnamed, jobs["clean"] / "fr" / "rank1.json"],
        "does not exist": [tmp_path / "nowhere"],
        "not a fingerprint": [
            jobs["clean"] / "fr",
            "--fingerprint",
            jobs["clean"] / "fr" / "rank0.json",
        ],
    }
    for phrase, args in cases.items():
        code, stdout, stderr = explain(*args)
        assert code == 2, (phrase, stdout, stderr)
        assert phrase in stderr, (phrase, stderr)
        assert "Traceback" not in stderr
