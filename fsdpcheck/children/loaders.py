"""Every known loader, run for real in a child rank: ``python -m fsdpcheck.children.loaders``.

Unsafe on purpose (gloo aborts a rank on a size mismatch, NCCL would block): only ever started by
:func:`fsdpcheck.children.observe.observe_loaders` as a separate, time-bounded job on gloo (and
by the benchmarks). Each rank builds the audited model as the audit did, runs one loader, and
emits what it then holds (digests per tensor, values of small buffers) for the parent to compare;
rank 0 also emits what every rank should hold.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from fsdpcheck.children.jobs import (
    expected_holdings,
    first_line,
    reference_buffers,
    stand_in_here,
    tensors_held,
)
from fsdpcheck.children.launch import emit, mark_stage
from fsdpcheck.distributed import setup
from fsdpcheck.distributed.environment import package_version
from fsdpcheck.distributed.liveness import is_collective_failure
from fsdpcheck.loader.load import load_full_state_dict
from fsdpcheck.model import wrap
from fsdpcheck.model.fingerprint import non_persistent_buffers
from fsdpcheck.options import BuildSpec
from fsdpcheck.pipeline import build_or_raise
from fsdpcheck.records import LoaderError, LoaderRecord
from fsdpcheck.vocab import ChildExit, ChildStage, LoaderFailure

log = logging.getLogger(__name__)

MODULE = "fsdpcheck.children.loaders"


def accelerate_version() -> str | None:
    return package_version("accelerate")


class _Run:
    """One rank's job: its arguments, its process group and the stage it is in."""

    def __init__(self, args: argparse.Namespace, ctx: Any):
        self.args, self.ctx = args, ctx
        self.rank = ctx.rank
        self.current = ChildStage.START
        self.source: dict[str, Any] | None = None  # rank 0's full state dict, untouched
        self.meta_built = False
        self.stands_for = stand_in_here()  # what the audit rank this rank stands for built

    def build(self, init: str | None = None, seed: int | None = None) -> Any:
        a, parent = self.args, self.stands_for
        spec = BuildSpec(
            parent.get("model") or a.model,
            init=init or a.init,
            dtype=parent.get("dtype") or a.dtype,
            seed=a.seed if seed is None else seed,
            text_only=a.text_only,
            trust_remote_code=a.trust_remote_code,
            allow_pickle=a.allow_pickle,
        )
        return build_or_raise(spec, self.rank, config_changes=parent.get("config"))

    def keep_source(self, state: Mapping[str, Any] | None) -> None:
        if self.rank == 0 and state is not None:
            self.source = {k: v.detach().clone() for k, v in state.items()}

    def note_meta(self, model: Any) -> None:
        self.meta_built = any(b.is_meta for b in model.buffers())

    def wrap(self, model: Any) -> None:
        wrap.apply(wrap.plan(model).modules, self.ctx.mesh)

    def stage(self, stage: ChildStage) -> None:
        self.current = stage
        mark_stage(stage)


def _audit_built(run: _Run) -> Any:
    """Built as the audit builds (``--init``), wrapped, rank 0's source kept."""
    built = run.build()
    run.keep_source(built.full_state_dict)
    run.note_meta(built.model)
    run.wrap(built.model)
    return built.model


def _materialise_others(run: _Run, model: Any) -> None:
    # As verl and torchtitan do: rank 0 keeps its values, the others get empty storage.
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device="cpu")


def _dcp_load(run: _Run, model: Any) -> None:
    _materialise_others(run, model)
    payload = dict(run.source) if run.source is not None else {}  # DCP rewrites what it gets
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, payload, options=options)


def dcp_broadcast(run: _Run) -> Any:
    """torch's set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True), alone."""
    model = _audit_built(run)
    run.stage(ChildStage.LOADING)
    _dcp_load(run, model)
    return model


def broadcast_each_buffer(model: Any, src: int = 0, group: Any = None) -> int:
    """verl's buffer loop before PR #6405: one broadcast per buffer in this rank's own
    ``named_buffers()`` order. Unsafe (ranks whose orders differ pair different tensors): only
    ever in a child job. Returns the number of broadcasts."""
    count = 0
    for _, buf in model.named_buffers():
        dist.broadcast(buf, src, group=group)
        count += 1
    return count


def named_buffers_order(run: _Run) -> Any:
    """verl's fsdp2_load_full_state_dict before PR #6405: DCP for the state dict, then
    :func:`broadcast_each_buffer`."""
    model = _audit_built(run)
    run.stage(ChildStage.LOADING)
    _dcp_load(run, model)
    broadcast_each_buffer(model)
    return model


def sorted_names(run: _Run) -> Any:
    """fsdpcheck's own loader (load_full_state_dict): checks, then pairs by sorted name."""
    model = _audit_built(run)
    run.stage(ChildStage.LOADING)
    load_full_state_dict(model, run.source if run.rank == 0 else None, group=run.ctx.side_channel)
    return model


def ddp_sync(run: _Run) -> Any:
    """torch DistributedDataParallel's constructor: shape check, then the start-up broadcast.
    Every rank builds for real, each from its own seed, as DDP users do."""
    built = run.build(init="all", seed=run.args.seed + run.rank)
    model = built.model
    run.keep_source(model.state_dict())
    run.stage(ChildStage.LOADING)
    DistributedDataParallel(model)
    return model


class _Accelerator:
    """The one attribute fsdp2_load_full_state_dict reads from its Accelerator."""

    def __init__(self, rank: int):
        self.is_main_process = rank == 0


def state_dict_order(run: _Run) -> Any:
    """accelerate's fsdp2_prepare_model with cpu_ram_efficient_loading, step for step: keep each
    rank's non-persistent buffers, move to meta, fully_shard, accelerate's own
    fsdp2_load_full_state_dict, then put each rank's own buffers back."""
    try:
        # accelerate: an optional extra, imported only by this loader
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    except ImportError as exc:  # the parent checks first; this is the backstop
        raise RuntimeError("accelerate is not installed") from exc

    built = run.build(init="all", seed=run.args.seed + run.rank)
    model = built.model
    original_sd = model.state_dict()
    run.keep_source(original_sd)
    kept = copy.deepcopy(non_persistent_buffers(model))
    model = model.to(torch.device("meta"))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    run.wrap(model)
    run.stage(ChildStage.LOADING)
    fsdp2_load_full_state_dict(_Accelerator(run.rank), model, original_sd)
    for fqn, tensor in kept.items():
        parent_name, _, local = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_buffer(local, tensor, persistent=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


RUNNERS: dict[str, Callable[[_Run], Any]] = {
    "named-buffers-order": named_buffers_order,
    "state-dict-order": state_dict_order,
    "ddp-sync": ddp_sync,
    "dcp-broadcast": dcp_broadcast,
    "sorted-names": sorted_names,
}


def _parser(runners: Mapping[str, Callable[[_Run], Any]]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    p.add_argument("--loader", required=True, choices=sorted(runners))
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--model", required=True)
    p.add_argument("--init", default="rank0")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-only", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--allow-pickle", action="store_true")
    return p


def main(
    argv: list[str] | None = None, runners: Mapping[str, Callable[[_Run], Any]] = RUNNERS
) -> int:
    """One rank of one loader job. ``runners``: other loaders run the same way (a test's: verl's
    released function, read from its wheel)."""
    args = _parser(runners).parse_args(argv)
    mark_stage(ChildStage.INIT)

    ctx = setup.init("gloo", args.timeout)
    run = _Run(args, ctx)
    code = ChildExit.DONE
    try:
        run.stage(ChildStage.BUILD)
        model = runners[args.loader](run)
        run.stage(ChildStage.RECORDING)
        expected = {}
        if run.rank == 0 and run.source is not None:
            expected = expected_holdings(model, run.source, ctx.world_size)
        record = LoaderRecord(
            rank=ctx.rank,
            loader=args.loader,
            tensors=tensors_held(model),
            order=tuple(name for name, _ in model.named_buffers()),
            expected=expected,
            reference=reference_buffers(lambda: run.build(init="all").model),
            meta_built=run.meta_built,
        )
    except Exception as exc:  # every failure is evidence: say which kind, then leave
        log.debug("rank %d: %s failed in %s", ctx.rank, args.loader, run.current, exc_info=True)
        collective = is_collective_failure(exc)
        kind = LoaderFailure.COLLECTIVE if collective else LoaderFailure.REFUSED
        error = LoaderError(kind, run.current, first_line(exc))
        record = LoaderRecord(rank=ctx.rank, loader=args.loader, error=error)
        code = ChildExit.COLLECTIVE if collective else ChildExit.REFUSED
        print(f"rank {ctx.rank}: {error.message}", file=sys.stderr)
    emit(record)
    mark_stage(ChildStage.DONE)
    sys.stderr.flush()
    sys.stdout.flush()
    # No destroy_process_group: after a loader broke the group it can block; the job is over.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
