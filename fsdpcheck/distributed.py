"""Distributed setup in one place: the default group, the gloo side channel and the mesh.

Metadata always travels on a separate gloo group created with ``timeout``, so the diagnosis
never depends on NCCL being healthy and never waits forever.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.errors import InputError
from fsdpcheck.records import EnvRecord

BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device_type: str
    timeout: float
    meta_group: Any
    owns_default_group: bool
    _mesh: Any = None

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, (self.world_size,))
        return self._mesh

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(
            f"environment variable {name}={raw!r} is not an integer; launch with torchrun "
            "or set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        ) from None


def launch_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from the env:// variables; one rank when unset."""
    rank = _int_env("RANK", 0)
    world_size = _int_env("WORLD_SIZE", 1)
    local_rank = _int_env("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise InputError(f"RANK={rank} is outside WORLD_SIZE={world_size}; fix the launcher.")
    if world_size > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise InputError(
            f"rank {rank}: WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; "
            "launch with torchrun or set the env:// variables."
        )
    return rank, local_rank, world_size


def resolve_backend(requested: str) -> str:
    if requested not in BACKENDS:
        raise InputError(f"--backend {requested!r}: choose one of {', '.join(BACKENDS)}.")
    cuda = torch.cuda.is_available()
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not (cuda and dist.is_nccl_available()):
        raise InputError(
            "--backend nccl needs CUDA and a torch build with NCCL; this host has "
            f"{'no CUDA device' if not cuda else 'no NCCL'}. Use --backend gloo (or auto)."
        )
    return requested


def init(backend: str = "auto", timeout: float = 60.0) -> DistContext:
    """Join (or reuse) the default process group and create the gloo side channel."""
    rank, local_rank, world_size = launch_env()
    backend = resolve_backend(backend)
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    owns = not dist.is_initialized()
    wait = timedelta(seconds=timeout)
    if owns:
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait
            )
        else:
            dist.init_process_group(backend, timeout=wait)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    meta_group = dist.new_group(backend="gloo", timeout=wait)
    return DistContext(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        timeout=timeout,
        meta_group=meta_group,
        owns_default_group=owns,
    )


def shutdown(ctx: DistContext) -> None:
    if ctx.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_record(rank: int, local_rank: int, world_size: int, backend: str) -> EnvRecord:
    """The allowlisted environment of this rank: versions and placement, nothing else."""
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
    )
