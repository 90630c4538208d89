"""One rank of a plain training script calling ``check_model`` while a peer is gone or stalled:
env:// variables and its own gloo group, as a launcher script or a Ray actor sets them up. The
call must return an ``AuditResult`` (exit 3, naming the missing rank) and leave the process
alive: each rank writes ``rank<N>.json`` after its calls returned.

argv: OUT SCENARIO TIMEOUT DELAY

- ``stalls``: in turn ``clean`` (both ranks on time: exit 0), ``stall-inside`` (rank 1 takes
  DELAY seconds inside the check, past the others' TIMEOUT) and ``stall-before`` (rank 1
  sleeps DELAY seconds before calling the check);
- ``exit-1`` / ``exit-0``: that rank exits right before the check; the other calls it alone.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from hook_paths_worker import SlowToDescribe
from hooked import rank, tiny_llama, write

import fsdpcheck
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


def called(model, timeout: float) -> dict:
    start = time.monotonic()
    result = fsdpcheck.check_model(model, timeout=timeout)
    report = result.report
    return {
        "exit_code": int(result.exit_code),
        "headline": result.headline,
        "seconds": round(time.monotonic() - start, 2),
        "own_error": result.own_error.message if result.own_error else None,
        "errors": [list(to_dict(e).values())[:3] for e in report.errors] if report else None,
    }


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    timeout, delay = float(sys.argv[3]), float(sys.argv[4])
    dist.init_process_group("gloo")
    model = tiny_llama(planted=False)
    record: dict = {}
    if scenario == "stalls":
        record["clean"] = called(model, timeout)
        if rank() == 1:
            SlowToDescribe(model, delay)
        record["stall-inside"] = called(model, timeout)
        if rank() == 1:
            time.sleep(delay)
        record["stall-before"] = called(model, timeout)
    else:
        gone = int(scenario.removeprefix("exit-"))
        # The peer dies once both ranks are through init_process_group: under load, rank 0
        # leaving first used to cut rank 1's own gloo handshake short (a test race, not the
        # check's failure).
        store = dist.distributed_c10d._get_default_store()
        if rank() != gone:
            store.set(f"through-init-{rank()}", "1")
        else:
            store.wait([f"through-init-{1 - gone}"])
            os._exit(0)  # a peer that dies just before the check
        record[scenario] = called(model, timeout)
    write(out, record)  # the process went on after every call
    if rank() == 0 and scenario == "stalls":  # the store's host stays until rank 1 is done
        deadline = time.monotonic() + 60
        while not (out / "rank1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    exit_skipping_teardown(0)


if __name__ == "__main__":
    main()
