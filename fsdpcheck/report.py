"""Assemble the report, once, from everything the audit gathered, and judge it: the verdict,
the exit code and the headline (pure: no I/O, no processes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdpcheck.checks.catalogue import Evidence, run_checks
from fsdpcheck.checks.checkpoint import resharded_note
from fsdpcheck.checks.groups import group_ranks, reference_group
from fsdpcheck.checks.hash_seed import hash_seed_note, probe_error
from fsdpcheck.checks.loaded import load_errors
from fsdpcheck.checks.observed import Observation, reproduce_error, with_observations
from fsdpcheck.checks.predict import backend_of, predict_loaders
from fsdpcheck.checks.value import not_compared
from fsdpcheck.checks.wrap_plan import unread_note
from fsdpcheck.records import (
    CheckpointRecord,
    Finding,
    Gathered,
    Group,
    LoadOutcome,
    MemoryRecord,
    ModelInfo,
    RankError,
    RankRecord,
    Report,
    VerifyResult,
    WrapPlan,
    to_dict,
)
from fsdpcheck.text import ranks_label, waited_on_another
from fsdpcheck.vocab import (
    ExitCode,
    FindingKind,
    LoaderVerdict,
    LoadMethod,
    LoadStatus,
    Snapshot,
    Verdict,
    finding_kind,
)

if TYPE_CHECKING:
    from fsdpcheck.checks.hash_seed import ProbeResult
    from fsdpcheck.options import AuditOptions

_STAGES = (Snapshot.PRE_WRAP, Snapshot.POST_WRAP)


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
    probe_failure: str | None = None  # why --probe K gave no result (its deadline, an exception)
    reproduce_failure: str | None = None  # why --reproduce ran no job at all
    memory: tuple[MemoryRecord, ...] = ()  # every rank's, gathered after the load
    rank0_load: bool = False  # rank 0's weights are loaded into every rank (the memory check)

    source: VerifyResult | None = None  # --source: every rank against the checkpoint on disk


# The findings a per-process hash seed can cause (a set iterated while registering tensors).
_ORDER_KINDS = frozenset(
    {FindingKind.BUFFER_ORDER, FindingKind.PARAM_ORDER, FindingKind.STATE_DICT_ORDER}
)


def assemble(outcome: AuditOutcome, options: AuditOptions | None) -> Report:
    """The report: findings, loader predictions and one verdict."""
    gathered = outcome.gathered
    groups = group_ranks(gathered.digests, gathered.hosts)
    records = gathered.records
    loaders = tuple(predict_loaders(groups, records, gathered.meta_ranks, backend_of(records)))
    evidence = Evidence(
        gathered,
        load=outcome.load,
        verify=outcome.verify,
        source=outcome.source,
        after_load=outcome.after_load,
        probe=outcome.probe,
        loaders=loaders,
        observed=outcome.observed,
        memory=outcome.memory,
        rank0_load=outcome.rank0_load,
    )
    findings = run_checks(evidence)
    errors = gathered.errors
    if outcome.load is not None:  # a load that did not happen is never consistent
        errors = _by_rank(*errors, *load_errors(outcome.load))
    if outcome.after_load is not None:
        errors = _by_rank(*errors, *outcome.after_load.errors)
    if options is not None and options.probe:  # a check the user asked for is never skipped quietly
        unanswered = probe_error(options.probe, outcome.probe, outcome.probe_failure)
        errors = _by_rank(*errors, *filter(None, [unanswered]))
    if options is not None and options.reproduce:  # likewise
        unanswered = reproduce_error(outcome.observed, outcome.reproduce_failure)
        errors = _by_rank(*errors, *filter(None, [unanswered]))
    if outcome.observed:
        loaders, _ = with_observations(loaders, outcome.observed)  # the findings: run_checks
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
        warnings=(
            *wrap_warnings(outcome.wrap_plan),
            *resharded_note(records, len(gathered.digests)),
            *unread_note({r: rec.fsdp_plan for r, rec in records.items()}),
            *hash_seed_note(
                gathered.seed_tags or {},
                {r: rec.env.hash_seed for r, rec in records.items()},
                probed=outcome.probe is not None,
                orders_differ=any(f.kind in _ORDER_KINDS for f in findings),
            ),
            *outcome.notes,
        ),
        environment=tuple(records[g.representative].env for g in groups),
        options=to_dict(options) if options is not None else {},
        timings=dict(outcome.timings),
        not_compared=_not_compared(gathered),
        checkpoint=_checkpoint(groups, records),
        memory=outcome.memory,
        source_check=outcome.source,
    )


# ---------------------------------------------------------------- the judgement


def verdict(findings: Sequence[Finding], errors: Sequence[RankError]) -> tuple[Verdict, ExitCode]:
    """``latent``: the ranks agree now, but only because they share a hash seed."""
    # A wrong prediction is fsdpcheck's bug, not a difference between the ranks.
    findings = [f for f in findings if f.kind != FindingKind.PREDICTION]
    if errors:
        judged = Verdict.ERROR
    elif findings and all(f.kind == FindingKind.HASH_SEED for f in findings):
        judged = Verdict.LATENT
    else:
        judged = Verdict.INCONSISTENT if findings else Verdict.CONSISTENT
    return judged, judged.exit_code(e.kind for e in errors)


def phrase(kind: str) -> str:
    member = finding_kind(kind)
    return member.phrase if member is not None else kind


def kind_order(kind: str) -> int:
    member = finding_kind(kind)
    return member.order if member is not None else len(FindingKind)


def headline(findings: Sequence[Finding], errors: Sequence[RankError], world_size: int) -> str:
    """One short line a person can act on."""
    if errors:
        return _error_headline(errors)
    findings = [f for f in findings if f.kind != FindingKind.PREDICTION]  # report_headline says it
    if not findings:
        if world_size <= 1:
            return "1 rank: nothing to compare across ranks"
        return f"all {world_size} ranks consistent"
    first = min(findings, key=_headline_key)
    same = [f for f in findings if (f.kind, f.cause) == (first.kind, first.cause)]
    ranks = {r for f in same for r in f.ranks}
    where = f"on {ranks_label(ranks)}" if ranks else "across hash seeds"
    line = f"{phrase(first.kind)} {where} ({first.cause})"
    rest = len(findings) - len(same)
    if rest:
        line += f"; {rest} other difference{'s' if rest > 1 else ''}"
    return line


def _headline_key(f: Finding) -> tuple:
    stage = _STAGES.index(f.snapshot) if f.snapshot in _STAGES else len(_STAGES)
    return kind_order(f.kind), stage, min(f.ranks, default=0)


def _error_headline(errors: Sequence[RankError]) -> str:
    # A rank that failed on its own before the ranks that only waited on it.
    ordered = sorted(errors, key=lambda e: (waited_on_another(e.message), e.rank))
    first = ordered[0]
    alike = [e for e in ordered if (e.stage, e.message) == (first.stage, first.message)]
    lines = first.message.strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > 160:
        message = message[:157] + "..."
    line = f"{ranks_label(e.rank for e in alike)} failed at {first.stage}: {message}"
    rest = len({e.rank for e in ordered} - {e.rank for e in alike})
    if rest:
        line += f"; {rest} more rank{'s' if rest > 1 else ''} failed differently"
    return line


def _not_compared(gathered: Gathered) -> tuple[int, ...]:
    keys = gathered.value_keys
    if keys is None or len(gathered.digests) < 2:
        return ()
    return not_compared(keys.values, keys.replicas, keys.siblings)


def _checkpoint(
    groups: Sequence[Group], records: Mapping[int, RankRecord]
) -> CheckpointRecord | None:
    reference = reference_group(groups, records)
    return records[reference.representative].checkpoint if reference is not None else None


def _by_rank(*errors: RankError) -> tuple[RankError, ...]:
    return tuple(sorted(errors, key=lambda e: e.rank))


def error_report(
    errors: Sequence[RankError], world_size: int, options: AuditOptions | None
) -> Report:
    """A report for a run that could not finish the gather."""
    return Report(
        verdict=Verdict.ERROR,
        exit_code=Verdict.ERROR.exit_code(e.kind for e in errors),
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
    bad = [f"{p.name} → {p.verdict_text()}" for p in report.loaders if p.worst != LoaderVerdict.OK]
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
        loader = "resume" if load.method == LoadMethod.RESUME else "sorted loader"
        line += f"; {loader} {state} on {ranks}"
    elif load is not None and load.outcome == LoadStatus.REFUSED:
        line += "; sorted loader refused (names, shapes or dtypes differ)"
    checked = report.source_check
    if checked is not None and checked.ran and checked.passed:
        line += f"; every rank matches the checkpoint (--source) on {ranks}"
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
