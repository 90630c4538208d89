"""``run_audit`` called again and again in one process, as ``fsdpcheck run`` and a Ray actor
call it (tests/ranks/test_repeat_audit.py): the script owns the default group (gloo), and after
each call, without collecting garbage itself, each rank notes its RSS and open descriptors.
Rank 0 writes ``--out``: per call every rank's numbers and exit code."""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from fsdpcheck.process import exit_skipping_teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    from fsdpcheck.audit import AuditOptions, run_audit
    from fsdpcheck.model.memory import rss

    calls = []
    for _ in range(args.calls):
        result = run_audit(AuditOptions(model=args.model, timeout=120))
        verdict = result.report.verdict if result.report is not None else None
        fds = len(os.listdir("/proc/self/fd"))
        code = int(result.exit_code)
        calls.append({"exit_code": code, "verdict": verdict, "rss": rss(), "fds": fds})
        del result
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, calls)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
    exit_skipping_teardown(main())
