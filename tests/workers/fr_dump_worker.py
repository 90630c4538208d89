"""One rank of a job that goes wrong in its collectives, recorded by torch's Flight Recorder: each
rank writes its fingerprint (``<out>/fp/rank<N>.json``) and its Flight Recorder dump (JSON in
``<out>/fr/rank<N>.json``, pickle in ``<out>/fr-pickle/``), then the job ends as it would have
ended (an abort, a hang cut short).

Cases (``--case``):
- ``buffers``: every rank broadcasts its ``named_buffers()`` from rank 0, one broadcast per buffer,
  in its own order (the loader bug). With ``hazard`` and different PYTHONHASHSEEDs the pairs differ
  in size: gloo aborts the receiver once rank 0 sends. So every other rank issues its broadcasts
  (async) and dumps first; rank 0 waits for their dumps, then issues and dumps.
- ``extra-all-reduce``: a short script (all_reduce, broadcast), and rank ``--extra-rank`` issues one
  more all_reduce that nobody joins (a logging all_reduce on one rank): it waits in it until a
  timer dumps every rank's trace and ends the process, as a watchdog would.
- ``clean``: the same script on every rank; the job completes, and the dumps agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # before the process group exists

import torch
import torch.distributed as dist

import fsdpcheck
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM


def dump(out: Path, rank: int) -> Path:
    """The JSON dump, and the pickle one torch's dump-on-timeout writes (``<prefix><rank>``)."""
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    write(out / "fr-pickle" / f"nccl_trace_rank_{rank}", _dump_fr_trace())
    return write(out / "fr" / f"rank{rank}.json", _dump_fr_trace_json())


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a reader never sees half a dump
    return path


def wait_for(paths: list[Path], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            sys.exit(f"never appeared: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


def end(code: int = 0) -> None:
    """Leave without destroy_process_group: the job is broken, and its teardown could wait."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def buffers(out: Path, rank: int, world: int, equal: bool) -> None:
    model = HazardForCausalLM(HazardConfig.equal_sizes() if equal else HazardConfig())
    fsdpcheck.save_fingerprint(model, out / "fp" / "rank{rank}.json")
    others = [out / "fr" / f"rank{r}.json" for r in range(1, world)]
    if rank == 0:
        wait_for(others)  # the receivers' traces are safe before rank 0 sends anything
    works = [dist.broadcast(buf, src=0, async_op=True) for _, buf in model.named_buffers()]
    dump(out, rank)
    finish(works, seconds=5.0)


def script(out: Path, rank: int, extra_rank: int | None) -> None:
    model = HazardForCausalLM(HazardConfig())
    order = sorted(model.named_buffers())  # the fixed loader: the same order everywhere
    fsdpcheck.save_fingerprint(model, out / "fp" / "rank{rank}.json")
    once = threading.Lock()

    def dump_and_end() -> None:
        if once.acquire(blocking=False):  # the watchdog or the main thread, whichever is first
            dump(out, rank)
            end(0)

    # A watchdog: whatever the main thread is waiting in, the trace is written and the job ends.
    watchdog = threading.Timer(4.0, dump_and_end)
    watchdog.daemon = True
    watchdog.start()
    dist.all_reduce(torch.ones(4))
    for _, buf in order:
        dist.broadcast(buf, src=0)
    if extra_rank is None:
        dump_and_end()
    if rank == extra_rank:
        try:
            dist.all_reduce(torch.tensor([1.5]))  # nobody else joins: waits until the watchdog
        except RuntimeError:  # the others' watchdog ended them first: the trace still holds it
            dump_and_end()
    threading.Event().wait()  # the others have moved on (their next step); the watchdog ends it


def finish(works: list, seconds: float) -> None:
    """Wait for the works in the background, at most ``seconds``: on a mismatch gloo aborts the
    receiver here (SIGABRT), as in the real job."""
    waiter = threading.Thread(target=lambda: [w.wait() for w in works], daemon=True)
    waiter.start()
    waiter.join(seconds)
    end(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--case", choices=("buffers", "buffers-equal", "extra-all-reduce", "clean"), required=True
    )
    parser.add_argument("--extra-rank", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.case in ("buffers", "buffers-equal"):
        buffers(out, rank, world, equal=args.case == "buffers-equal")
    else:
        script(out, rank, args.extra_rank if args.case == "extra-all-reduce" else None)


if __name__ == "__main__":
    main()
