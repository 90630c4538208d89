"""Ranks started by srun or mpirun, as those launchers leave them: only their own variables
(and MASTER_ADDR/MASTER_PORT), none of torchrun's. They must form one job, not lone ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import QUIET_ENV, REPO

from fsdpcheck.children.launch import free_port
from fsdpcheck.distributed.launcher import FOREIGN

RDV = ("MASTER_ADDR", "MASTER_PORT")


def _start(rank_vars: list[dict[str, str]], args: list[str]) -> list[subprocess.CompletedProcess]:
    """Start one process per entry with exactly these launcher variables (nothing of torchrun)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *FOREIGN}
    base = {k: v for k, v in os.environ.items() if k not in drop and k not in RDV}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fsdpcheck", *args],
            env={**base, **QUIET_ENV, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **extra},
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        for extra in rank_vars
    ]  # fmt: skip
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=150)
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return out


def _two_ranks(tmp_path: Path, names: tuple[str, str, str]) -> None:
    rdv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [{names[0]: str(r), names[1]: "2", names[2]: str(r), **rdv} for r in range(2)]
    report = tmp_path / "report.json"
    args = ["audit", "--model", "hazard", "--no-load", "--timeout", "60", "--json", str(report)]
    done = _start(ranks, args)
    for r, proc in enumerate(done):
        assert proc.returncode == 0, f"rank {r}: {proc.stdout}{proc.stderr}"
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and data["verdict"] == "consistent"
    assert sorted(e["rank"] for e in data["environment"]) == [0]  # one group of both ranks
    assert [len(g["ranks"]) for g in data["groups"]] == [2]
    assert done[0].stdout.count("verdict:") == 1 and "verdict:" not in done[1].stdout


def test_srun_variables_alone_form_one_two_rank_job(tmp_path: Path) -> None:
    _two_ranks(tmp_path, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def test_mpirun_variables_alone_form_one_two_rank_job(tmp_path: Path) -> None:
    _two_ranks(
        tmp_path, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    )
