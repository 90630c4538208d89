"""The bucketed loader (``load_full_state_dict``'s default path) on real processes (CPU, gloo):
every case ends in ``verify_load`` passing on every rank, and says which path it took."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_worker_cases, run_worker_ranks

from fsdpcheck.children.launch import LaunchResult


def run_worker(
    out: Path, model: str, *args: str, seeds: tuple[int, int] = (1, 1), timeout: float = 90.0
) -> tuple[LaunchResult, list[dict]]:
    """Two ranks of ``load_fast_worker.py``; returns the launch and each rank's JSON record."""
    return run_worker_ranks(
        "load_fast_worker.py",
        out,
        ["--model", model, "--timeout", "30", *args],
        seeds=seeds,
        timeout=timeout,
    )


HAZARD = ["--model", "hazard", "--timeout", "30"]
MESHES = {
    "hsdp-1x2-dim1-shards": ("--mesh", "1,2", "--shard-dim1", "--odd-params"),
    "hsdp-2x1-replicated": ("--mesh", "2,1"),
}


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path) -> dict:
    """The cases below, one 2-rank job per pair of hash seeds (the worker's ``--cases``)."""
    alike = {  # hash seeds (1, 1)
        "bf16-tied": [*HAZARD, "--dtype", "bfloat16", "--source-dtype", "float32", "--tie"],
        **{name: [*HAZARD, *args] for name, args in MESHES.items()},
        "bucket-disagree": [*HAZARD, "--bucket-bytes-rank1", "4096"],
        "dcp-on-rank-1": [*HAZARD, "--dcp-on-rank", "1"],
        "forced-dcp": [*HAZARD, "--method", "dcp", "--odd-params"],
    }
    differ = {  # hash seeds (0, 1): the RoPE buffers in opposite orders
        "meta-uneven": [*HAZARD, "--odd-params", "--persistent-buffer", "--cpu-offload"],
        "llama-buckets": ["--model", str(llama_checkpoint), "--timeout", "30"]
        + ["--bucket-bytes", "2048"],
    }
    root = tmp_path_factory.mktemp("loads")
    return {
        **run_worker_cases("load_fast_worker.py", root / "alike", alike, seeds=(1, 1)),
        **run_worker_cases("load_fast_worker.py", root / "differ", differ, seeds=(0, 1)),
    }


def _assert_verified(result: LaunchResult, records: list[dict], method: str = "bucketed") -> None:
    assert result.codes == [0, 0], result.output(0) + result.output(1)
    for record in records:
        assert record["error"] is None, record["error"]
        verify = record["verify"]
        assert verify["ran"] and verify["passed"], verify
        assert verify["checked"] == record["n_params"] + record["n_buffers"]
        assert record["load"]["method"] == method, record["load"]
    assert records[0]["verify"]["mismatches"] == []


def test_meta_rank_uneven_shards_persistent_buffer_and_cpu_offload(loads: dict) -> None:
    # Rank 1 builds on meta; params of 3 and 1 rows shard as 2+1 and 1+0 (rank 1's is empty);
    # a persistent int64 buffer is a state-dict entry that is not a parameter; FSDP2 keeps the
    # shards under a CPUOffloadPolicy. Hash seeds 0 and 1 reorder the RoPE buffers.
    result, records = loads["meta-uneven"]
    _assert_verified(result, records)
    rank0, rank1 = records
    assert rank0["load"]["materialised"] is False and rank1["load"]["materialised"] is True
    for record in records:
        load = record["load"]
        assert load["fallback_reason"] is None
        assert load["params_loaded"] == record["n_params"] + 1  # + the persistent buffer
        assert load["buffers_broadcast"] == 2 and load["collectives"] == 2 + 1
    # Each rank gets only its own shards: rank 1 receives what it holds and nothing more.
    assert rank1["load"]["state_bytes"] == rank1["local_bytes"] + 6 * 8  # + the replicated buffer
    assert rank0["load"]["state_bytes"] == rank1["load"]["state_bytes"]  # rank 0 sent exactly that
    assert rank1["load"]["state_messages"] >= 1


def test_llama_checkpoint_with_buckets_smaller_than_one_tensor(loads: dict) -> None:
    # 2048-byte buckets: the embedding shard (128 x 64 float32 = 32 KiB) travels in 16 slices.
    result, records = loads["llama-buckets"]
    _assert_verified(result, records)
    rank1 = records[1]["load"]
    assert rank1["bucket_bytes"] <= 2048
    assert rank1["state_messages"] > records[1]["n_params"]  # tensors split across buckets
    assert rank1["state_bytes"] == records[1]["local_bytes"]


def test_bfloat16_model_from_a_float32_source_with_tied_weights(loads: dict) -> None:
    result, records = loads["bf16-tied"]
    _assert_verified(result, records)
    for record in records:
        assert record["tied"] is True  # still one tensor under two names
        assert record["load"]["params_loaded"] == record["n_params"] + 1  # both names count
    # bfloat16 on the wire (converted on rank 0), and the tied weight moved once.
    rank1 = records[1]
    assert rank1["load"]["state_bytes"] == rank1["local_bytes"]


@pytest.mark.parametrize("case", sorted(MESHES))
def test_two_dimensional_meshes_and_dim1_shards(loads: dict, case: str) -> None:
    args = MESHES[case]
    result, records = loads[case]
    _assert_verified(result, records)
    placements = {tuple(p) for p in records[1]["placements"].values()}
    assert all(len(p) == 2 and p[0] == "R" for p in placements), placements
    if "--shard-dim1" in args:
        assert ("R", "S(1)") in placements


def test_ranks_that_disagree_on_bucket_size_fall_back_to_dcp_and_say_why(loads: dict) -> None:
    result, records = loads["bucket-disagree"]
    _assert_verified(result, records, method="dcp")
    reasons = {record["load"]["fallback_reason"] for record in records}
    [reason] = reasons  # the same decision, for the same reason, on every rank
    assert reason.startswith("rank 1 shard, tie or bucket the state dict differently")
    assert "bucket_bytes" in reason
    assert all(record["load"]["state_messages"] == 0 for record in records)


def test_a_rank_asking_for_dcp_takes_everyone_there(loads: dict) -> None:
    result, records = loads["dcp-on-rank-1"]
    _assert_verified(result, records, method="dcp")
    # Rank 0 asked for the bucketed path and says why it did not get it; rank 1 got what it asked.
    reasons = [r["load"]["fallback_reason"] for r in records]
    assert reasons == ["rank 1 asked for method='dcp'", None]


def test_forced_dcp_says_no_fallback(loads: dict) -> None:
    result, records = loads["forced-dcp"]
    _assert_verified(result, records, method="dcp")
    assert all(r["load"]["fallback_reason"] is None for r in records)


def test_a_rank_failing_mid_load_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    result, records = run_worker(tmp_path, "hazard", "--fail-materialise-on-rank", "1")
    assert not result.timed_out  # every rank gave up and said why: no hang
    assert result.codes == [3, 3], result.output(0) + result.output(1)
    messages = {record["error"]["message"] for record in records}
    [message] = messages
    assert "rank 1: materialising failed: MemoryError: injected" in message
    assert "must not be used" in message


# --- pure parts, in process ---------------------------------------------------------------------
