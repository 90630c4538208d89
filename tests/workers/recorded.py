"""What every load worker shares: its common arguments, and how a rank ends: its record as
``rank<N>.json``, whatever happened."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from fsdpcheck.distributed import setup as distributed
from fsdpcheck.errors import FsdpcheckError


def worker_parser() -> argparse.ArgumentParser:
    """The arguments every load worker takes; each adds its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--init", default="rank0")
    return parser


def run_recorded(
    out: Path, ctx: distributed.DistContext, work: Callable[[dict], None], *, started: float
) -> int:
    """Run ``work(record)``; an fsdpcheck error becomes the record's ``error`` and the exit code.
    The record is written and the process group shut down either way."""
    record: dict = {"rank": ctx.rank, "error": None}
    code = 0
    try:
        work(record)
    except FsdpcheckError as exc:
        record["error"] = {"type": type(exc).__name__, "kind": exc.kind, "message": str(exc)}
        code = exc.exit_code
    finally:
        record["elapsed"] = round(time.monotonic() - started, 3)
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record, indent=2))
        distributed.shutdown(ctx)
    return code


def main_with_cases(main: Callable[[list[str]], int]) -> int:
    """``main(argv)`` once, or, with ``--cases FILE --out ROOT``, once per case of ``FILE``
    (``{case: argv}``) in turn on one process group that this process starts (so each case's
    ``distributed.init`` reuses it, as check_model reuses a script's): one launch, many cases.
    Case ``C`` writes its records into ``ROOT/C`` and each rank's exit code as ``exit<N>``."""
    argv = sys.argv[1:]
    if "--cases" not in argv:
        return main(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    root = Path(args.out)
    for case, case_argv in json.loads(Path(args.cases).read_text()).items():
        out = root / case
        out.mkdir(parents=True, exist_ok=True)
        code = main([*case_argv, "--out", str(out)])
        (out / f"exit{dist.get_rank()}").write_text(str(code))
        dist.barrier()
    dist.destroy_process_group()
    return 0
