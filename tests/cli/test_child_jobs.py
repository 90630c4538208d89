"""The child-job framework on real processes: deadlines, kills, stages and records."""

from __future__ import annotations

import os
import textwrap

import psutil
import pytest

from fsdpcheck.children.launch import launch, run_each
from fsdpcheck.vocab import ChildStage

# torchrun's agent variables as its workers see them (torch 2.6+).
TORCHRUN_VARS = {
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_ERROR_FILE": "/nonexistent/error.json",
    "TORCH_ELASTIC_TEST": "1",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_NAME": "default",
    "ROLE_RANK": "1",
    "ROLE_WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


def _py(code: str) -> list[str]:
    return ["-c", textwrap.dedent(code)]


def test_a_job_past_its_deadline_is_killed_with_everything_it_started() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = """
        import subprocess, sys, time
        from fsdpcheck.children.launch import mark_stage
        from fsdpcheck.vocab import ChildStage
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        mark_stage(ChildStage.LOADING)  # a rank stuck inside a collective
        time.sleep(60)
    """
    result = launch(_py(code), 2, timeout=5.0)
    assert result.timed_out and result.codes == [None, None]
    assert [r.stage for r in result.ranks] == [ChildStage.LOADING, ChildStage.LOADING]
    assert result.elapsed < 30
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    # No grandchild of theirs is left anywhere either.
    orphans = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and p.info["cmdline"][-1] == "import time; time.sleep(60)"
    ]
    assert not [p for p in orphans if p.pid not in before]


def test_records_arrive_as_they_are_emitted_and_exit_codes_are_kept() -> None:
    code = """
        import os, sys
        from fsdpcheck.children.launch import emit
        print("noise that is not a record")
        emit({"seed": os.environ["PYTHONHASHSEED"], "n": 1})
        emit({"seed": os.environ["PYTHONHASHSEED"], "n": 2})
        sys.exit(int(os.environ["PYTHONHASHSEED"]))
    """
    seen: list[tuple[int, int]] = []
    envs = [{"PYTHONHASHSEED": str(s)} for s in (0, 3)]
    outcomes = run_each(
        _py(code), envs, jobs=2, timeout=60, on_record=lambda i, r: seen.append((i, r["n"]))
    )
    assert [o.returncode for o in outcomes] == [0, 3]
    assert [[r["n"] for r in o.records] for o in outcomes] == [[1, 2], [1, 2]]
    assert outcomes[1].result == {"seed": "3", "n": 2}
    assert sorted(seen) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert "noise" in outcomes[0].stdout
    assert "code 3" in outcomes[1].failure(60)


def test_a_job_started_under_torchrun_is_a_job_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # With torchrun's agent variables inherited, rank 0 would wait for an agent store nobody
    # serves (issue 19); the child's own env:// variables must win.
    for key, value in TORCHRUN_VARS.items():
        monkeypatch.setenv(key, value)
    code = """
        import os
        import torch.distributed as dist
        from fsdpcheck.children.launch import emit
        dist.init_process_group("gloo")
        dist.barrier()
        agent = sorted(k for k in os.environ if k.startswith(("TORCHELASTIC", "GROUP_", "ROLE_")))
        emit({"rank": dist.get_rank(), "world": dist.get_world_size(), "agent": agent,
              "local_world": os.environ["LOCAL_WORLD_SIZE"]})
        dist.destroy_process_group()
    """
    result = launch(_py(code), 2, env={"OMP_NUM_THREADS": "1"}, timeout=90)
    assert result.codes == [0, 0], result.output(0)
    records = [r.result for r in result.ranks]
    assert [(r["rank"], r["world"], r["local_world"]) for r in records] == [
        (0, 2, "2"),
        (1, 2, "2"),
    ]
    assert all(r["agent"] == [] for r in records)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the parent's own is untouched
