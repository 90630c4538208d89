"""accelerate on 2 CPU ranks (Accelerator(cpu=True): DDP over gloo): prepare the model, then
check_prepared with ``on_failure="warn"`` and with "raise"."""

import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator
from hooked import outcome, rank, tiny_llama, write

from fsdpcheck.integrations.accelerate import check_prepared

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(tiny_llama())


def check(on_failure: str):
    def run():
        result = check_prepared(
            accelerator,
            model,
            on_failure=on_failure,
            timeout=30,
            json_path=out / f"{on_failure}.json",
        )
        return result.exit_code

    return run


record = {"warn": outcome(check("warn")), "raise": outcome(check("raise"))}
record["prepared"] = type(model).__name__
record["distributed_type"] = str(accelerator.distributed_type)
record["world_size"] = dist.get_world_size()
write(out, record)
print(f"rank {rank()} done")
