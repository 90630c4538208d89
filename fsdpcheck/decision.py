"""How a run ends on every rank: rank 0's report published and its exit code and headline
sent to every rank (:func:`decide`), or, when a peer died, stopped answering or never came, the
peer named and an error report (:func:`give_up`, :func:`never_met`). Shared by the audit,
``check_model`` and ``check_step``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdpcheck.distributed import liveness
from fsdpcheck.distributed import setup as distributed
from fsdpcheck.distributed.wire import broadcast_decision
from fsdpcheck.options import AuditOptions
from fsdpcheck.records import RankError, Report
from fsdpcheck.report import error_report, report_headline
from fsdpcheck.text import GAVE_UP, waited_on_another
from fsdpcheck.vocab import ErrorKind, ExitCode, Stage


@dataclass(frozen=True)
class AuditResult:
    rank: int
    exit_code: int
    report: Report | None  # rank 0 only
    own_error: RankError | None = None  # this rank's failure, for it to print
    headline: str = ""  # rank 0's one-line conclusion, known on every rank


def never_met(
    exc: liveness.NeverMet,
    options: AuditOptions | None = None,
    publish: Callable[[Report], None] | None = None,
) -> AuditResult:
    """The ranks never met on the side channel: exit 3 on this rank, naming who never arrived
    (rank 0 has the report)."""
    try:
        return ended(exc.ctx, exc.errors, None, options, publish, stage=Stage.LAUNCH)
    finally:
        distributed.shutdown(exc.ctx)


def decide(
    ctx: distributed.DistContext,
    report: Report | None,
    publish: Callable[[Report], None] | None = None,
    *,
    own_error: RankError | None = None,
) -> AuditResult:
    """Collective: rank 0's report published, then its exit code and headline on every rank
    (exit 3 where rank 0 has no report)."""
    code, headline = ExitCode.RUNTIME, ""
    if report is not None:
        code, headline = report.exit_code, report_headline(report)
        if publish is not None:
            publish(report)
    code, headline = broadcast_decision(code, headline, ctx.side_channel)
    return AuditResult(ctx.rank, code, report, own_error, headline)


def give_up(
    ctx: distributed.DistContext,
    exc: BaseException,
    own: RankError | None,
    options: AuditOptions | None = None,
    publish: Callable[[Report], None] | None = None,
    *,
    stage: Stage = Stage.GATHER,
    known: Sequence[RankError] = (),
    aborted: Sequence[RankError] | None = None,
) -> AuditResult:
    """A peer died or stopped answering: name it from heartbeats and stage marks, end the
    others, and give rank 0 an error report (exit 3 everywhere). ``own``: this rank's own
    failure, if it had one; else it gave up waiting in ``stage``. ``known``: failures the
    ranks left for each other (each rank's own exception in its step), listed first.
    ``aborted``: the abort mark's errors, where this rank's watch took them before it gave up
    (``AbortWatch.disarm``): the run's conclusion, read from no store (its host may be gone)."""
    if aborted:
        errors = [*(e for e in [own] if e is not None), *(e for e in aborted if e != own)]
    else:
        errors = liveness.diagnose_peers(ctx, exc, own=own)
        errors = [*known, *(e for e in errors if e not in known)]
        liveness.signal_abort(ctx, errors)
    return ended(ctx, errors, own, options, publish, stage=stage)


def ended(
    ctx: distributed.DistContext,
    errors: list[RankError],
    own: RankError | None,
    options: AuditOptions | None = None,
    publish: Callable[[Report], None] | None = None,
    *,
    stage: Stage = Stage.GATHER,
) -> AuditResult:
    """The run is over without a report of findings: exit 3 on this rank, ``errors`` (which
    name the rank responsible) in rank 0's error report (published) and as the headline."""
    report = error_report(errors, ctx.world_size, options) if ctx.rank == 0 else None
    if report is not None and publish is not None:
        publish(report)
    own = own or next((e for e in errors if e.rank == ctx.rank), None)
    first = min(errors, key=lambda e: waited_on_another(e.message))  # stable: a cause first
    own = own or RankError(ctx.rank, stage, f"{GAVE_UP} {first.message}", ErrorKind.RUNTIME)
    # Nothing more is read from the store; its host (rank 0 under env:// ranks) keeps it up at
    # exit until every other rank has said the same.
    liveness.mark_ended(ctx)
    return AuditResult(ctx.rank, ExitCode.RUNTIME, report, own, first.message)
