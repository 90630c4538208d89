"""A training script's own FSDP2 setup (tiny Llama, every rank materialised, one fully_shard per
decoder layer and the root), with one rank set apart on request, then ``check_model``.

Rank 0 writes the report to ``--out``; every rank exits with ``check_model``'s exit code.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import fsdpcheck
from fsdpcheck.model.presets import PRESETS
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

FAULTS = ("freeze", "mixed-precision", "config")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", choices=FAULTS, action="append", default=[])
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--cpu-offload", action="store_true", help="on every rank")
    parser.add_argument("--bf16-everywhere", action="store_true", help="param_dtype on every rank")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    odd = dist.get_rank() == args.fault_rank
    config = PRESETS["tiny-llama"].make_config()
    if odd and "config" in args.fault:  # a stale config.json on this rank's node
        config.rope_parameters["rope_theta"] = 500000.0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if odd and "freeze" in args.fault:
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)

    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp = MixedPrecisionPolicy()
    if args.bf16_everywhere or (odd and "mixed-precision" in args.fault):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    offload = CPUOffloadPolicy(pin_memory=False) if args.cpu_offload else OffloadPolicy()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)

    result = fsdpcheck.check_model(model, timeout=60)
    if result.report is not None:
        with open(args.out, "w") as out:
            json.dump(to_dict(result.report), out)
    if result.exit_code == 3:  # a peer is gone: the script's own group cannot be used either
        os._exit(3)
    dist.destroy_process_group()
    return result.exit_code


if __name__ == "__main__":
    exit_skipping_teardown(main())
