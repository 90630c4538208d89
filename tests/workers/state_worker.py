"""One rank of a state test: a training script's own steps, then fsdpcheck on the result.

Cases (``--case``; each rank writes ``{"report": rank 0's report(s), else null}`` as
``rank<N>.json`` into the folder ``--out``; several in turn in one process group with
``--cases``, as every batched worker does: ``recorded.main_with_cases``):

- ``dcp-only``: rank 0 builds real, the others on meta; fully_shard; DCP
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` alone (the meta ranks
  ``to_empty()`` first), then ``check_model``: non-persistent buffers hold garbage there.
- ``dcp-and-buffers``: the same, then ``fsdpcheck.load.broadcast_buffers`` (the clean twin).
- ``untied``: every rank builds real, re-assigns ``lm_head.weight`` as a new Parameter (a loader
  that breaks the tie), wraps, then ``check_model``.
- ``tied``: the same without the re-assignment (the clean twin).
- ``replica-drift``: every rank builds real, wraps on a (2, 1) HSDP mesh (the two ranks are
  replicas), then rank 1's loader writes other values into its local shard of one parameter.
- ``meta-assign``: rank 1 builds on meta and loads rank 0's values with
  ``load_state_dict(sd, assign=True)``: its non-persistent ``inv_freq`` stays on meta.
  ``meta-assign-rebuilt``: the same, then rank 1 rebuilds its rotary embedding (the clean twin).
- ``eval``, ``hook``, ``buffer-copy``, ``eps``, ``numerics``: every rank builds real and wraps; on
  rank 1 only: ``model.eval()``; a forward hook scaling one MLP's output; a buffer that is a copy
  where rank 0's is a view of ``inv_freq``; the final norm a ``LayerNorm(eps=0.1)`` where rank 0's
  is ``LayerNorm(eps=1e-5)``; deterministic algorithms and a float64 default dtype (set after the
  build, restored after the check). The clean twins are ``tied`` and ``same-state`` (the norm,
  the view and the hook on every rank alike).
- ``audits``: ``run_audit`` once per ``--audit`` spec ``MODEL:INIT[:DTYPE[:MESH[:SEED]]]`` in this
  one process group; ``SEED`` ``rank`` means this rank's number (per-rank initial values).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from recorded import main_with_cases
from torch import nn

import fsdpcheck
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict


def _build(model_name: str, *, real: bool) -> nn.Module:
    from fsdpcheck.model.build import _from_config
    from fsdpcheck.model.presets import PRESETS

    torch.manual_seed(0)
    with torch.device("cpu" if real else "meta"):
        return _from_config(PRESETS[model_name].make_config(), False)


def _wrap(model: nn.Module, shape: tuple[int, ...] | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdpcheck.model.wrap import plan

    shape = shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for _, module in plan(model).modules:
        fully_shard(module, mesh=mesh)


def _dcp(model_name: str, *, buffers: bool) -> nn.Module:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    model = _build(model_name, real=rank == 0)
    source = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    _wrap(model)
    if rank != 0:
        model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, source, options=options)
    if buffers:
        from fsdpcheck.loader.load import broadcast_buffers

        broadcast_buffers(model)
    return model


def _tie_case(model_name: str, *, untie: bool) -> nn.Module:
    model = _build(model_name, real=True)
    if untie:  # what a loader does when it assigns a fresh tensor to every name it loads
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    _wrap(model)
    return model


def _replica_drift(model_name: str) -> nn.Module:
    model = _build(model_name, real=True)
    _wrap(model, (dist.get_world_size(), 1))
    if dist.get_rank() == 1:  # this replica's loader read another checkpoint for one tensor
        with torch.no_grad():
            model.model.norm.weight.to_local().add_(1.0)
    return model


def _meta_assign(model_name: str, *, rebuild: bool) -> nn.Module:
    source = _build(model_name, real=True).state_dict()  # every rank: rank 0's values (seed 0)
    if dist.get_rank() == 0:
        return _build(model_name, real=True)
    model = _build(model_name, real=False)
    model.load_state_dict(source, assign=True)
    if rebuild:  # non-persistent buffers are in no state dict: recompute them
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(config=model.config)
    return model


def _scale_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def _set_up(model_name: str, case: str) -> nn.Module:
    """Every rank builds real and wraps; rank 1 (or, for ``same-state``, every rank) sets one
    thing up its own way first."""
    model = _build(model_name, real=True)
    odd = dist.get_rank() == 1 or case == "same-state"
    hidden = model.config.hidden_size
    rotary = model.model.rotary_emb
    view = rotary.inv_freq[:2]
    shared = case in ("buffer-copy", "same-state")
    if shared:  # rank 0's is a view of inv_freq; rank 1's a copy of it
        head = view.clone() if case == "buffer-copy" and odd else view
        rotary.register_buffer("inv_freq_head", head, persistent=False)
    if case in ("eps", "same-state"):
        eps = 0.1 if case == "eps" and odd else 1e-5
        model.model.norm = nn.LayerNorm(hidden, eps=eps)
    if case == "eval":  # every rank's attention drops out: eval on rank 1 computes otherwise
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.1
    if odd and case in ("eval", "eval-no-dropout"):
        model.eval()  # eval-no-dropout: as from_pretrained leaves it, nothing depends on it
    if odd and case in ("hook", "same-state"):
        model.model.layers[0].mlp.register_forward_hook(_scale_output)
    _wrap(model)
    return model


def _audit(spec: str) -> dict:
    from fsdpcheck.audit import AuditOptions, run_audit

    parts = spec.split(":") + [""] * 5
    model, init, dtype, mesh, seed = parts[:5]
    options = AuditOptions(
        model=model,
        backend="gloo",
        timeout=60.0,
        init=init,
        dtype=dtype or None,
        mesh=tuple(int(x) for x in mesh.split(",")) if mesh else None,
        seed=dist.get_rank() if seed == "rank" else int(seed or 0),
        load=seed != "rank",  # per-rank values: as `--no-load`, the state before any load
    )
    result = run_audit(options)
    report = to_dict(result.report) if result.report else None
    return {"spec": spec, "report": report, "exit_code": result.exit_code}


def _run(case: str, model_name: str, audits: list[str]) -> tuple[int, object]:
    """One case: its exit code on this rank and what rank 0 reports."""
    if case == "audits":
        reports = [_audit(spec) for spec in audits]
        return max((r["exit_code"] for r in reports), default=0), reports
    cases = {
        "dcp-only": lambda: _dcp(model_name, buffers=False),
        "dcp-and-buffers": lambda: _dcp(model_name, buffers=True),
        "untied": lambda: _tie_case(model_name, untie=True),
        "tied": lambda: _tie_case(model_name, untie=False),
        "replica-drift": lambda: _replica_drift(model_name),
        "meta-assign": lambda: _meta_assign(model_name, rebuild=False),
        "meta-assign-rebuilt": lambda: _meta_assign(model_name, rebuild=True),
        **{
            name: functools.partial(_set_up, model_name, name)
            for name in (
                "eval",
                "eval-no-dropout",
                "hook",
                "buffer-copy",
                "eps",
                "numerics",
                "same-state",
            )
        },
    }
    model = cases[case]()
    with _numerics(case == "numerics" and dist.get_rank() == 1):
        result = fsdpcheck.check_model(model, timeout=60)
    return result.exit_code, to_dict(result.report) if result.report is not None else None


@contextlib.contextmanager
def _numerics(switch: bool) -> Iterator[None]:
    """Deterministic algorithms on and a float64 default dtype, restored after."""
    if not switch:
        yield
        return
    dtype = torch.get_default_dtype()
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(False)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--audit", action="append", default=[])
    args = parser.parse_args(argv)
    owns = not dist.is_initialized()  # with --cases the group is main_with_cases'
    if owns:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    code, report = _run(args.case, args.model, args.audit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"report": report}))
    if owns:
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    exit_skipping_teardown(main_with_cases(main))
