"""The bare job the audit is compared with: what a trainer does before loading weights, and
nothing else: import torch and transformers, join the process group, build the model (on meta,
as ``audit --init meta`` does), ``fully_shard`` each decoder layer and the root, exit.

``--model`` is an fsdpcheck preset name or a directory holding a ``config.json``."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    args = parser.parse_args()

    from fsdpcheck.model.presets import PRESETS  # the preset's config, nothing else of fsdpcheck

    preset = PRESETS.get(args.model)
    if preset is not None:
        config = preset.make_config()
    else:
        config = transformers.AutoConfig.from_pretrained(args.model)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
