"""What a command does to its own interpreter: the debug log, the rank hash seed re-exec,
SIGTERM, gc, torch elastic's error file on the way out, and the exit itself.

Only the command layer calls these, except :func:`configure_logging`, which a training script
may call too (``import fsdpcheck`` already calls it when ``FSDPCHECK_LOG`` is set).
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import NoReturn

from fsdpcheck.distributed.launcher import rank_hint

log = logging.getLogger(__name__)

LOG_VARIABLE = "FSDPCHECK_LOG"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_HANDLER = "fsdpcheck-stderr"
_REEXEC_MARK = "FSDPCHECK_HASH_SEED_VARIED"


# A log line as this handler writes it: how a child's stderr reader tells it from the real error.
LOG_LINE = re.compile(r"^\[rank -?\d+\] (fsdpcheck[\w.]*: |\| )")


class _RankFormatter(logging.Formatter):
    """Every line of a record (a traceback's too) carries the rank, so ranks' interleaved
    stderr stays readable."""

    def __init__(self, rank: int):
        super().__init__("%(name)s: %(message)s")
        self._prefix = f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        lines = text.splitlines()
        head = self._prefix + lines[0]
        # Continuation lines are marked apart from a record's first line (see LOG_LINE).
        return "\n".join([head, *(f"{self._prefix}| {line}" for line in lines[1:])])


def configure_logging(level: str | None = None) -> None:
    """Send the ``fsdpcheck`` loggers to stderr, one line per record prefixed with the rank
    (``[rank 1] fsdpcheck.audit: ...``), at ``level`` (``debug``, ``info`` or ``warning``;
    default: ``$FSDPCHECK_LOG``). Without either, logging stays as the caller set it up; a
    second call only changes the level."""
    wanted = (level or os.environ.get(LOG_VARIABLE) or "").strip().lower()
    if not wanted:
        return
    logger = logging.getLogger("fsdpcheck")
    if not any(h.get_name() == _HANDLER for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER)
        handler.setFormatter(_RankFormatter(rank_hint(os.environ)))
        logger.addHandler(handler)
        logger.propagate = False  # one line per record, even where the root logs too
    logger.setLevel(_LEVELS.get(wanted, logging.WARNING))
    if wanted not in _LEVELS:
        log.warning("%s=%s is not a level: use debug, info or warning", LOG_VARIABLE, wanted)


def vary_hash_seed() -> None:
    """Restart this interpreter with PYTHONHASHSEED = its rank, before anything is hashed for
    real; the restarted one (marked in its environment) carries on."""
    if os.environ.get(_REEXEC_MARK) == "1":
        return
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = str(rank_hint(env))
    env[_REEXEC_MARK] = "1"
    log.debug("re-exec with PYTHONHASHSEED=%s", env["PYTHONHASHSEED"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fsdpcheck", *sys.argv[1:]], env)


class Terminated(Exception):
    """SIGTERM, e.g. torchrun stopping the job because another rank exited."""


def _terminated(signum: int, frame: object) -> None:
    # An exception, not an exit: the audit's failure path still names the cause and, on
    # rank 0, writes the report before the launcher's follow-up SIGKILL.
    raise Terminated("stopped by SIGTERM (the launcher is ending the job)")


def raise_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _terminated)


def tune_gc() -> None:
    """For a short-lived process that imports torch and transformers and builds a model: with
    the default thresholds, Python runs full collections over that whole heap several times
    (about 0.6 s of CPU per rank on a 70B-shaped config); far fewer young ones do the job."""
    gc.set_threshold(50_000, 100, 100)


def tell_torchrun(message: str) -> None:
    """Write torch elastic's error file, so torchrun's summary names the cause, not exit codes.

    Its plain form (a message and a timestamp, no traceback): the summary shows the one-line
    cause as it is, where a recorded exception would show a Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return

    try:
        with open(path, "w") as file:
            json.dump({"message": f"fsdpcheck: {message}", "timestamp": int(time.time())}, file)
    except OSError:  # a summary without the cause is worse, but never a reason to fail
        log.debug("could not write %s", path, exc_info=True)


def exit_skipping_teardown(code: int | str | None) -> NoReturn:
    """End the command with ``code`` (a ``SystemExit`` code): threads are waited for, exit
    handlers run and output is flushed as on any exit; only the interpreter's teardown after
    them is skipped.

    torch keeps destroyed process groups alive from its caches (DTensor's sharding decisions
    hold the mesh, the mesh holds its groups), so their gloo threads are still running while
    the interpreter tears itself down, and the process now and then aborts there ("terminate
    called without an active exception", exit -6) after its report is out: an exit 0 or 2
    that a CI job reads as a crash. Nothing is left to tear down that the OS does not free.
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, exit 1, as Python does
        sys.stderr.write(f"{code}\n")
        code = 1
    handlers_started = False

    def terminated(*_: object) -> None:
        # The command is over: a SIGTERM now (torchrun ending the job because a rank that
        # finished first exited non-zero) stops the wait for threads but still runs the exit
        # handlers (a script's logger flushing its run, say) and keeps the command's code,
        # where raise_on_sigterm's exception would leave a traceback and exit 1.
        if not handlers_started:
            atexit._run_exitfuncs()
        _flush_and_exit(code)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminated)
    # What the interpreter's own exit does before its teardown: wait for non-daemon threads
    # (and run what they registered), then the exit handlers.
    wait_for_threads = getattr(threading, "_shutdown", None)
    if wait_for_threads is not None:
        wait_for_threads()
    handlers_started = True
    atexit._run_exitfuncs()
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        # a closed pipe: nothing more can reach it; a SIGTERM's flush inside the exit's own
        # flush of that stream: the exit's own finishes it
        except (OSError, ValueError, RuntimeError):
            log.debug("could not flush %s", stream, exc_info=True)
    os._exit(code)


def end_by_sigint() -> NoReturn:
    """End this process as Python ends one on an uncaught ``KeyboardInterrupt``: killed by
    SIGINT (its parent sees the signal, not an exit code), no teardown to wait on."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # only if the signal did not end it
