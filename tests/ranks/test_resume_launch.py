"""Resume and launch provenance on 2 real ranks (issue 21): one job (tests/workers/
resume_worker.py) saves DCP checkpoints, then resumes from them through ``check_model`` and
``audit --resume`` (library and CLI), and starts rank 1 with an extra flag; every failing case
with its clean twin."""

from __future__ import annotations

import json

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import launch


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    out = root / "cases.json"
    result = launch(
        ["tests/workers/resume_worker.py", "--out", str(out), "--root", str(root)],
        2,
        env={**QUIET_ENV, "OMP_NUM_THREADS": "1"},
        # Rank 1 started with one more flag and another allow-listed NCCL variable.
        rank_env=lambda r: (
            {"FSDPCHECK_TEST_EXTRA_ARGV": "--enforce-eager", "NCCL_ALGO": "Tree"} if r else {}
        ),
        cwd=str(REPO),
        timeout=300,
    )
    # Rank 1 is killed in the last case (audit-resume-peer-died), on purpose.
    assert result.codes == [0, -9] and out.is_file(), result.output(0) + result.output(1)
    return json.loads(out.read_text())


def _kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def test_a_script_resumed_from_its_own_checkpoint_on_every_rank_is_consistent(cases) -> None:
    for case in ("resumed", "resumed-latest"):
        done = cases[case]
        assert done["exit_codes"] == [0, 0], done["report"]["findings"]
        checkpoint = done["report"]["checkpoint"]
        assert checkpoint["step"] == 100 and checkpoint["saved_ranks"] == 2
        assert checkpoint["path"].endswith("tiny/step-100")


def test_a_rank_that_resumed_another_step_is_a_checkpoint_finding(cases) -> None:
    done = cases["stale"]
    assert done["exit_codes"] == [1, 1]
    [finding] = done["report"]["findings"]
    assert (finding["kind"], finding["ranks"], finding["reference_rank"]) == ("checkpoint", [1], 0)
    fields = [d["field"] for d in finding["details"]["groups"][0]["differences"]]
    assert fields == ["path", "step", "metadata"]
    assert "(step 200, .metadata" in finding["summary"] and "(step 100," in finding["summary"]


def test_a_rank_started_with_an_extra_flag_is_a_launch_finding(cases) -> None:
    done = cases["launch-skew"]
    assert done["exit_codes"] == [1, 1]
    [finding] = done["report"]["findings"]
    assert (finding["kind"], finding["ranks"]) == ("launch", [1])
    [group] = finding["details"]["groups"]
    assert [d["other"] for d in group["argv"]] == [["--enforce-eager"]]
    assert group["env"] == [{"key": "NCCL_ALGO", "reference": "<unset>", "other": "Tree"}]
    assert "--enforce-eager" in finding["summary"] and "NCCL_ALGO" in finding["summary"]


def test_audit_resume_loads_every_rank_with_dcp_and_verifies_it(cases) -> None:
    done = cases["audit-resume"]
    report = done["report"]
    assert done["exit_codes"] == [0, 0], report["findings"] + report["errors"]
    assert report["load"]["outcome"] == "loaded" and report["load"]["method"] == "resume"
    assert report["verify"]["passed"] is True and report["verify"]["checked"] > 0
    assert report["checkpoint"]["step"] == 1 and report["options"]["resume"].endswith("step-1")
    assert report["options"]["init"] == "meta"  # a resume builds on meta, --init or not
    # Its failing twin: rank 1 resumed the later save.
    stale = cases["audit-resume-stale"]
    assert stale["exit_codes"] == [1, 1]
    kinds = _kinds(stale["report"])
    assert "checkpoint" in kinds and "verify" in kinds
    [finding] = [f for f in stale["report"]["findings"] if f["kind"] == "checkpoint"]
    assert finding["ranks"] == [1]


def test_audit_resume_of_a_directory_one_rank_lacks_is_bad_input_naming_it(cases) -> None:
    done = cases["audit-resume-missing"]
    assert done["exit_codes"] == [2, 2]
    [error] = done["report"]["errors"]
    assert (error["rank"], error["kind"]) == (1, "input")
    assert "rank 1 cannot read it" in error["message"] and "step-9" in error["message"]


def test_audit_resume_through_the_cli(cases) -> None:
    done = cases["cli-resume"]
    assert done["exit_codes"] == [0, 0], done["stdout"]
    report = done["report"]
    assert report["verdict"] == "consistent" and report["verify"]["passed"] is True
    assert report["checkpoint"]["step"] == 1  # the root's LATEST names step-1
    assert "verification against rank 0's checkpoint passed" in done["stdout"]
    assert "resume verified on 2 ranks" in done["stdout"]
    missing = cases["cli-resume-missing"]
    assert missing["exit_codes"] == [2, 2]
    assert "rank 1 cannot read it" in missing["report"]["errors"][0]["message"]


def test_audit_resume_of_a_shard_file_damaged_on_one_rank_is_bad_input_naming_it(cases) -> None:
    """DCP raises rank 1's read failure on every rank: the error is rank 1's, and the
    checkpoint's (exit 2), not a runtime failure on rank 0."""
    done = cases["audit-resume-damaged"]
    assert done["exit_codes"] == [2, 2]
    report = done["report"]
    [error] = report["errors"]
    assert (error["rank"], error["stage"], error["kind"]) == (1, "load", "input")
    assert "damaged-step-1 on rank 1:" in error["message"] and "- rank 1: " in error["message"]
    assert report["load"]["outcome"] == "failed" and report["load"]["error_kind"] == "input"


def test_a_rank_that_cannot_read_its_metadata_before_the_load_ends_every_rank(cases) -> None:
    """Rank 1 fails before dcp.load's first collective: every rank learns it there and none
    waits inside the load (the clean twin is audit-resume)."""
    done = cases["audit-resume-metadata-on-1"]
    assert done["exit_codes"] == [2, 2]
    report = done["report"]
    errors = {(e["rank"], e["stage"], e["kind"]) for e in report["errors"]}
    assert errors == {(1, "load", "input")}, report["errors"]
    [error] = report["errors"]
    assert (
        "could not read it before dcp.load" in error["message"] and "- rank 1: " in error["message"]
    )
    assert {f["kind"] for f in report["findings"]} >= {"checkpoint"}  # its .metadata differs


def test_a_peer_dying_inside_dcp_load_is_a_runtime_failure_naming_it(cases) -> None:
    """The clean twin is audit-resume: the same load with no rank killed."""
    done = cases["audit-resume-peer-died"]
    assert done["exit_code"] == 3  # rank 0's own: rank 1 was killed
    report = done["report"]
    assert report["exit_code"] == 3 and report["verdict"] == "error"
    [error] = report["errors"]
    assert (error["rank"], error["stage"], error["kind"]) == (1, "load", "runtime")
    assert "rank 1 died during stage 'load'" in error["message"]
