"""accelerate on 2 CPU ranks (Accelerator(cpu=True): DDP over gloo): for the clean and the
planted tiny Llama, prepare, then check_prepared with ``on_failure="warn"`` and with "raise"."""

import sys
from pathlib import Path

from accelerate import Accelerator
from hooked import run_twins, tiny_llama

from fsdpcheck.integrations.accelerate import check_prepared

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)


def check(model, on_failure: str, json_path: Path):
    def run():
        return check_prepared(
            accelerator, model, on_failure=on_failure, timeout=30, json_path=json_path
        ).exit_code

    return run


record = {"distributed_type": str(accelerator.distributed_type)}


def hooked(planted: bool):
    model = accelerator.prepare(tiny_llama(planted))
    record["prepared"] = type(model).__name__
    return lambda mode, json_path: check(model, mode, json_path)


run_twins(out, hooked, record)
