"""A training script's pre-flight: its own process group, its own model, then check_model."""

import json
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

dist.init_process_group("gloo")
model = HazardForCausalLM(HazardConfig())
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

result = fsdpcheck.check_model(model, timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 30)
assert dist.is_initialized(), "check_model must not tear down the script's process group"
if result.report is not None:
    with open(sys.argv[1], "w") as out:
        json.dump(to_dict(result.report), out)
if result.exit_code == 3:  # a peer is gone: the script's own group cannot be used either
    os._exit(3)
dist.barrier()  # the script's own group still works
dist.destroy_process_group()
exit_skipping_teardown(result.exit_code)
