"""Which launcher started a rank: pure detection from an environment, then real 2-rank jobs
started with only srun's or only mpirun's variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUIET_ENV, REPO

from fsdpcheck.dist.launcher import FOREIGN, LaunchEnv, detect
from fsdpcheck.errors import InputError
from fsdpcheck.launch import free_port

RDV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, LaunchEnv("none", 0, 0, 1)),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", **RDV},
            LaunchEnv("torchrun", 1, 1, 2, "127.0.0.1", 29511),
        ),
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "ACCELERATE_MIXED_PRECISION": "no",
             **RDV},
            LaunchEnv("accelerate", 3, 1, 4, "127.0.0.1", 29511),
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", **RDV},
            LaunchEnv("srun", 1, 0, 2, "127.0.0.1", 29511),
        ),
        (  # old SLURM releases call it SLURM_NPROCS
            {"SLURM_PROCID": "0", "SLURM_NPROCS": "1", "SLURM_LOCALID": "0"},
            LaunchEnv("srun", 0, 0, 1),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "0", **RDV},
            LaunchEnv("mpirun", 2, 0, 4, "127.0.0.1", 29511),
        ),
        (  # torchrun inside an sbatch allocation: the allocation's SLURM_* are not this job's
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", **RDV},
            LaunchEnv("torchrun", 5, 1, 8, "127.0.0.1", 29511),
        ),
        (  # mpirun inside an allocation
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", **RDV},
            LaunchEnv("mpirun", 1, 1, 2, "127.0.0.1", 29511),
        ),
        (  # a wrapper that exports RANK from mpirun's variables: they agree
            {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
             "OMPI_COMM_WORLD_SIZE": "2", **RDV},
            LaunchEnv("torchrun", 1, 1, 2, "127.0.0.1", 29511),
        ),
    ],
)  # fmt: skip
def test_detect(environ: dict[str, str], expected: LaunchEnv) -> None:
    assert detect(environ) == expected


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE", "RANK"]),
        ({"LOCAL_RANK": "0"}, ["LOCAL_RANK"]),
        ({"SLURM_PROCID": "0"}, ["SLURM_PROCID", "SLURM_NTASKS"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **RDV}, ["SLURM_LOCALID"]),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK"]),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
         ["MASTER_ADDR and MASTER_PORT", "scontrol show hostnames"]),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
         ["MASTER_PORT", "mpirun -x"]),
        ({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "1",
          "OMPI_COMM_WORLD_SIZE": "2", **RDV}, ["mixed", "OMPI_COMM_WORLD_SIZE=2", "unset"]),
        ({"RANK": "2", "WORLD_SIZE": "2", **RDV}, ["RANK=2", "WORLD_SIZE=2"]),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, ["SLURM_PROCID='x'"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"},
         ["MASTER_PORT='http'"]),
    ],
)  # fmt: skip
def test_partial_or_mixed_variables_are_bad_input(environ: dict, named: list[str]) -> None:
    with pytest.raises(InputError) as caught:
        detect(environ)
    message = str(caught.value)
    for text in named:
        assert text in message, message
    assert "\n" not in message


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
