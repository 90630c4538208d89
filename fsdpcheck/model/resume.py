"""The checkpoint a rank resumes from: what it finds there (:func:`checkpoint_record`), read
only, nothing unpickled, nothing written. ``audit --resume`` loads it with
:func:`fsdpcheck.loader.resume.load_checkpoint`.

A DCP checkpoint directory holds ``.metadata`` (DCP's index of every tensor's chunks, a pickle)
and one or more ``__R_N.distcp`` files per saving rank ``R``. The record hashes the bytes of
``.metadata`` and counts the shard files by name, so a different save, a stale copy or a
directory with another rank's files missing reads differently, without unpickling anything.

The checkpoints the framework hooks are handed are read the same way, by the index each save
writes once (the record's ``index`` names it): an HF Trainer ``checkpoint-N`` directory by the
bytes of its ``trainer_state.json`` (its step from there when the name says none), a
single-file checkpoint (Lightning's ``.ckpt``, any ``torch.save`` file: a zip) by its zip
directory, each entry's name, CRC-32 and size, read from the end of the file without
decompressing or unpickling it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from pathlib import Path

from fsdpcheck.records import CheckpointRecord

log = logging.getLogger(__name__)

METADATA = ".metadata"
TRAINER_STATE = "trainer_state.json"  # HF Trainer's checkpoint-N: its TrainerState, JSON
ZIP_DIRECTORY = "zip directory"  # a torch.save file's entries (name, CRC-32, size)
FILE_BYTES = "file bytes"  # another single file: its size, first and last MiB
_EDGE = 1 << 20
_STATE_BYTES = 16 << 20  # a trainer_state.json past this is not read for its step
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
    try:
        if path.is_file():
            index, digest = _file_digest(path)
            return CheckpointRecord(
                text, str(path), step_of(path.name), digest, shard_files=0, index=index
            )
        if not path.is_dir():
            return CheckpointRecord(text, str(path), problem=f"{path} is not a file or directory")
        names = os.listdir(path)
        index = next((n for n in (METADATA, TRAINER_STATE) if n in names), None)
        digest = _digest(path / index) if index is not None else None
        step = step_of(path.name)
        if step is None and index == TRAINER_STATE:
            step = _trainer_step(path / TRAINER_STATE)
    except OSError as exc:
        log.debug("checkpoint %s could not be read", path, exc_info=True)
        return CheckpointRecord(text, str(path), problem=f"{type(exc).__name__}: {exc}")
    shards = [m for m in (_SHARD.match(n) for n in names) if m]
    writers = {int(m.group(1)) for m in shards}
    return CheckpointRecord(
        given=text,
        path=str(path),
        step=step,
        metadata=digest,
        shard_files=len(shards),
        saved_ranks=max(writers) + 1 if writers else None,
        index=index,
    )


def _file_digest(path: Path) -> tuple[str, str]:
    """A single-file checkpoint's index and its digest: a zip's (torch.save) entry list, read
    from its central directory; any other file by its size and its first and last MiB."""
    h = hashlib.blake2b(digest_size=16)
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    h.update(f"{info.filename}\0{info.CRC:08x}\0{info.file_size}\n".encode())
            return ZIP_DIRECTORY, h.hexdigest()
        except zipfile.BadZipFile:  # a zip signature in a file that is not one: its bytes
            log.debug("%s is not a readable zip", path, exc_info=True)
            h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as handle:
        h.update(handle.read(_EDGE))
        if size > 2 * _EDGE:
            handle.seek(size - _EDGE)
            h.update(handle.read(_EDGE))
    return FILE_BYTES, h.hexdigest()


def _trainer_step(path: Path) -> int | None:
    """``global_step`` from an HF Trainer's ``trainer_state.json`` (plain JSON)."""
    if path.stat().st_size > _STATE_BYTES:
        return None
    try:
        step = json.loads(path.read_bytes()).get("global_step")
    except (ValueError, AttributeError):  # not the Trainer's JSON: the name's step, or none
        log.debug("%s holds no TrainerState", path, exc_info=True)
        return None
    return step if isinstance(step, int) else None


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
    if record.index != METADATA:
        return (
            f"{where}: rank {rank} finds no {METADATA} in {record.path}, so it is not a "
            f"torch.distributed.checkpoint directory; {fix}."
        )
    return ""
