"""One process, no job: build a model as the audit does, wrap it on a one-rank group of its own,
and fingerprint it before and after (the ``fingerprint`` command)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.model.wrap import DEFAULT_MIN_PARAMS
from fsdpcheck.offline.files import FingerprintFile, env_record, process_identity
from fsdpcheck.options import BuildSpec
from fsdpcheck.records import RankError, RankRecord
from fsdpcheck.vocab import ErrorKind, Snapshot, Stage

T = TypeVar("T")


@dataclass(frozen=True)
class StandaloneOptions(BuildSpec):
    wrap: bool = True
    wrap_classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS
    rank: int | None = None  # else the launcher's RANK


@dataclass
class _Stages:
    """Runs stages until one fails; the failure becomes the record's error, as in the audit."""

    rank: int
    error: RankError | None = None
    timings: dict[str, float] | None = None

    def run(self, name: Stage, fn: Callable[[], T]) -> T | None:
        if self.error is not None:
            return None
        start = time.perf_counter()
        try:
            return fn()
        except FsdpcheckError as exc:
            self.error = RankError(self.rank, name, str(exc), exc.kind)
        except Exception as exc:  # recorded, so that diff names this rank's failure
            message = f"{type(exc).__name__}: {exc}"
            self.error = RankError(self.rank, name, message, ErrorKind.RUNTIME)
        finally:
            if self.timings is not None:
                self.timings[name] = round(time.perf_counter() - start, 4)
        return None


def fingerprint_standalone(options: StandaloneOptions) -> FingerprintFile:
    """Resolve → build → fingerprint → (wrap on a private one-rank group → fingerprint).

    The rank (from the launcher's variables, or ``options.rank``) decides what ``--init``
    builds, as in the audit; no peer is contacted. A stage that fails leaves its error in the
    record instead of raising, so ``diff`` names it."""
    from fsdpcheck.model import build, fingerprint, resolve, wrap

    identity = process_identity(options.rank)
    stages = _Stages(identity.rank)
    resolved = stages.run(
        Stage.RESOLVE,
        lambda: resolve.resolve(
            options.model, rank=identity.rank, allow_pickle=options.allow_pickle
        ),
    )
    built = stages.run(
        Stage.BUILD,
        lambda: build.build(
            resolved,
            rank=identity.rank,
            init=options.init,
            dtype=options.dtype,
            seed=options.seed,
            text_only=options.text_only,
            trust_remote_code=options.trust_remote_code,
        ),
    )
    # As the audit: parameters' values are compared only where every rank holds its own.
    values = options.init == "all"
    pre = stages.run(
        Stage.FINGERPRINT_PRE,
        lambda: fingerprint.fingerprint(built.model, Snapshot.PRE_WRAP, param_values=values),
    )
    planned = stages.run(
        Stage.WRAP_PLAN,
        lambda: wrap.plan(built.model, options.wrap_classes, min_params=options.min_params),
    )
    notes: list[str] = []
    post = None
    wrapped = False  # fully_shard was applied (or tried): the plan belongs in the file
    if options.wrap and planned is not None:
        skip = _cannot_wrap_alone()
        if skip:
            notes.append(skip)
        else:
            wrapped = True

            def wrap_and_fingerprint():
                with private_mesh() as mesh:
                    wrap.apply(planned.modules, mesh)
                    return fingerprint.fingerprint(
                        built.model, Snapshot.POST_WRAP, param_values=values
                    )

            post = stages.run(Stage.WRAP, wrap_and_fingerprint)
    elif not options.wrap:
        notes.append("not wrapped (--no-wrap): pre-wrap fingerprint only")
    env = env_record(identity)
    record = RankRecord(env=env, pre_wrap=pre, post_wrap=post, error=stages.error)
    if built is not None:
        from fsdpcheck.model.rank_state import with_state

        record = with_state(record, built.model, built.config)
    return FingerprintFile(
        record=record,
        model=built.info if built is not None else None,
        wrap=planned.plan if wrapped else None,
        notes=tuple(notes),
    )


def _cannot_wrap_alone() -> str:
    """Why this process cannot make a group of its own ("" when it can)."""
    import torch.distributed as dist

    if not dist.is_available():
        return "not wrapped: this torch build has no torch.distributed"
    if dist.is_initialized():
        # A one-rank group inside a running job would need the job's store, which may be the
        # very thing that is broken; the pre-wrap fingerprint needs no group at all.
        return (
            "not wrapped: this process already belongs to a process group, and the offline "
            "fingerprint never touches a job's group; pre-wrap fingerprint only"
        )
    return ""


@contextlib.contextmanager
def private_mesh(timeout: float = 60.0) -> Iterator[Any]:
    """A one-rank gloo group on an in-memory store (no address, no port, no peer) and its 1-D
    mesh; torn down on exit. Needs a process without a default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout),
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
