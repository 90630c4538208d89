"""Memory of the load on real processes (issue 27): a rank that materialised the full model
during a rank-0 load is a ``memory`` finding naming it and the bytes; its clean twin (that rank
on meta, receiving only its shards) is consistent. One 2-rank job of
tests/workers/memory_worker.py runs every case: a training script's own load then
``check_model(rank0_load=True)``, and ``audit --builder``. One torchrun launch audits a 120 MB
Llama as a user does (``--init rank0``, the default), the clean stack the rule must stay quiet
on: its first build imports transformers and the model's module inside the build stage."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO, launch, read_report, run_plain, torchrun_fsdpcheck

MODEL_BYTES = 6 * 4096 * 2048 * 4  # the worker's model, float32
MIB = 2**20


def _run_cases(tmp_path: Path) -> dict:
    out = tmp_path / "cases.json"
    job = launch(
        [str(REPO / "tests" / "workers" / "memory_worker.py"), "--out", str(out)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        timeout=240,
        cwd=str(REPO),
    )
    assert job.codes == [0, 0] and out.is_file(), job.output(0)[-3000:] + job.output(1)[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_cases(tmp_path_factory.mktemp("memory"))


def _memory_findings(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["kind"] == "memory"]


FOUND = ["script-full", "script-full-data", "builder-full_on_rank_1"]
CLEAN = ["script-meta", "script-meta-data", "builder-meta_on_rank_1"]
# glibc's malloc_trim, where this process's C library has one: check_model reads RSS after it.
HAS_MALLOC_TRIM = hasattr(ctypes.CDLL(None), "malloc_trim")


def _assert_found(done: dict) -> None:
    report = done["report"]
    # The measured records in the message: a miss says which rank's figure fell short.
    assert done["exit_codes"] == [1, 1] and report["verdict"] == "inconsistent", report["memory"]
    (finding,) = _memory_findings(report)
    assert finding["ranks"] == [1] and finding["details"]["rule"] == "rank0-load"
    assert finding["details"]["model_bytes"] == MODEL_BYTES
    # It held about the model, not its 96 MiB shard; the summary names the rank and the bytes.
    assert finding["details"]["bytes"] >= 0.75 * MODEL_BYTES
    assert "rank 1 held" in finding["summary"] and "MiB" in finding["summary"]
    assert [f["kind"] for f in report["findings"]] == ["memory"]


def _assert_clean(done: dict) -> None:
    report = done["report"]
    assert done["exit_codes"] == [0, 0], report["findings"] + report["errors"]
    assert report["verdict"] == "consistent"


def _assert_records(cases: dict) -> None:
    """What the records say whatever else runs on the host: a rank's anonymous memory cannot
    be taken from it (no swap on the test hosts), library pages it faults back in are left out
    of a stage, and the rule's margins are half a model wide."""
    audit = {m["rank"]: m for m in cases["builder-meta_on_rank_1"]["report"]["memory"]}
    assert sorted(audit) == [0, 1]
    for m in audit.values():
        assert m["method"] in ("stage", "lifetime")
        assert [s["stage"] for s in m["stages"]] == ["build", "wrap", "load"]
        assert (m["model_bytes"], m["shard_bytes"]) == (MODEL_BYTES, MODEL_BYTES // 2)
        assert all(s["peak"] >= max(s["start"], s["end"]) for s in m["stages"])
    build = {r: m["stages"][0]["peak"] - m["stages"][0]["start"] for r, m in audit.items()}
    assert build[0] >= 0.75 * MODEL_BYTES, build  # rank 0 wrote every page of the model
    assert build[1] < 0.25 * MODEL_BYTES, build  # rank 1 built on meta
    # check_model: the process's peak so far and its RSS now, nothing per stage.
    script = cases["script-meta"]["report"]["memory"]
    assert [m["method"] for m in script] == ["process", "process"]
    assert all(m["process_peak"] >= m["current"] > 0 and not m["stages"] for m in script)
    assert all(m["trimmed"] is HAS_MALLOC_TRIM for m in script)


@pytest.mark.parametrize("case", FOUND)
def test_a_rank_that_held_the_full_model_under_rank0_loading_is_named(cases, case) -> None:
    _assert_found(cases[case])


@pytest.mark.parametrize("case", CLEAN)
def test_the_clean_twin_on_meta_is_consistent(cases, case) -> None:
    _assert_clean(cases[case])


def test_every_rank_s_memory_is_in_the_report(cases) -> None:
    _assert_records(cases)


def test_the_memory_verdicts_hold_beside_a_cpu_and_allocation_hog(tmp_path: Path) -> None:
    # Issue 37: a suite that fails on a busy runner gets ignored. Two processes spin on the
    # CPU and one allocates, touches and frees 512 MiB over and over while the same job runs;
    # every verdict and record assertion above must still hold.
    hog = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "workers" / "hog.py"), "--seconds", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "hog running"
        loaded = _run_cases(tmp_path)
        assert hog.poll() is None  # the load ran for the whole job
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait(timeout=30)
    for case in FOUND:
        _assert_found(loaded[case])
    for case in CLEAN:
        _assert_clean(loaded[case])
    _assert_records(loaded)


def test_every_rank_from_pretrained_after_freed_data_is_found_and_its_twin_is_not(
    tmp_path: Path,
) -> None:
    # Issue 37 as reported: the script made and freed 8 MiB of data, then every rank
    # from_pretrained the full model. Its twin: only rank 0 loads the files, rank 1 on meta
    # (measured: 102 MiB held against the rule's 148). Here transformers 5.24's from_pretrained
    # peaks high enough to be found with or without the trim (211 MiB held); the retained copy
    # the trim decides is script-full-data's, which was consistent before it.
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = tmp_path / "llama"
    config = LlamaConfig(  # 197 MiB in float32, like the 211 MiB model
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    out = tmp_path / "cases.json"
    job = launch(
        [str(REPO / "tests" / "workers" / "memory_worker.py"), "--out", str(out)]
        + ["--pretrained", str(model)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        timeout=240,
        cwd=str(REPO),
    )
    assert job.codes == [0, 0] and out.is_file(), job.output(0)[-3000:] + job.output(1)[-3000:]
    cases = json.loads(out.read_text())
    _assert_clean(cases["pretrained-meta"])
    found = cases["pretrained-full"]
    report = found["report"]
    assert found["exit_codes"] == [1, 1], report["memory"]
    (finding,) = _memory_findings(report)
    assert finding["ranks"] == [1] and finding["details"]["rule"] == "rank0-load"
    full = finding["details"]["model_bytes"]
    assert full > 64 * MIB and finding["details"]["bytes"] >= 0.75 * full


def test_malloc_trim_hands_back_what_glibc_kept(tmp_path: Path) -> None:
    # The mechanism check_model relies on, in a fresh process: 48 freed weights of 4 MiB that
    # glibc keeps resident are handed back by fsdpcheck.model.memory.trim_heap. Whether glibc
    # keeps them on its own depends on its dynamic thresholds and the order of the frees (seen
    # both ways, run to run); its two thresholds fixed, it always does: the 4 MiB blocks come
    # from the heap, and the heap's top is never trimmed by a free.
    if not HAS_MALLOC_TRIM:
        pytest.skip("this C library has no malloc_trim")
    code = (
        "import json, torch\n"
        "from fsdpcheck.model.memory import rss, trim_heap\n"
        "ws = [torch.ones(2**20) for _ in range(48)]\n"
        "held = rss(); del ws\n"
        "kept = rss(); trimmed = trim_heap(); after = rss()\n"
        "print(json.dumps([held, kept, trimmed, after]))\n"
    )
    kept_by_glibc = {"MALLOC_MMAP_THRESHOLD_": str(16 * MIB), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
    env = {"OMP_NUM_THREADS": "1", **kept_by_glibc}
    proc = run_plain([sys.executable, "-c", code], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    held, kept, trimmed, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert trimmed is True
    assert kept > held - 64 * MIB  # glibc kept the 192 MiB resident after they were freed
    assert after < kept - 128 * MIB  # the trim handed them back


def test_the_stock_rank0_audit_of_a_model_above_the_floor_stays_consistent(tmp_path) -> None:
    from transformers import LlamaConfig

    model = tmp_path / "llama"
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    config.save_pretrained(model)  # no weights: rank 0 fills, rank 1 builds on meta
    out = tmp_path / "report.json"
    argv = torchrun_fsdpcheck(2, "audit", "--model", str(model), "--json", str(out))
    proc = run_plain(argv, env={**QUIET_ENV, "OMP_NUM_THREADS": "1"}, timeout=240)
    report = read_report(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["verdict"] == "consistent" and report["findings"] == []
    memory = {m["rank"]: m for m in report["memory"]}
    full = memory[0]["model_bytes"]
    assert full > 64 * MIB
    build = {r: m["stages"][0]["peak"] - m["stages"][0]["start"] for r, m in memory.items()}
    assert build[0] >= 0.9 * full  # rank 0 held the model it filled ...
    assert build[1] < build[0] - 0.5 * full  # ... rank 1, on meta, only what both imported
    assert "memory held" in proc.stdout
