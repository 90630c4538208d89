"""One process, no job: build a model as the audit does, wrap it on a one-rank group of its own,
and fingerprint it before and after (the ``fingerprint`` command); or fingerprint a training
script's own model (``save_fingerprint``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdpcheck.model import wrap
from fsdpcheck.model.rank_state import look, model_record
from fsdpcheck.model.wrap import DEFAULT_MIN_PARAMS, model_class
from fsdpcheck.offline.files import (
    DEFAULT_PATH,
    FingerprintFile,
    env_record,
    format_path,
    process_identity,
    write_fingerprint,
)
from fsdpcheck.options import BuildSpec
from fsdpcheck.pipeline import Stages, before_wrap, build_from, record_of
from fsdpcheck.records import ModelInfo
from fsdpcheck.vocab import Init, Snapshot, Stage


def describe_model(model: Any) -> ModelInfo:
    """What a training script's model is, from the model alone."""
    config = getattr(model, "config", None)
    tensors = [*model.parameters(), *model.buffers()]
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else None
    on_meta = any(t.device.type == "meta" for t in tensors)
    architecture = model_class(model).__name__
    name = getattr(config, "name_or_path", None) or architecture
    return ModelInfo(
        spec=architecture,
        kind="script",
        name=str(name),
        path=None,
        architecture=architecture,
        dtype=dtype,
        init="meta" if on_meta else "script",
        checkpoint=False,
    )


def save_fingerprint(
    model: Any, path: str | os.PathLike = DEFAULT_PATH, *, rank: int | None = None
) -> Path:
    """Write this process's fingerprint of ``model`` to ``path``, with no collective at all.

    Call it on every rank, e.g. right after building (and wrapping) the model and before any
    loader: it only reads local tensors, so it works when collectives are broken or a peer is
    gone, and the files are there even if the job hangs afterwards. ``path`` may contain
    ``{rank}``, ``{local_rank}``, ``{world_size}`` and ``{host}``. Returns the path written.
    Compare the files with ``fsdpcheck diff DIR``.
    """
    identity = process_identity(rank)
    env = env_record(identity)
    content = FingerprintFile(record=model_record(model, env), model=describe_model(model))
    return write_fingerprint(content, format_path(path, env))


@dataclass(frozen=True)
class StandaloneOptions(BuildSpec):
    wrap: bool = True
    wrap_classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS
    rank: int | None = None  # else the launcher's RANK


def fingerprint_standalone(options: StandaloneOptions) -> FingerprintFile:
    """Resolve → build → fingerprint → (wrap on a private one-rank group → fingerprint).

    The rank (from the launcher's variables, or ``options.rank``) decides what ``--init``
    builds, as in the audit; no peer is contacted. A stage that fails leaves its error in the
    record instead of raising, so ``diff`` names it. The record is the one the audit gathers:
    each fingerprint with its ties, the post-wrap one with this rank's shard coordinate."""
    identity = process_identity(options.rank)
    stages = Stages(identity.rank)
    built, _ = build_from(options, identity.rank, stages)
    # As the audit: parameters' values are compared only where every rank holds its own.
    values = options.init == Init.ALL
    pre, planned = before_wrap(stages, built, options, values=values)
    notes: list[str] = []
    post = None
    wrapped = False  # fully_shard was applied (or tried): the plan belongs in the file
    if options.wrap and planned is not None:
        skip = _cannot_wrap_alone()
        if skip:
            notes.append(skip)
        else:
            wrapped = True

            def wrap_and_look():
                with private_mesh() as mesh:  # the look needs the group the shards live on
                    wrap.apply(planned.modules, mesh)
                    return look(built.model, Snapshot.POST_WRAP, param_values=values, buffers=False)

            post = stages.run(Stage.WRAP, wrap_and_look)
    elif not options.wrap:
        notes.append("not wrapped (--no-wrap): pre-wrap fingerprint only")
    record = record_of(env_record(identity), stages, built, pre, post)
    return FingerprintFile(
        record=record,
        model=built.info if built is not None else None,
        wrap=planned.plan if wrapped else None,
        notes=tuple(notes),
    )


def _cannot_wrap_alone() -> str:
    """Why this process cannot make a group of its own ("" when it can)."""
    if not dist.is_available():
        return "not wrapped: this torch build has no torch.distributed"
    if dist.is_initialized():
        # A one-rank group inside a running job would need the job's store, which may be the
        # very thing that is broken; the pre-wrap fingerprint needs no group at all.
        return (
            "not wrapped: this process already belongs to a process group, and the offline "
            "fingerprint never touches a job's group; pre-wrap fingerprint only"
        )
    return ""


@contextlib.contextmanager
def private_mesh(timeout: float = 60.0) -> Iterator[Any]:
    """A one-rank gloo group on an in-memory store (no address, no port, no peer) and its 1-D
    mesh; torn down on exit. Needs a process without a default group."""
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout),
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
