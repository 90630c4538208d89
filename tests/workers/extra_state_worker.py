"""A training script whose module keeps extra state (``get_extra_state``, as TransformerEngine
keeps its fp8 scales), then ``check_model``: ``--where rank1`` gives it to rank 1's module only,
``--where all`` to every rank's (the clean twin). Writes rank 0's report to ``--out``."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--where", choices=("rank1", "all"), required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = HazardForCausalLM(HazardConfig())
if args.where == "all" or dist.get_rank() == 1:
    mlp = model.model.layers[0].mlp

    class WithExtraState(type(mlp)):  # nn.Module looks get_extra_state up on the class
        def get_extra_state(self):
            return {"fp8_scale": 1.0}

        def set_extra_state(self, state):
            pass

    mlp.__class__ = WithExtraState
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

result = fsdpcheck.check_model(model, timeout=60)
if result.report is not None:
    with open(args.out, "w") as out:
        json.dump(to_dict(result.report), out)
dist.destroy_process_group()
exit_skipping_teardown(result.exit_code)
