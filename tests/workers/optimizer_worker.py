"""One rank of an optimizer test: a training script's own FSDP2 model, AdamW and lr scheduler,
then ``check_model(model, optimizer=, scheduler=)``.

Cases (``--case``; each rank writes ``{"report": rank 0's report, else null}`` as
``rank<N>.json`` into ``--out``; several in turn in one process group with ``--cases``):

- ``reset``: three steps, a DCP save of the model and the optimizer
  (``get_optimizer_state_dict``) into ``--out``/ckpt, then a fresh model, AdamW and scheduler
  that load only the model (the optimizer's state did not exist yet, so DCP had nothing to load
  it into: KempnerForge#115); ``check_model(..., checkpoint=)``.
- ``restored``: the same, with the optimizer loaded through ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict`` and the scheduler's state restored (the clean twin).
- ``lr``: AdamW with lr 1e-4 on rank 0 and 2e-4 on rank 1; ``lr-same``: 1e-4 on both.
- ``replica-state``: an HSDP (2, 1) mesh (the two ranks are replicas), one step, then rank 1's
  ``exp_avg`` of one parameter scaled; ``replica-same``: without the scaling (the clean twin).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from recorded import main_with_cases
from torch import nn

import fsdpcheck
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


def _model(shape: tuple[int, ...] | None = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    shape = shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model


def _train(model: nn.Module, lr: float = 1e-3, steps: int = 3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    torch.manual_seed(1)  # the same batches on every rank: replicas stay replicas
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def _resume(out: Path, *, restore: bool):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _model()
    opt, sched = _train(model)
    ckpt = out / "ckpt"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(ckpt))
    saved_sched = sched.state_dict()  # in memory: a scheduler's state is a pickle on disk

    fresh = _model()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    if restore:
        state = {
            "model": get_model_state_dict(fresh),
            "optim": get_optimizer_state_dict(fresh, opt),
        }
        dcp.load(state, checkpoint_id=str(ckpt))
        set_model_state_dict(fresh, state["model"])
        set_optimizer_state_dict(fresh, opt, state["optim"])
        sched.load_state_dict(saved_sched)
    else:  # the optimizer's state is empty: nothing of it is loaded
        state = {"model": get_model_state_dict(fresh), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_model_state_dict(fresh, state["model"])
    return fresh, opt, sched, ckpt


def _run(case: str, out: Path) -> tuple[int, object]:
    rank = dist.get_rank()
    checkpoint = None
    if case in ("reset", "restored"):
        model, opt, sched, checkpoint = _resume(out, restore=case == "restored")
    elif case in ("lr", "lr-same"):
        model = _model()
        lr = 2e-4 if case == "lr" and rank == 1 else 1e-4
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = None
    else:
        model = _model((2, 1))
        opt, sched = _train(model, steps=1)
        if case == "replica-state" and rank == 1:
            state = opt.state[model[2].weight]["exp_avg"]
            state.to_local().mul_(3.0)
    result = fsdpcheck.check_model(
        model, optimizer=opt, scheduler=sched, checkpoint=checkpoint, timeout=60
    )
    return result.exit_code, to_dict(result.report) if result.report is not None else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    owns = not dist.is_initialized()  # with --cases the group is main_with_cases'
    if owns:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code, report = _run(args.case, out)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"report": report}))
    if owns:
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    exit_skipping_teardown(main_with_cases(main))
