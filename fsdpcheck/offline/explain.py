"""``fsdpcheck explain``: the Flight Recorder dumps of a job that hung or aborted, as a report that
names the first collective where the ranks diverged, and, with the model's fingerprints, the
tensors behind it.

The report is the audit's (records.Report): same console, JSON, JUnit and exit codes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from fsdpcheck.checks.catalogue import Evidence, checks_named, run_checks
from fsdpcheck.checks.collectives import RankTrace
from fsdpcheck.errors import InputError
from fsdpcheck.offline.files import FINGERPRINT_SCHEMA, FingerprintFile
from fsdpcheck.offline.traces import TraceInputs, read_traces
from fsdpcheck.records import Gathered, RankRecord, Report, from_dict
from fsdpcheck.report import ranks_by_host, verdict
from fsdpcheck.text import int_ranges, ranks_label


def explain(
    paths: Sequence[str | os.PathLike],
    *,
    fingerprints: Sequence[str | os.PathLike] = (),
    allow_pickle: bool = False,
) -> Report:
    """``fsdpcheck explain`` as a function: the report over dumps (and fingerprints)."""
    return explain_traces(
        read_traces(paths, allow_pickle=allow_pickle), read_fingerprints(fingerprints)
    )


def explain_traces(
    inputs: TraceInputs, fingerprints: Sequence[tuple[str, FingerprintFile]] = ()
) -> Report:
    """The report over dumps already read (pure: no files, no processes)."""
    traces = {f.trace.rank: f.trace for f in inputs.files}
    records = {content.record.env.rank: content.record for _, content in fingerprints}
    evidence = Evidence(Gathered({}, {}, records, 0), traces=traces)
    findings = run_checks(evidence, checks_named("collective"))
    name, code = verdict(findings, [])
    notes = _warnings(inputs, traces, records)
    if not findings and not records and _broadcasts(traces):
        notes.append(
            "Flight Recorder records sizes, not names: broadcasts that pair different tensors "
            "of the same size (a same-size buffer swap) look alike here; pass the job's "
            "fingerprints (--fingerprint) to name what each broadcast carried"
        )
    first = fingerprints[0][1] if fingerprints else None
    return Report(
        verdict=name,
        exit_code=code,
        world_size=len(traces),
        model=first.model if first is not None else None,
        wrap=first.wrap if first is not None else None,
        groups=(),
        findings=tuple(findings),
        errors=(),
        hosts=ranks_by_host({r: rec.env.host for r, rec in records.items()}),
        warnings=tuple(notes),
        options={
            "command": "explain",
            "inputs": [
                {
                    "rank": f.trace.rank,
                    "path": f.path,
                    "format": f.format,
                    "version": f.version,
                    "collectives": len(f.trace.collectives),
                    "truncated": f.trace.truncated,
                }
                for f in inputs.files
            ],
            "fingerprints": [
                {"rank": c.record.env.rank, "path": path, "host": c.record.env.host}
                for path, c in fingerprints
            ],
        },
    )


def _warnings(
    inputs: TraceInputs, traces: dict[int, RankTrace], records: dict[int, RankRecord]
) -> list[str]:
    notes = [f"skipped {item}" for item in inputs.skipped]
    ranks = sorted(traces)
    gaps = sorted(set(range(ranks[0], ranks[-1] + 1)) - set(ranks))
    if gaps:
        notes.append(f"no dump for {ranks_label(gaps)}: compared the others only")
    wrapped = [r for r, t in traces.items() if t.truncated]
    if wrapped:
        notes.append(
            f"the Flight Recorder buffer wrapped on {ranks_label(wrapped)} (oldest entries "
            "dropped): compared from the first collective every rank still holds; a larger "
            "TORCH_FR_BUFFER_SIZE keeps more"
        )
    p2p = {r: t.p2p for r, t in traces.items() if t.p2p}
    if p2p:
        notes.append(f"point-to-point entries (send/recv) on {ranks_label(p2p)} were not compared")
    versions = {f.version for f in inputs.files}
    if len(versions) > 1:
        notes.append(f"the dumps have different format versions: {', '.join(sorted(versions))}")
    if records:
        unmatched = sorted(set(records) - set(traces))
        if unmatched:
            notes.append(f"fingerprints of {ranks_label(unmatched)} match no dump: unused")
        without = sorted(set(traces) - set(records))
        if without:
            notes.append(
                f"no fingerprint of {ranks_label(without)}: their tensors are named by size "
                f"from rank {min(records)}'s fingerprint, where one tensor alone fits"
            )
    if not any(t.collectives for t in traces.values()):
        notes.append(
            "no dump holds a collective: was TORCH_FR_BUFFER_SIZE set before the process "
            f"group started? (ranks {int_ranges(ranks)})"
        )
    return notes


def _broadcasts(traces: dict[int, RankTrace]) -> bool:
    return any(c.op == "broadcast" for t in traces.values() for c in t.collectives)


# ---------------------------------------------------------------- fingerprints


def read_fingerprints(paths: Sequence[str | os.PathLike]) -> list[tuple[str, FingerprintFile]]:
    """``--fingerprint``: files, or directories of ``*.json`` fingerprints; one per rank."""
    found: list[tuple[str, FingerprintFile]] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.glob("*.json") if p.is_file())
            if not files:
                raise InputError(_no_fingerprint(f"{path} holds no *.json file"))
        elif path.is_file():
            files = [path]
        else:
            raise InputError(_no_fingerprint(f"{path} does not exist"))
        found.extend((str(f), _read_fingerprint(f)) for f in files)
    seen: dict[int, str] = {}
    for path, content in found:
        rank = content.record.env.rank
        if rank in seen:
            raise InputError(
                f"{seen[rank]} and {path} are both fingerprints of rank "
                f"{rank}; pass one per rank, from the job the dumps came from."
            )
        seen[rank] = path
    return found


def _no_fingerprint(what: str) -> str:
    return (
        f"--fingerprint {what}. Pass the fingerprints the job wrote, one per "
        "rank (fsdpcheck.save_fingerprint(model) in the training script, or `fsdpcheck "
        "fingerprint --model M --out 'fp/rank{rank}.json'` under the job's launcher)."
    )


def _read_fingerprint(path: Path) -> FingerprintFile:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(
            _no_fingerprint(f"{path} is not readable JSON ({type(exc).__name__}: {exc})")
        ) from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != FINGERPRINT_SCHEMA:
        raise InputError(
            _no_fingerprint(
                f"{path} is not a fingerprint this fsdpcheck reads (schema {schema!r}, "
                f"expected {FINGERPRINT_SCHEMA!r})"
            )
        )
    try:
        content = from_dict(FingerprintFile, data)
        if type(content.record.env.rank) is not int:
            raise TypeError(f"env.rank is {content.record.env.rank!r}")
        for fp in content.record.fingerprints():
            for t in (*fp.buffers, *fp.params):
                _ = t.numel, str(t.name), str(t.dtype)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise InputError(
            _no_fingerprint(f"{path} is malformed ({type(exc).__name__}: {exc})")
        ) from None
    return content
