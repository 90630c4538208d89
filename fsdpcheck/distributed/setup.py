"""Distributed setup in one place: the default group, the gloo side channel and the mesh.

Metadata always travels on a separate gloo group created with ``timeout``, so the diagnosis
never depends on NCCL being healthy and never waits forever.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdpcheck.distributed import launcher
from fsdpcheck.errors import InputError
from fsdpcheck.model.parallel import ep_meshes
from fsdpcheck.options import MeshSpec, resolve_mesh
from fsdpcheck.vocab import Backend

log = logging.getLogger(__name__)


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device_type: str
    timeout: float
    owns_default_group: bool
    side_channel: Any = None  # fsdpcheck's gloo group, set once every rank has arrived
    mesh: Any = None
    store: Any = None  # the default group's store, for stage marks; None when unavailable
    ep_meshes: Any = None  # model.parallel.EpMeshes: the views --ep shards over, built with mesh
    ended: bool = False  # this rank concluded a failed run and said so (liveness.mark_ended)

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class JoinError(RuntimeError):
    """The side channel or the mesh could not be built: a peer never arrived, or the store's
    host is gone. ``ctx`` is this rank's context so far (its store, no side channel, no mesh),
    for the caller to name who is missing and to shut down."""

    def __init__(self, ctx: DistContext, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.ctx = ctx
        self.cause = cause


def resolve_backend(requested: str) -> Backend:
    """The backend ``requested`` runs on here: ``auto`` is nccl with CUDA, else gloo."""
    if requested not in Backend._value2member_map_:
        choices = ", ".join(b.value for b in Backend)
        raise InputError(f"--backend {str(requested)!r}: choose one of {choices}.")
    requested = Backend(requested)
    cuda = torch.cuda.is_available()
    if requested is Backend.AUTO:
        return Backend.NCCL if cuda else Backend.GLOO
    if requested is Backend.NCCL and not (cuda and dist.is_nccl_available()):
        raise InputError(
            "--backend nccl needs CUDA and a torch build with NCCL; this host has "
            f"{'no CUDA device' if not cuda else 'no NCCL'}. Use --backend gloo (or auto)."
        )
    return requested


def init(
    backend: str = "auto",
    timeout: float = 60.0,
    *,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_names: tuple[str, ...] | None = None,
    tp: int | None = None,
    ep: int | None = None,
    arrive: Callable[[DistContext], None] | None = None,
) -> DistContext:
    """Join (or reuse) the default process group, create the gloo side channel and the mesh.

    Everything that can be checked without a peer is checked first, so bad input never leaves
    another rank waiting in a rendezvous. ``arrive`` is called with the context so far (its
    store, no side channel) right before the first collective, to leave this rank's mark;
    what it raises goes on up. A side channel or mesh that cannot be built (a peer never
    came, the store's host is gone) raises :class:`JoinError` after at most ``timeout``.
    """
    found = None
    owns = not dist.is_initialized()
    if not owns:  # a script's own group: its launcher variables may be gone
        rank, world_size = dist.get_rank(), dist.get_world_size()  # (Lightning drops WORLD_SIZE)
        local_rank = launcher.local_rank_hint(os.environ, rank)
        # The script's backend decides, and its current CUDA device is its own business.
        backend = "nccl" if "nccl" in str(dist.get_backend()).lower() else "gloo"
    else:
        found = launcher.detect(os.environ)
        rank, local_rank, world_size = found.rank, found.local_rank, found.world_size
        backend = resolve_backend(backend).value
    asked = {"requested": mesh_shape, "names": mesh_names, "tp": tp, "ep": ep}
    spec = _mesh_spec(world_size=world_size, rank=rank, **asked)
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda" and owns:
        devices = torch.cuda.device_count()
        if local_rank >= devices:
            raise InputError(
                f"rank {rank}: LOCAL_RANK={local_rank} but this host has {devices} CUDA "
                f"device{'s' if devices != 1 else ''}, and NCCL needs one per rank; launch at "
                f"most {devices} ranks per node (--nproc-per-node {devices}), or use --backend "
                "gloo to run on CPU."
            )
        torch.cuda.set_device(local_rank)
    wait = timedelta(seconds=timeout)
    if owns:
        # srun and mpirun set no RANK/WORLD_SIZE: hand them to env:// explicitly rather than
        # exporting them, so nothing leaks into this process's environment or a report.
        explicit = found is not None and not found.from_torch_env
        _init_default_group(backend, rank, world_size, wait, timeout, explicit=explicit)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
        spec = _mesh_spec(world_size=world_size, rank=rank, **asked)
    store = _default_store()
    ctx = DistContext(
        rank, local_rank, world_size, backend, device_type, timeout, owns, store=store
    )
    if arrive is not None:
        arrive(ctx)
    try:
        ctx.side_channel = dist.new_group(backend="gloo", timeout=wait)
        # Every rank builds the mesh here, before any stage can fail, because building a 2-D
        # mesh is itself a collective.
        names = spec.names or (("replicate", "shard") if len(spec.sizes) == 2 else None)
        # A dim over fewer ranks than the world gets groups of its own: with the run's timeout,
        # not the backend's 30 minutes (a whole-world dim reuses the default group, which has it).
        override = {
            (names[d] if names else d): group_options(device_type, timeout)
            for d, size in enumerate(spec.sizes)
            if size < world_size
        }
        if override and "backend_override" in inspect.signature(init_device_mesh).parameters:
            ctx.mesh = init_device_mesh(
                device_type, spec.sizes, mesh_dim_names=names, backend_override=override
            )
        else:  # torch 2.6 builds sub-mesh groups with the default group's options only
            ctx.mesh = init_device_mesh(device_type, spec.sizes, mesh_dim_names=names)

        # flattening a mesh dim is a collective too
        ctx.ep_meshes = ep_meshes(ctx.mesh, group_options(device_type, timeout))
    except Exception as exc:  # a peer never came, or the store's host is gone
        log.debug("rank %d: the side channel could not be built", rank, exc_info=True)
        raise JoinError(ctx, exc) from exc
    log.info("rank %d of %d on %s, mesh %s %s", rank, world_size, backend, spec.sizes, names)
    return ctx


def group_options(device_type: str, timeout: float) -> tuple[str, Any]:
    """``(backend, options)`` for a group fsdpcheck builds through DeviceMesh, bounded by
    ``timeout`` (``init_device_mesh``'s and ``_flatten``'s ``backend_override``)."""
    if device_type == "cuda":
        options: Any = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options, backend = dist.ProcessGroupGloo._Options(), "gloo"
    options._timeout = timedelta(seconds=timeout)
    return backend, options


def _mesh_spec(
    requested: tuple[int, ...] | None,
    names: tuple[str, ...] | None,
    tp: int | None,
    ep: int | None,
    *,
    world_size: int,
    rank: int,
) -> MeshSpec:
    try:
        spec = resolve_mesh(requested, names, tp=tp, ep=ep, world=world_size)
    except ValueError as exc:
        raise InputError(f"rank {rank}: {exc}") from None
    return spec or MeshSpec((world_size,))


def _init_default_group(
    backend: str, rank: int, world_size: int, wait: timedelta, timeout: float, *, explicit: bool
) -> None:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
        return
    try:
        placement = {"rank": rank, "world_size": world_size} if explicit else {}
        dist.init_process_group(backend, init_method="env://", timeout=wait, **placement)
    except (RuntimeError, TimeoutError, OSError) as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"rank {rank}: could not join the rendezvous at {where} within {timeout:g}s "
            f"({first}). Check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that the "
            "port is reachable from this host."
        ) from None


_runs = 0  # fsdpcheck runs in this process: every rank makes the same calls, in the same order


def _default_store() -> Any:
    """The default group's store, under a prefix of this run's own: a script that calls
    ``check_model`` twice must not meet the first call's stage marks or abort mark."""
    global _runs
    _runs += 1
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API: stage marks are a nicety, never a requirement
        log.debug("no default store: running without stage marks", exc_info=True)
        return None
    return dist.PrefixStore(f"fsdpcheck-run{_runs}", store)


def shutdown(ctx: DistContext) -> None:
    """Release the groups this run made. In the script's own default group (``check_model``,
    ``run_audit`` in a Ray actor or a long job) the side channel is destroyed by itself: torch
    keeps every group until the default group goes, and each held its sockets (5 descriptors a
    call on 2 ranks, issue 37's repeated ``run_audit``)."""
    if not dist.is_initialized():
        return
    if ctx.owns_default_group:
        dist.destroy_process_group()
        return
    if ctx.side_channel is not None:
        try:
            dist.destroy_process_group(ctx.side_channel)
        except Exception:  # a group torch already let go of: nothing left to release
            log.debug("rank %d: the side channel was not destroyed", ctx.rank, exc_info=True)
        ctx.side_channel = None
