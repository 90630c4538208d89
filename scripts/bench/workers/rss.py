"""Run a script or ``-m module`` in this interpreter and report its peak RSS on exit.

``python scripts/bench/workers/rss.py -m fsdpcheck audit ...`` behaves like ``python -m fsdpcheck
audit ...`` and finally writes ``@rss {"rank": .., "maxrss": bytes, "cpu": seconds}`` to stderr:
``getrusage(RUSAGE_SELF)``'s high-water mark and user + system time of this process. Used by
scripts/bench (the audit, init and trainer rows) so that the audit and the bare job are measured
the same way.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys

MARK = "@rss "


def _report() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        "rank": os.environ.get("RANK"),
        "maxrss": usage.ru_maxrss * 1024,  # KiB on Linux
        "cpu": usage.ru_utime + usage.ru_stime,  # seconds this process ran, user + system
    }
    sys.stderr.write(MARK + json.dumps(record) + "\n")
    sys.stderr.flush()


def main() -> None:
    args = sys.argv[1:]
    # An exit handler, not a ``finally``: fsdpcheck's CLI ends with os._exit once its exit
    # handlers have run (fsdpcheck.process.exit_skipping_teardown), which no ``finally`` survives.
    atexit.register(_report)
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
