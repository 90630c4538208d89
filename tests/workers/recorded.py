"""What every load worker shares: its common arguments, and how a rank ends: its record as
``rank<N>.json``, whatever happened."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
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
