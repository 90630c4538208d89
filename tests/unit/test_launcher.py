"""Which launcher started a rank: pure detection from an environment dict."""

from __future__ import annotations

import pytest

from fsdpcheck.distributed.launcher import LaunchEnv, detect, local_rank_hint, rank_hint
from fsdpcheck.errors import InputError

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


def test_rank_hint_names_a_rank_even_for_bad_input() -> None:
    assert rank_hint({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == 3  # no SLURM_LOCALID
    assert rank_hint({"RANK": "x"}) == 0


def test_local_rank_hint_for_a_script_that_joined_its_own_group() -> None:
    assert local_rank_hint({"LOCAL_RANK": "3"}, 7) == 3
    assert local_rank_hint({"SLURM_LOCALID": "1"}, 7) == 1
    assert local_rank_hint({}, 7) == 7


def test_only_torch_launchers_leave_rank_and_world_size_to_env_init() -> None:
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).from_torch_env
    assert not detect(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    ).from_torch_env
    assert not detect({}).from_torch_env  # one rank: passed explicitly too
