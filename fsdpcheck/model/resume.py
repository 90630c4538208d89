"""The checkpoint a rank resumes from: what it finds there (:func:`checkpoint_record`), read
only, nothing unpickled, nothing written. ``audit --resume`` loads it with
:func:`fsdpcheck.loader.resume.load_checkpoint`.

A DCP checkpoint directory holds ``.metadata`` (DCP's index of every tensor's chunks, a pickle)
and one or more ``__R_N.distcp`` files per saving rank ``R``. The record hashes the bytes of
``.metadata`` and counts the shard files by name, so a different save, a stale copy or a
directory with another rank's files missing reads differently, without unpickling anything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from fsdpcheck.records import CheckpointRecord

log = logging.getLogger(__name__)

METADATA = ".metadata"
# Files naming the newest checkpoint inside a checkpoint root (DeepSpeed's ``latest``; others
# write ``LATEST``): their first line is a directory name, or a step number.
LATEST_FILES = ("LATEST", "latest")
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
# How trainers name a checkpoint directory by its step: torchtitan ``step-100``, DeepSpeed
# ``global_step100``, Lightning ``epoch=0-step=100``, HF Trainer ``checkpoint-100``, Megatron
# ``iter_0000100``. The first that matches the directory's own name wins.
_STEP_NAMES = (
    re.compile(r"(?:^|[^a-z])step[-_=]?(\d+)", re.IGNORECASE),
    re.compile(r"^step(\d+)$", re.IGNORECASE),
    re.compile(r"^checkpoint[-_](\d+)$", re.IGNORECASE),
    re.compile(r"^iter[-_](\d+)$", re.IGNORECASE),
)
_LATEST_BYTES = 4096  # a LATEST file holds a name, not data


def step_of(name: str) -> int | None:
    """The step a checkpoint directory's own name says (None: it names none)."""
    for pattern in _STEP_NAMES:
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    return None


def checkpoint_record(given: str | os.PathLike[str]) -> CheckpointRecord:
    """What this rank finds at ``given``: never raises for a path that is missing or unreadable
    (that is the record's ``problem``: a finding, not a crash)."""
    text = os.fspath(given)
    try:
        path = _resolve(Path(text))
    except OSError as exc:
        log.debug("checkpoint %s could not be resolved", text, exc_info=True)
        return CheckpointRecord(text, problem=f"{type(exc).__name__}: {exc}")
    if not path.exists():
        return CheckpointRecord(text, problem=f"{path} does not exist on this rank")
    if not path.is_dir():
        return CheckpointRecord(text, str(path), problem=f"{path} is not a directory")
    try:
        names = os.listdir(path)
        digest = _digest(path / METADATA) if METADATA in names else None
    except OSError as exc:
        log.debug("checkpoint %s could not be read", path, exc_info=True)
        return CheckpointRecord(text, str(path), problem=f"{type(exc).__name__}: {exc}")
    shards = [m for m in (_SHARD.match(n) for n in names) if m]
    writers = {int(m.group(1)) for m in shards}
    return CheckpointRecord(
        given=text,
        path=str(path),
        step=step_of(path.name),
        metadata=digest,
        shard_files=len(shards),
        saved_ranks=max(writers) + 1 if writers else None,
    )


def _resolve(path: Path) -> Path:
    """``path``'s realpath; a checkpoint root with a LATEST file, the directory it names."""
    real = Path(os.path.realpath(path))
    if not real.is_dir() or (real / METADATA).exists():
        return real
    for name in LATEST_FILES:
        marker = real / name
        if not marker.is_file():
            continue
        with open(marker, "rb") as handle:
            first = handle.read(_LATEST_BYTES).decode(errors="replace").strip().splitlines()
        target = first[0].strip() if first else ""
        if not target:
            continue
        named = real / target
        if named.is_dir():
            return Path(os.path.realpath(named))
        if target.isdigit():  # a step number: the subdirectory whose name says that step
            for child in sorted(real.iterdir()):
                if child.is_dir() and step_of(child.name) == int(target):
                    return Path(os.path.realpath(child))
        return Path(os.path.realpath(named))  # what it names, missing: the record says so
    return real


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resume_problem(record: CheckpointRecord, *, rank: int) -> str:
    """Why ``audit --resume`` cannot load from what this rank found (one paragraph), or ""."""
    where = f"--resume {record.given}"
    fix = "pass the DCP checkpoint directory every rank can read (one holding .metadata)"
    if record.problem is not None:
        return f"{where}: rank {rank} cannot read it: {record.problem}; {fix}."
    if record.metadata is None:
        return (
            f"{where}: rank {rank} finds no {METADATA} in {record.path}, so it is not a "
            f"torch.distributed.checkpoint directory; {fix}."
        )
    return ""
