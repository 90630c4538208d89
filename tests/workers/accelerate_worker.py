"""accelerate on 2 CPU ranks (gloo): for the clean and the planted tiny Llama, prepare, then
check_prepared with ``on_failure="warn"`` and with "raise"; first as accelerate runs on CPU (DDP),
then through its FSDP2 path (``fsdp_version=2``), there with check_first_step as well.

The Accelerator is built as an FSDP2 script builds it. On CPU, accelerate 1.15 turns that into
DDP without a word: ``AcceleratorState`` keeps ``DistributedType.MULTI_CPU`` and drops the plugin
(FSDP is enabled for accelerator devices only), which the record shows. The FSDP2 twins then set
the state's distributed type and plugin, the one gate: past it ``prepare`` runs accelerate's own
FSDP2 path (``fsdp2_prepare_model``: auto-wrap policy, ``fully_shard``; the optimizer swap) on CPU
for real."""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from hooked import Tokens, tiny_llama, twins, write
from torch.distributed.tensor import DTensor

from fsdpcheck.integrations.accelerate import check_first_step, check_prepared

out = Path(sys.argv[1])
plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
record = {"distributed_type": str(accelerator.distributed_type), "is_fsdp2": accelerator.is_fsdp2}


def check(model, on_failure: str, json_path: Path, optimizer=None):
    def run():
        return check_prepared(
            accelerator,
            model,
            on_failure=on_failure,
            timeout=30,
            json_path=json_path,
            optimizer=optimizer,
        ).exit_code

    return run


def hooked(planted: bool):
    model = accelerator.prepare(tiny_llama(planted))
    record["prepared"] = type(model).__name__
    return lambda mode, json_path: check(model, mode, json_path)


def check_fsdp2(model, optimizer, on_failure: str, json_path: Path):
    batch = Tokens()[0]
    batch = {key: value[None] for key, value in batch.items()}

    def step():
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def run():
        # The prepared optimizer (accelerate's wrapper) too: the same on both ranks.
        exit_code = check(model, on_failure, json_path, optimizer)()
        stepped = check_first_step(
            accelerator,
            model,
            step,
            on_failure=on_failure,
            timeout=30,
            json_path=json_path.with_suffix(".step.json"),
        )
        return {"exit_code": exit_code, "step_exit": stepped.exit_code}

    return run


def hooked_fsdp2(planted: bool):
    model = tiny_llama(planted)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    record.setdefault("fsdp2-prepared", []).append(
        {
            "class": type(accelerator.unwrap_model(model)).__name__,
            "dtensor_params": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    )
    return lambda mode, json_path: check_fsdp2(model, optimizer, mode, json_path)


record.update(twins(out, hooked))
# Past the CPU gate (see above). PartialState too: every AcceleratorState() built later (prepare
# builds some) copies its distributed type from PartialState's shared state.
accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
accelerator.state.fsdp_plugin = plugin
record["fsdp2"] = twins(out, hooked_fsdp2, prefix="fsdp2-")
write(out, record)
print("done")
