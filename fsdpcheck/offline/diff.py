"""``fsdpcheck diff``: saved fingerprints as ranks, through the audit's own analysis and report.

Each file is one rank: ranks of one job (hung or not), or the same model on two machines or two
library versions (their version differences are ``env`` findings, as in the audit).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.errors import InputError
from fsdpcheck.offline.files import FingerprintFile, Inputs, Loaded, need_two, read_inputs
from fsdpcheck.records import RankRecord, Report
from fsdpcheck.report import AuditOutcome, assemble


def diff_fingerprints(paths: Sequence[str | os.PathLike]) -> Report:
    """``fsdpcheck diff`` as a function: the report over fingerprint files and directories."""
    return diff_records(read_inputs(paths))


def diff_records(inputs: Inputs | Sequence[Loaded]) -> Report:
    """The audit's analysis and report over saved records (pure: no torch, no processes).

    Each file is one rank. Ranks come from the records; when two files claim the same rank
    (today's run against last week's), files take positions 0, 1, … in argument order instead,
    and a warning says so. ``options["inputs"]`` maps each rank to its file.
    """
    if not isinstance(inputs, Inputs):
        inputs = Inputs(tuple(inputs))
    files = list(inputs.files)
    if len(files) < 2:
        raise InputError(need_two(f"{len(files)} fingerprint(s) were given"))
    recorded = [f.content.record.env.rank for f in files]
    positional = len(set(recorded)) != len(recorded)
    if positional:
        ranked = list(enumerate(files))
    else:
        ranked = sorted(zip(recorded, files, strict=True), key=lambda pair: pair[0])
    records = {rank: _as_rank(f.content.record, rank) for rank, f in ranked}
    gathered = gathered_from(records)
    first = ranked[0][1].content
    report = assemble(AuditOutcome(gathered, model=first.model, wrap_plan=first.wrap), None)
    warnings = list(report.warnings)
    if positional:
        warnings.append(_positional_note(ranked))
    warnings.extend(_model_notes([f.content for _, f in ranked]))
    warnings.extend(f"skipped {item}" for item in inputs.skipped)
    if inputs.duplicates:
        warnings.append(f"given more than once, compared once: {', '.join(inputs.duplicates)}")
    for _, f in ranked:
        warnings.extend(f"{f.path}: {note}" for note in f.content.notes)
    options = {
        "command": "diff",
        "positional": positional,
        "inputs": [
            {
                "rank": rank,
                "path": f.path,
                "recorded_rank": f.content.record.env.rank,
                "host": f.content.record.env.host,
                "created": f.content.created,
            }
            for rank, f in ranked
        ],
    }
    return replace(report, warnings=tuple(warnings), options=options)


def _as_rank(record: RankRecord, rank: int) -> RankRecord:
    if record.env.rank == rank:
        return record
    error = record.error and replace(record.error, rank=rank)
    return replace(record, env=replace(record.env, rank=rank), error=error)


def _positional_note(ranked: list[tuple[int, Loaded]]) -> str:
    mapping = ", ".join(
        f"{f.path} (recorded rank {f.content.record.env.rank}) → rank {rank}" for rank, f in ranked
    )
    return f"several files claim the same rank, so ranks follow argument order: {mapping}"


def _model_notes(contents: list[FingerprintFile]) -> list[str]:
    described = {
        (c.model.name, c.model.architecture, c.model.dtype, c.model.init)
        for c in contents
        if c.model is not None
    }
    if len(described) <= 1:
        return []
    listed = "; ".join(
        f"{name} ({arch}, {dtype}, init {init})" for name, arch, dtype, init in sorted(described)
    )
    return [f"the files describe different model builds: {listed}"]
