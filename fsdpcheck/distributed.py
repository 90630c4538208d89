"""Distributed setup in one place: the default group, the gloo side channel and the mesh.

Metadata always travels on a separate gloo group created with ``timeout``, so the diagnosis
never depends on NCCL being healthy and never waits forever.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.errors import InputError
from fsdpcheck.records import EnvRecord, RankError, from_dict, to_dict

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
    on_stage: Callable[[str], None] | None = None  # progress, for a console on rank 0

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
        devices = torch.cuda.device_count()
        if local_rank >= devices:
            raise InputError(
                f"rank {rank}: LOCAL_RANK={local_rank} but this host has {devices} CUDA "
                f"device{'s' if devices != 1 else ''}, and NCCL needs one per rank; launch at "
                f"most {devices} ranks per node (--nproc-per-node {devices}), or use --backend "
                "gloo to run on CPU."
            )
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
    if ctx.on_stage is not None:
        ctx.on_stage(stage)
    if ctx.store is None:
        return
    try:
        ctx.store.set(_STAGE_KEY.format(ctx.rank), stage)
    except Exception:
        ctx.store = None


_ABORT_KEY = "fsdpcheck/abort"


def signal_abort(ctx: DistContext, errors: list[RankError]) -> None:
    """Tell every rank's abort watch that this run is over, and why (a rank gave up)."""
    if ctx.store is None:
        return
    try:
        ctx.store.set(_ABORT_KEY, json.dumps([to_dict(e) for e in errors[:16]]))
    except Exception:
        pass


def _abort_errors(payload: bytes) -> list[RankError]:
    try:
        return [from_dict(RankError, e) for e in json.loads(payload)]
    except (ValueError, TypeError, KeyError):
        return [RankError(-1, "abort", payload.decode(errors="replace"), "runtime")]


_ALIVE_KEY = "fsdpcheck/alive/{}"


def heartbeat_interval(world_size: int) -> float:
    """One store write per rank per interval: keep the store's load flat at large scale."""
    return max(1.0, world_size / 512)


class AbortWatch:
    """A daemon thread that beats this rank's heartbeat and ends the rank when the run is over.

    The heartbeat lets a rank that gives up tell a dead peer from a slow one. The abort mark
    covers a rank stuck in its own work (a stalled filesystem, a deadlocked import) that never
    reaches the gather: when the others give up they leave the mark, and this thread exits the
    process with code 3 instead of leaving it behind. It also exits when the store's host
    (rank 0, or the launcher's agent) has been gone for a whole timeout.
    """

    def __init__(self, ctx: DistContext, on_abort: Callable[[list[RankError]], None] | None = None):
        self._ctx = ctx
        self._on_abort = on_abort
        self._interval = heartbeat_interval(ctx.world_size)
        self._done = threading.Event()
        self._armed = True
        self._thread = threading.Thread(target=self._run, name="fsdpcheck-abort-watch", daemon=True)

    def __enter__(self) -> AbortWatch:
        if self._ctx.store is not None and self._ctx.world_size > 1:
            self._thread.start()
        return self

    def disarm(self) -> None:
        """Keep beating but never abort: this rank is concluding the run itself."""
        self._armed = False

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        # Joined, not abandoned: a daemon thread still inside a store call when the
        # interpreter exits makes C++ terminate the process.
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 5)

    def _run(self) -> None:
        store, alive = self._ctx.store, _ALIVE_KEY.format(self._ctx.rank)
        unreachable_since = None
        while True:
            try:
                store.add(alive, 1)
                aborted = store.check([_ABORT_KEY])
                errors = _abort_errors(store.get(_ABORT_KEY)) if aborted else None
                unreachable_since = None
            except Exception:
                # Rank 0 may simply have finished first; only a store gone for a whole
                # timeout means nobody is left to conclude the run.
                unreachable_since = unreachable_since or time.monotonic()
                gone = time.monotonic() - unreachable_since >= self._ctx.timeout
                why = "the rendezvous store is gone: rank 0 or the launcher died"
                errors = [RankError(self._ctx.rank, "abort", why, "runtime")] if gone else None
            if self._done.is_set():
                return
            if errors and self._armed:
                self._abort(errors)
            if self._done.wait(self._interval):
                return

    def _abort(self, errors: list[RankError]) -> None:
        sys.stderr.write(f"fsdpcheck: rank {self._ctx.rank} aborting: {errors[0].message}\n")
        sys.stderr.flush()
        if self._on_abort is not None:
            try:  # rank 0 publishes what the rank that gave up found, then goes
                self._on_abort(errors)
            except Exception:
                pass
        os._exit(3)


def dead_ranks(ctx: DistContext) -> set[int]:
    """Ranks whose heartbeat does not move over a few intervals (needs the abort watch)."""
    if ctx.store is None or ctx.world_size == 1:
        return set()
    try:
        before = {r: ctx.store.add(_ALIVE_KEY.format(r), 0) for r in range(ctx.world_size)}
        time.sleep(3 * heartbeat_interval(ctx.world_size))
        after = {r: ctx.store.add(_ALIVE_KEY.format(r), 0) for r in range(ctx.world_size)}
    except Exception:
        return set()
    return {r for r in before if r != ctx.rank and before[r] == after[r]}


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


def collective_cause(exc: BaseException) -> str:
    """The useful part of a collective's error: gloo prefixes a source path and adds advice."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]
    return f"{type(exc).__name__}: {first}"


# Stages in the order every rank passes them; a peer marked earlier than us is behind.
STAGE_ORDER = (
    "launch", "download", "resolve", "build", "fingerprint-pre", "wrap-plan", "wrap",
    "fingerprint-post", "gather", "load", "verify",
)  # fmt: skip


def _stage_index(stage: str | None) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else 0


def diagnose_peers(
    ctx: DistContext, exc: BaseException, *, own: RankError | None
) -> list[RankError]:
    """Turn a failed collective into errors that name the rank(s) responsible.

    A rank whose heartbeat stopped died; failing that, a rank marked at an earlier stage than
    this one is stuck there; failing that, the failure is this rank's own.
    """
    cause = collective_cause(exc)
    stages = last_stages(ctx)
    mine = stages.get(ctx.rank) or "gather"
    dead = dead_ranks(ctx)
    errors = [own] if own is not None else []
    for r in sorted(dead):
        stage = stages.get(r) or "launch"
        message = (
            f"rank {r} died during stage '{stage}' "
            f"(its heartbeat stopped; rank {ctx.rank} saw: {cause})"
        )
        errors.append(RankError(r, stage, message, "runtime"))
    behind = [
        (r, stage or "launch")
        for r, stage in sorted(stages.items())
        if r != ctx.rank and _stage_index(stage) < _stage_index(mine)
    ]
    for r, stage in [] if dead else behind:
        message = (
            f"rank {r} is stuck in stage '{stage}' (rank {ctx.rank} gave up waiting at "
            f"'{mine}' after --timeout {ctx.timeout:g}s: {cause})"
        )
        errors.append(RankError(r, stage, message, "runtime"))
    if len(errors) == (1 if own else 0):
        message = f"rank {ctx.rank} failed at '{mine}': {cause}"
        errors.append(RankError(ctx.rank, mine, message, "runtime"))
    return errors


def exchange_slots(
    raw: bytes,
    group: Any,
    *,
    size: int,
    device: Any = "cpu",
    src: int = 0,
    attached: int = 0,
    attachment: bytes = b"",
) -> tuple[list[bytes], bytes]:
    """Collective: every rank's fixed-size ``raw``, in group order, on every rank.

    With ``attached`` > 0 (the same on every rank), the rank at group index ``src`` also sends
    every rank its ``attachment``, padded to ``attached`` bytes, in the same round: returned
    second (``b""`` otherwise). Sizes never depend on what a rank holds, so ranks that disagree
    still exchange cleanly. An all_to_all of the slot rather than an all_gather: gloo's
    all_gather is a ring (world-1 hops, one after another), its all_to_all one round of direct
    messages; 0.9 ms against 3.0 ms at 4 ranks on 2 cores (see docs/benchmarks.md)."""
    me = dist.get_rank(group=group)
    if len(attachment) > attached:
        raise ValueError(f"attachment of {len(attachment)} bytes exceeds attached={attached}")
    width = len(raw)
    sent = width + (attached if me == src else 0)
    outgoing = bytearray(raw + attachment.ljust(attached, b"\0") if me == src else raw)
    own = torch.frombuffer(outgoing, dtype=torch.uint8).to(device).repeat(size)
    received = [width + (attached if i == src else 0) for i in range(size)]
    out = torch.empty(sum(received), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        out, own, output_split_sizes=received, input_split_sizes=[sent] * size, group=group
    )
    flat = out.cpu().numpy().tobytes()
    slots, extra, offset = [], b"", 0
    for i, count in enumerate(received):
        slots.append(flat[offset : offset + width])
        if i == src:
            extra = flat[offset + width : offset + count]
        offset += count
    return slots, extra


def transport_device(group: Any) -> torch.device:
    # gloo (including the cpu half of a "cpu:gloo,cuda:nccl" group) moves CPU tensors only.
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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
        accelerate=package_version("accelerate"),
    )
