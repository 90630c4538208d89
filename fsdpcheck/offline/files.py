"""Fingerprint files: what one process writes (its record, with no collective) and how
``diff`` reads them back, refusing bad input with one paragraph.

A fingerprint file holds one :class:`~fsdpcheck.records.RankRecord`, the same record the audit
gathers, so ``diff`` runs the audit's own analysis over files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdpcheck.distributed.environment import env_record as audit_env_record
from fsdpcheck.distributed.environment import package_version
from fsdpcheck.distributed.launcher import local_rank_hint, rank_hint
from fsdpcheck.errors import InputError
from fsdpcheck.model.keys import value_digests
from fsdpcheck.output import unwritable, write_text
from fsdpcheck.records import (
    EnvRecord,
    ModelInfo,
    RankRecord,
    WrapPlan,
    from_dict,
    to_dict,
)

log = logging.getLogger(__name__)

FINGERPRINT_SCHEMA = "fsdpcheck.fingerprint/4"
SCHEMA_PREFIX = "fsdpcheck.fingerprint/"
DEFAULT_PATH = "fsdpcheck-fingerprints/rank{rank}.json"


@dataclass(frozen=True)
class FingerprintFile:
    """What one process writes: its record, and what it was a record of."""

    record: RankRecord
    model: ModelInfo | None = None
    wrap: WrapPlan | None = None
    created: str = ""  # UTC, ISO 8601
    fsdpcheck: str = ""  # the version that wrote it
    notes: tuple[str, ...] = ()  # e.g. why the model was not wrapped
    schema: str = FINGERPRINT_SCHEMA


@dataclass(frozen=True)
class Identity:
    """Where this process sits in its job, read without any collective."""

    rank: int
    local_rank: int
    world_size: int
    backend: str


# ---------------------------------------------------------------- writing


def process_identity(rank: int | None = None) -> Identity:
    """This process's rank: the default group's when one exists (a local lookup, never a
    collective), else the launcher's variables (torchrun, srun, mpirun); else rank 0 of 1.
    ``rank`` overrides the rank. The backend is the group's, else the one the audit would
    choose here (nccl with CUDA, else gloo), so that offline records compare with gathered ones.
    """
    # torch here only: `diff` reads fingerprint files with this module and never imports torch.
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        own, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    else:
        # Any launcher's variables (torchrun, srun, mpirun); no rendezvous is needed here.
        own = _int_env("RANK", rank_hint(os.environ))
        world = _first_int_env(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"), 1)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = local_rank_hint(os.environ, own)
    if rank is not None:
        own = rank
    if own < 0:
        raise InputError(f"rank {own} is negative; pass a rank of 0 or more.")
    return Identity(own, local, max(world, own + 1), backend)


def _first_int_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name):
            return _int_env(name, default)
    return default


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(
            f"environment variable {name}={raw!r} is not an integer, so this process cannot "
            "tell its rank; fix the launcher's variables, or pass the rank explicitly "
            "(save_fingerprint(..., rank=N) or fsdpcheck fingerprint --rank N)."
        ) from None


def env_record(identity: Identity) -> EnvRecord:
    """The audit's allowlisted environment record, for a process that has no group."""
    return audit_env_record(
        identity.rank, identity.local_rank, identity.world_size, identity.backend
    )


def format_path(path: str | os.PathLike, env: EnvRecord) -> Path:
    text = os.fspath(path)
    try:
        text = text.format(
            rank=env.rank, local_rank=env.local_rank, world_size=env.world_size, host=env.host
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise InputError(
            f"rank {env.rank}: fingerprint path {text!r} has a placeholder that cannot be "
            f"filled ({type(exc).__name__}: {exc}); use {{rank}}, {{local_rank}}, "
            "{world_size} or {host}, and double other braces ({{ }})."
        ) from None
    return Path(text).expanduser()


def write_fingerprint(content: FingerprintFile, path: str | os.PathLike) -> Path:
    """Write atomically (a reader never sees half a file); unwritable paths are bad input."""
    content = replace(
        content,
        created=content.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        fsdpcheck=content.fsdpcheck or package_version("fsdpcheck") or "unknown",
    )
    path = Path(path)
    data = to_dict(content)
    try:
        write_text(json.dumps({"schema": data.pop("schema"), **data}) + "\n", path)  # marker first
    except OSError as exc:
        raise _unwritable(content.record.env.rank, path, exc) from None
    return path


def check_writable(path: str | os.PathLike, rank: int) -> None:
    """Fail before any work when the fingerprint could not be written."""
    problem = unwritable(path)
    if problem is not None:
        raise _unwritable(rank, Path(path), problem)


def _unwritable(rank: int, path: Path, exc: OSError) -> InputError:
    return InputError(
        f"rank {rank}: cannot write the fingerprint to {path} ({exc.strerror or exc}); choose "
        "a writable path (--out, or save_fingerprint's path), e.g. one under the job's working "
        "directory."
    )


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Loaded:
    """A fingerprint file as ``diff`` read it."""

    path: str
    content: FingerprintFile


@dataclass(frozen=True)
class Inputs:
    """Every fingerprint ``diff`` will compare, in argument order, and what was skipped."""

    files: tuple[Loaded, ...]
    skipped: tuple[str, ...] = ()  # "path: why", for JSON in a directory that is no fingerprint
    duplicates: tuple[str, ...] = field(default=())  # paths given more than once


def read_inputs(paths: Sequence[str | os.PathLike]) -> Inputs:
    """Load every FILE and every ``*.json`` fingerprint in every DIR; bad input raises
    :class:`InputError` with one paragraph naming the file and the fix."""
    if not paths:
        raise InputError(need_two("no files were given"))
    files: list[Loaded] = []
    skipped: list[str] = []
    duplicates: list[str] = []
    seen: set[str] = set()
    schemas: dict[str, list[str]] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = _from_directory(path, skipped, schemas)
        elif path.exists():
            data = _read_json(path)
            schemas.setdefault(_schema_of(path, data), []).append(str(path))
            found = [(path, data)]
        else:
            raise InputError(
                f"fsdpcheck diff: {path} does not exist. Pass fingerprint files written by "
                "`fsdpcheck fingerprint --out` or fsdpcheck.save_fingerprint, or the "
                "directory that holds them."
            )
        for file, data in found:
            key = os.path.realpath(file)
            if key in seen:
                duplicates.append(str(file))
                continue
            seen.add(key)
            files.append(Loaded(str(file), data))  # parsed below, once schemas agree
    _check_schemas(schemas)
    loaded = tuple(Loaded(f.path, _parse(Path(f.path), f.content)) for f in files)
    if len(loaded) < 2:
        what = "only one fingerprint was found" if loaded else "no fingerprint was found"
        raise InputError(need_two(what + (f" (skipped: {'; '.join(skipped)})" if skipped else "")))
    return Inputs(loaded, tuple(skipped), tuple(duplicates))


def need_two(what: str) -> str:
    return (
        f"fsdpcheck diff needs at least two fingerprints to compare, but {what}. Write one per "
        "rank with `fsdpcheck fingerprint --model M --out fp/rank{rank}.json` (under your "
        "launcher) or fsdpcheck.save_fingerprint(model) in the training script, then run "
        "`fsdpcheck diff fp/`; or pass two files, e.g. today's and last week's."
    )


def _from_directory(
    path: Path, skipped: list[str], schemas: dict[str, list[str]]
) -> list[tuple[Path, Any]]:
    """A directory's ``*.json`` fingerprints, by name; other JSON there (a report) is skipped."""
    found = []
    for file in sorted(path.glob("*.json")):
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.debug("%s skipped", file, exc_info=True)
            skipped.append(f"{file.name}: not readable JSON ({type(exc).__name__})")
            continue
        schema = data.get("schema") if isinstance(data, dict) else None
        if not (isinstance(schema, str) and schema.startswith(SCHEMA_PREFIX)):
            skipped.append(f"{file.name}: not a fingerprint ({_foreign_kind(data)})")
            continue
        schemas.setdefault(schema, []).append(str(file))
        found.append((file, data))
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise InputError(
            f"fsdpcheck diff: cannot read {path} ({why}). Check the path and its permissions."
        ) from None
    except ValueError as exc:
        raise InputError(
            f"fsdpcheck diff: {path} is not JSON ({exc}); it may be truncated (was the job "
            "killed while writing?) or not a fingerprint. Re-create it with `fsdpcheck "
            "fingerprint` or fsdpcheck.save_fingerprint."
        ) from None


def _foreign_kind(data: Any) -> str:
    schema = data.get("schema") if isinstance(data, dict) else None
    if isinstance(schema, str) and schema.startswith("fsdpcheck.report/"):
        return "an fsdpcheck report (--json output)"
    if isinstance(schema, str):
        return f"schema {schema!r}"
    return "no fsdpcheck schema marker"


def _schema_of(path: Path, data: Any) -> str:
    schema = data.get("schema") if isinstance(data, dict) else None
    if isinstance(schema, str) and schema.startswith(SCHEMA_PREFIX):
        return schema
    raise InputError(
        f"fsdpcheck diff: {path} is not an fsdpcheck fingerprint: it is {_foreign_kind(data)}. "
        f'Fingerprints start with {{"schema": "{FINGERPRINT_SCHEMA}"}}; write them with '
        "`fsdpcheck fingerprint --out` or fsdpcheck.save_fingerprint, and pass those files."
    )


def _check_schemas(schemas: dict[str, list[str]]) -> None:
    if len(schemas) > 1:
        listed = "; ".join(
            f"{schema}: {', '.join(paths[:3])}{' …' if len(paths) > 3 else ''}"
            for schema, paths in sorted(schemas.items())
        )
        raise InputError(
            f"fsdpcheck diff: the fingerprints mix schema versions ({listed}), so their records "
            "cannot be compared field by field. Re-create the older ones with the same fsdpcheck "
            f"version (this one reads {FINGERPRINT_SCHEMA})."
        )
    for schema, paths in schemas.items():
        if schema != FINGERPRINT_SCHEMA:
            raise InputError(
                f"fsdpcheck diff: {paths[0]} has schema {schema!r}, but this fsdpcheck reads "
                f"{FINGERPRINT_SCHEMA} only; it was written by another fsdpcheck version. "
                "Run diff with the version that wrote it, or re-create the fingerprints."
            )


def _parse(path: Path, data: dict) -> FingerprintFile:
    try:
        content = from_dict(FingerprintFile, data)
        if not isinstance(content.record, RankRecord) or not isinstance(
            content.record.env, EnvRecord
        ):
            raise TypeError("no record with an environment")
        if type(content.record.env.rank) is not int:
            raise TypeError(f"env.rank is {content.record.env.rank!r}, not an integer")
        # Everything diff will compute from the record, so damage shows here, not as a crash.
        content.record.group_digest()
        value_digests(content.record)
        for fp in content.record.fingerprints():
            for t in (*fp.buffers, *fp.params):
                tuple(int(d) for d in t.shape)
                str(t.name), str(t.dtype)
    except _DAMAGE as exc:
        marked = f"{path} has the fingerprint schema marker but its record is"
        raise malformed(marked, exc) from None
    return content


# What reading a damaged record raises, in the checks above and in diff's own walk over it.
_DAMAGE = (TypeError, ValueError, KeyError, AttributeError)


@contextlib.contextmanager
def damaged_as_input(what: str) -> Iterator[None]:
    """Damage the checks above did not foresee, met while diffing: still bad input."""
    try:
        yield
    except _DAMAGE as exc:
        raise malformed(what, exc) from None


def malformed(what: str, exc: BaseException) -> InputError:
    return InputError(
        f"fsdpcheck diff: {what} malformed ({type(exc).__name__}: {exc}); it was edited or "
        "damaged. Re-create it with `fsdpcheck fingerprint` or fsdpcheck.save_fingerprint."
    )
