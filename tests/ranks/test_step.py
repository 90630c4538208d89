"""check_step on 2 real gloo ranks (tests/workers/step_worker.py): each first-step failure of
issue 20 and its clean twin, in one launch. Each asserts the kind, the module named, that the
check ended within its bound, and the exit code on every rank."""

from __future__ import annotations

import pytest
from conftest import run_worker_ranks

TIMEOUT = 20.0
BOUND = TIMEOUT + 10.0  # a divergence is reported within the timeout plus a small bound
FAST = 6.0  # a pair that never comes is found by the ranks' wait marks, not the timeout
# issue 37: every schedule torch ships, rank 1 built for other microbatch counts (each case its
# own pipeline group), and its clean twin (equal counts). DualPipeV needs as many as stages.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "loopedbfs", "interleavedzb", "zbv", "dualpipev")
UNEVEN = {name: ("4-3", "4-2", "3-4") for name in SCHEDULES} | {"dualpipev": ("5-4", "6-4", "4-5")}
SCHEDULE_FAILS = [f"schedule-{name}-{counts}" for name in SCHEDULES for counts in UNEVEN[name]]
SCHEDULE_TWINS = [f"schedule-{name}-4-4" for name in SCHEDULES]
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
    "a2a-self",
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
    *SCHEDULE_FAILS,
    *SCHEDULE_TWINS,
    "p2p-lone-batch",
    "p2p-lone-batch-unreceived",
    # its sends posted ahead of their pair stay posted on the world group: last of the p2p cases
    "pipeline-fewer-microbatches",
    "unseen-rank0",  # last: it ends the job (exit 3 on both ranks)
]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], object]:
    out = tmp_path_factory.mktemp("step")
    result, records = run_worker_ranks(
        "step_worker.py", out, ["--timeout", str(TIMEOUT), *CASES], timeout=420
    )
    assert result.codes == [3, 3], result.output(0)[-3000:] + result.output(1)[-3000:]
    return records, result


@pytest.fixture(scope="module")
def raised(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], object]:
    """A job of its own (it ends with exit 3): rank 1's step raises while rank 0 waits in a
    collective the watch cannot see, until rank 1's process is gone."""
    out = tmp_path_factory.mktemp("step-raised")
    args = ["--timeout", str(TIMEOUT), "raise-rank1-unseen-rank0"]
    result, records = run_worker_ranks("step_worker.py", out, args, timeout=120)
    assert result.codes == [3, 3], result.output(0)[-3000:] + result.output(1)[-3000:]
    return [r["raise-rank1-unseen-rank0"] for r in records], result


# Three stages: a chain of batches, and a cycle of receives no rank can leave (issue 37: it
# ended at the timeout, exit 3). Each case its own group.
THREE_TWINS = [
    "p2p-ring-all",
    "p2p-chain-all",
    "schedule-1f1b-4-4-4",
    "schedule-interleaved-3-3-3",
]
THREE_FAILS = [
    # rank 1's batch is whole, rank 2's never: rank 0's batch, paired with rank 1's, must not
    # be waited on in gloo (rank 1 never issues its own)
    "p2p-chain-broken",
    "schedule-1f1b-4-4-3",
    "schedule-interleaved-3-3-2",
    "schedule-gpipe-4-3-4",
    "schedule-loopedbfs-4-4-3",
    "p2p-cycle-all",
]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("step-three")
    args = ["--timeout", str(TIMEOUT), *THREE_TWINS, *THREE_FAILS]
    result, records = run_worker_ranks(
        "step_worker.py", out, args, seeds=(1, 1, 1), nprocs=3, timeout=240
    )
    assert result.codes == [0, 0, 0], result.output(0)[-3000:]
    return {case: [r[case] for r in records] for case in (*THREE_TWINS, *THREE_FAILS)}


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
        # issue 37 today: the digests differed, no pair of ranks did, so it was issued; gloo
        # raised on rank 1 and both ranks exited 3 after the timeout, blaming rank 0
        (
            "a2a-self",
            "splits do not pair",
            ["rank 1 sends itself 1 elements and expects 2 from itself", "gloo raises"],
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


@pytest.mark.parametrize("case", SCHEDULE_TWINS)
def test_every_schedule_torch_ships_is_consistent_at_equal_microbatches(ran, case):
    per_rank, report = _case(ran, case)
    assert [r["exit_code"] for r in per_rank] == [0, 0]
    assert report["verdict"] == "consistent" and report["findings"] == []
    assert all(r["params_changed"] for r in per_rank)


@pytest.mark.parametrize("case", SCHEDULE_FAILS)
def test_every_schedule_with_a_stage_built_for_other_microbatches_is_named_in_a_second(ran, case):
    # Issue 37: under Schedule1F1B rank 1's last gradient send paired with the receive of rank
    # 0's fused [send F3, recv B2] batch, was issued while the batch waited for its send's pair,
    # and blocked in gloo: exit 3 on both ranks after the timeout, blaming rank 1.
    per_rank, report = _case(ran, case)
    assert [r["exit_code"] for r in per_rank] == [1, 1], [r["headline"] for r in per_rank]
    for rank in per_rank:
        assert rank["seconds"] < FAST, rank["seconds"]
    found = _only(report, "step")
    assert found["details"]["group"] == "pipeline"
    sides = [s for s in found["details"]["ranks"].values() if "op" in s]
    assert sides and all(s["op"] in ("send", "recv") for s in sides), sides
    # The stage and microbatch of each side that issued one, in the details and the summary.
    for side in sides:
        assert {"stage", "phase", "microbatch"} <= set(side), side
        label = f"stage {side['stage']} {side['phase']}, microbatch {side['microbatch']}"
        assert label in found["summary"], found["summary"]


def test_a_lone_send_then_receive_against_a_peer_s_fused_batch_runs_and_its_broken_twin_is_named(
    ran,
):
    # Rank 0 receives and sends in one batch, rank 1 sends then receives on its own. Holding
    # rank 0's batch until rank 1's receive came while rank 1 waited for that batch before
    # sending named a deadlock unwatched gloo does not have: rank 1 goes ahead once rank 0
    # waits on it.
    per_rank, report = _case(ran, "p2p-lone-batch")
    assert [r["exit_code"] for r in per_rank] == [0, 0], report["findings"]
    per_rank, report = _case(ran, "p2p-lone-batch-unreceived")
    assert [r["exit_code"] for r in per_rank] == [1, 1]
    assert all(r["seconds"] < FAST for r in per_rank)
    found = _only(report, "step")
    assert "the sends and receives do not pair" in found["details"]["reason"]


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
    # here. After the watch the function is the script's again and computes what it should;
    # whether dynamo compiles it then is torch's choice (2.13 does not, 2.15 does: issue 37),
    # so frames_after is only reported.
    for rank in ran:
        case = rank["compiled-step"]
        assert case["frames_under_watch"] == 0, case
        assert case["after_values"] == [4.0] * 4, case  # all_reduce over 2 ranks, then * 2


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


def test_an_exit_3_names_the_rank_that_raised_and_holds_each_rank_s_own_exception(raised):
    # Issue 37: rank 1 named rank 0 (waiting for it) "stuck", and rank 1's own error was
    # nowhere in the report.
    per_rank, _ = raised
    assert [r["exit_code"] for r in per_rank] == [3, 3]
    for rank in per_rank:
        assert rank["seconds"] < BOUND
        assert "rank 1's step raised: ValueError: rank 1's own failure" in rank["headline"], rank
    report = per_rank[0]["report"]
    assert report["verdict"] == "error"
    said = {r: " | ".join(e["message"] for e in report["errors"] if e["rank"] == r) for r in (0, 1)}
    assert "rank 1's step raised: ValueError: rank 1's own failure in its step" in said[1]
    # Rank 0's own exception (its collective ended when rank 1's process went) is there too,
    # said to come after rank 1's.
    assert "rank 0's step raised only after rank 1's" in said[0], report["errors"]


@pytest.mark.parametrize("case", THREE_TWINS)
def test_three_stages_that_pair_are_consistent(three, case):
    per_rank = three[case]
    # what each rank said, in full: a false finding seen once on a loaded machine (issue 37)
    said = "\n".join(
        f"{r['headline']}: "
        + " | ".join(
            f"{f['summary']} ({(f.get('details') or {}).get('reason', '')})"
            for f in (r.get("report") or {}).get("findings") or ()
        )
        for r in per_rank
    )
    assert [r["exit_code"] for r in per_rank] == [0, 0, 0], said
    assert per_rank[0]["report"]["findings"] == []
    if case.startswith("schedule-"):  # the ring and chain move activations only
        assert all(r["params_changed"] for r in per_rank)


@pytest.mark.parametrize("case", THREE_FAILS)
def test_three_stages_that_cannot_pair_are_named_in_a_second_on_every_rank(three, case):
    per_rank = three[case]
    assert [r["exit_code"] for r in per_rank] == [1, 1, 1], [r["headline"] for r in per_rank]
    assert all(r["seconds"] < FAST for r in per_rank), [r["seconds"] for r in per_rank]
    found = per_rank[0]["report"]["findings"]
    assert found and {f["kind"] for f in found} == {"step"}


def test_a_cycle_of_receives_over_three_ranks_is_one_finding_naming_the_cycle(three):
    found = _only(three["p2p-cycle-all"][0]["report"], "step")
    assert found["details"]["group_ranks"] == [0, 1, 2]
    reason = found["details"]["reason"]
    assert "they form a cycle: rank 0 waits at its recv from rank 2" in reason, reason
    assert "rank 2 at its recv from rank 1" in reason and "rank 1 at its recv from rank 0" in reason


def test_each_check_deletes_the_keys_its_watch_left_in_the_store(ran):
    # Issue 37: the watch's keys (a few per collective and member) were never deleted, so a job
    # that checks often grew its store: 43 keys a check over these small steps, measured. What
    # stays is each check's liveness marks (a stage mark and a heartbeat per rank) and the
    # groups the cases create.
    cases = [c for c in CASES if c not in ("submesh-timeout", "unseen-rank0")]
    for rank in ran:
        counts = [rank[c]["store_keys"] for c in cases if "store_keys" in rank[c]]
        grown = (counts[-1] - counts[0]) / (len(counts) - 1)
        assert grown < 20, counts
