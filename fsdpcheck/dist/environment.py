"""What software a rank runs, from an allowlist only (no arbitrary variables, no secrets)."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata


from fsdpcheck.records import EnvRecord


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_record(rank: int, local_rank: int, world_size: int, backend: str) -> EnvRecord:
    """The allowlisted environment of this rank: versions and placement, nothing else."""
    import torch

    return EnvRecord(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        host=socket.gethostname(),
        backend=backend,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=package_version("transformers"),
        hash_seed=os.environ.get("PYTHONHASHSEED", "random"),
        accelerate=package_version("accelerate"),
        nccl=nccl_version(),
        cuda=torch.version.cuda,
    )


def nccl_version() -> str | None:
    """The NCCL version torch was built with, ``2.21.5``; None without NCCL (CPU builds)."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this build, or no CUDA runtime: nothing to compare
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)
