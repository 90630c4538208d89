"""One rank of the hook edge cases (2 CPU ranks, gloo), each case after the other in one job,
calling the HF Trainer hook as the Trainer does (``on_train_begin``) on a tiny Llama:

- ``unwritable``: ``json_path`` under a regular file, in both modes: every rank must fail fast
  with the same error, before any collective, and none may go on alone;
- ``new-folder``: its clean twin, ``json_path`` in a folder that does not exist yet (the report
  write makes it): the check runs and rank 0 writes the report;
- ``slow-peer``: rank 1 takes ``--delay`` seconds, past the others' ``--timeout``, to describe
  its model; with ``on_failure="warn"`` every rank must warn and return the same result, and
  none be ended by the check (``--delay 0``: not run);
- ``fast-peer``: its clean twin, no delay.

After each case the ranks meet in a barrier, as training would; rank ``<N>.json`` says what the
hook did on this rank."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch.distributed as dist
from hooked import outcome, rank, tiny_llama, write

from fsdpcheck.integrations.hf import FsdpcheckCallback
from fsdpcheck.process import exit_skipping_teardown


class SlowToDescribe:
    """Makes one rank's model slow to walk once (a stalled filesystem, a busy host), inside the
    check, after the ranks have met: its next ``named_modules()`` call sleeps ``delay`` first."""

    def __init__(self, model, delay: float):
        walk = model.named_modules

        def named_modules(*args, **kwargs):
            model.named_modules = walk  # once
            time.sleep(delay)
            return walk(*args, **kwargs)

        model.named_modules = named_modules


def hook(model, mode: str, json_path: Path | None, timeout: float):
    """How to run the hook as the Trainer would; it returns the check's exit code."""
    callback = FsdpcheckCallback(on_failure=mode, timeout=timeout, json_path=json_path)

    def run() -> int:
        callback.on_train_begin(None, None, None, model=model)
        return int(callback.result.exit_code)

    return run


def timed(run) -> dict:
    start = time.monotonic()
    record = outcome(run)
    record["seconds"] = round(time.monotonic() - start, 2)
    dist.barrier()  # training goes on: every rank must still be here
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--delay", type=float, default=20.0)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    model = tiny_llama(planted=False)
    record: dict = {}
    blocked = out / "not-a-folder"  # the test makes it a regular file
    for mode in ("warn", "raise"):
        path = blocked / f"{mode}.json"
        record[f"unwritable-{mode}"] = timed(hook(model, mode, path, args.timeout))
    path = out / "made-by-the-write" / "report.json"
    record["new-folder"] = timed(hook(model, "raise", path, args.timeout))
    record["fast-peer"] = timed(hook(model, "warn", None, args.timeout))
    if args.delay:
        if rank() == 1:
            SlowToDescribe(model, args.delay)
        record["slow-peer"] = timed(hook(model, "warn", None, args.timeout))
    write(out, record)
    print(f"rank {rank()} done")
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
    exit_skipping_teardown(main())
