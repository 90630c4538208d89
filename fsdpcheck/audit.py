"""The audit, one rank's view: resolve → build → fingerprint → wrap → fingerprint → gather →
analyse → report. Library code: takes options, returns data, never prints."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fsdpcheck import distributed
from fsdpcheck.errors import EXIT_RUNTIME, FsdpcheckError
from fsdpcheck.faults import maybe_inject
from fsdpcheck.records import (
    LoadOutcome,
    ModelInfo,
    RankError,
    RankRecord,
    Report,
    VerifyResult,
    WrapPlan,
)
from fsdpcheck.wrap import DEFAULT_MIN_PARAMS

if TYPE_CHECKING:
    from fsdpcheck.build import BuiltModel

T = TypeVar("T")


@dataclass(frozen=True)
class AuditOptions:
    model: str
    backend: str = "auto"
    timeout: float = 60.0
    init: str = "rank0"
    dtype: str | None = None
    seed: int = 0
    text_only: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    wrap_classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS
    mesh: tuple[int, ...] | None = None  # (replicate, shard) for HSDP; default: 1-D, all ranks
    load: bool = True  # run the project's loader and verify every rank afterwards
    reproduce: bool = False  # also run the unsafe loader, in an isolated child job
    probe: int = 0  # rank 0 also probes the build under this many hash seeds (0: off)
    download: bool = False  # rank 0 fetches a hub id into the cache first; the others wait


@dataclass(frozen=True)
class AuditResult:
    rank: int
    exit_code: int
    report: Report | None  # rank 0 only
    own_error: RankError | None = None  # this rank's failure, for it to print
    headline: str = ""  # rank 0's one-line conclusion, known on every rank


@dataclass
class _RankState:
    """What one rank learns on its way to the gather."""

    ctx: distributed.DistContext
    timings: dict[str, float] = field(default_factory=dict)
    error: RankError | None = None
    model_info: ModelInfo | None = None
    wrap_plan: WrapPlan | None = None
    publish: Callable[[Report], None] | None = None

    def stage(self, name: str, fn: Callable[[], T]) -> T | None:
        """Run one stage unless an earlier one failed; record its time or its error."""
        if self.error is not None:
            return None
        rank = self.ctx.rank
        distributed.mark_stage(self.ctx, name)
        start = time.perf_counter()
        try:
            maybe_inject(rank, name)
            return fn()
        except FsdpcheckError as exc:
            self.error = RankError(rank, name, str(exc), exc.kind)
        except Exception as exc:  # any failure must reach the gather, not strand the others
            self.error = RankError(rank, name, f"{type(exc).__name__}: {exc}", "runtime")
        finally:
            self.timings[name] = round(time.perf_counter() - start, 4)
        return None


def run_audit(
    options: AuditOptions,
    *,
    progress: Callable[[str], None] | None = None,
    publish: Callable[[Report], None] | None = None,
) -> AuditResult:
    """Run the audit on this rank; every rank of the job must call it.

    ``progress`` is called with each stage's name as rank 0 enters it. ``publish`` is called on
    rank 0 with the finished report *before* the other ranks are released: launchers such as
    torchrun stop every rank as soon as one exits non-zero, so the report must be out first.
    """
    ctx = distributed.init(options.backend, options.timeout, mesh_shape=options.mesh)
    ctx.on_stage = progress if ctx.rank == 0 else None
    try:
        on_abort = None
        if ctx.rank == 0 and publish is not None:

            def on_abort(errors: list[RankError]) -> None:
                from fsdpcheck.report import error_report

                publish(error_report(errors, ctx.world_size, options))

        with distributed.AbortWatch(ctx, on_abort) as watch:
            return _audit(options, ctx, watch, publish)
    finally:
        distributed.shutdown(ctx)


def check_model(model: Any, *, timeout: float = 60.0) -> AuditResult:
    """Pre-flight check of a training script's own model: every rank calls it, after building
    (and optionally wrapping) the model and before loading weights. Reuses the script's process
    group; metadata goes over a gloo side channel bounded by ``timeout``. The report (rank 0)
    has findings and loader predictions; ``exit_code`` is the same on every rank."""
    from fsdpcheck.fingerprint import fingerprint
    from fsdpcheck.model.config_record import config_record
    from fsdpcheck.model.fsdp_plan import fsdp_plan

    ctx = distributed.init("auto", timeout)
    try:
        with distributed.AbortWatch(ctx) as watch:
            state = _RankState(ctx)
            env = distributed.env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
            wrapped = any(hasattr(p, "placements") for p in model.parameters())
            stage = "post-wrap" if wrapped else "pre-wrap"
            fp = state.stage("fingerprint", lambda: fingerprint(model, stage))
            plan = state.stage("fsdp-plan", lambda: fsdp_plan(model))
            config = state.stage("config", lambda: config_record(getattr(model, "config", None)))
            record = RankRecord(
                env=env,
                pre_wrap=None if wrapped else fp,
                post_wrap=fp if wrapped else None,
                error=state.error,
                fsdp_plan=plan,
                config=config,
            )
            return _conclude(None, ctx, state, record, watch, built=None)
    finally:
        distributed.shutdown(ctx)


def _audit(
    options: AuditOptions,
    ctx: distributed.DistContext,
    watch: distributed.AbortWatch,
    publish: Callable[[Report], None] | None,
) -> AuditResult:
    from fsdpcheck import build, fingerprint, resolve, wrap
    from fsdpcheck.model.config_record import config_record
    from fsdpcheck.model.fsdp_plan import fsdp_plan

    state = _RankState(ctx, publish=publish)
    env = distributed.env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
    probing = _ProbeThread(options) if ctx.rank == 0 and options.probe else None
    if options.download:
        _download_on_rank0(options, ctx, state)
    resolved = state.stage(
        "resolve",
        lambda: resolve.resolve(options.model, rank=ctx.rank, allow_pickle=options.allow_pickle),
    )
    built = state.stage(
        "build",
        lambda: build.build(
            resolved,
            rank=ctx.rank,
            init=options.init,
            dtype=options.dtype,
            seed=options.seed,
            text_only=options.text_only,
            trust_remote_code=options.trust_remote_code,
        ),
    )
    config = state.stage("config", lambda: config_record(built.config))
    pre = state.stage("fingerprint-pre", lambda: fingerprint.fingerprint(built.model, "pre-wrap"))
    planned = state.stage(
        "wrap-plan",
        lambda: wrap.plan(built.model, options.wrap_classes, min_params=options.min_params),
    )
    state.stage("wrap", lambda: wrap.apply(planned[1], ctx.mesh))
    post = state.stage(
        "fingerprint-post", lambda: fingerprint.fingerprint(built.model, "post-wrap")
    )
    plan = state.stage("fsdp-plan", lambda: fsdp_plan(built.model))
    if built is not None:
        state.model_info = built.info
    if planned is not None:
        state.wrap_plan = planned[0]
    record = RankRecord(
        env=env, pre_wrap=pre, post_wrap=post, error=state.error, fsdp_plan=plan, config=config
    )
    return _conclude(options, ctx, state, record, watch, built, probing)


def _conclude(
    options: AuditOptions | None,
    ctx: distributed.DistContext,
    state: _RankState,
    record: RankRecord,
    watch: distributed.AbortWatch,
    built: BuiltModel | None,
    probing: _ProbeThread | None = None,
) -> AuditResult:
    """Gather, analyse on rank 0, and agree on one exit code; a dead peer ends it with exit 3.

    ``options`` None: :func:`check_model`, which only checks (the script loads its own weights).
    """
    from fsdpcheck.gather import broadcast_decision, gather_records
    from fsdpcheck.render import report_headline
    from fsdpcheck.report import assemble, error_report, with_reproduction

    distributed.mark_stage(ctx, "gather")
    start = time.perf_counter()
    try:
        maybe_inject(ctx.rank, "gather")
        gathered = gather_records(record, ctx.meta_group, rank=ctx.rank, world_size=ctx.world_size)
        state.timings["gather"] = round(time.perf_counter() - start, 4)
        report = None
        if gathered is not None:
            report = assemble(gathered, options, state.model_info, state.wrap_plan, state.timings)
        if options is not None:  # every rank knows, so every rank takes the same branch
            report = _load_stage(options, ctx, state, built, report)
            if report is not None and options.reproduce:
                report = with_reproduction(report, options)
            if report is not None and probing is not None:
                report = probing.fold_into(report)
        code, headline = EXIT_RUNTIME, ""
        if report is not None:
            code, headline = report.exit_code, report_headline(report)
            if state.publish is not None:
                state.publish(report)
        code, headline = broadcast_decision(code, headline, ctx.meta_group)
        return AuditResult(ctx.rank, code, report, state.error, headline)
    except Exception as exc:  # a peer died or timed out: name it from heartbeats and marks
        watch.disarm()
        errors = distributed.diagnose_peers(ctx, exc, own=state.error)
        distributed.signal_abort(ctx, errors)
        report = error_report(errors, ctx.world_size, options) if ctx.rank == 0 else None
        if report is not None and state.publish is not None:
            state.publish(report)
        own = state.error or RankError(
            ctx.rank, "gather", f"gave up: {errors[0].message}", "runtime"
        )
        return AuditResult(ctx.rank, EXIT_RUNTIME, report, own, errors[0].message)


def _download_on_rank0(options: AuditOptions, ctx: distributed.DistContext, state: _RankState):
    """Rank 0 downloads into the shared cache while the others wait, then all read the cache."""
    import torch.distributed as dist

    from fsdpcheck.resolve import download

    if ctx.rank == 0:
        state.stage(
            "download",
            lambda: download(options.model, rank=0, allow_pickle=options.allow_pickle),
        )
    try:
        dist.barrier(group=ctx.meta_group)
    except Exception as exc:  # a dead peer: the gather will name it
        if state.error is None:
            state.error = RankError(
                ctx.rank, "download", distributed.collective_cause(exc), "runtime"
            )


class _ProbeThread:
    """``--probe K`` on rank 0: child builds under K hash seeds, alongside the audit's own work.

    Bounded by a share of ``--timeout``, because the other ranks wait for rank 0's decision."""

    def __init__(self, options: AuditOptions):
        self._options = options
        self._started = time.monotonic()
        self._budget = max(5.0, 0.8 * options.timeout)
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fsdpcheck-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from fsdpcheck.probe import probe

        o = self._options
        try:
            self._result = probe(
                o.model,
                seeds=o.probe,
                text_only=o.text_only,
                trust_remote_code=o.trust_remote_code,
                timeout=self._budget,
            )
        except BaseException as exc:  # reported in the audit's warnings, never fatal
            self._error = exc

    def fold_into(self, report: Report) -> Report:
        from dataclasses import replace

        from fsdpcheck.report import with_probe

        self._thread.join(max(0.0, self._budget + 5 - (time.monotonic() - self._started)))
        if self._result is not None:
            return with_probe(report, self._result)
        why = f"{type(self._error).__name__}: {self._error}" if self._error else "timed out"
        return replace(report, warnings=(*report.warnings, f"--probe did not finish: {why}"))


def _load_stage(
    options: AuditOptions,
    ctx: distributed.DistContext,
    state: _RankState,
    built: BuiltModel | None,
    report: Report | None,
) -> Report | None:
    """Collective: rank 0 decides whether the loader runs; then load and verify, or say why not."""
    from fsdpcheck.gather import broadcast_decision
    from fsdpcheck.report import with_load

    skip = _load_skip_reason(options, report, built) if ctx.rank == 0 else ""
    go, _ = broadcast_decision(0 if skip else 1, "", ctx.meta_group)
    if go:
        load, verified = _load_and_verify(ctx, state, built)
        return with_load(report, load, verified) if report is not None else None
    if report is not None:
        return with_load(report, LoadOutcome(False, "skipped", skip), None)
    return None


def _load_skip_reason(
    options: AuditOptions, report: Report | None, built: BuiltModel | None
) -> str:
    """Why rank 0 will not run the loader ("" to run it). Decided on rank 0, then shared."""
    if report is None or report.errors:
        return "a rank failed before the load"
    if not options.load:
        return "--no-load"
    if options.init == "meta":
        return "--init meta: nothing to load from"
    if built is None or built.full_state_dict is None:
        return "rank 0 holds no weights"
    return ""


def _load_and_verify(
    ctx: distributed.DistContext, state: _RankState, built: BuiltModel | None
) -> tuple[LoadOutcome, VerifyResult | None]:
    """Collective: the sorted, validated loader, then the proof that every rank is equal."""
    from fsdpcheck.load import load_full_state_dict
    from fsdpcheck.verify import verify_load

    distributed.mark_stage(ctx, "load")
    full = built.full_state_dict if ctx.rank == 0 else None
    # The gloo channel on every backend: the bucketed path stages CUDA shards through host
    # memory, and the audit's collectives stay bounded by --timeout, whatever NCCL's state.
    start = time.perf_counter()
    try:
        maybe_inject(ctx.rank, "load")
        result = load_full_state_dict(built.model, full or {}, group=ctx.meta_group)
    except FsdpcheckError as exc:  # refused on every rank alike: nothing was loaded
        state.timings["load"] = round(time.perf_counter() - start, 4)
        return LoadOutcome(True, "refused", str(exc), seconds=state.timings["load"]), None
    state.timings["load"] = round(time.perf_counter() - start, 4)
    load = LoadOutcome(
        ran=True,
        outcome="loaded",
        params_loaded=result.params_loaded,
        buffers_broadcast=result.buffers_broadcast,
        collectives=result.collectives,
        seconds=state.timings["load"],
        method=result.method,
        fallback_reason=result.fallback_reason,
        state_messages=result.state_messages,
        state_bytes=result.state_bytes,
    )
    distributed.mark_stage(ctx, "verify")
    start = time.perf_counter()
    maybe_inject(ctx.rank, "verify")
    verified = verify_load(built.model, full, group=ctx.meta_group)
    state.timings["verify"] = round(time.perf_counter() - start, 4)
    return load, verified
