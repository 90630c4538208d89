"""Stage 9: assemble the report from gathered records, and write it as JSON."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpcheck.analyse import analyse, group_ranks, ranks_label, verdict
from fsdpcheck.predict import predict_loaders
from fsdpcheck.records import (
    Finding,
    LoadOutcome,
    ModelInfo,
    RankError,
    Report,
    VerifyResult,
    WrapPlan,
    from_dict,
    to_dict,
)

if TYPE_CHECKING:
    from fsdpcheck.audit import AuditOptions
    from fsdpcheck.gather import Gathered


def assemble(
    gathered: Gathered,
    options: AuditOptions | None,
    model: ModelInfo | None,
    wrap_plan: WrapPlan | None,
    timings: dict[str, float],
) -> Report:
    groups = group_ranks(gathered.digests, gathered.hosts)
    records = gathered.records
    findings = analyse(groups, records)
    loaders = predict_loaders(groups, records, gathered.meta_ranks)
    errors = tuple(
        sorted((r.error for r in records.values() if r.error is not None), key=lambda e: e.rank)
    )
    warnings = wrap_warnings(wrap_plan)
    name, code = verdict(findings, errors)
    return Report(
        verdict=name,
        exit_code=code,
        world_size=len(gathered.digests),
        model=model,
        wrap=wrap_plan,
        groups=tuple(groups),
        findings=tuple(findings),
        errors=errors,
        loaders=tuple(loaders),
        hosts=ranks_by_host(gathered.hosts),
        warnings=warnings,
        environment=tuple(records[g.representative].env for g in groups),
        options=to_dict(options) if options is not None else {},
        timings=timings,
    )


def with_load(report: Report, load: LoadOutcome, verified: VerifyResult | None) -> Report:
    """Fold the loader's outcome and the verification into the report; a failed proof is a
    ``verify`` finding (exit 1)."""
    findings = list(report.findings)
    if verified is not None and verified.ran and not verified.passed:
        for mismatch in verified.mismatches:
            findings.append(
                Finding(
                    kind="verify",
                    ranks=tuple(mismatch.get("ranks", ())),
                    reference_rank=0,
                    stage="load",
                    cause="loading",
                    summary=f"after the sorted loader, {mismatch.get('kind', 'tensor')} "
                    f"{mismatch.get('name')} differs from rank 0's source on ranks "
                    f"{ranks_label(mismatch.get('ranks', ()))}: {mismatch.get('reason', '')}",
                    tensors=(str(mismatch.get("name")),),
                    details=dict(mismatch),
                )
            )
    name, code = verdict(findings, report.errors)
    return replace(
        report, load=load, verify=verified, findings=tuple(findings), verdict=name, exit_code=code
    )


def with_probe(report: Report, result: Any) -> Report:
    """Fold ``fsdpcheck.probe``'s result in: a ``hash-seed`` finding, and ``latent`` when that
    is the only finding (the ranks agree now, but only because they share a hash seed)."""
    from fsdpcheck.probe import probe_finding

    finding = probe_finding(result)
    findings = report.findings + ((finding,) if finding is not None else ())
    name, code = verdict(findings, report.errors)
    return replace(report, probe=to_dict(result), findings=findings, verdict=name, exit_code=code)


def with_reproduction(report: Report, options: AuditOptions) -> Report:
    """Run every known loader for real, each in an isolated child job (never in-process)."""
    from fsdpcheck.children.observe import fold_reproduction

    return fold_reproduction(report, options)


def ranks_by_host(hosts: dict[int, str]) -> dict[str, tuple[int, ...]]:
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    return {host: tuple(ranks) for host, ranks in sorted(by_host.items())}


def wrap_warnings(wrap_plan: WrapPlan | None) -> tuple[str, ...]:
    if wrap_plan is None:
        return ()
    warnings = []
    if wrap_plan.missing:
        warnings.append(
            f"wrap classes not in this model: {', '.join(wrap_plan.missing)} "
            f"(from {wrap_plan.source}); skipped"
        )
    if wrap_plan.fallback and wrap_plan.requested:
        warnings.append(
            "none of the requested wrap classes is present: fell back to size-based wrapping "
            f"(--min-params {wrap_plan.min_params:,})"
        )
    return tuple(warnings)


def error_report(
    errors: Sequence[RankError], world_size: int, options: AuditOptions | None
) -> Report:
    """A report for a run that could not finish the gather."""
    return Report(
        verdict="error",
        exit_code=2 if all(e.kind == "input" for e in errors) else 3,
        world_size=world_size,
        model=None,
        wrap=None,
        groups=(),
        findings=(),
        errors=tuple(errors),
        options=to_dict(options) if options is not None else {},
    )


def write_json(report: Report, path: Path) -> None:
    """Write atomically, so a reader never sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the report from CI artifact collectors
    with os.fdopen(fd, "w") as out:
        json.dump(to_dict(report), out, indent=2, sort_keys=False)
        out.write("\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Report:
    return from_dict(Report, json.loads(Path(path).read_text()))
