"""``audit --resume DIR``: the model's state dict loaded from a DCP checkpoint directory with
``torch.distributed.checkpoint.load``, the way torchtitan resumes (build on meta, shard, give
storage, load), and rank 0's full copy of it read alone, to verify every rank against."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdpcheck.distributed.liveness import is_collective_failure
from fsdpcheck.errors import InputError
from fsdpcheck.loader.load import materialise
from fsdpcheck.model.resume import resume_problem
from fsdpcheck.model.state import buffer_reference
from fsdpcheck.records import CheckpointRecord
from fsdpcheck.text import ranks_label

log = logging.getLogger(__name__)


def load_checkpoint(model: Any, record: CheckpointRecord, *, rank: int, group: Any = None) -> int:
    """Collective over ``group``: ``model``'s state dict loaded in place from the DCP directory
    ``record`` names (``dcp.load`` reshards onto the model's own placements), the way
    torchtitan resumes: meta tensors get storage first, and non-persistent buffers, which no
    checkpoint holds, are recomputed from the model's config where its class can. Keys may sit
    under "model", as torchtitan and ``Stateful`` apps save them. Returns the entries loaded.

    ``dcp.load`` unpickles ``.metadata``: resume only from a checkpoint you trust, as with any
    DCP resume. A checkpoint that does not hold this model's keys, or that a rank cannot read
    its shards of, is bad input naming that rank (DCP raises it on every rank alike). A peer that
    died or timed out inside ``dcp.load`` is not: that exception goes on up unchanged, for the
    caller to name the peer from its heartbeat (exit 3)."""
    # This rank's own part before DCP's first collective (its .metadata is unpickled here):
    # a rank that fails it must not leave the others waiting inside dcp.load, so every rank
    # says whether it is ready, and all load or none does.
    own: Exception | None = None
    try:
        problem = resume_problem(record, rank=rank)
        if problem:
            raise InputError(problem)
        if materialise(model):
            restore_buffers(model)
        state = get_model_state_dict(model)
        reader = dcp.FileSystemReader(record.path)
        payload = _payload(state, reader)
    except Exception as exc:
        log.debug("rank %d: resume from %s not ready", rank, record.path, exc_info=True)
        own = exc
    reason = f"{type(own).__name__}: {_first_line(own)}" if own is not None else ""
    unready = _unready_ranks(reason, rank, group)  # collective, on every rank
    if isinstance(own, InputError):
        raise own  # its own paragraph, naming this rank and the fix
    if unready:
        lines = "".join(f"\n  - rank {r}: {why}" for r, why in sorted(unready.items()))
        raise InputError(
            f"--resume {record.given}: no rank loaded {record.path}: "
            f"{ranks_label(unready)} could not read it before dcp.load:{lines}\n"
            "Its .metadata on that rank's filesystem is missing, damaged or not this model's; "
            "pass a complete checkpoint this model saved, on every node."
        ) from own
    try:
        dcp.load(payload, storage_reader=reader, process_group=group)
    except CheckpointException as exc:  # DCP gathered each rank's own failure, on every rank
        log.debug("rank %d: dcp.load from %s failed", rank, record.path, exc_info=True)
        collective = [e for e, _ in exc.failures.values() if is_collective_failure(e)]
        if collective:  # the words that say so, whichever rank's failure carries them
            cause = collective[0]
            raise RuntimeError(f"dcp.load: {type(cause).__name__}: {_first_line(cause)}") from exc
        raise InputError(_failed_ranks(record, exc, rank, group)) from exc
    except Exception as exc:
        if is_collective_failure(exc):  # a peer died or timed out: not the checkpoint's fault
            raise
        log.debug("rank %d: dcp.load from %s failed", rank, record.path, exc_info=True)
        raise InputError(
            f"--resume {record.given}: rank {rank} could not load this model's state dict "
            f"from {record.path}: {type(exc).__name__}: {_first_line(exc)}; pass a checkpoint "
            "this model saved."
        ) from exc
    set_model_state_dict(model, state)
    return len(state)


def full_state_from(model: Any, record: CheckpointRecord) -> dict[str, Any]:
    """The model's full (unsharded) state dict as the checkpoint holds it, read by this process
    alone: the source rank 0 verifies every rank's shards against after the resume."""
    reader = dcp.FileSystemReader(record.path)
    stored = reader.read_metadata().state_dict_metadata
    names = list(model.state_dict())
    prefix = "" if any(n in stored for n in names) else "model."
    full = {}
    for name in names:
        meta = stored.get(prefix + name)
        if isinstance(meta, TensorStorageMetadata):
            full[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    payload = {"model": full} if prefix else full
    try:
        dcp.load(payload, storage_reader=dcp.FileSystemReader(record.path), no_dist=True)
    except CheckpointException as exc:  # a BaseException: an ordinary failure for the caller
        raise RuntimeError(f"rank 0's full copy of {record.path}: {_first_line(exc)}") from exc
    # No checkpoint holds non-persistent buffers: this rank's own, recomputed from the config.
    for name, buf in model.named_buffers():
        if name not in full and not buf.is_meta:
            full[name] = buf.detach().cpu().clone()
    return full


def _payload(state: dict[str, Any], reader: Any) -> dict[str, Any]:
    keys = set(reader.read_metadata().state_dict_metadata)
    nested = not (set(state) & keys) and any(k.startswith("model.") for k in keys)
    return {"model": state} if nested else state


def restore_buffers(model: Any) -> int:
    """Non-persistent buffers recomputed from the model's config after ``to_empty()`` (what a
    trainer's ``init_weights`` does); the number restored (0: the class cannot recompute)."""
    reference = buffer_reference(model)
    if reference is None:
        return 0
    try:
        wanted = reference.buffers()
    except Exception:  # a class that cannot be rebuilt here: the after-load check says so
        log.debug("buffers could not be recomputed", exc_info=True)
        return 0
    restored = 0
    with torch.no_grad():
        for name, buf in model.named_buffers():
            want = wanted.get(name)
            if want is not None and tuple(want.shape) == tuple(buf.shape):
                buf.copy_(want.to(buf.dtype))
                restored += 1
    return restored


_REASON_BYTES = 300  # each rank's one-line reason, cut to fit one fixed-size slot


def _unready_ranks(reason: str, rank: int, group: Any) -> dict[int, str]:
    """Collective over ``group`` (bounded by its timeout): the ranks (global numbers) that
    could not get ready for ``dcp.load``, each with its one-line reason."""
    if not dist.is_initialized():
        return {rank: reason} if reason else {}
    raw = reason.encode()[:_REASON_BYTES]
    slot = torch.zeros(_REASON_BYTES + 1, dtype=torch.uint8)
    slot[0] = max(len(raw), 1) if reason else 0  # 0: ready
    if raw:
        slot[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    slots = [torch.zeros_like(slot) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, slot, group=group)
    unready = {}
    for index, got in enumerate(slots):
        size = int(got[0])
        if size:
            text = got[1 : 1 + size].numpy().tobytes().decode(errors="replace").strip("\0")
            global_rank = dist.get_global_rank(group, index) if group is not None else index
            unready[global_rank] = text or "failed"
    return unready


def _failed_ranks(record: CheckpointRecord, exc: Any, rank: int, group: Any) -> str:
    """The ranks whose own part of ``dcp.load`` failed, one ``- rank N:`` line each (how the
    report attributes a failed load), in one paragraph with the fix."""

    def global_rank(r: int) -> int:  # DCP numbers them in ``group``
        if not dist.is_initialized():  # one process, no group: the failure is this rank's
            return rank
        return dist.get_global_rank(group, r) if group is not None else r

    failures = sorted((global_rank(r), failure) for r, failure in exc.failures.items())
    lines = "".join(
        f"\n  - rank {r}: {type(e).__name__}: {_first_line(e)}" for r, (e, _) in failures
    )
    return (
        f"--resume {record.given}: dcp.load could not load this model's state dict from "
        f"{record.path} on {ranks_label([r for r, _ in failures])}:{lines}\n"
        "The checkpoint is not this model's, or its shards on that rank's filesystem are "
        "damaged or incomplete; pass a complete checkpoint this model saved."
    )


def _first_line(exc: BaseException) -> str:
    """The cause in one line: a CheckpointException carries each rank's traceback, whose last
    line is the error itself."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return (lines[-1] if type(exc).__name__ == "CheckpointException" else lines[0])[:300]
