"""Assemble the report, once, from everything the audit gathered (pure: no I/O, no processes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdpcheck.checks.hash_seed import probe_finding
from fsdpcheck.checks.layout import analyse, group_ranks, headline, verdict
from fsdpcheck.checks.loaded import load_errors, load_findings, verify_findings
from fsdpcheck.checks.observed import Observation, with_observations
from fsdpcheck.checks.predict import predict_loaders
from fsdpcheck.checks.ties import tie_findings
from fsdpcheck.checks.uninitialized import uninitialized_findings
from fsdpcheck.checks.value import not_compared, value_findings
from fsdpcheck.records import (
    Finding,
    Gathered,
    Group,
    LoadOutcome,
    ModelInfo,
    RankError,
    Report,
    VerifyResult,
    WrapPlan,
    to_dict,
)
from fsdpcheck.vocab import (
    ErrorKind,
    ExitCode,
    FindingKind,
    LoaderVerdict,
    LoadStatus,
    Verdict,
)

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult
    from fsdpcheck.options import AuditOptions


@dataclass(frozen=True)
class AuditOutcome:
    """Everything rank 0 learned in one audit, before any of it is judged."""

    gathered: Gathered
    model: ModelInfo | None = None
    wrap_plan: WrapPlan | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    load: LoadOutcome | None = None
    verify: VerifyResult | None = None
    observed: Mapping[str, Observation] | None = None  # --reproduce: each loader for real, once
    probe: ProbeResult | None = None  # --probe K
    notes: tuple[str, ...] = ()  # warnings from optional extras that did not finish
    after_load: Gathered | None = None  # every rank's ties and buffer problems after the load


def assemble(outcome: AuditOutcome, options: AuditOptions | None) -> Report:
    """The report: findings, loader predictions and one verdict."""
    gathered = outcome.gathered
    groups = group_ranks(gathered.digests, gathered.hosts)
    records = gathered.records
    findings = analyse(groups, records) + state_findings(groups, gathered)
    errors = gathered.errors
    if outcome.load is not None:  # a load that did not happen is never consistent
        findings.extend(load_findings(outcome.load, len(gathered.digests)))
        errors = _by_rank(*errors, *load_errors(outcome.load))
    if outcome.verify is not None:
        findings.extend(verify_findings(outcome.verify))
    if outcome.after_load is not None:
        after = outcome.after_load
        findings.extend(state_findings(group_ranks(after.digests, after.hosts), after))
        errors = _by_rank(*errors, *after.errors)
    if outcome.probe is not None and (found := probe_finding(outcome.probe)) is not None:
        findings.append(found)
    loaders = tuple(predict_loaders(groups, records, gathered.meta_ranks))
    if outcome.observed:
        loaders, wrong = with_observations(loaders, outcome.observed)
        findings.extend(wrong)
    name, code = verdict(findings, errors)
    return Report(
        verdict=name,
        exit_code=code,
        world_size=len(gathered.digests),
        model=outcome.model,
        wrap=outcome.wrap_plan,
        groups=tuple(groups),
        findings=tuple(findings),
        errors=errors,
        loaders=loaders,
        load=outcome.load,
        verify=outcome.verify,
        probe=to_dict(outcome.probe) if outcome.probe is not None else None,
        hosts=ranks_by_host(gathered.hosts),
        warnings=(*wrap_warnings(outcome.wrap_plan), *outcome.notes),
        environment=tuple(records[g.representative].env for g in groups),
        options=to_dict(options) if options is not None else {},
        timings=dict(outcome.timings),
        not_compared=_not_compared(gathered),
    )


def state_findings(groups: Sequence[Group], gathered: Gathered) -> list[Finding]:
    """``tie``, ``uninitialized`` and ``value`` findings from one gather."""
    records = gathered.records
    findings = tie_findings(groups, records) + uninitialized_findings(groups, records)
    if gathered.values is not None:
        everyone = {**records, **(gathered.extra or {})}
        findings += value_findings(
            everyone, gathered.values, gathered.replicas or {}, gathered.shard_keys or {}
        )
    return findings


def _not_compared(gathered: Gathered) -> tuple[int, ...]:
    if gathered.values is None or len(gathered.digests) < 2:
        return ()
    return not_compared(gathered.values, gathered.replicas or {})


def _by_rank(*errors: RankError) -> tuple[RankError, ...]:
    return tuple(sorted(errors, key=lambda e: e.rank))


def error_report(
    errors: Sequence[RankError], world_size: int, options: AuditOptions | None
) -> Report:
    """A report for a run that could not finish the gather."""
    bad_input = all(e.kind == ErrorKind.INPUT for e in errors)
    return Report(
        verdict=Verdict.ERROR,
        exit_code=ExitCode.BAD_INPUT if bad_input else ExitCode.RUNTIME,
        world_size=world_size,
        model=None,
        wrap=None,
        groups=(),
        findings=(),
        errors=tuple(errors),
        options=to_dict(options) if options is not None else {},
    )


def report_headline(report: Report) -> str:
    """The one line a person can act on."""
    line = headline(report.findings, report.errors, report.world_size)
    bad = [f"{p.name} → {p.verdict}" for p in report.loaders if p.verdict != LoaderVerdict.OK]
    if bad and any(f.kind != FindingKind.PREDICTION for f in report.findings):
        line += ": " + ", ".join(bad)
    wrong = [f.details for f in report.findings if f.kind == FindingKind.PREDICTION]
    if wrong:
        line += "; PREDICTION WRONG (a bug in fsdpcheck): " + ", ".join(
            f"{w['loader']} predicted {w['predicted']}, observed {w['observed']}" for w in wrong
        )
    load, verified = report.load, report.verify
    ranks = f"{report.world_size} rank{'s' if report.world_size != 1 else ''}"
    if load is not None and load.outcome == LoadStatus.LOADED and verified is not None:
        state = "verified" if verified.passed else "left ranks different"
        line += f"; sorted loader {state} on {ranks}"
    elif load is not None and load.outcome == LoadStatus.REFUSED:
        line += "; sorted loader refused (names, shapes or dtypes differ)"
    return line


def ranks_by_host(hosts: Mapping[int, str]) -> dict[str, tuple[int, ...]]:
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
