"""Every check the report runs, in the order its findings appear, and the one function that runs
them. Pure: the checks read what the audit gathered and return findings.

A check names the finding kinds it can produce and what it reads (:class:`Need`). Checks that
compare the reference group with each other group in turn share a *walk*: adjacent checks of one
walk run group by group, so one group's findings stay together in the report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import groupby
from typing import Any

from fsdpcheck.checks.checkpoint import checkpoint_findings
from fsdpcheck.checks.collectives import RankTrace, collective_findings
from fsdpcheck.checks.config import config_findings
from fsdpcheck.checks.env import env_findings
from fsdpcheck.checks.expert import expert_findings
from fsdpcheck.checks.flags import device_findings
from fsdpcheck.checks.groups import (
    Pair,
    group_ranks,
    pairs,
    reference_group,
    speakers,
    usable_groups,
)
from fsdpcheck.checks.hash_seed import ProbeResult, probe_finding
from fsdpcheck.checks.launch import launch_findings
from fsdpcheck.checks.layout import LAYOUT_KINDS, layout_findings
from fsdpcheck.checks.loaded import load_findings, verify_findings
from fsdpcheck.checks.memory import memory_findings
from fsdpcheck.checks.module_state import module_state_findings, numerics_findings
from fsdpcheck.checks.non_finite import non_finite_findings
from fsdpcheck.checks.observed import Observation, with_observations
from fsdpcheck.checks.optimizer import optimizer_findings
from fsdpcheck.checks.source import source_findings
from fsdpcheck.checks.step import StepRecord, divergence_findings, non_finite_finding
from fsdpcheck.checks.ties import tie_findings
from fsdpcheck.checks.unexplained import unexplained_findings
from fsdpcheck.checks.uninitialized import uninitialized_findings
from fsdpcheck.checks.value import value_findings
from fsdpcheck.checks.wrap_plan import wrap_plan_findings
from fsdpcheck.checks.wrapper import wrapper_findings
from fsdpcheck.model.names import canonical_gathered
from fsdpcheck.records import (
    Finding,
    Gathered,
    Group,
    LoaderPrediction,
    LoadOutcome,
    MemoryRecord,
    VerifyResult,
)
from fsdpcheck.vocab import FindingKind, LoadMethod, Snapshot, Word


class Need(Word):
    """What a check reads. A snapshot is read where both sides recorded it (a rank without one
    is compared on what it has), so it never keeps a check from running; every other need is an
    optional part of the audit, and a check that needs it runs only when it is there."""

    PRE_WRAP = "pre-wrap"  # each rank's model as built
    POST_WRAP = "post-wrap"  # ... after fully_shard
    VALUES = "values"  # --values: every rank's value digests
    LOAD = "load"  # --load: the sorted loader's outcome
    VERIFY = "verify"  # --load: the proof of equality after it
    SOURCE = "source"  # --source: every rank against the checkpoint on disk
    AFTER_LOAD = "after-load"  # --load: every rank's ties and buffers, gathered again
    PROBE = "probe"  # --probe K: the model built under other hash seeds
    OBSERVED = "observed"  # --reproduce: what the real loaders did
    STEP = "step"  # check_step, audit --step: every rank's record of its watched step
    TRACES = "traces"  # explain: every rank's Flight Recorder trace of a job that already ran
    FINDINGS = "findings"  # every finding of the checks before it (always there)
    MEMORY = "memory"  # every rank's host (and CUDA) memory over build, wrap and load


_ALWAYS = frozenset({Need.PRE_WRAP, Need.POST_WRAP, Need.FINDINGS})


@dataclass(frozen=True)
class Evidence:
    """Everything the checks read from one audit (``fsdpcheck diff``: from saved records)."""

    gathered: Gathered
    load: LoadOutcome | None = None
    verify: VerifyResult | None = None
    source: VerifyResult | None = None  # --source
    after_load: Gathered | None = None
    probe: ProbeResult | None = None
    loaders: Sequence[LoaderPrediction] = ()  # the predictions the observations are held to
    observed: Mapping[str, Observation] | None = None
    step: Mapping[int, StepRecord] | None = None  # by rank
    traces: Mapping[int, RankTrace] | None = None  # by rank; the records are fingerprints
    findings: Sequence[Finding] = ()  # for a check that needs Need.FINDINGS: those before it
    memory: Sequence[MemoryRecord] = ()  # every rank's, gathered after the load
    rank0_load: bool = False  # the job loads rank 0's weights: ranks > 0 hold only shards

    @cached_property
    def groups(self) -> list[Group]:
        return group_ranks(self.gathered.digests, self.gathered.hosts)

    def has(self, need: Need) -> bool:
        present = {
            Need.VALUES: self.gathered.value_keys is not None,
            Need.LOAD: self.load is not None,
            Need.VERIFY: self.verify is not None,
            Need.SOURCE: self.source is not None,
            Need.AFTER_LOAD: self.after_load is not None,
            Need.PROBE: self.probe is not None,
            Need.OBSERVED: bool(self.observed),
            Need.STEP: self.step is not None,
            Need.TRACES: self.traces is not None,
            Need.MEMORY: bool(self.memory),
        }
        return need in _ALWAYS or present[need]


@dataclass(frozen=True)
class Check:
    """One check: its name, the kinds it can find, what it reads, and how it runs.

    ``run`` takes the :class:`Evidence`, or, for a check with a ``walk``, one :class:`Pair` of
    the reference group and another group. A check that needs :attr:`Need.AFTER_LOAD` reads the
    gather taken after the load in place of the audit's."""

    name: str
    kinds: tuple[FindingKind, ...]
    needs: frozenset[Need]
    run: Callable[[Any], Sequence[Finding]]
    walk: str = ""  # adjacent checks of one walk run group by group

    def ready(self, evidence: Evidence) -> bool:
        return all(evidence.has(need) for need in self.needs)


def _checks(*checks: tuple) -> tuple[Check, ...]:
    return tuple(
        Check(name, kinds, frozenset(needs), run, walk) for name, kinds, needs, run, walk in checks
    )


# ---------------------------------------------------------------- how each check reads


def _wrap_plan(p: Pair) -> list[Finding]:
    return wrap_plan_findings(p.ref_rank, p.ref.fsdp_plan, p.group.ranks, p.other.fsdp_plan)


def _wrappers(p: Pair) -> list[Finding]:
    return wrapper_findings(p.ref_rank, p.ref, p.group.ranks, p.other)


def _config(p: Pair) -> list[Finding]:
    return config_findings(p.ref_rank, p.ref.config, p.group.ranks, p.other.config)


def _module_state(p: Pair) -> list[Finding]:
    return module_state_findings(p.ref_rank, p.ref, p.group.ranks, p.other)


def _numerics(p: Pair) -> list[Finding]:
    return numerics_findings(p.ref_rank, p.ref, p.group.ranks, p.other)


def _devices(e: Evidence) -> list[Finding]:
    records = e.gathered.records
    reference = reference_group(e.groups, records)
    if reference is None:
        return []
    usable = usable_groups(e.groups, records)
    return device_findings(
        reference.representative,
        [(g.ranks, records[g.representative]) for g in usable],
        speakers(e.gathered, reference),
    )


def _checkpoint(e: Evidence) -> list[Finding]:
    return checkpoint_findings(e.groups, e.gathered.records)


def _launch(e: Evidence) -> list[Finding]:
    return launch_findings(e.groups, e.gathered.records)


def _ties(e: Evidence) -> list[Finding]:
    return tie_findings(e.groups, e.gathered.records)


def _uninitialized(e: Evidence) -> list[Finding]:
    return uninitialized_findings(e.groups, e.gathered.records)


def _non_finite(e: Evidence) -> list[Finding]:
    return non_finite_findings(e.groups, e.gathered.records)


def _values(e: Evidence) -> list[Finding]:
    g = e.gathered
    everyone = {**g.records, **(g.extra or {})}  # value senders that are no group's too
    return value_findings(everyone, g.value_keys)


def _optimizer(e: Evidence) -> list[Finding]:
    return optimizer_findings(e.groups, e.gathered)


def _experts(e: Evidence) -> list[Finding]:
    return expert_findings(e.gathered)


def _load(e: Evidence) -> list[Finding]:
    return load_findings(e.load, len(e.gathered.digests))


def _verify(e: Evidence) -> list[Finding]:
    resumed = e.load is not None and e.load.method == LoadMethod.RESUME
    return verify_findings(e.verify, "the resume (dcp.load)" if resumed else "the sorted loader")


def _memory(e: Evidence) -> list[Finding]:
    return memory_findings(e.memory, rank0_load=e.rank0_load)


def _source(e: Evidence) -> list[Finding]:
    return source_findings(e.source)


def _probe(e: Evidence) -> list[Finding]:
    found = probe_finding(e.probe)
    return [] if found is None else [found]


def _unexplained(e: Evidence) -> list[Finding]:
    return unexplained_findings(e.gathered, e.groups, e.findings)


def _unexplained_after_load(e: Evidence) -> list[Finding]:
    return unexplained_findings(e.gathered, e.groups, e.findings, Snapshot.LOAD)


def _prediction(e: Evidence) -> list[Finding]:
    return list(with_observations(e.loaders, e.observed)[1])


def _step(e: Evidence) -> list[Finding]:
    return divergence_findings(e.step)


def _non_finite_in_step(e: Evidence) -> list[Finding]:
    found = non_finite_finding(e.step)
    return [] if found is None else [found]


def _collectives(e: Evidence) -> list[Finding]:
    return collective_findings(e.traces, e.gathered.records)


K, N = FindingKind, Need

CHECKS: tuple[Check, ...] = _checks(
    # name, kinds, needs, run, walk
    ("layout", LAYOUT_KINDS, {N.PRE_WRAP, N.POST_WRAP}, layout_findings, "fingerprints"),
    ("env", (K.ENV,), (), env_findings, "fingerprints"),
    ("numerics", (K.NUMERICS,), (), _numerics, "fingerprints"),
    ("wrapper", (K.WRAPPER,), (), _wrappers, "fingerprints"),
    ("wrap-plan", (K.WRAP_PLAN,), {N.POST_WRAP}, _wrap_plan, "plan"),
    ("config", (K.CONFIG,), (), _config, "plan"),
    ("module-state", (K.MODULE_STATE,), (), _module_state, "plan"),
    ("device", (K.DEVICE,), {N.PRE_WRAP, N.POST_WRAP}, _devices, ""),
    ("checkpoint", (K.CHECKPOINT,), (), _checkpoint, ""),
    ("launch", (K.LAUNCH,), (), _launch, ""),
    ("tie", (K.TIE,), {N.PRE_WRAP, N.POST_WRAP}, _ties, ""),
    ("uninitialized", (K.UNINITIALIZED,), (), _uninitialized, ""),
    ("non-finite", (K.NON_FINITE,), (), _non_finite, ""),
    ("value", (K.VALUE,), {N.VALUES}, _values, ""),
    ("optimizer", (K.OPTIMIZER,), (), _optimizer, ""),
    ("expert", (K.EXPERT,), (), _experts, ""),
    ("load", (K.VERIFY,), {N.LOAD}, _load, ""),
    ("verify", (K.VERIFY,), {N.VERIFY}, _verify, ""),
    ("source", (K.SOURCE,), {N.SOURCE}, _source, ""),
    ("tie-after-load", (K.TIE,), {N.AFTER_LOAD}, _ties, ""),
    ("uninitialized-after-load", (K.UNINITIALIZED,), {N.AFTER_LOAD}, _uninitialized, ""),
    ("non-finite-after-load", (K.NON_FINITE,), {N.AFTER_LOAD}, _non_finite, ""),
    ("value-after-load", (K.VALUE,), {N.AFTER_LOAD, N.VALUES}, _values, ""),
    ("memory", (K.MEMORY,), {N.MEMORY}, _memory, ""),
    ("hash-seed", (K.HASH_SEED,), {N.PROBE}, _probe, ""),
    ("prediction", (K.PREDICTION,), {N.OBSERVED}, _prediction, ""),
    ("step", (K.STEP,), {N.STEP}, _step, ""),
    ("non-finite-in-step", (K.NON_FINITE,), {N.STEP}, _non_finite_in_step, ""),
    ("collective", (K.COLLECTIVE,), {N.TRACES}, _collectives, ""),
    # The last resort: a record that differs where no finding above names its ranks.
    ("unexplained", (K.UNEXPLAINED,), {N.FINDINGS}, _unexplained, ""),
    (
        "unexplained-after-load",
        (K.UNEXPLAINED,),
        {N.AFTER_LOAD, N.FINDINGS},
        _unexplained_after_load,
        "",
    ),
)

# What a gather of every rank's state says on its own (after a training step, say).
STATE_CHECKS = ("tie", "uninitialized", "value")
STEP_CHECKS = ("step", "non-finite-in-step")


def checks_named(*names: str) -> tuple[Check, ...]:
    """The catalogue's checks of these names, in catalogue order."""
    unknown = set(names) - {c.name for c in CHECKS}
    if unknown:
        raise ValueError(f"no such check: {sorted(unknown)}")
    return tuple(c for c in CHECKS if c.name in names)


def run_checks(evidence: Evidence, checks: Sequence[Check] = CHECKS) -> list[Finding]:
    """The findings of every check whose needs ``evidence`` meets, in catalogue order.

    Tensors are paired by canonical names (wrapper levels left out, see
    :mod:`fsdpcheck.checks.wrapper`): the ``wrapper`` check reports the raw-name difference."""
    evidence = replace(
        evidence,
        gathered=canonical_gathered(evidence.gathered),
        after_load=canonical_gathered(evidence.after_load),
    )
    findings: list[Finding] = []
    for walk, block in groupby(checks, key=lambda c: c.walk):
        if walk:
            ready = [c for c in block if c.ready(evidence)]
            for pair in pairs(evidence.groups, evidence.gathered.records):
                for check in ready:
                    findings.extend(check.run(pair))
            continue
        for check in block:
            view = _read_by(check, evidence)
            if view is not None and Need.FINDINGS in check.needs:
                view = replace(view, findings=tuple(findings))
            if view is not None and check.ready(view):
                findings.extend(check.run(view))
    return findings


def _read_by(check: Check, evidence: Evidence) -> Evidence | None:
    """The evidence ``check`` reads: the gather after the load for an after-load check (None
    when there was none)."""
    if Need.AFTER_LOAD not in check.needs:
        return evidence
    if evidence.after_load is None:
        return None
    return replace(evidence, gathered=evidence.after_load)
