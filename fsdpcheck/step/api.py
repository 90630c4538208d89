"""``check_step``: a training script's first step, run once under the collective watch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fsdpcheck.decision import AuditResult, decide, never_met
from fsdpcheck.distributed import liveness
from fsdpcheck.distributed import setup as distributed
from fsdpcheck.distributed.environment import env_record
from fsdpcheck.step.session import conclude_step, give_up_on_step, step_report, watched_step
from fsdpcheck.step.watch import ChannelLost

log = logging.getLogger(__name__)

__all__ = ["check_step"]


def check_step(model: Any, step: Callable[[], Any], *, timeout: float = 60.0) -> AuditResult:
    """Run ``step`` (this rank's zero-argument forward, backward and optimizer step; it may
    return the loss) once, while every collective it issues is first agreed on by every rank.

    Every rank calls it, each with its own step. Where the ranks' next collectives differ (an
    extra micro-batch, a module only one rank runs) no rank issues it: the step unwinds on
    every rank and the report names the first such collective in the model's terms (finding
    kind ``step``). After a step every rank finished: a NaN or Inf loss, gradient or parameter
    is ``non-finite``; HSDP replicas that differ are ``value``. ``exit_code`` is the same on
    every rank; the report is on rank 0.

    The step runs once, for real: after a clean step the model is what the step left. After a
    divergence the step did not complete (FSDP2 modules may be left unsharded): do not train
    on from it. Reuses the script's process group; the watch's exchanges go over a gloo side
    channel bounded by ``timeout``."""
    try:
        ctx = liveness.join("auto", timeout)
    except liveness.NeverMet as exc:  # a peer never arrived: named, exit 3
        return never_met(exc)
    try:
        with liveness.AbortWatch(ctx) as watch:
            env = env_record(ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend)
            try:
                forget: list = []
                record, seconds = watched_step(ctx, model, step, forget=forget, abort=watch)
                outcome = conclude_step(ctx, model, env, record, seconds, abort=watch)
                report = step_report(outcome, ctx.world_size) if outcome is not None else None
                decided = decide(ctx, report)
                # Every rank is past its step (the decision is collective): nobody reads the
                # watch's keys again.
                for call in forget:
                    call()
                return decided
            # ChannelLost is a BaseException (a step's own ``except Exception`` must not
            # swallow it): caught by name, or a side-channel timeout escapes as a raw error.
            except (Exception, ChannelLost) as exc:  # a peer stopped answering: name it
                log.debug("rank %d: check_step gave up", ctx.rank, exc_info=True)
                return give_up_on_step(ctx, exc, watch)
    finally:
        distributed.shutdown(ctx)
