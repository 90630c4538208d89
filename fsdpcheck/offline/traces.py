"""Flight Recorder dumps, read back: one file per rank, as ``_dump_fr_trace_json()`` writes them
(JSON) or as torch's dump-on-timeout writes them (pickle, to ``TORCH_FR_DUMP_TEMP_FILE<rank>``).

The dump format is the one torch's own analyzer (``torchfrtrace``,
``torch.distributed.flight_recorder``) reads: ``version``, ``pg_config`` and ``entries``. Its loader
unpickles every file; this one reads JSON and takes pickle only when asked, and even then refuses
any pickle that names a class (a dump holds plain values only). Its matcher needs ``pg_config``'s
membership, which gloo leaves empty, so the matching is fsdpcheck's own
(:mod:`fsdpcheck.checks.collectives`).

A dump does not say which rank wrote it: the rank is the number that ends the file name, as
torch names them (``nccl_trace_rank_3``, or ``rank3.json``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpcheck.checks.collectives import Collective, RankTrace, dtype_name
from fsdpcheck.errors import InputError

log = logging.getLogger(__name__)

_EXTENSIONS = re.compile(r"(\.(json|pkl|pickle|bin|dump|trace))+$", re.I)
_RANK = re.compile(r"(\d+)$")
_TORCH_FRAMES = ("/torch/", "/typing_extensions.py")  # the caller is the first frame outside


@dataclass(frozen=True)
class TraceFile:
    path: str
    trace: RankTrace
    version: str  # the dump format's version, e.g. "2.10"
    format: str  # "json" or "pickle"


@dataclass(frozen=True)
class TraceInputs:
    files: tuple[TraceFile, ...]  # by rank
    skipped: tuple[str, ...] = ()  # "name: why", for files in a directory that are no dump


def read_traces(paths: Sequence[str | os.PathLike], *, allow_pickle: bool = False) -> TraceInputs:
    """Every dump in every DIR (its files, not below) and every FILE; bad input raises
    :class:`InputError` with one paragraph naming the file and the fix."""
    if not paths:
        raise InputError(_need_two("no path was given"))
    files: list[TraceFile] = []
    skipped: list[str] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            for file in sorted(p for p in path.iterdir() if p.is_file()):
                if file.name.startswith("."):
                    continue  # a half-written temporary file, an editor's swap file
                loaded = _read(file, allow_pickle, skipped)
                if loaded is not None:
                    files.append(loaded)
        elif path.is_file():
            loaded = _read(path, allow_pickle, None)
            assert loaded is not None
            files.append(loaded)
        else:
            raise InputError(
                f"{path} does not exist. Pass the directory holding the "
                "Flight Recorder dumps (one file per rank), or the files themselves."
            )
    by_rank: dict[int, TraceFile] = {}
    for f in files:
        other = by_rank.get(f.trace.rank)
        if other is not None and os.path.realpath(other.path) != os.path.realpath(f.path):
            raise InputError(
                f"{other.path} and {f.path} both end in rank number "
                f"{f.trace.rank}, so they cannot both be that rank's dump. Pass one dump per "
                "rank (the files of one job, e.g. one TORCH_FR_DUMP_TEMP_FILE prefix)."
            )
        by_rank[f.trace.rank] = f
    if len(by_rank) < 2:
        found = "no Flight Recorder dump was found" if not by_rank else "only one dump was found"
        if skipped:
            found += f" (skipped: {'; '.join(skipped)})"
        raise InputError(_need_two(found))
    return TraceInputs(tuple(by_rank[r] for r in sorted(by_rank)), tuple(skipped))


def _need_two(what: str) -> str:
    return (
        f"fsdpcheck explain needs the Flight Recorder dumps of at least two ranks, but {what}. "
        "Set TORCH_FR_BUFFER_SIZE (e.g. 2000) before the process group starts, then write one "
        "dump per rank, e.g. open(f'fr/rank{rank}.json', 'wb').write("
        "torch._C._distributed_c10d._dump_fr_trace_json()), or let torch dump on a timeout "
        "(TORCH_FR_DUMP_TEMP_FILE; pickle: pass --allow-pickle), and pass that directory."
    )


def _read(path: Path, allow_pickle: bool, skipped: list[str] | None) -> TraceFile | None:
    """One dump; in a directory (``skipped`` given) a file that is no dump is skipped."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"cannot read {path} ({exc.strerror or exc}). Check the path and its permissions."
        ) from None
    if raw[:1] == b"\x80":  # every pickle protocol since 2 opens with PROTO
        if not allow_pickle:
            raise InputError(
                f"{path} is a pickle (torch's dump-on-timeout format). "
                "Unpickling can run code the file names, so fsdpcheck refuses pickle unless you "
                "pass --allow-pickle, for dumps your own job wrote; even then it refuses any "
                "pickle that names a class. Or write JSON dumps with "
                "torch._C._distributed_c10d._dump_fr_trace_json()."
            )
        data, kind = _unpickle(path, raw), "pickle"
    else:
        try:
            data, kind = json.loads(raw), "json"
        except (UnicodeDecodeError, ValueError) as exc:
            if skipped is not None:
                skipped.append(f"{path.name}: neither JSON nor pickle")
                return None
            raise InputError(
                f"{path} is not a Flight Recorder dump: neither JSON nor "
                f"pickle ({type(exc).__name__}); it may be truncated (was the job killed while "
                "writing it?). Pass the dumps torch wrote, one per rank."
            ) from None
    if not (isinstance(data, dict) and "entries" in data):
        if skipped is not None:
            skipped.append(f"{path.name}: {kind}, but no Flight Recorder dump (no 'entries')")
            return None
        raise InputError(
            f"{path} is {kind} but not a Flight Recorder dump (it has no "
            "'entries'). Pass the dumps torch wrote, one per rank (a fingerprint goes to "
            "--fingerprint)."
        )
    rank = _rank_of(path)
    try:
        trace = _trace(rank, data)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        log.debug("malformed dump %s", path, exc_info=True)
        raise InputError(
            f"{path} looks like a Flight Recorder dump but an entry is "
            f"malformed ({type(exc).__name__}: {exc}); it was edited, damaged, or written by a "
            "torch this fsdpcheck does not know. Re-dump it, or pass the other ranks' dumps only."
        ) from None
    return TraceFile(str(path), trace, str(data.get("version", "")), kind)


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, strings and numbers only: a dump never needs a class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _unpickle(path: Path, raw: bytes) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any unpickling failure is this file's fault
        log.debug("unpickling %s", path, exc_info=True)
        raise InputError(
            f"{path} is a pickle fsdpcheck will not load ({exc}); a Flight "
            "Recorder dump holds plain values only, so this is damaged or not a dump. Pass the "
            "dumps torch wrote, one per rank."
        ) from None


def _rank_of(path: Path) -> int:
    stem = _EXTENSIONS.sub("", path.name)
    match = _RANK.search(stem)
    if match is None:
        raise InputError(
            f"cannot tell which rank wrote {path}: a dump does not record "
            "its rank, so its file name must end in it, as torch names them "
            "(TORCH_FR_DUMP_TEMP_FILE + rank, e.g. nccl_trace_rank_3). Rename it, e.g. "
            "rank3.json."
        )
    return int(match.group(1))


def _trace(rank: int, data: dict) -> RankTrace:
    entries = data["entries"]
    if not isinstance(entries, list):
        raise TypeError("'entries' is not a list")
    collectives = []
    p2p = 0
    for entry in entries:
        if entry.get("is_p2p"):
            p2p += 1
            continue
        collectives.append(_collective(entry))
    truncated = bool(entries) and min(int(e["record_id"]) for e in entries) > 0
    return RankTrace(
        rank=rank,
        collectives=tuple(collectives),
        truncated=truncated,
        group_ranks=_group_ranks(data.get("pg_config")),
        p2p=p2p,
    )


def _collective(entry: dict) -> Collective:
    backend, _, op = str(entry["profiling_name"]).partition(":")
    group, desc = entry["process_group"]
    return Collective(
        group=str(group),
        seq=int(entry["collective_seq_id"]),
        op=op.split(" ")[0] or backend,
        input_sizes=_sizes(entry.get("input_sizes", ())),
        input_dtypes=tuple(dtype_name(str(d)) for d in entry.get("input_dtypes", ())),
        output_sizes=_sizes(entry.get("output_sizes", ())),
        group_desc=str(desc),
        backend=backend if op else "",
        record_id=int(entry["record_id"]),
        where=_caller(entry.get("frames") or ()),
    )


def _sizes(sizes: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in size) for size in sizes)


def _caller(frames: Sequence[dict]) -> str:
    """The first frame outside torch (frames run innermost first): the line that issued it."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename and not any(part in filename for part in _TORCH_FRAMES):
            return f"{filename}:{frame.get('line', '?')} ({frame.get('name', '?')})"
    return ""


def _group_ranks(config: Any) -> dict[str, tuple[int, ...]]:
    """Each group's members where the dump records them (NCCL does; gloo leaves this empty)."""
    if not isinstance(config, dict):
        return {}
    groups = {}
    for name, info in config.items():
        try:
            ranks = json.loads(info["ranks"]) if isinstance(info["ranks"], str) else info["ranks"]
            members = tuple(int(r) for r in ranks)
        except (TypeError, ValueError, KeyError):
            log.debug("pg_config entry %r unreadable", name, exc_info=True)
            continue
        if name and members:
            groups[str(name)] = members
    return groups
