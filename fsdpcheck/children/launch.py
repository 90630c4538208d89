"""The one child-job framework: start a command as N local ranks (or many one-rank jobs), bounded
in time, and read back where each rank got to and what it found.

Parent side: :func:`launch` (one job of N ranks, each with the env:// variables and its own
environment, e.g. ``PYTHONHASHSEED``) and :func:`run_each` (independent one-rank jobs, at most
``jobs`` at a time). Every rank starts in a session of its own; when the deadline passes, when
the parent is interrupted, or when the job is over, every rank's whole process group is killed,
so no process outlives its job.

Child side: :func:`mark_stage` (where this rank is now) and :func:`emit` (one result record), each
one JSON line on stdout that starts with :data:`MARK` (a :class:`~fsdpcheck.records.ChildLine`,
never pickle; other output is ignored); the parent reads each result back as the job's record
type (``record=``).
A line is flushed before the next step starts, so the parent can tell a rank killed inside a
collective (a hang) from one still importing torch at the deadline (too slow to say anything),
and a broken process group never stands between the parent and the evidence.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpcheck.distributed.launcher import FOREIGN
from fsdpcheck.process import LOG_LINE
from fsdpcheck.records import ChildLine, from_dict, to_dict
from fsdpcheck.vocab import ChildStage

log = logging.getLogger(__name__)

MARK = "@fsdpcheck "  # prefix of the JSON lines a child prints (other output is ignored)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding fsdpcheck/
_POLL = 0.05  # seconds between checks of the ranks' exits
# What a C++ std::thread destroyed while joinable prints (torch's exit abort, fsdpcheck/process.py)
TEARDOWN_ABORT = "terminate called without an active exception"

# What fsdpcheck's own jobs run with: offline, quiet, one thread each, unbuffered.
JOB_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONUNBUFFERED": "1",
}
# torchrun's agent speaks to its own workers through these; a child job is a new job, and with
# TORCHELASTIC_USE_AGENT_STORE its rank 0 would wait for a store nobody serves (issue 19).
_AGENT_VARS = frozenset(
    {
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_ERROR_FILE",
    }
)
_AGENT_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    elapsed: float  # seconds from launch to this rank's exit
    stage: ChildStage | None = None  # the last stage it marked
    records: tuple[Any, ...] = ()  # the results it emitted, in order, as the job's record type

    @property
    def signal(self) -> str | None:
        return signal_name(self.returncode)

    @property
    def result(self) -> Any | None:
        """Its last result record, if it emitted one."""
        return self.records[-1] if self.records else None

    def failure(self, timeout: float) -> str:
        """Why it gave no result: the deadline, or its exit and most telling stderr line."""
        if self.returncode is None:
            return f"timed out after {timeout:g} s (killed)"
        last = [line for line in self.stderr[-2000:].strip().splitlines() if line.strip()]
        detail = last[-1] if last else "no output"
        return f"child exited with code {self.returncode} without a result: {detail}"


@dataclass(frozen=True)
class LaunchResult:
    ranks: tuple[RankOutcome, ...]
    elapsed: float
    timed_out: bool

    @property
    def codes(self) -> list[int | None]:
        return [r.returncode for r in self.ranks]

    def output(self, rank: int = 0) -> str:
        return self.ranks[rank].stdout + self.ranks[rank].stderr

    def aborted_in_teardown(self, rank: int) -> bool:
        """The rank died of SIGABRT in the interpreter's teardown, after its own work: torch's
        exit abort where a destroyed gloo group's threads outlive the script (the reason
        fsdpcheck's own commands end with :func:`fsdpcheck.process.exit_skipping_teardown`)."""
        return self.ranks[rank].returncode == -6 and TEARDOWN_ABORT in self.output(rank)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(
    environ: Mapping[str, str], extra: Mapping[str, str], rank_vars: Mapping[str, str]
) -> dict[str, str]:
    """A rank's whole environment: ``environ`` without an enclosing job's launcher variables,
    then ``extra``, then its own rank variables; this fsdpcheck first on ``PYTHONPATH``."""
    inherited = {
        k: v
        for k, v in environ.items()
        if k not in FOREIGN and k not in _AGENT_VARS and not k.startswith(_AGENT_PREFIXES)
    }
    env = {**inherited, **extra, **rank_vars}
    # This fsdpcheck, wherever it was imported from, whatever the child's working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    return env


class _Rank:
    """One started rank: its process, its stderr file and the reader of its stdout."""

    def __init__(
        self,
        rank: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_record: Callable[[int, Any], None] | None,
        record: type[Any] | None,
    ):
        self.rank = rank
        self.stage: ChildStage | None = None
        self.records: list[Any] = []
        self._record = record
        self.lines: list[str] = []
        self.exited: float | None = None
        self.killed = False
        self._on_record = on_record
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=self.err,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            text=True,
            start_new_session=True,  # its own process group: one kill takes all it started
        )
        _LIVE.add(self.proc)
        self.reader = threading.Thread(target=self._read, name=f"fsdpcheck-rank{rank}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            stage, result = _parse(line, self._record)
            if stage is not None:
                self.stage = stage
            if result is not None:
                self.records.append(result)
                if self._on_record is not None:
                    self._on_record(self.rank, result)

    def kill(self) -> None:
        """Kill its whole process group, whatever is left of it, and reap it."""
        if self.proc.poll() is None:
            self.killed = True
        kill_group(self.proc)
        _LIVE.discard(self.proc)

    def outcome(self, start: float) -> RankOutcome:
        self.reader.join(timeout=10)  # EOF once the group is gone
        self.err.seek(0)
        stderr = self.err.read()
        self.err.close()
        code = None if self.killed else self.proc.returncode
        elapsed = (self.exited or time.monotonic()) - start
        return RankOutcome(
            self.rank, code, "".join(self.lines), stderr, elapsed, self.stage, tuple(self.records)
        )


def launch(
    argv: Sequence[str],
    nprocs: int,
    *,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    timeout: float = 120.0,
    cwd: str | None = None,
    port: int | None = None,
    on_record: Callable[[int, Any], None] | None = None,
    cancel: threading.Event | None = None,
    record: type[Any] | None = None,
    rank_args: Callable[[int], Sequence[str]] | None = None,
) -> LaunchResult:
    """Start ``python <argv...>`` (``argv`` after the interpreter) as ``nprocs`` ranks of one
    job and wait for them, at most ``timeout`` seconds (or until ``cancel`` is set); then kill
    every rank's process group. ``record``: the type the ranks' results are read back as (else
    plain mappings); ``on_record(rank, record)`` is called as each arrives (from reader
    threads). ``rank_args(rank)``: arguments only that rank gets, after ``argv`` (a node
    launched with another flag)."""
    port = port or free_port()
    start = time.monotonic()
    ranks: list[_Rank] = []
    timed_out = False
    try:
        for rank in range(nprocs):
            rank_vars = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(rank_env(rank) if rank_env else {}),
            }
            rank_environ = child_env(os.environ, env or {}, rank_vars)
            own = [*argv, *(rank_args(rank) if rank_args else ())]
            ranks.append(_Rank(rank, own, rank_environ, cwd, on_record, record))
        log.info("launched %d rank(s), port %d: python %s", nprocs, port, " ".join(argv))
        deadline = start + timeout
        while True:
            for r in ranks:
                if r.exited is None and r.proc.poll() is not None:
                    r.exited = time.monotonic()
            if all(r.exited is not None for r in ranks):
                break
            if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
                timed_out = True
                break
            time.sleep(_POLL)
    finally:
        for r in ranks:
            r.kill()
    outcomes = tuple(r.outcome(start) for r in ranks)
    log.info(
        "job of %d rank(s) ended after %.1f s: codes %s, stages %s%s",
        nprocs,
        time.monotonic() - start,
        [o.returncode for o in outcomes],
        [o.stage for o in outcomes],
        " (deadline or cancelled)" if timed_out else "",
    )
    return LaunchResult(outcomes, time.monotonic() - start, timed_out)


def run_each(
    argv: Sequence[str],
    envs: Sequence[Mapping[str, str]],
    *,
    jobs: int | None,
    timeout: float,
    on_record: Callable[[int, Any], None] | None = None,
    record: type[Any] | None = None,
) -> list[RankOutcome]:
    """``argv`` once per environment in ``envs``, each a one-rank job bounded by ``timeout``, at
    most ``jobs`` at a time (default: the usable cores). ``on_record(index, record)`` is called
    one call at a time, as records arrive."""
    lock = threading.Lock()
    cancel = threading.Event()

    def one(index: int) -> RankOutcome:
        def report(_: int, result: Any) -> None:
            if on_record is not None:
                with lock:
                    on_record(index, result)

        job = launch(
            argv,
            1,
            env=envs[index],
            timeout=timeout,
            on_record=report,
            cancel=cancel,
            record=record,
        )
        return job.ranks[0]

    workers = max(1, min(jobs or usable_cores(), len(envs)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsdpcheck-job")
    try:
        return list(pool.map(one, range(len(envs))))
    except BaseException:
        cancel.set()  # every running job kills its ranks; queued ones are cancelled
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _LiveProcesses:
    """Every rank still running: killed at interpreter exit, e.g. when a daemon thread that
    launched them is abandoned."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            kill_group(proc)


_LIVE = _LiveProcesses()
atexit.register(_LIVE.kill_all)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also after the leader exited: what it left behind
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do from here
        log.warning("pid %d survived SIGKILL for 10 s", proc.pid)


# ---------------------------------------------------------------- child side


def mark_stage(stage: ChildStage) -> None:
    """Child side: this rank is now in ``stage``."""
    _write(ChildLine(stage=stage))


def emit(record: Any) -> None:
    """Child side: one result record, a frozen record of the job's type (the only things a
    child prints on purpose)."""
    _write(ChildLine(result=to_dict(record)))


def _write(line: ChildLine) -> None:
    fields = {k: v for k, v in to_dict(line).items() if v is not None}
    sys.stdout.write(MARK + json.dumps(fields, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _parse(line: str, record: type[Any] | None) -> tuple[ChildStage | None, Any]:
    """A marked line's stage and its result, read as a ``record``; nothing for any other line,
    nor for one cut short by a kill mid-write or not of this job's format."""
    if not line.startswith(MARK):
        return None, None
    try:
        parsed = from_dict(ChildLine, json.loads(line[len(MARK) :]))
        result = parsed.result
        if result is not None and record is not None:
            result = from_dict(record, result)
    except (ValueError, TypeError, AttributeError, KeyError):
        log.debug("an unreadable child line: %.80s", line, exc_info=True)
        return None, None
    return parsed.stage, result


# ---------------------------------------------------------------- reading a rank's end

_ERROR_LINE = re.compile(r"error|what\(\)|enforce fail|abort|timed out|timeout", re.IGNORECASE)


def signal_name(code: int | None) -> str | None:
    """``SIGABRT`` for a rank killed by that signal (a negative return code); else None."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def last_error(stderr: str, limit: int = 500) -> str:
    """The most telling line of a child's stderr: gloo's enforce message, a traceback's end."""
    # fsdpcheck's own log lines (FSDPCHECK_LOG, inherited by children) are never the error.
    lines = [
        line.strip() for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)
    ]
    telling = [line for line in lines if _ERROR_LINE.search(line)]
    return (telling or lines or [""])[-1][:limit]
