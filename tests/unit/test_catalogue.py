"""The catalogue names every check the report runs, and running it is what the report does."""

from __future__ import annotations

from dataclasses import replace

from synthetic import EMBED, FULL, SCALE, state_record, valued

from fsdpcheck.checks.catalogue import CHECKS, Evidence, Need, run_checks
from fsdpcheck.model.keys import value_keys
from fsdpcheck.records import (
    BufferProblem,
    ConfigRecord,
    FsdpGroupRecord,
    FsdpPlanRecord,
    Gathered,
    LoadOutcome,
    TieRecord,
)
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import FindingKind

LM_HEAD = "lm_head.weight"
TIED = TieRecord("post-wrap", shared=((LM_HEAD, EMBED),), expected=((LM_HEAD, EMBED),))
UNTIED = TieRecord("post-wrap", shared=(), expected=((LM_HEAD, EMBED),))
GARBAGE = BufferProblem(SCALE, "post-wrap", "differs", ("1e-38",), ("8",))


def _record(rank, digest="bb", ties=(TIED,), problems=(), config="c0", dtype="float32"):
    buffers = [valued(FULL, "aa", ["1"]), valued(SCALE, "ss", ["8"])]
    tensors = (buffers, [valued(EMBED, digest, ["0.5"])])
    record = state_record(rank, pre=tensors, post=tensors, ties=ties, uninitialized=problems)
    plan = FsdpPlanRecord(groups=(FsdpGroupRecord(("",), (EMBED,), param_dtype=dtype),))
    return replace(record, config=ConfigRecord(config, {"a": config}), fsdp_plan=plan)


def _gathered(records) -> Gathered:
    """As rank 0 holds it: one record per digest, every rank's value digests."""
    digests = {r: record.group_digest() for r, record in records.items()}
    representatives: dict[str, int] = {}
    for rank in sorted(digests):
        representatives.setdefault(digests[rank], rank)
    kept = {r: records[r] for r in representatives.values()}
    extra = {r: rec for r, rec in records.items() if r not in kept}
    return Gathered(digests, {}, kept, 0, value_keys=value_keys(records), extra=extra)


# Rank 1 unties and holds other values; ranks 2 and 3 differ in plan and config; 2 has garbage.
AUDIT = _gathered(
    {
        0: _record(0),
        1: _record(1, digest="xx", ties=(UNTIED,)),
        2: _record(2, config="c2", dtype="bfloat16", problems=(GARBAGE,)),
        3: _record(3, config="c3", dtype="float16"),
    }
)
AFTER_LOAD = _gathered({0: _record(0), 1: _record(1, ties=(UNTIED,), problems=(GARBAGE,))})


def test_every_finding_kind_is_produced_by_a_registered_check():
    produced = {kind for check in CHECKS for kind in check.kinds}
    deliberately_unregistered: set[FindingKind] = set()  # none today
    assert set(FindingKind) - produced == deliberately_unregistered
    assert produced <= set(FindingKind)


def test_check_names_are_unique_and_each_check_finds_only_its_kinds():
    assert len({c.name for c in CHECKS}) == len(CHECKS)
    evidence = Evidence(AUDIT, load=LoadOutcome(True, "refused", "no"), after_load=AFTER_LOAD)
    for check in CHECKS:
        found = run_checks(evidence, (check,))
        assert {f.kind for f in found} <= set(check.kinds), check.name


def test_the_report_is_the_catalogue_in_order_one_group_at_a_time():
    evidence = Evidence(AUDIT, after_load=AFTER_LOAD)
    report = assemble(AuditOutcome(AUDIT, after_load=AFTER_LOAD), None)
    assert report.findings == tuple(run_checks(evidence))
    assert [(f.kind, f.ranks) for f in report.findings] == [
        ("wrap-plan", (2,)),  # the plan walk: each group's wrap plan, then its config
        ("config", (2,)),
        ("wrap-plan", (3,)),
        ("config", (3,)),
        ("tie", (1,)),
        ("uninitialized", (2,)),
        ("value", (1,)),
        ("tie", (1,)),  # after the load
        ("uninitialized", (1,)),
    ]


def test_a_check_runs_only_when_what_it_needs_is_there():
    without_values = replace(AUDIT, value_keys=None)
    kinds = [f.kind for f in run_checks(Evidence(without_values))]
    assert FindingKind.VALUE not in kinds and FindingKind.TIE in kinds
    optional = {n for c in CHECKS for n in c.needs} - {Need.PRE_WRAP, Need.POST_WRAP, Need.FINDINGS}
    bare = Evidence(without_values)
    assert not any(bare.has(need) for need in optional)
    assert [c.name for c in CHECKS if c.ready(bare)] == [
        "layout",
        "env",
        "numerics",
        "wrapper",
        "wrap-plan",
        "config",
        "module-state",
        "device",
        "checkpoint",
        "launch",
        "tie",
        "uninitialized",
        "non-finite",
        "optimizer",
        "expert",
        "unexplained",
    ]
