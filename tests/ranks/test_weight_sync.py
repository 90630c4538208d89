"""The trainer-to-rollout weight sync, proven (one 3-rank job, gloo): ranks 0 and 1 train under
FSDP2, rank 2 receives the weights by broadcast from rank 0 as trl's and verl's NCCL sync send
them (tests/workers/weight_sync_worker.py). ``state_digests`` of the shards equals that of the
whole tensors; ``compare_digests`` finds each broken sync and passes the clean one."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_worker_ranks

from fsdpcheck import compare_digests
from fsdpcheck.model.threads import all_cores
from fsdpcheck.records import StateDigests, from_dict
from fsdpcheck.vocab import ExitCode, SyncDifference, Verdict

PARAMS = {"embed.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}
SYNCED = PARAMS | {"big.weight", "big.bias", "scale"}  # no inv_freq: never sent


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("weight-sync")
    result, records = run_worker_ranks(
        "weight_sync_worker.py", out, [], seeds=(1, 1, 1), nprocs=3, timeout=180
    )
    assert result.codes == [0, 0, 0], "".join(result.output(r)[-3000:] for r in range(3))
    return records


def _digests(data: dict) -> StateDigests:
    return from_dict(StateDigests, data)


def _sender(job: list[dict]) -> StateDigests:
    return _digests(job[0]["sender"])


def test_shards_and_whole_tensors_digest_alike(job: list[dict]) -> None:
    rank0, rank1 = _sender(job), _digests(job[1]["sender"])
    assert rank0 == rank1  # every trainer rank gets the combined digests
    assert set(rank0.tensors) == SYNCED and rank0.sharded == 7
    assert all(t.digest for t in rank0.tensors.values())
    assert rank0.tensors["big.weight"].shape == (1536, 1024)
    assert rank0.tensors["big.weight"].dtype == "torch.bfloat16"
    whole = _digests(job[0]["whole"])  # from full_tensor(): no collective
    assert compare_digests(rank0, whole).differences == ()
    assert rank0.tensors == whole.tensors


def test_shards_digested_on_threads_digest_alike(job: list[dict]) -> None:
    for rank in (0, 1):  # one thread per rank in the job; all the host's cores here
        assert job[rank]["threads"] == all_cores()
        assert _digests(job[rank]["sender_threaded"]) == _sender(job)


def test_tensor_parallel_shards_of_dim_1(job: list[dict]) -> None:
    for label, found in job[0]["shard1"].items():
        sharded, whole = _digests(found["sharded"]), _digests(found["whole"])
        assert sharded.sharded == 1 and whole.sharded == 0, label
        assert sharded.tensors == whole.tensors, label


def test_clean_sync_is_consistent(job: list[dict]) -> None:
    result = compare_digests(_sender(job), _digests(job[2]["cases"]["clean"]))
    assert result.verdict == Verdict.CONSISTENT and result.consistent
    assert result.exit_code == ExitCode.CONSISTENT
    assert result.compared == len(SYNCED) and result.differences == ()


@pytest.mark.parametrize(
    ("case", "name", "difference"),
    [
        ("dtype", "layers.0.weight", SyncDifference.DTYPE),  # advertised float16, sent bf16
        ("skipped", "layers.1.bias", SyncDifference.MISSING),
        ("stale", "big.weight", SyncDifference.VALUE),  # as it was before the step
    ],
)
def test_each_broken_sync_is_named(
    job: list[dict], case: str, name: str, difference: SyncDifference
) -> None:
    result = compare_digests(_sender(job), _digests(job[2]["cases"][case]))
    assert result.verdict == Verdict.INCONSISTENT and result.exit_code == ExitCode.FINDINGS
    assert [(d.name, d.difference) for d in result.differences] == [(name, difference)]


def test_receiver_digest_round_trips(job: list[dict], tmp_path: Path) -> None:
    import json

    from fsdpcheck.records import to_dict

    received = _digests(job[2]["cases"]["clean"])
    path = tmp_path / "digests.json"
    path.write_text(json.dumps(to_dict(received)))
    assert from_dict(StateDigests, json.loads(path.read_text())) == received


def test_every_rank_of_a_world_with_a_receiver_digests_without_a_group(job: list[dict]) -> None:
    # Issue 37: the disaggregated layout of trl, verl and AReaL. The trainers' shards combine
    # over their own mesh's group; the receiver has nothing sharded and waits for no one.
    assert _digests(job[0]["default"]) == _digests(job[1]["default"]) == _sender(job)
    receiver = _digests(job[2]["default"])
    assert receiver.sharded == 0 and set(receiver.tensors) == SYNCED
    assert job[2]["default_seconds"] < 5, job[2]["default_seconds"]


def test_a_rank_that_never_calls_is_named_in_an_fsdpcheck_error(job: list[dict]) -> None:
    silent = job[0]["silent"]
    assert silent["raised"] == "fsdpcheck.errors.PeersTimedOut", silent
    assert silent["ranks"] == [1]
    assert "rank 1" in silent["message"] and "state_digests" in silent["message"]
    assert silent["seconds"] < 5 + 20, silent  # the timeout asked for, not the store's 60 s
