"""check_step on 2 real gloo ranks (tests/workers/step_worker.py): each first-step failure of
issue 20 and its clean twin, in one launch. Each asserts the kind, the module named, that the
check ended within its bound, and the exit code on every rank."""

from __future__ import annotations

import pytest
from conftest import run_worker_ranks

TIMEOUT = 20.0
BOUND = TIMEOUT + 10.0  # a divergence is reported within the timeout plus a small bound
CASES = [
    "equal",
    "extra-rank1",
    "extra-rank0",
    "tower-rank1",
    "tower-all",
    "labels-ignored",
    "hsdp",
    "hsdp-lr-rank1",
    # issue 31: the full descriptor, agreement within each group, DTensor's collectives
    "broadcast-self-root",
    "reduce-sum-max",
    "a2a-unpaired",
    "collectives-agree",
    "pp-subgroups",
    "clip-all",
    "clip-rank0",
    "submesh-timeout",
    "p2p-ring",
    "p2p-size",
    "pipeline-clean",
    "p2p-unreceived",
    "compiled-step",
    # its sends posted ahead of their pair stay posted on the world group: last of the p2p cases
    "pipeline-fewer-microbatches",
    "unseen-rank0",  # last: it ends the job (exit 3 on both ranks)
]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], object]:
    out = tmp_path_factory.mktemp("step")
    result, records = run_worker_ranks(
        "step_worker.py", out, ["--timeout", str(TIMEOUT), *CASES], timeout=300
    )
    assert result.codes == [3, 3], result.output(0)[-3000:] + result.output(1)[-3000:]
    return records, result


@pytest.fixture(scope="module")
def ran(job) -> list[dict]:
    return job[0]


def _case(records: list[dict], case: str) -> tuple[list[dict], dict]:
    per_rank = [r[case] for r in records]
    for rank in per_rank:
        assert rank["seconds"] < BOUND, rank
    assert per_rank[1]["report"] is None  # rank 0 renders
    return per_rank, per_rank[0]["report"]


def _only(report: dict, kind: str) -> dict:
    assert [f["kind"] for f in report["findings"]] == [kind], report["findings"]
    return report["findings"][0]


@pytest.mark.parametrize(
    "case",
    [
        "equal",
        "tower-all",
        "hsdp",
        "collectives-agree",
        "pp-subgroups",
        "clip-all",
        "p2p-ring",  # each rank sends before it receives: no wait on each other
        "pipeline-clean",  # torch.distributed.pipelining, GPipe over 2 stages
        "compiled-step",
    ],
)
def test_the_clean_twins_are_consistent_and_the_step_ran(ran, case):
    per_rank, report = _case(ran, case)
    assert [r["exit_code"] for r in per_rank] == [0, 0]
    assert report["verdict"] == "consistent" and report["findings"] == []
    assert all(r["params_changed"] for r in per_rank)  # the real step, not a copy


@pytest.mark.parametrize(("case", "extra"), [("extra-rank1", 1), ("extra-rank0", 0)])
def test_an_extra_micro_batch_is_named_before_anyone_waits(ran, case, extra):
    per_rank, report = _case(ran, case)
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert found["ranks"] == [extra]
    details = found["details"]
    assert details["issued_by"] == [extra] and details["not_issued_by"] == [1 - extra]
    assert details["modules"] == [""]  # the next micro-batch starts with the root's all-gather
    assert "had finished its step" in found["summary"]
    assert "all-gather of the root module" in found["summary"]
    assert "collectives differ in the step" in per_rank[1]["headline"]


def test_a_tower_only_one_rank_runs_is_named_before_gloo_aborts(ran):
    per_rank, report = _case(ran, "tower-rank1")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert found["ranks"] == [1]
    assert found["details"]["modules"] == ["llama.model.layers.0", "tower"]
    assert "`tower`" in found["summary"] and "sizes differ" in found["summary"]
    assert "tower.0.weight" in found["tensors"]


def test_a_batch_with_no_label_that_counts_is_non_finite(ran):
    per_rank, report = _case(ran, "labels-ignored")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "non-finite")
    assert found["ranks"] == [1] and found["details"]["loss"] == {"1": "nan"}
    assert "loss nan on rank 1" in found["summary"]


def test_hsdp_replicas_that_differ_after_the_step_are_a_value_finding(ran):
    # Each rank its own batch, gradients all-reduced over the replicate dim: the replicas agree
    # after the step (the "hsdp" twin) unless a rank's own optimizer steps differently.
    per_rank, report = _case(ran, "hsdp-lr-rank1")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "value")
    assert found["ranks"] == [1] and found["snapshot"] == "step"
    assert "llama.model.embed_tokens.weight" in found["tensors"]


@pytest.mark.parametrize(
    ("case", "reason", "said"),
    [
        # today: both ranks issue it, each the root, and hang until the script's timeout
        ("broadcast-self-root", "roots differ", ["root rank 0", "root rank 1"]),
        # today: consistent, the tensor a mix of both ops
        ("reduce-sum-max", "reduce ops differ", ["sum on rank 0, max on rank 1"]),
        # today: gloo aborts rank 0 ("Received data size doesn't match")
        (
            "a2a-unpaired",
            "splits do not pair",
            ["rank 1 sends rank 0 4 elements, rank 0 expects 2"],
        ),
    ],
)
def test_a_collective_whose_members_disagree_beyond_its_size_is_named_before_it_is_issued(
    ran, case, reason, said
):
    per_rank, report = _case(ran, case)
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert found["ranks"] == [1] and found["reference_rank"] == 0
    assert reason in found["details"]["reason"]
    assert found["details"]["group_ranks"] == [0, 1]
    for text in said:
        assert text in found["summary"], found["summary"]
    assert "step_worker.py" in found["summary"]  # the script's line that issued it


def test_a_send_whose_receive_expects_another_size_is_named_before_either_is_issued(ran):
    # Today: not watched; gloo aborts the receiver.
    per_rank, report = _case(ran, "p2p-size")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert "the send does not match its receive" in found["details"]["reason"]
    assert "sends 4 float32" in found["summary"] and "expects 2 float32" in found["summary"]
    sides = found["details"]["ranks"]
    assert sides["rank 0"]["peer"] == 1 and sides["rank 1"]["peer"] == 0


def test_a_stage_whose_sends_the_next_stage_never_receives_is_named_before_either_blocks(ran):
    # torchtitan#775. Today: each stage posted its sends ahead (the other was waiting in the
    # watch), then blocked in gloo's wait for a receive that never came: exit 3 on a timeout.
    per_rank, report = _case(ran, "pipeline-fewer-microbatches")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert "the sends and receives do not pair" in found["details"]["reason"]
    sides = found["details"]["ranks"]
    sender = sides["rank 0"]
    assert (sender["op"], sender["peer"], sender["numel"], sender["dtype"]) == (
        "send",
        1,
        16,
        "float32",
    )
    # Stage 1's schedule takes 2 microbatches: stage 0's third forward send is never taken.
    assert (sender["stage"], sender["phase"], sender["microbatch"]) == (0, "forward", 2)
    assert sides["rank 1"]["phase"] == "backward" and sides["rank 1"]["peer"] == 0
    assert "send to rank 1 (stage 0 forward, microbatch 2)" in found["summary"]


def test_a_send_whose_peer_finishes_its_step_is_named_not_a_timeout(ran):
    per_rank, report = _case(ran, "p2p-unreceived")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert found["details"]["reason"].startswith(
        "the pair never comes: rank 1 finished its step without the other side of rank 0's "
        "send to rank 1 (2 float32"
    )
    assert found["details"]["not_issued_by"] == [1]


def test_a_compiled_step_runs_eagerly_under_the_watch_and_compiles_after_it(ran):
    # What docs/checks.md says runs: under the watch's dispatch mode dynamo compiles no frame
    # on any torch, so the step's collectives are the eager ones, all watched; a torch that
    # compiles under a dispatch mode (collectives inside a graph the watch may not see) fails
    # here. After the watch, by version: torch 2.13 does not compile a function first called
    # under the watch on its next call either; 2.15 does (issue 37), which is harmless (the
    # watch saw its eager form), so there it is only reported.
    import torch

    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    for rank in ran:
        case = rank["compiled-step"]
        assert case["frames_under_watch"] == 0, case
        if release < (2, 15):
            assert case["frames_after"] == 0, case


def test_a_grad_norm_over_dtensor_gradients_on_rank_0_only_is_named_before_it_is_issued(ran):
    # Today: DTensor's all-reduce runs inside its own dispatch, unseen; rank 1's watch timed
    # out and raised a raw RuntimeError out of check_step.
    per_rank, report = _case(ran, "clip-rank0")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    found = _only(report, "step")
    assert found["ranks"] == [0] and found["details"]["not_issued_by"] == [1]
    assert "all-reduce at step_worker.py" in found["summary"]
    assert "a DTensor redistribution" in found["summary"]


def test_the_sub_mesh_groups_fsdpcheck_builds_carry_its_timeout(ran):
    # Today the one-rank "dp_shard" groups carried gloo's default 30 minutes; the "dp_replicate" dim
    # spans the world and reuses the script's own group (its timeout is the script's).
    for rank in ran:
        assert rank["submesh-timeout"]["timeouts"]["dp_shard"] == 7.0


def test_a_collective_the_watch_cannot_see_ends_every_rank_with_exit_3_naming_it(job):
    # Today rank 1's watch raised a raw RuntimeError out of check_step. Rank 0 waits in its
    # thread's all-reduce until rank 1 gives up and leaves; then its own check gives up too.
    records, result = job
    assert result.codes == [3, 3]
    per_rank = [r["unseen-rank0"] for r in records]
    assert [r["exit_code"] for r in per_rank] == [3, 3]
    for rank in per_rank:
        assert rank["seconds"] < BOUND
    # Named by the rank that gave up first: rank 1 (rank 0 stuck), as seen in every run here.
    assert "rank 0 is stuck in stage 'step'" in per_rank[1]["headline"], per_rank[1]["headline"]
