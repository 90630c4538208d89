"""A child job's environment: a new job, not a worker of whatever launched its parent."""

from __future__ import annotations

import os

from fsdpcheck.children.launch import child_env

RANK_VARS = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29600"}


def test_an_enclosing_jobs_launcher_and_agent_variables_are_dropped():
    parent = {
        "PATH": "/usr/bin",
        "HOME": "/home/me",
        "RANK": "3",
        "WORLD_SIZE": "8",
        "MASTER_PORT": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 would wait for the agent's store
        "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
        "TORCH_ELASTIC_WORKER_IDENTIFIER": "x",
        "GROUP_RANK": "0",
        "ROLE_RANK": "3",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "8",
        "SLURM_PROCID": "5",
        "OMPI_COMM_WORLD_RANK": "5",
    }
    env = child_env(parent, {"OMP_NUM_THREADS": "1"}, RANK_VARS)
    assert {k: v for k, v in env.items() if k != "PYTHONPATH"} == {
        "PATH": "/usr/bin",
        "HOME": "/home/me",
        "OMP_NUM_THREADS": "1",
        **RANK_VARS,
    }


def test_this_fsdpcheck_comes_first_on_the_path():
    import fsdpcheck

    root = os.path.dirname(os.path.dirname(os.path.abspath(fsdpcheck.__file__)))
    env = child_env({"PYTHONPATH": "/elsewhere"}, {}, {})
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
