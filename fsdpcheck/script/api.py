"""``fsdpcheck run`` as a call: a script, a module or a training function, checked from its first
``fully_shard`` to the end of its first step (the command and a Ray actor share it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fsdpcheck.options import RunOptions
from fsdpcheck.records import Report
from fsdpcheck.script.runner import Target, run
from fsdpcheck.script.session import RunOutcome, RunStopped, ScriptSession, ended_by_the_run

log = logging.getLogger(__name__)

__all__ = ["run_checked", "watched_run"]


def watched_run(
    work: Callable[[], Any],
    options: RunOptions,
    publish: Callable[[Report], None] | None = None,
) -> tuple[RunOutcome, BaseException | None]:
    """Run ``work`` under a :class:`ScriptSession`; this rank's outcome, and how ``work`` ended
    when it did not return: its own exception or ``SystemExit``, a :class:`RunStopped` (the
    run stopped it), a :class:`StepDiverged` (the watch did), a ``ChannelLost`` (the watch lost
    a peer: the outcome names it). Ctrl-C goes on up at once, as without fsdpcheck."""
    session = ScriptSession(options, publish)
    session.install()
    error: BaseException | None = None
    try:
        work()
    except KeyboardInterrupt:
        session.remove()
        raise
    except BaseException as exc:  # the script's own end, or the run stopping it
        log.debug("the script ended with %s", type(exc).__name__, exc_info=True)
        error = exc
    outcome = session.finish(None if isinstance(error, RunStopped) else error)
    return outcome, error


def run_checked(
    target: str | Callable[..., Any],
    *args: Any,
    module: bool = False,
    timeout: float = 60.0,
    watch_steps: int = 1,
    steps: int | None = None,
    source: str | None = None,
    strict: bool = False,
) -> RunOutcome:
    """Every rank calls it where it would call ``target``: a training function (called with
    ``args``), a script's path or, with ``module=True``, a module's name (run as ``python
    SCRIPT ARGS`` or ``python -m MODULE ARGS`` would, ``args`` its ``sys.argv[1:]``), checked
    as ``fsdpcheck run`` checks it. Returns this rank's :class:`RunOutcome` (the report on rank
    0; ``exit_code`` the same on every rank once the ranks concluded, ``None`` when nothing was
    found and the script's own end decides). Never ends the process; the target's own
    exception is raised again once every rank concluded."""
    options = RunOptions(
        timeout=timeout, watch_steps=watch_steps, steps=steps, source=source, strict=strict
    )
    if callable(target):

        def work() -> Any:
            return target(*args)

    else:
        script = Target(str(target), tuple(str(a) for a in args), module)

        def work() -> Any:
            return run(script)

    outcome, error = watched_run(work, options)
    # The run's own ends are in the outcome (its exit_code and report), not raised: a library
    # caller never gets fsdpcheck's internal BaseExceptions.
    if error is not None and not (ended_by_the_run(error) or isinstance(error, SystemExit)):
        raise error
    return outcome
