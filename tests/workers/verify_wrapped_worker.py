"""One rank of the wrapped-model load test: a tiny model wrapped as torchtitan wraps its layers
(activation checkpointing on every layer, ``torch.compile`` on every layer, or both, all before
``fully_shard``), loaded with ``load_full_state_dict`` from rank 0's full state dict named as the
model's state dict names it, or, as torchtitan loads, with DCP's ``set_model_state_dict`` from
one named as a checkpoint names it (no wrapper in any name), and checked with
``fsdpcheck.verify_load``; then rank 1 changes one weight of its shard and the check runs again.
One case after another in one launch; the results go to ``rank<N>.json``."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from recorded import run_recorded, worker_parser
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.distributed import setup as distributed
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

CASES = ("plain", "checkpointed", "compiled", "checkpointed-compiled", "checkpointed-compiled-dcp")


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))  # persistent: in the state dict
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def wrapped(case: str, *, real: bool) -> nn.Module:
    """The model as the case wraps it, before ``fully_shard``; on meta unless ``real``."""
    torch.manual_seed(0)
    with torch.device("cpu" if real else "meta"):
        model = Tiny()
    if "checkpointed" in case:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: type(m) is Layer
        )
    if "compiled" in case:  # per layer, as torchtitan compiles (compiling waits for a forward)
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer)
    return model


def main() -> int:
    args = worker_parser().parse_args()  # --model: unused, the model is built here
    out = Path(args.out)
    start = time.monotonic()
    ctx = distributed.init("gloo", args.timeout)

    def work(record: dict) -> None:
        for case in CASES:
            model = wrapped(case, real=ctx.rank == 0)
            # Rank 0's full state dict, before sharding, by the names the model's state dict uses.
            source = None
            if ctx.rank == 0:
                named = wrapped("plain", real=True) if case.endswith("-dcp") else model
                source = {k: v.detach().clone() for k, v in named.state_dict().items()}
            for layer in model.layers:
                fully_shard(layer, mesh=ctx.mesh)
            fully_shard(model, mesh=ctx.mesh)
            if case.endswith("-dcp"):
                method = _dcp_load(model, source, ctx.side_channel)
            else:
                method = fsdpcheck.load_full_state_dict(
                    model, source, group=ctx.side_channel
                ).method
            loaded = fsdpcheck.verify_load(model, source, group=ctx.side_channel)
            tampered_name, target = _first_layer_weight(model)
            if ctx.rank == 1:
                with torch.no_grad():
                    target.to_local().add_(1.0)
            tampered = fsdpcheck.verify_load(model, source, group=ctx.side_channel)
            record[case] = {
                "method": method,
                "names": [n for n, _ in model.named_parameters()],
                "state_names": sorted(model.state_dict()),
                "verify": to_dict(loaded),
                "tampered": to_dict(tampered),
                "tampered_name": tampered_name,
            }

    return run_recorded(out, ctx, work, started=start)


def _dcp_load(model: nn.Module, source: dict | None, group) -> str:
    """torchtitan's load: DCP from rank 0's full state dict, then the non-persistent buffers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # A copy: DCP writes rank 0's local shards back into the dict it is given.
    set_model_state_dict(model, dict(source) if source is not None else {}, options=options)
    fsdpcheck.broadcast_buffers(model, group=group)
    return "dcp"


def _first_layer_weight(model: nn.Module) -> tuple[str, nn.Parameter]:
    """The first layer's projection weight, and the name the state dict gives it."""
    state = model.state_dict(keep_vars=True)
    name = next(k for k in sorted(state) if k.startswith("layers.0.") and k.endswith("proj.weight"))
    return name, state[name]


if __name__ == "__main__":
    exit_skipping_teardown(main())
