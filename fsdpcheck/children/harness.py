"""Child interpreters with a deadline each: the harness behind probe and scan.

A child prints its results as JSON lines that start with :data:`MARK` (never pickle); anything
else it prints is ignored. Each child is killed when its deadline passes.
"""

from __future__ import annotations

import json
import os
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

MARK = "@fsdpcheck "  # prefix of the JSON lines a child prints (other output is ignored)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding fsdpcheck/


@dataclass(frozen=True)
class ChildOutcome:
    seed: int
    lines: tuple[Mapping[str, Any], ...]  # the JSON records the child printed
    returncode: int | None  # None: killed at the deadline
    timed_out: bool
    stderr_tail: str
    elapsed: float


def child_env(seed: int) -> dict[str, str]:
    """The parent's environment with a fixed hash seed, offline, one thread per child."""
    env = dict(os.environ)
    root = str(_PACKAGE_ROOT)
    env.update(
        PYTHONHASHSEED=str(seed),
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
    )
    return env


class ChildRunner:
    """Run ``python <argv>`` children with a deadline each; :meth:`kill_all` on the way out."""

    def __init__(self) -> None:
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def run(
        self,
        argv: Sequence[str],
        seed: int,
        timeout: float,
        on_line: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> ChildOutcome:
        start = time.monotonic()
        expired = threading.Event()
        lines: list[Mapping[str, Any]] = []
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                env=child_env(seed),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            with self._lock:
                self._live.add(proc)

            def expire() -> None:
                expired.set()
                proc.kill()

            timer = threading.Timer(timeout, expire)
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    record = _parse(line)
                    if record is not None:
                        lines.append(record)
                        if on_line is not None:
                            on_line(record)
                proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                with self._lock:
                    self._live.discard(proc)
            err.seek(0)
            tail = err.read()[-2000:]
        code = None if expired.is_set() else proc.returncode
        return ChildOutcome(
            seed, tuple(lines), code, expired.is_set(), tail, round(time.monotonic() - start, 3)
        )

    def kill_all(self) -> None:
        with self._lock:
            for proc in self._live:
                if proc.poll() is None:
                    proc.kill()


def run_seeds(
    argv: Sequence[str],
    seeds: Sequence[int],
    *,
    jobs: int | None,
    timeout: float,
    on_line: Callable[[int, Mapping[str, Any]], None] | None = None,
) -> dict[int, ChildOutcome]:
    """Run ``argv`` once per hash seed, at most ``jobs`` at a time (default: the usable cores)."""
    runner = ChildRunner()
    lock = threading.Lock()

    def one(seed: int) -> ChildOutcome:
        def report(record: Mapping[str, Any]) -> None:
            if on_line is not None:
                with lock:
                    on_line(seed, record)

        return runner.run(argv, seed, timeout, report)

    workers = max(1, min(jobs or usable_cores(), len(seeds)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsdpcheck-seed")
    try:
        outcomes = list(pool.map(one, seeds))
    except BaseException:
        runner.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {o.seed: o for o in outcomes}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def failure_message(outcome: ChildOutcome, timeout: float) -> str:
    if outcome.timed_out:
        return f"timed out after {timeout:g} s (killed)"
    last = [ln for ln in outcome.stderr_tail.strip().splitlines() if ln.strip()]
    detail = last[-1] if last else "no output"
    return f"child exited with code {outcome.returncode} without a result: {detail}"


def _parse(line: str) -> Mapping[str, Any] | None:
    if not line.startswith(MARK):
        return None
    try:
        record = json.loads(line[len(MARK) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def emit(record: Mapping[str, Any]) -> None:
    """Child side: one JSON line on stdout (the only thing a child prints on purpose)."""
    sys.stdout.write(MARK + json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()
