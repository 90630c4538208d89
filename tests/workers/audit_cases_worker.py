"""Audits in turn, in one 2-rank job: each case is a real ``run_audit`` on the job's gloo group
(as a training script's own group), so one launch covers what would otherwise be one launch
per case (bad inputs, builders).

``--cases FILE``: ``{name: {"model": str | None | [rank 0's, rank 1's], "options": {AuditOptions
field: value}, "env": {variable: value, set for that case}}}``. Rank 0 writes ``--out``: per
case, every rank's exit code and headline and the report (or, for an input refused before the
gather, what every rank raised)."""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdpcheck.audit import AuditOptions, run_audit
from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict
from fsdpcheck.vocab import Backend, DType, Init

ENUMS = {"init": Init, "dtype": DType, "backend": Backend}


def _case(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    model = spec["model"][rank] if isinstance(spec["model"], list) else spec["model"]
    options = {
        k: tuple(v) if isinstance(v, list) else v for k, v in spec.get("options", {}).items()
    }
    for name, kind in ENUMS.items():  # JSON carries the Enums' values
        if isinstance(options.get(name), str):
            options[name] = kind(options[name])
    os.environ.update(spec.get("env", {}))  # e.g. an injected fault, for this case alone
    try:
        result = run_audit(AuditOptions(model=model, **options))
    except FsdpcheckError as exc:  # refused before any gather, as the CLI reports it
        return {"exit_code": exc.exit_code, "raised": str(exc), "report": None, "headline": ""}
    finally:
        for key in spec.get("env", {}):
            os.environ.pop(key, None)
    report = to_dict(result.report) if result.report is not None else None
    return {
        "exit_code": int(result.exit_code),
        "raised": None,
        "report": report,
        "headline": result.headline,
    }


def run_cases(cases: dict[str, Any]) -> dict[str, Any]:
    """Every case in turn on the default group; per case, every rank's exit code and what it
    raised, and rank 0's report."""
    done: dict[str, Any] = {}
    store = dist.distributed_c10d._get_default_store()
    for name, spec in cases.items():
        dist.barrier()
        before = store.num_keys()
        mine = _case(spec, dist.get_rank())
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        done[name] = {
            # keys the audit left in the job's store (after every rank's gather above)
            "store_keys_left": store.num_keys() - before,
            "exit_codes": [r["exit_code"] for r in every],
            "raised": [r["raised"] for r in every],
            "headlines": [r["headline"] for r in every],
            "report": every[0]["report"],
        }
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    cases = json.loads(Path(args.cases).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    done = run_cases(cases)
    if rank == 0:
        Path(args.out).write_text(json.dumps(done))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    exit_skipping_teardown(main())
