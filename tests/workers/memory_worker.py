"""Memory of the load, in one 2-rank job (tests/ranks/test_memory.py): a 201 MB float32 model
(6 × Linear(4096, 2048), each weight 32 MiB, so glibc hands every one back to the kernel when
it is freed), loaded from rank 0.

First a training script's own rank-0 load then ``check_model(rank0_load=True)``: clean (rank 1
on meta) before buggy (rank 1 builds the full model on CPU too), since ``check_model`` reads the
process's peak so far; each also after the script prepared its data, with 48 weights of 4 MiB
that glibc keeps in its heap once freed (issue 37). Then ``audit --builder`` with the builders
below, clean and buggy (the audit measures each stage on its own). Rank 0 writes ``--out``: per
case, every rank's exit code and rank 0's report. Also the ``--builder`` functions themselves:
``memory_worker.py:FUNCTION``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.process import exit_skipping_teardown

LAYERS, IN, OUT = 6, 4096, 2048
# The same 192 MiB as 48 weights of 4 MiB: below glibc's mmap threshold once the script freed a
# larger tensor (its data, say), so a freed weight stays in malloc's heap, resident.
SMALL_LAYERS, SMALL = 48, 1024
DATA = 8 * 2**20  # the script's data preparation: bytes made and freed before the model


def _model(real: bool, small: bool = False) -> nn.Module:
    layers, n_in, n_out = (SMALL_LAYERS, SMALL, SMALL) if small else (LAYERS, IN, OUT)
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(n_in, n_out, bias=False) for _ in range(layers)))
    if real:  # every page touched, as a real initialisation or a file read touches it
        model.to_empty(device="cpu")
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.fill_(0.01 * (i + 1))
    return model


def meta_on_rank_1(ctx):
    """Rank-0 loading done right: rank 0 builds and returns its state dict, rank 1 on meta."""
    model = _model(real=ctx.rank == 0)
    return (model, dict(model.state_dict())) if ctx.rank == 0 else model


def full_on_rank_1(ctx):
    """Rank-0 loading asked, but rank 1 builds the full model on CPU too before the load."""
    model = _model(real=True)
    return (model, dict(model.state_dict())) if ctx.rank == 0 else model


def _script(rank1_real: bool, data: bool = False) -> dict:
    """A training script: build, fully_shard, its own rank-0 load, then check_model. ``data``:
    it prepared its data first (a tensor made and freed, which raises glibc's mmap threshold)
    and builds 48 smaller weights, which glibc then keeps resident after FSDP freed them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdpcheck
    from fsdpcheck.records import to_dict

    rank = dist.get_rank()
    if data:
        prepared = torch.ones(DATA // 4)
        del prepared
    model = _model(real=rank == 0 or rank1_real, small=data)
    source = dict(model.state_dict()) if rank == 0 else None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdpcheck.load_full_state_dict(model, source, bucket_bytes=16 * 2**20)
    del source
    result = fsdpcheck.check_model(model, timeout=120, rank0_load=True)
    report = to_dict(result.report) if result.report is not None else None
    return {"exit_code": int(result.exit_code), "report": report}


def _pretrained(path: str, rank1_real: bool) -> dict:
    """Issue 37 as a user ran it: the script prepares its data (a tensor made and freed), then
    every rank ``from_pretrained``s the full model (transformers#43749) or, in the clean twin,
    only rank 0 does and the others build on meta; FSDP2, rank 0's weights loaded into every
    rank, ``check_model(rank0_load=True)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import fsdpcheck
    from fsdpcheck.records import to_dict

    rank = dist.get_rank()
    prepared = torch.ones(DATA // 4)
    del prepared
    if rank == 0 or rank1_real:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    source = dict(model.state_dict()) if rank == 0 else None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank != 0 and not rank1_real:
        model.to_empty(device="cpu")
    fsdpcheck.load_full_state_dict(model, source, bucket_bytes=16 * 2**20)
    del source
    result = fsdpcheck.check_model(model, timeout=120, rank0_load=True)
    report = to_dict(result.report) if result.report is not None else None
    return {"exit_code": int(result.exit_code), "report": report}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pretrained", help="only the from_pretrained pair, from this directory")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    from fsdpcheck.audit import AuditOptions, run_audit
    from fsdpcheck.records import to_dict

    done = {}
    if args.pretrained:  # clean first: check_model reads the process's peak so far
        done["pretrained-meta"] = _pretrained(args.pretrained, rank1_real=False)
        done["pretrained-full"] = _pretrained(args.pretrained, rank1_real=True)
        _finish(done, args.out)
        return
    # Clean first: check_model reads the process's peak so far, and peaks only grow.
    cases = {
        "script-meta": (False, False),
        "script-meta-data": (False, True),
        "script-full-data": (True, True),
        "script-full": (True, False),
    }
    for name, (rank1_real, data) in cases.items():
        done[name] = _script(rank1_real, data)
    for name in ("meta_on_rank_1", "full_on_rank_1"):
        result = run_audit(AuditOptions(builder=f"{__file__}:{name}", timeout=120))
        report = to_dict(result.report) if result.report is not None else None
        done[f"builder-{name}"] = {"exit_code": int(result.exit_code), "report": report}
    _finish(done, args.out)


def _finish(done: dict, out: str) -> None:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v["exit_code"] for k, v in done.items()})
    if dist.get_rank() == 0:
        for name, case in done.items():
            case["exit_codes"] = [codes[name] for codes in every]
        with open(out, "w") as f:
            json.dump(done, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
    exit_skipping_teardown(main())
