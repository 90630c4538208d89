"""Ranks started by a launcher script (env://), srun, mpirun or ``accelerate launch``, as those
launchers leave them: only their own variables (and MASTER_ADDR/MASTER_PORT), none of
torchrun's, each rank writing its own report (``--json r$RANK.json``, srun's per-task names).
They must form one job, not lone ranks; the clean job (every rank with PYTHONHASHSEED=0) is
``consistent`` with exit 0, whatever differs per process by nature (rank numbers in argv and
paths, DESIGN fact 11). Its twin's rank 1 differs twice, for real: another hash seed on the
hash-order ``hazard`` model (one ``buffer-order`` finding) and ``NCCL_ALGO=Tree`` (one ``launch``
finding naming that variable and no argument: the per-rank paths are still no difference).
Each launcher's twins run at the same time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import free_port
from fsdpcheck.distributed.launcher import FOREIGN

RDV = ("MASTER_ADDR", "MASTER_PORT")
AUDIT = ["audit", "--model", "hazard", "--no-load", "--timeout", "60"]
BUFFER_ORDER = "buffer order differs at index 0"


def _start(
    jobs: list[list[tuple[list[str], dict[str, str]]]],
) -> list[list[subprocess.CompletedProcess]]:
    """Start every job's processes at once, each with exactly these launcher variables (nothing
    of torchrun's); a job is a list of (argv, env) pairs. Waits for all, kills what is left."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTHONHASHSEED", *FOREIGN}
    base = {k: v for k, v in os.environ.items() if k not in drop and k not in RDV}
    started = [
        [
            subprocess.Popen(
                argv, env={**base, **QUIET_ENV, "OMP_NUM_THREADS": "1", **extra}, cwd=REPO,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            )
            for argv, extra in job
        ]
        for job in jobs
    ]  # fmt: skip
    done = []
    try:
        for job in started:
            out = []
            for proc in job:
                stdout, stderr = proc.communicate(timeout=200)
                out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
            done.append(out)
    finally:
        for proc in (p for job in started for p in job):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return done


# Each launcher's variables for rank r of 2 on one node, and the report path its users write.
LAUNCHERS = {
    "env": (
        lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
        "r{rank}.json",
    ),
    "srun": (
        lambda r: {
            "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
            "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_TASK_PID": str(9000 + r),
        },
        "report-task{rank}.json",  # what srun's %t names per task
    ),
    "mpirun": (
        lambda r: {
            "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "0", "PMIX_RANK": str(r),
        },
        "report.{rank}.json",
    ),
}  # fmt: skip
# srun jobs are often multi-node HSDP: its twins run on a 2x1 mesh.
EXTRA = {"srun": ["--mesh", "2,1"]}


def _job(folder: Path, launcher: str, twin: bool) -> list[tuple[list[str], dict]]:
    variables, path = LAUNCHERS[launcher]
    skew = {"PYTHONHASHSEED": "1", "NCCL_ALGO": "Tree"} if twin else {}
    rdv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    folder.mkdir(parents=True)
    return [
        (
            [sys.executable, "-m", "fsdpcheck", *AUDIT, *EXTRA.get(launcher, []),
             "--json", str(folder / path.format(rank=r))],
            {**variables(r), **rdv, "PYTHONHASHSEED": "0", **(skew if r == 1 else {})},
        )
        for r in range(2)
    ]  # fmt: skip


def _read(folder: Path, launcher: str, done: list[subprocess.CompletedProcess]) -> dict:
    """Rank 0's report, once each rank ended with the report's exit code."""
    report = json.loads((folder / LAUNCHERS[launcher][1].format(rank=0)).read_text())
    for r, proc in enumerate(done):
        assert proc.returncode == report["exit_code"], f"rank {r}: {proc.stdout}{proc.stderr}"
    assert report["world_size"] == 2  # one job of both ranks, not lone ranks
    assert done[0].stdout.count("verdict:") == 1 and "verdict:" not in done[1].stdout
    return report


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_launchers_clean_job_is_consistent_and_its_skewed_twin_is_found(
    tmp_path: Path, launcher: str
) -> None:
    clean_dir, skewed_dir = tmp_path / "clean", tmp_path / "skewed"
    clean, skewed = _start([_job(clean_dir, launcher, False), _job(skewed_dir, launcher, True)])
    report = _read(clean_dir, launcher, clean)
    assert (report["verdict"], report["exit_code"]) == ("consistent", 0), report["findings"]
    assert [len(g["ranks"]) for g in report["groups"]] == [2]
    assert sorted(e["rank"] for e in report["environment"]) == [0]
    twin = _read(skewed_dir, launcher, skewed)
    assert (twin["verdict"], twin["exit_code"]) == ("inconsistent", 1)
    found = {f["kind"]: f for f in twin["findings"]}
    assert sorted(found) == ["buffer-order", "launch"], twin["findings"]
    assert found["buffer-order"]["ranks"] == [1]
    assert BUFFER_ORDER in found["buffer-order"]["summary"]
    [skew] = found["launch"]["details"]["groups"]
    assert skew["ranks"] == [1] and skew["argv"] == [], skew
    assert [d["key"] for d in skew["env"]] == ["NCCL_ALGO"]


def test_accelerate_launch_clean_is_consistent_and_vary_hash_seed_is_not(tmp_path: Path) -> None:
    """``accelerate launch`` with 2 processes and no accelerate config file: its multi-process
    launcher is torch's elastic agent plus ACCELERATE_* variables (``--multi_gpu`` names it;
    on a host without GPUs the ranks use gloo, and ``--cpu`` would start one process). The
    clean job, and ``--vary-hash-seed`` as its twin."""
    launcher = str(Path(sys.executable).with_name("accelerate"))
    home = {"HF_HOME": str(tmp_path / "hf-home"), "PYTHONHASHSEED": "0"}

    def job(name: str, *extra: str) -> list[tuple[list[str], dict]]:
        argv = [
            launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "fsdpcheck", *AUDIT, *extra,
            "--json", str(tmp_path / f"{name}.json"),
        ]  # fmt: skip
        return [(argv, home)]

    (clean,), (varied,) = _start([job("clean"), job("varied", "--vary-hash-seed")])
    report = json.loads((tmp_path / "clean.json").read_text())
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert (report["verdict"], report["world_size"]) == ("consistent", 2), report["findings"]
    twin = json.loads((tmp_path / "varied.json").read_text())
    assert varied.returncode != 0 and twin["exit_code"] == 1
    assert [f["kind"] for f in twin["findings"]] == ["buffer-order"], twin["findings"]
    assert twin["findings"][0]["ranks"] == [1]


def test_per_rank_reports_under_a_load_and_a_probe(tmp_path: Path) -> None:
    """Two more clean jobs with per-rank report paths, at once: env:// ranks that load and
    verify (``tiny-llama``, so the load's records are compared too), and srun's variables with
    ``--probe 2`` on the hash-order model (seeds 0 and 1 already give its two orders): latent,
    with the ``hash-seed`` finding alone, no ``launch`` finding."""
    loaded, probed = tmp_path / "loaded", tmp_path / "probed"
    swap = {"hazard": ["tiny-llama"], "--no-load": []}
    load_job = [
        ([w for word in argv for w in swap.get(word, [word])], env)
        for argv, env in _job(loaded, "env", False)
    ]
    probe_job = [
        ([*argv[:-2], "--probe", "2", *argv[-2:]], env) for argv, env in _job(probed, "srun", False)
    ]
    load_done, probe_done = _start([load_job, probe_job])
    report = _read(loaded, "env", load_done)
    assert (report["verdict"], report["exit_code"]) == ("consistent", 0), report["findings"]
    assert report["load"]["outcome"] == "loaded" and report["verify"]["passed"] is True
    report = _read(probed, "srun", probe_done)
    assert (report["verdict"], report["exit_code"]) == ("latent", 1), report["findings"]
    assert [f["kind"] for f in report["findings"]] == ["hash-seed"]
