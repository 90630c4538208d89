"""Deliberate failures for testing the never-hang guarantees on real processes.

``FSDPCHECK_INJECT_FAULT="RANK:STAGE:ACTION[,...]"`` makes rank RANK, on entering STAGE, do
ACTION: ``raise`` (a runtime exception), ``input`` (bad-input error), ``kill`` (SIGKILL itself),
``hang`` (sleep far past any timeout). Unset in normal use; read once per stage, never logged.
"""

from __future__ import annotations

import os
import signal
import time

from fsdpcheck.errors import InputError

FAULT_ENV = "FSDPCHECK_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


def maybe_inject(rank: int, stage: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        parts = entry.strip().split(":")
        if len(parts) != 3 or parts[0] != str(rank) or parts[1] != stage:
            continue
        action = parts[2]
        if action == "raise":
            raise InjectedFault(f"injected fault at {stage}")
        if action == "input":
            raise InputError(f"rank {rank}: injected bad input at {stage}")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            time.sleep(10**6)
