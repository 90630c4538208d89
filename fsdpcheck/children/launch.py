"""Run one command as N local ranks with the env:// variables, bounded in time.

Used by the test-suite, the benchmarks and ``--reproduce``: unlike torchrun it can give each
rank its own environment (``PYTHONHASHSEED``), keeps every rank's exit code, and kills the whole
process group of every rank when the time is up.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    elapsed: float  # seconds from launch to this rank's exit


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    argv: Sequence[str],
    nprocs: int,
    *,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    timeout: float = 120.0,
    cwd: str | None = None,
    port: int | None = None,
) -> LaunchResult:
    """Start ``python -m <argv...>``-style commands (``argv`` after the interpreter) as ranks."""
    from fsdpcheck.distributed.launcher import FOREIGN

    port = port or free_port()
    # A new job: an enclosing srun's or mpirun's variables would contradict the ones set here.
    inherited = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    base = {**inherited, **(env or {})}
    procs: list[tuple[subprocess.Popen, object, object]] = []
    start = time.monotonic()
    for rank in range(nprocs):
        rank_vars = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env={**base, **rank_vars, **(rank_env(rank) if rank_env else {})},
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
        procs.append((proc, out, err))
    deadline = start + timeout
    timed_out = False
    exited: dict[int, float] = {}
    while len(exited) < nprocs:
        for rank, (proc, _, _) in enumerate(procs):
            if rank not in exited and proc.poll() is not None:
                exited[rank] = time.monotonic() - start
        if len(exited) == nprocs:
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    killed = set()
    for rank, (proc, _, _) in enumerate(procs):
        if proc.poll() is None:
            _kill_group(proc)
            killed.add(rank)
    outcomes = []
    for rank, (proc, out, err) in enumerate(procs):
        code = None if rank in killed else proc.returncode
        out.seek(0)
        err.seek(0)
        elapsed = exited.get(rank, time.monotonic() - start)
        outcomes.append(RankOutcome(rank, code, out.read(), err.read(), elapsed))
        out.close()
        err.close()
    return LaunchResult(tuple(outcomes), time.monotonic() - start, timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


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
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    telling = [line for line in lines if _ERROR_LINE.search(line)]
    return (telling or lines or [""])[-1][:limit]
