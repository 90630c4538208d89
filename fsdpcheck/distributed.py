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
from fsdpcheck.records import EnvRecord, RankError

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
    mesh: Any = None
    store: Any = None  # the default group's store, for stage marks; None when unavailable

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


def init(
    backend: str = "auto", timeout: float = 60.0, *, mesh_shape: tuple[int, ...] | None = None
) -> DistContext:
    """Join (or reuse) the default process group, create the gloo side channel and the mesh.

    Everything that can be checked without a peer is checked first, so bad input never leaves
    another rank waiting in a rendezvous.
    """
    rank, local_rank, world_size = launch_env()
    backend = resolve_backend(backend)
    shape = _mesh_shape(mesh_shape, world_size, rank)
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    owns = not dist.is_initialized()
    wait = timedelta(seconds=timeout)
    if owns:
        _init_default_group(backend, rank, world_size, wait, timeout)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
        shape = _mesh_shape(mesh_shape, world_size, rank)
    meta_group = dist.new_group(backend="gloo", timeout=wait)
    # Every rank builds the mesh here, before any stage can fail, because building a 2-D mesh
    # is itself a collective.
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return DistContext(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        backend=backend,
        device_type=device_type,
        timeout=timeout,
        meta_group=meta_group,
        owns_default_group=owns,
        mesh=mesh,
        store=_default_store(),
    )


def _mesh_shape(requested: tuple[int, ...] | None, world_size: int, rank: int) -> tuple[int, ...]:
    if not requested:
        return (world_size,)
    product = 1
    for d in requested:
        product *= d
    if len(requested) > 2 or product != world_size or min(requested) < 1:
        raise InputError(
            f"rank {rank}: --mesh {','.join(map(str, requested))} needs "
            f"{product} ranks but WORLD_SIZE is {world_size}; pass REPLICATE,SHARD whose "
            "product is the world size (e.g. --mesh 2,4 on 8 ranks), or omit --mesh."
        )
    return tuple(requested)


def _init_default_group(
    backend: str, rank: int, world_size: int, wait: timedelta, timeout: float
) -> None:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
        return
    try:
        dist.init_process_group(backend, timeout=wait)
    except (RuntimeError, TimeoutError, OSError) as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"rank {rank}: could not join the rendezvous at {where} within {timeout:g}s "
            f"({first}). Check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that the "
            "port is reachable from this host."
        ) from None


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: stage marks are a nicety, never a requirement
        return None


_STAGE_KEY = "fsdpcheck/stage/{}"


def mark_stage(ctx: DistContext, stage: str) -> None:
    """Leave this rank's current stage in the store, so a failed gather can name who is missing."""
    if ctx.store is None:
        return
    try:
        ctx.store.set(_STAGE_KEY.format(ctx.rank), stage)
    except Exception:
        ctx.store = None


def last_stages(ctx: DistContext) -> dict[int, str | None]:
    """Each rank's last marked stage; empty when the store is gone (its host died)."""
    if ctx.store is None:
        return {}
    stages: dict[int, str | None] = {}
    try:
        for r in range(ctx.world_size):
            key = _STAGE_KEY.format(r)
            stages[r] = ctx.store.get(key).decode() if ctx.store.check([key]) else None
    except Exception:
        return {}
    return stages


def diagnose_peers(
    ctx: DistContext, exc: BaseException, *, own: RankError | None
) -> list[RankError]:
    """Turn a failed collective into errors that name the rank(s) that never arrived."""
    text = str(exc).strip()
    cause = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    errors = [own] if own is not None else []
    stages = last_stages(ctx)
    for r, stage in sorted(stages.items()):
        if r != ctx.rank and stage != "gather":
            errors.append(
                RankError(
                    r,
                    stage or "launch",
                    f"rank {r} never reached the gather: it died or hangs in stage "
                    f"'{stage or 'launch'}' (rank {ctx.rank} gave up: {cause})",
                    "runtime",
                )
            )
    if len(errors) == (1 if own else 0):
        errors.append(
            RankError(
                ctx.rank,
                "gather",
                f"the gather failed on rank {ctx.rank} ({cause}); a peer died or timed out "
                f"during the exchange (--timeout {ctx.timeout:g}s)",
                "runtime",
            )
        )
    return errors


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
