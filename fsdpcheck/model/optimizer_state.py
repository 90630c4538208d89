"""A rank's optimizer (and lr scheduler) as a record, and where it falls short of a checkpoint.

Read only: nothing here steps, initialises or loads into the caller's optimizer (torch's
``get_optimizer_state_dict`` would create missing state by a fake step, which would hide the very
reset this looks for). The checkpoint side is read through DCP's own ``.metadata`` and a
``dcp.load`` of just the optimizer entries, each rank its own slices (``no_dist``); no other
file is unpickled (an HF Trainer's ``optimizer.pt`` is a pickle: it is not read).
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpcheck.model.fingerprint import dtype_name, value_digest
from fsdpcheck.records import (
    OptimizerRecord,
    OptimizerState,
    OptimizerTensor,
    ParamGroupRecord,
    ResumeMismatch,
    SchedulerRecord,
)

log = logging.getLogger(__name__)

# The state a resume must bring back, where the checkpoint holds it non-zero.
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum")


def text(value: Any) -> str:
    """A setting as text that compares exactly: ``repr`` of numbers (a float's repr round-trips),
    a one-element tensor as its value, sequences element-wise, other objects by type."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type != "meta":
            return text(value.detach().cpu().item())
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(text(v) for v in value) + ")"
    return type(value).__name__


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if getattr(tensor, "placements", None) is not None else tensor


def _state_tensor(key: str, value: torch.Tensor) -> OptimizerTensor:
    placements = getattr(value, "placements", None)
    local = _local(value)
    return OptimizerTensor(
        key=key,
        shape=tuple(value.shape),
        dtype=dtype_name(value.dtype),
        placements=tuple(str(p) for p in placements) if placements is not None else None,
        local_shape=tuple(local.shape) if placements is not None else None,
        digest=value_digest(local.detach()),
    )


def param_names(model: Any, optimizer: Any) -> dict[int, str]:
    """id(parameter) → its name: the model's, else ``#group.index`` in the optimizer."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters():  # a tied parameter by its first name
        names.setdefault(id(p), n)
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            names.setdefault(id(p), f"#{g}.{i}")
    return names


def optimizer_record(
    model: Any,
    optimizer: Any,
    scheduler: Any = None,
    checkpoint: str | None = None,
) -> OptimizerRecord:
    """This rank's ``optimizer`` (and ``scheduler``) as a record; with ``checkpoint`` (a resolved
    DCP directory), every place the loaded state falls short of the checkpoint's."""
    # accelerate's AcceleratedOptimizer / AcceleratedScheduler hold the torch ones.
    optimizer = _unwrapped(optimizer, "optimizer")
    scheduler = _unwrapped(scheduler, "scheduler") if scheduler is not None else None
    names = param_names(model, optimizer)
    groups, states = [], []
    for g, group in enumerate(optimizer.param_groups):
        hyper = tuple(sorted((str(k), text(v)) for k, v in group.items() if k != "params"))
        groups.append(ParamGroupRecord(g, tuple(names[id(p)] for p in group["params"]), hyper))
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            scalars, tensors = [], []
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.append(_state_tensor(str(key), value))
                else:
                    scalars.append((str(key), text(value)))
            states.append(OptimizerState(names[id(p)], g, tuple(scalars), tuple(tensors)))
    record = OptimizerRecord(
        cls=type(optimizer).__qualname__,
        groups=tuple(groups),
        states=tuple(states),
        scheduler=scheduler_record(scheduler) if scheduler is not None else None,
    )
    if checkpoint is None:
        return record
    resumed, entries = against_checkpoint(optimizer, scheduler, checkpoint, names)
    return replace(record, resumed=resumed, checkpoint_entries=entries)


def _unwrapped(obj: Any, attribute: str) -> Any:
    inner = getattr(obj, attribute, None)
    if attribute == "optimizer" and isinstance(inner, torch.optim.Optimizer):
        return inner
    if attribute == "scheduler" and inner is not None and hasattr(inner, "last_epoch"):
        return inner
    return obj


def scheduler_record(scheduler: Any) -> SchedulerRecord:
    try:
        lrs = tuple(text(v) for v in scheduler.get_last_lr())
    except Exception:  # a scheduler that never stepped has no last lr yet
        log.debug("get_last_lr() failed on %s", type(scheduler).__name__, exc_info=True)
        lrs = ()
    step_count = getattr(scheduler, "_step_count", None)
    return SchedulerRecord(
        cls=type(scheduler).__qualname__,
        last_epoch=int(getattr(scheduler, "last_epoch", -1)),
        step_count=int(step_count) if step_count is not None else None,
        lrs=lrs,
    )


# ``<prefix>state.<param>.<key>``: the flattened key DCP stores an optimizer state dict under
# (torch's get_optimizer_state_dict names parameters; a plain ``optimizer.state_dict()`` numbers
# them in param-group order).
_STATE_KEY = re.compile(r"^(?:(?P<prefix>.*)\.)?state\.(?P<param>.+)\.(?P<key>[^.]+)$")


def _saved_entries(stored: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(parameter, state key) → the checkpoint's key, for its optimizer state entries."""
    found: dict[tuple[str, str], str] = {}
    for key in stored:
        m = _STATE_KEY.match(key)
        if m and (m["key"] in MOMENTS or m["key"] == "step"):
            found.setdefault((m["param"], m["key"]), key)
    return found


def against_checkpoint(
    optimizer: Any,
    scheduler: Any,
    path: str,
    names: Mapping[int, str],
) -> tuple[tuple[ResumeMismatch, ...], int]:
    """(where the loaded state falls short of the checkpoint's, how many of the checkpoint's
    optimizer entries were compared: those of this optimizer's parameters): a moment absent or
    all zero where the saved one is non-zero, a step count other than the saved one, a
    scheduler that never stepped where the saved optimizer did."""
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata  # DCP's own pickle: the one we read
    saved = _saved_entries(stored)
    if not saved:
        return (), 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    numbered = {id(p): str(i) for i, p in enumerate(params)}  # optimizer.state_dict()'s ids
    wanted: list[tuple[Any, str, str, Any]] = []  # (parameter, state key, checkpoint key, meta)
    saved_as = _saved_names(saved, [names[id(p)] for p in params])
    for p in params:
        for key in (*MOMENTS, "step"):
            name = saved_as.get(names[id(p)], names[id(p)])
            ckpt_key = saved.get((name, key)) or saved.get((numbered[id(p)], key))
            meta = stored.get(ckpt_key) if ckpt_key else None
            if isinstance(meta, TensorStorageMetadata):
                wanted.append((p, key, ckpt_key, meta))
    mismatches: list[ResumeMismatch] = []
    steps: list[float] = []
    for batch in _batches(wanted):
        payload = {ckpt_key: _template(p, meta, key) for p, key, ckpt_key, meta in batch}
        with warnings.catch_warnings():  # "assuming ... a single process": as meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(payload, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        for p, key, ckpt_key, _ in batch:
            held = _local(payload[ckpt_key])
            if key == "step":
                steps.append(float(held.item()))
            found = _short(held, (optimizer.state.get(p) or {}).get(key), key)
            if found is not None:
                mismatches.append(ResumeMismatch(names[id(p)], key, *found))
    saved_step = max(steps, default=0.0)
    if scheduler is not None and saved_step > 0 and getattr(scheduler, "last_epoch", 0) <= 0:
        # A scheduler stepped with the optimizer sits at its step; one still at 0 where the saved
        # optimizer had stepped was not restored (docs/checks.md: per-epoch schedulers).
        mismatches.append(
            ResumeMismatch("", "last_epoch", text(int(scheduler.last_epoch)), text(saved_step))
        )
    return tuple(mismatches), len(wanted)


# Saved state read at once, at most (bytes of this rank's slices): a model's worth of moments
# never sits in memory beside the optimizer's own.
_BATCH_BYTES = 256 << 20


def _batches(wanted: list[tuple[Any, str, str, Any]]):
    batch: list[tuple[Any, str, str, Any]] = []
    size = 0
    for entry in wanted:
        p, key, _, meta = entry
        numel = _local(p).numel() if key != "step" else 1
        size += numel * meta.properties.dtype.itemsize
        batch.append(entry)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _short(held: torch.Tensor, mine: Any, key: str) -> tuple[str, str] | None:
    """(loaded, saved) where this rank's ``mine`` falls short of the saved ``held``."""
    if key == "step":
        saved = float(held.item())
        loaded = float(mine.item()) if isinstance(mine, torch.Tensor) else mine
        if loaded is None or not math.isclose(float(loaded), saved):
            return ("absent" if loaded is None else text(float(loaded))), text(saved)
        return None
    if not bool(held.count_nonzero()):
        return None  # nothing to bring back
    if mine is None:
        return "absent", "non-zero"
    if not bool(_local(mine).count_nonzero()):
        return "all zero", "non-zero"
    return None


def _saved_names(saved: Mapping[tuple[str, str], str], names: list[str]) -> dict[str, str]:
    """Parameter name → the name the checkpoint saved it under, where that is the name with a
    prefix (a Lightning module's ``model.``, checked on ``pl_module.model``) and no other saved
    name ends the same way."""
    stored = {param for param, _ in saved}
    out = {}
    for name in names:
        if name in stored:
            continue
        longer = [s for s in stored if s.endswith("." + name)]
        if len(longer) == 1:
            out[name] = longer[0]
    return out


def _template(param: torch.Tensor, meta: Any, key: str) -> torch.Tensor:
    """Where ``dcp.load`` puts the saved entry: a scalar step, or a moment laid out like the
    parameter (a DTensor: this rank's own slice only)."""
    dtype = meta.properties.dtype
    if key == "step" or tuple(meta.size) != tuple(param.shape):
        return torch.zeros(tuple(meta.size), dtype=dtype)
    return torch.zeros_like(param.detach(), dtype=dtype)
