"""What software a rank runs, from an allowlist only (no arbitrary variables, no secrets)."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import socket
from collections.abc import Iterator
from importlib import metadata

from fsdpcheck.records import EnvRecord

log = logging.getLogger(__name__)


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
        log.debug("no NCCL version", exc_info=True)
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def all_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Inside, torch's intra-op kernels (copies, fills) use ``count`` threads: for work only
    this rank does while the others on the host wait (rank 0 materialising the model)."""
    import torch

    previous = torch.get_num_threads()
    if count > previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


def worker_threads() -> int:
    """Threads for memory-bound work on this rank: this process's cores, shared with the other
    ranks on the host (torchrun's LOCAL_WORLD_SIZE), at least one."""
    return max(1, all_cores() // _local_ranks())


def lead_threads() -> int:
    """Threads for the rank with the most work while the others on the host do a small share
    each (rank 0 checksumming every other rank's slices): every core but one per other rank."""
    return max(worker_threads(), all_cores() - (_local_ranks() - 1))


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
