"""One rank's stages, run the same way by the audit, ``check_model``, ``fingerprint`` and the
child jobs: a runner that keeps going until a stage fails and turns that failure into the rank's
error, and the resolve → build step they all start with."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsdpcheck.distributed.liveness import is_collective_failure
from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.faults import maybe_inject
from fsdpcheck.model import wrap
from fsdpcheck.model.build import BuiltModel, build
from fsdpcheck.model.memory import MEASURED, StageMeter
from fsdpcheck.model.rank_state import look, rank_record
from fsdpcheck.model.resolve import resolve
from fsdpcheck.options import BuildSpec
from fsdpcheck.records import EnvRecord, RankError, RankRecord
from fsdpcheck.vocab import ErrorKind, Snapshot, Stage

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Stages:
    """Runs one rank's stages in order until one fails; that failure becomes the rank's error
    (a rank that fails must still reach the gather, so nothing is raised)."""

    rank: int
    # Told each stage as the rank enters it: the liveness mark, rank 0's console.
    hooks: Sequence[Callable[[Stage], None]] = ()
    timings: dict[str, float] = field(default_factory=dict)
    error: RankError | None = None
    current: Stage = Stage.LAUNCH  # the stage this rank entered last
    # A child job has no gather to reach: it records the error and lets the exception go on up,
    # so that its own classifier sees the real exception.
    raising: bool = False
    # Host (and CUDA) memory over the stages that hold the model (build, wrap, load).
    memory: StageMeter = field(default_factory=StageMeter)

    def enter(self, stage: Stage) -> None:
        self.current = stage
        for hook in self.hooks:
            hook(stage)

    @contextmanager
    def timed(self, stage: Stage) -> Iterator[None]:
        """Enter ``stage``, inject a test fault, record its time; what it raises goes on up
        (for the collective stages, whose failures the caller classifies)."""
        self.enter(stage)
        start = time.perf_counter()
        try:
            with self.memory.measure(stage) if stage in MEASURED else nullcontext():
                maybe_inject(self.rank, stage)
                yield
        finally:
            self.timings[stage] = round(time.perf_counter() - start, 4)

    def run(self, stage: Stage, fn: Callable[[], T], *, collective: bool = False) -> T | None:
        """``fn()`` as ``stage``, unless an earlier stage failed; None when it did or this one
        does (its error is then :attr:`error`). ``collective``: ``fn`` runs a collective, and
        when that fails (a peer died or timed out) the exception goes on up unrecorded, to the
        caller that names the peer from heartbeats and stage marks (exit 3, not this rank's
        error)."""
        if self.error is not None:
            return None
        try:
            with self.timed(stage):
                return fn()
        except FsdpcheckError as exc:
            self.error = RankError(self.rank, stage, str(exc), exc.kind)
            if self.raising:
                raise
        except Exception as exc:  # any failure must reach the gather, not strand the others
            if collective and is_collective_failure(exc):
                raise
            log.debug("rank %d: stage %s failed", self.rank, stage, exc_info=True)
            message = f"{type(exc).__name__}: {exc}"
            self.error = RankError(self.rank, stage, message, ErrorKind.RUNTIME)
            if self.raising:
                raise
        return None


def build_from(
    spec: BuildSpec,
    rank: int,
    stages: Stages | None = None,
    *,
    config_changes: Mapping[str, Any] | None = None,
) -> tuple[BuiltModel | None, RankError | None]:
    """Resolve and build ``spec`` on ``rank`` (what ``--init`` builds depends on the rank), as
    the stages ``resolve`` and ``build`` of ``stages`` (a runner of its own by default).
    ``config_changes``: top-level config keys set after reading it (a child rank standing for
    a rank whose config differs).

    Returns the model, or None, and the runner's error (None when every stage so far ran)."""
    stages = stages if stages is not None else Stages(rank)

    def build_model() -> BuiltModel:
        return build(
            resolved,
            rank=rank,
            init=spec.init,
            dtype=spec.dtype,
            seed=spec.seed,
            text_only=spec.text_only,
            trust_remote_code=spec.trust_remote_code,
            config_changes=config_changes,
        )

    resolved = stages.run(
        Stage.RESOLVE, lambda: resolve(spec.model, rank=rank, allow_pickle=spec.allow_pickle)
    )
    if resolved is not None:
        log.info("resolved %r: %s %s", spec.model, resolved.kind, resolved.path or resolved.name)
    built = stages.run(Stage.BUILD, build_model)
    if built is not None:
        info = built.info
        log.info(
            "built %s: init %s, dtype %s, materialised %s, %.2f s",
            info.architecture,
            spec.init,
            info.dtype,
            built.materialised,
            stages.timings[Stage.BUILD],
        )
    return built, stages.error


def build_or_raise(
    spec: BuildSpec, rank: int, *, config_changes: Mapping[str, Any] | None = None
) -> BuiltModel:
    """:func:`build_from` for a child job: the same stages, but a failure raises."""
    built, _ = build_from(spec, rank, Stages(rank, raising=True), config_changes=config_changes)
    assert built is not None  # a failed stage raised
    return built


# ---------------------------------------------------------------- the per-rank record
# The stages every rank runs around the wrap, the same in the audit and the offline fingerprint.


def look_at(stages: Stages, built: BuiltModel | None, snapshot: Snapshot, *, values: bool) -> Any:
    """The ``fingerprint-pre`` / ``fingerprint-post`` stage: this rank's look at its model
    (parameters' values only where ``values``; buffers are checked after the load)."""
    stage = Stage.FINGERPRINT_PRE if snapshot == Snapshot.PRE_WRAP else Stage.FINGERPRINT_POST
    return stages.run(
        stage, lambda: look(built.model, snapshot, param_values=values, buffers=False)
    )


def before_wrap(
    stages: Stages, built: BuiltModel | None, spec: Any, *, values: bool
) -> tuple[Any, Any]:
    """The look before wrapping, then the wrap plan (``spec``'s ``wrap_classes`` and
    ``min_params``): each None where its stage did not run."""
    pre = look_at(stages, built, Snapshot.PRE_WRAP, values=values)
    planned = stages.run(
        Stage.WRAP_PLAN,
        lambda: wrap.plan(built.model, spec.wrap_classes, min_params=spec.min_params),
    )
    return pre, planned


def record_of(
    env: EnvRecord, stages: Stages, built: BuiltModel | None, *looks: Any, **extra: Any
) -> RankRecord:
    """This rank's record: what its looks saw, its model's state, its error if a stage failed."""
    return rank_record(
        env,
        *looks,
        error=stages.error,
        model=built.model if built is not None else None,
        config=built.config if built is not None else None,
        **extra,
    )
