"""One watched step, collective from end to end: run it under the collective watch, look at
what it left, bring every rank's record to rank 0 and judge it there.

Used by :func:`fsdpcheck.check_step` (the script's own step) and ``audit --step`` (a synthetic
one). Every rank calls :func:`watched_step` and then :func:`conclude_step`; both are bounded by
the side channel's timeout, and every rank that can still run takes the same branch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fsdpcheck.checks.catalogue import STATE_CHECKS, STEP_CHECKS, Evidence, checks_named, run_checks
from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.step import (
    StepNonFinite,
    StepRecord,
    loss_word,
    raised_errors,
)
from fsdpcheck.decision import AuditResult, give_up
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.gather import gather_distinct, gather_records
from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.model.rank_state import look, rank_record
from fsdpcheck.records import (
    EnvRecord,
    Finding,
    Gathered,
    RankError,
    RankRecord,
    Report,
)
from fsdpcheck.report import headline, ranks_by_host, verdict
from fsdpcheck.step.watch import ChannelLost, CollectiveWatch, StepDiverged, fsdp_owners
from fsdpcheck.text import RAISED_AFTER
from fsdpcheck.vocab import Cause, ErrorKind, Snapshot, Stage

log = logging.getLogger(__name__)

_LISTED = 3


@dataclass(frozen=True)
class StepOutcome:
    """What rank 0 learned from one watched step (``None`` fields elsewhere)."""

    findings: tuple[Finding, ...]
    errors: tuple[RankError, ...]
    gathered: Gathered | None  # every rank's state after the step
    seconds: float  # the step itself, watch included, on this rank
    watch_seconds: float  # the watch's share


def watched_step(
    ctx: DistContext,
    model: Any,
    step: Callable[[], Any],
    *,
    forget: list[Callable[[], Any]] | None = None,
    abort: liveness.AbortWatch | None = None,
) -> tuple[StepRecord, float]:
    """Collective: run ``step`` once under the watch; this rank's record and the seconds the
    step took, watch included. ``forget``: gets the call that deletes what the watch left in
    the store, for the caller to make once every rank has concluded. ``abort``: the rank's
    abort watch; the step stops once it took the abort mark (``AbortWatch.guarded``).

    Raises :class:`ChannelLost` when a peer stopped answering (the caller names it)."""
    liveness.mark_stage(ctx, Stage.STEP)
    watch = CollectiveWatch(
        ctx.side_channel,
        ctx.world_size,
        fsdp_owners(model),
        store=abort.guarded(ctx.store) if abort is not None else ctx.store,
        rank=ctx.rank,
        timeout=ctx.timeout,
    )
    if forget is not None:
        forget.append(watch.forget)
        forget.append(lambda: forget_raise(ctx))
    returned, message = None, ""
    start = time.perf_counter()
    try:
        with watch, watch.batches(), watch.point_to_point():
            returned = step()
    except StepDiverged:
        log.debug("step unwound at collective #%s", watch.at)
    except ChannelLost:
        raise
    except Exception as exc:  # the script's own failure: reported, never left to strand a peer
        log.debug("the step raised", exc_info=True)
        message = f"{type(exc).__name__}: {exc}"
        leave_raise(ctx, message)
    watch.finish(raised=bool(message))
    seconds = time.perf_counter() - start
    return step_record(watch, model, returned, message), seconds


def step_record(
    watch: CollectiveWatch, model: Any, returned: Any = None, message: str = ""
) -> StepRecord:
    """This rank's record of a watched step that is over (:meth:`CollectiveWatch.finish` ran):
    ``returned`` what the step returned (its loss), ``message`` the exception it raised."""
    outcome = "diverged" if watch.diverged else ("raised" if message else "finished")
    loss = _loss(returned)
    non_finite = _non_finite(model, loss) if outcome == "finished" else StepNonFinite()
    record = StepRecord(
        outcome=outcome,
        collectives=len(watch.calls),
        at=watch.at,
        doing=watch.doing,
        state=watch.state,
        before=watch.context(),
        message=message,
        loss=loss if loss is None or math.isfinite(loss) else None,
        non_finite=non_finite,
        exchanges=watch.exchanges,
        channel_bytes=watch.channel_bytes,
        watch_seconds=round(watch.seconds, 6),
        group_ranks=watch.group_ranks,
        peers=watch.peers,
        reason=watch.reason,
    )
    log.info("step %s after %d collectives", outcome, len(watch.calls))
    return record


_RAISED_KEY = "fsdpcheck/step-raised/{}"


def leave_raise(ctx: DistContext, message: str) -> None:
    """This rank's own exception in its step, for whichever rank has to give up on the run:
    it names the rank that raised, not the one left waiting for it."""
    if ctx.store is None:
        return
    try:
        ctx.store.set(
            _RAISED_KEY.format(ctx.rank), json.dumps({"message": message, "at": time.time()})
        )
    except Exception:  # the store's host is gone: the gather carries the exception instead
        log.debug("could not leave the step's exception", exc_info=True)


def forget_raise(ctx: DistContext) -> None:
    if ctx.store is not None:
        try:
            ctx.store.delete_key(_RAISED_KEY.format(ctx.rank))
        except Exception:  # the store's host is gone: nothing left to grow
            log.debug("could not delete the step's exception", exc_info=True)


def step_raises(ctx: DistContext) -> tuple[RankError, ...]:
    """Every rank's own exception in its step that it left in the store, the first raised
    first; a later one is said to come after it (a peer's failure often ends another rank's
    collective). O(world) store calls: only a run that gives up reads them."""
    if ctx.store is None:
        return ()
    left = []
    for rank in range(ctx.world_size):
        key = _RAISED_KEY.format(rank)
        try:
            if ctx.store.check([key]):
                value = json.loads(ctx.store.get(key))
                left.append((float(value["at"]), rank, str(value["message"])))
        except Exception:  # the store's host is gone: what the others left is lost
            log.debug("could not read rank %d's step exception", rank, exc_info=True)
    left.sort()
    errors = []
    for at, rank, message in left:
        said = f"rank {rank}'s step raised: {message}"
        if errors:
            first_at, first = left[0][0], left[0][1]
            said = (
                f"rank {rank}'s step {RAISED_AFTER} rank {first}'s had ({at - first_at:.1f}s "
                f"later): {message}"
            )
        errors.append(RankError(rank, Stage.STEP, said, ErrorKind.RUNTIME))
    return tuple(errors)


def conclude_step(
    ctx: DistContext,
    model: Any,
    env: EnvRecord,
    record: StepRecord,
    seconds: float,
    abort: liveness.AbortWatch | None = None,
) -> StepOutcome | None:
    """Collective: every rank's state after the step and its step record, judged on rank 0
    (``None`` elsewhere). Replicas (HSDP) are compared only after a step every rank finished.
    Raises ConnectionError where ``abort`` (the rank's abort watch) took the abort mark: the
    ranks that gave up will never join the gather."""
    if abort is not None:
        abort.stop_if_over()
    liveness.mark_stage(ctx, Stage.STEP_REPORT)
    state = RankRecord(env=env)
    if record.outcome == "finished" and _has_replicas(model):
        # As the audit records a rank: the values, and which ranks the meshes make replicas.
        after = look(model, Snapshot.POST_WRAP, param_values=True, buffers=False)
        state = rank_record(env, after)
    gathered = gather_records(state, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size)
    records = gather_distinct(record, ctx.side_channel, rank=ctx.rank, world_size=ctx.world_size)
    if records is None:
        return None
    findings = run_checks(Evidence(gathered, step=records), checks_named(*STEP_CHECKS))
    if gathered is not None and gathered.value_keys is not None:
        findings += [
            replace(f, snapshot=Snapshot.STEP, cause=Cause.DIVERGENT)
            for f in run_checks(Evidence(gathered), checks_named(*STATE_CHECKS))
        ]
    errors = tuple(
        RankError(r, Stage.STEP, f"rank {r}'s step raised: {message}", ErrorKind.RUNTIME)
        for r, message in raised_errors(records).items()
    )
    return StepOutcome(tuple(findings), errors, gathered, seconds, record.watch_seconds)


def give_up_on_step(
    ctx: DistContext, exc: BaseException, abort: liveness.AbortWatch | None
) -> AuditResult:
    """A watched step's exchange failed (``check_step``, ``fsdpcheck run``): the run ends
    naming the rank responsible, each rank's own exception in its step first, or with the
    abort mark's errors where this rank's watch took them (read from no store)."""
    aborted = abort.disarm() if abort is not None else None
    raises = () if aborted else step_raises(ctx)
    own = next((e for e in raises if e.rank == ctx.rank), None)
    return give_up(ctx, exc, own, stage=Stage.STEP, known=raises, aborted=aborted)


def merged(report: Report, outcome: StepOutcome) -> Report:
    """``report`` with the step's findings and errors, and one verdict over all of them."""
    findings = (*report.findings, *outcome.findings)
    errors = tuple(sorted((*report.errors, *outcome.errors), key=lambda e: e.rank))
    name, code = verdict(findings, errors)
    timings = {**report.timings, "step": round(outcome.seconds, 4)}
    timings["step-watch"] = round(outcome.watch_seconds, 4)
    return replace(
        report, verdict=name, exit_code=code, findings=findings, errors=errors, timings=timings
    )


def step_report(outcome: StepOutcome, world_size: int) -> Report:
    """check_step's own report: the step's findings, every rank's group and environment."""
    gathered = outcome.gathered
    groups = group_ranks(gathered.digests, gathered.hosts) if gathered else []
    name, code = verdict(outcome.findings, outcome.errors)
    empty = Report(
        verdict=name,
        exit_code=code,
        world_size=world_size,
        model=None,
        wrap=None,
        groups=tuple(groups),
        findings=(),
        errors=(),
        hosts=ranks_by_host(gathered.hosts) if gathered else {},
        environment=tuple(gathered.records[g.representative].env for g in groups)
        if gathered
        else (),
    )
    return merged(empty, outcome)


def step_headline(report: Report) -> str:
    return headline(report.findings, report.errors, report.world_size)


def _loss(returned: Any) -> float | None:
    """The loss a step returned: a scalar tensor, a number, or an output with ``.loss``."""
    value = getattr(returned, "loss", returned)
    if isinstance(value, dict):
        value = value.get("loss")
    try:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.detach().float().cpu())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    except Exception:  # a loss we cannot read is no finding
        log.debug("could not read the step's loss", exc_info=True)
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _non_finite(model: Any, loss: float | None) -> StepNonFinite:
    """NaN or Inf in the loss, this rank's gradients and its parameters (local shards)."""
    params, grads = [], []
    for name, param in model.named_parameters():
        params.append((name, _local(param.detach())))
        if param.grad is not None:
            grads.append((name, _local(param.grad.detach())))

    def bad(named: list[tuple[str, torch.Tensor]]) -> list[str]:
        floats = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
        if not floats:
            return []
        # A NaN or Inf element makes the sum NaN or Inf, so a finite sum clears the tensor in
        # one read with no mask allocated (isfinite().all() of a 1B model's shards costs
        # seconds); a non-finite sum may still be a finite tensor overflowing, so those few
        # are checked element by element. One flag per tensor, read back in one transfer.
        sums = torch.stack([t.sum(dtype=torch.float32) for _, t in floats])
        flags = torch.isfinite(sums).cpu().tolist()
        suspects = [i for i, ok in enumerate(flags) if not ok]
        if suspects:
            exact = torch.stack([torch.isfinite(floats[i][1]).all() for i in suspects])
            for i, ok in zip(suspects, exact.cpu().tolist(), strict=True):
                flags[i] = ok
        return [n for (n, _), ok in zip(floats, flags, strict=True) if not ok]

    bad_grads, bad_params = bad(grads), bad(params)
    return StepNonFinite(
        loss=loss_word(loss),
        grads=tuple(bad_grads[:_LISTED]),
        grad_count=len(bad_grads),
        params=tuple(bad_params[:_LISTED]),
        param_count=len(bad_params),
    )


def _has_replicas(model: Any) -> bool:
    """A parameter on a 2-D mesh (HSDP): its replicas must agree after the step."""
    return any(getattr(getattr(p, "device_mesh", None), "ndim", 1) >= 2 for p in model.parameters())
