"""What differs per process by nature never reaches the launch record (issue 30): each rank's
own numbers inside arguments and paths, a Ray worker's own command line, host, pid and memory
addresses are normalised on the rank, before any digest; a real launch difference is still a
``launch`` finding. Each case is two or three ranks' records, as launch_record makes them from
the argv and environment each rank really had, through the report's checks."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
from synthetic import state_record, tensor

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.distributed.environment import launch_record
from fsdpcheck.records import RankRecord
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import FindingKind, Verdict

RAY = "/venv/lib/python3.12/site-packages/ray/_private/workers/default_worker.py"


def torchrun(rank: int, local: int | None = None, node: int = 0, **extra: str) -> dict:
    local = rank if local is None else local
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node), **extra}


def srun(rank: int, local: int | None = None, node: int = 0, **extra: str) -> dict:
    local = rank if local is None else local
    ids = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
    return {**ids, "SLURM_NTASKS": "4", **extra}


def _report(started: dict[int, tuple[list[str], dict[str, str]]]):
    """Each rank's record as that rank would make it from its own argv and environment."""
    records = {}
    for rank, (argv, environ) in started.items():
        base = state_record(rank, pre=([], [tensor("w", (4,))]))
        records[rank] = replace(base, launch=launch_record(argv, environ, rank=rank))
    return assemble(AuditOutcome(gathered_from(records)), None), records


def _consistent(started) -> dict[int, RankRecord]:
    report, records = _report(started)
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]
    assert len({r.group_digest() for r in records.values()}) == 1  # one group, before any check
    return records


def _launch_finding(started):
    report, _ = _report(started)
    found = [f for f in report.findings if f.kind == FindingKind.LAUNCH]
    assert report.verdict == Verdict.INCONSISTENT and len(found) == 1, report.findings
    return found[0]


AUDIT = ["/v/bin/fsdpcheck", "audit", "--model", "tiny-llama", "--mesh", "2,1", "--probe", "8"]


@pytest.mark.parametrize(
    "per_rank",
    [
        ["--json", "r{r}.json"],  # a launcher script's per-rank report
        ["--json={r}.json", "--junit", "out/rank{r}/report.xml"],
        ["--json", "out/{r}/report.json", "--log", "logs/rank_{r}.log"],
        ["--log", "report-0{r}.log"],  # srun's report-%2t, expanded per task
        ["--device", "cuda:{r}", "--local-rank={r}", "--node-rank", "0"],
        ["--json", "report.{r}.json", "--trace", "trace.{r}"],  # an mpirun user's per-rank names
    ],
    ids=["r1.json", "rank1-dir", "number-dir", "srun-%2t", "device", "dotted"],
)
def test_words_that_differ_only_by_each_ranks_own_number_are_alike(per_rank: list[str]) -> None:
    def argv(r: int) -> list[str]:
        return [*AUDIT, *(w.format(r=r) for w in per_rank)]

    records = _consistent({r: (argv(r), torchrun(r)) for r in range(3)})
    assert "<rank>" in " ".join(records[1].launch.argv) or "<per-rank>" in records[1].launch.argv
    # srun's variables alone (no torch variable) say the same, on two nodes.
    _consistent({r: (argv(r % 2), srun(r, local=r % 2, node=r // 2)) for r in range(4)})


def test_a_number_that_is_a_value_of_its_own_stays_as_it_is() -> None:
    """Coincidental digits on rank 1: a mesh, a seed, an exponent, a version, a model id."""
    argv = ["train.py", "--mesh", "2,1", "--seed", "1", "--lr", "1e-1", "--v", "v1.0.1"]
    argv += ["--model", "meta-llama/Llama-3.1-8B", "--port=29501", "--warmup", "0.1"]
    # Digits in names that are no rank's: a model, a numbered run directory, a date.
    argv += ["--base", "gpt2", "--out", "/tmp/pytest-1/run1/test_an1/x.json", "--day", "2024-01-01"]
    record = launch_record(argv, torchrun(1), rank=1)
    assert list(record.argv) == argv  # nothing of it is rank 1's own
    _consistent({r: (argv, torchrun(r)) for r in range(2)})


def test_a_real_launch_difference_is_still_found_with_per_rank_paths() -> None:
    def argv(r: int, lr: str = "1e-3", script: str = "train.py") -> list[str]:
        return [script, "--lr", lr, "--json", f"r{r}.json"]

    # Another NCCL algorithm on rank 1; its clean twin is every test above.
    algo = {
        0: (argv(0), torchrun(0, NCCL_ALGO="Ring")),
        1: (argv(1), torchrun(1, NCCL_ALGO="Tree")),
    }
    finding = _launch_finding(algo)
    assert finding.ranks == (1,) and "environment NCCL_ALGO" in finding.summary
    # Another learning rate on rank 1: named by position, with both values.
    finding = _launch_finding({0: (argv(0), torchrun(0)), 1: (argv(1, "2e-3"), torchrun(1))})
    assert "[2] 2e-3 (rank 0: 1e-3)" in finding.summary
    # Another entry script on rank 1.
    other = {0: (argv(0), torchrun(0)), 1: (argv(1, script="/x/eval.py"), torchrun(1))}
    assert "[0] eval.py (rank 0: train.py)" in _launch_finding(other).summary
    # A bare number is a value even where it equals each rank's own: a per-rank seed.
    seeds = {r: ([*argv(r), "--seed", str(r)], torchrun(r)) for r in range(2)}
    assert "[6] 1 (rank 0: 0)" in _launch_finding(seeds).summary
    # A per-rank path that names another rank's number is not this rank's own: found (rank 1
    # on node 0 may say r0: 0 is its node rank).
    wrong = {r: (argv(1 if r == 2 else r), torchrun(r)) for r in range(3)}
    finding = _launch_finding(wrong)
    assert finding.ranks == (2,) and "r1.json" in finding.summary


def test_a_ray_workers_own_arguments_are_not_compared_but_its_variables_are() -> None:
    def worker(r: int) -> list[str]:
        return [
            RAY,
            "--node-ip-address=10.0.0.2",
            f"--worker-id={r}f3a9c0e1d2b4",
            f"--runtime-env-hash={1000 + r}",
            f"--worker-launch-time-ms=17{r}0000",
            "--object-store-name=/tmp/ray/session_1/sockets/plasma_store",
        ]

    # verl's actors set RANK and friends themselves.
    records = _consistent({r: (worker(r), torchrun(r)) for r in range(2)})
    assert records[0].launch.argv == ("<ray worker>",)
    skewed = {r: (worker(r), torchrun(r, NCCL_ALGO="Tree" if r else "Ring")) for r in range(2)}
    assert _launch_finding(skewed).ranks == (1,)


def test_addresses_host_and_pid_are_placeholders() -> None:
    host, pid = socket.gethostname(), os.getpid()
    argv = ["train.py", "--hook", "<function f at 0x7f3a1c2b4d60>", f"--tag={host}/pid{pid}"]
    argv += ["--steps", str(pid)]  # a value that equals the pid is a value
    record = launch_record(argv, {"NCCL_X": f"/tmp/{host}/r1"}, rank=1)
    assert record.argv[2:] == (
        "<function f at 0x<address>>",
        "--tag=<host>/pid<pid>",
        "--steps",
        str(pid),
    )
    assert record.env == {"NCCL_X": "/tmp/<host>/r<rank>"}


def test_a_constant_that_looks_like_one_ranks_own_number_is_no_finding() -> None:
    """``step_0.pt`` is every rank's checkpoint: rank 0 records ``step_<rank>.pt`` (its own
    0), rank 1 ``step_0.pt``. Word by word they were one word: no launch or unexplained
    finding. The same word where rank 1 really had another step is found."""
    argv = ["train.py", "--resume", "ckpt/step_0.pt", "--json", "r{r}.json"]
    script = {r: {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)}  # no node rank
    started = {r: ([w.format(r=r) for w in argv], script[r]) for r in range(2)}
    report, records = _report(started)
    assert records[0].launch.argv[2] == "ckpt/step_<rank>.pt"
    assert records[1].launch.argv[2] == "ckpt/step_0.pt"
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]
    other = {
        **started,
        1: (["train.py", "--resume", "ckpt/step_2.pt", "--json", "r1.json"], torchrun(1)),
    }
    assert "step_2.pt" in _launch_finding(other).summary


def test_a_host_name_is_per_host_and_a_constant_host_is_a_constant() -> None:
    """Two nodes: each rank's log folder named after its host is alike; rank 0's host given to
    every rank (``--dist-url tcp://node-a:29500``) is alike too, though only node-a's ranks
    wrote it ``<host>``; another address on one rank is found."""

    def report(urls: dict[int, str]):
        records = {}
        for rank, host in enumerate(("node-a", "node-b")):
            argv = ["train.py", "--log", f"logs/{host}/r{rank}.log", "--dist-url", urls[rank]]
            base = state_record(rank, pre=([], [tensor("w", (4,))]))
            launch = launch_record(argv, torchrun(rank, local=0, node=rank), rank=rank, host=host)
            records[rank] = replace(base, env=replace(base.env, host=host), launch=launch)
        return assemble(AuditOutcome(gathered_from(records)), None), records

    same = "tcp://node-a:29500"
    clean, records = report({0: same, 1: same})
    assert records[0].launch.argv[2:] == (
        "logs/<host>/r<rank>.log",
        "--dist-url",
        "tcp://<host>:29500",
    )
    assert records[1].launch.argv[4] == same
    assert clean.verdict == Verdict.CONSISTENT, [f.summary for f in clean.findings]
    skewed, _ = report({0: same, 1: "tcp://node-c:29500"})
    [finding] = [f for f in skewed.findings if f.kind == FindingKind.LAUNCH]
    assert finding.ranks == (1,) and "node-c" in finding.summary
