"""Ranks started by srun or mpirun, as those launchers leave them: only their own variables
(and MASTER_ADDR/MASTER_PORT), none of torchrun's. They must form one job, not lone ranks. Each
rank writes its own report, as launcher scripts do (``--json r1.json`` on rank 1, srun's
``report-%t``): what differs only by each rank's own number is no ``launch`` finding (issue 30),
while a real launch difference still is."""

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
TORCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _base_env() -> dict[str, str]:
    """This environment without any launcher's variables, quiet, one thread, one hash seed."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", *FOREIGN}
    base = {k: v for k, v in os.environ.items() if k not in drop and k not in RDV}
    return {**base, **QUIET_ENV, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _wait(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
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


def _two_ranks(
    tmp_path: Path,
    names: tuple[str, str, str],
    report: str,
    extra: tuple[str, ...] = (),
    *,
    model: str = "hazard",
    rank_env: dict[int, dict[str, str]] | None = None,
) -> tuple[list[subprocess.CompletedProcess], dict]:
    """Two ranks with these launcher variables, each given its own report path (``report``
    with ``{r}`` its rank); rank 0's report."""
    rdv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        {names[0]: str(r), names[1]: "2", names[2]: str(r), **rdv, **(rank_env or {}).get(r, {})}
        for r in range(2)
    ]
    args = [sys.executable, "-m", "fsdpcheck", "audit", "--model", model, "--timeout", "60", *extra]
    procs = [
        subprocess.Popen(
            [*args, "--json", str(tmp_path / report.format(r=r))],
            env={**_base_env(), **ranks[r]},
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]  # fmt: skip
    done = _wait(procs)
    data = json.loads((tmp_path / report.format(r=0)).read_text())
    assert data["world_size"] == 2, data
    assert done[0].stdout.count("verdict:") == 1 and "verdict:" not in done[1].stdout
    return done, data


def _agreeing(done: list[subprocess.CompletedProcess], data: dict, verdict: str = "consistent"):
    codes = [0, 0] if verdict == "consistent" else [1, 1]
    assert [p.returncode for p in done] == codes, [p.stdout + p.stderr for p in done]
    assert data["verdict"] == verdict, [f["summary"] for f in data["findings"]]
    assert sorted(e["rank"] for e in data["environment"]) == [0]  # one group of both ranks
    assert [len(g["ranks"]) for g in data["groups"]] == [2]
    assert not [f for f in data["findings"] if f["kind"] != "hash-seed"], data["findings"]


def test_srun_variables_alone_form_one_two_rank_job(tmp_path: Path) -> None:
    """srun's variables only, each task its own report (``report-%t.json``); ``--probe`` on a
    model whose buffer order follows the hash seed: latent, and no ``launch`` finding. Seeds 0
    and 1 already give the hazard's two orders (children/probe.py), so 2 seeds say what 8 do at
    a quarter of the child builds."""
    done, data = _two_ranks(
        tmp_path, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "report-{r}.json",
        ("--no-load", "--probe", "2"),
    )  # fmt: skip
    _agreeing(done, data, "latent")
    assert [f["kind"] for f in data["findings"]] == ["hash-seed"]


def test_mpirun_variables_alone_form_one_two_rank_job(tmp_path: Path) -> None:
    """mpirun's variables only, HSDP (``--mesh 2,1``), each rank's report in its own folder."""
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1").mkdir()
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    done, data = _two_ranks(tmp_path, names, "rank{r}/report.json", ("--no-load", "--mesh", "2,1"))
    _agreeing(done, data)


def test_env_ranks_each_writing_its_own_report(tmp_path: Path) -> None:
    """A launcher script's env:// ranks: ``--json r0.json`` on rank 0, ``r1.json`` on rank 1."""
    done, data = _two_ranks(tmp_path, TORCH, "r{r}.json", model="tiny-llama")
    _agreeing(done, data)
    assert data["load"]["outcome"] == "loaded"


def test_env_ranks_started_with_another_nccl_algorithm_are_named(tmp_path: Path) -> None:
    """The same per-rank reports, but rank 1 started with NCCL_ALGO=Tree: a launch finding
    naming the variable and rank 1, not the report paths."""
    done, data = _two_ranks(
        tmp_path, TORCH, "r{r}.json", ("--no-load",), model="tiny-llama",
        rank_env={0: {"NCCL_ALGO": "Ring"}, 1: {"NCCL_ALGO": "Tree"}},
    )  # fmt: skip
    assert [p.returncode for p in done] == [1, 1], [p.stdout + p.stderr for p in done]
    [launch] = [f for f in data["findings"] if f["kind"] == "launch"]
    assert launch["ranks"] == [1] and "NCCL_ALGO" in launch["summary"]
    assert "json" not in launch["summary"] and data["verdict"] == "inconsistent"
