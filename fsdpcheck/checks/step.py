"""``step`` and ``non-finite``: what one training step did on each rank, compared (pure).

Each rank records the collectives its step issued (:class:`CollectiveCall`) and, at the first
point where the ranks' descriptors differed, what every rank was about to do there
(:class:`StepRecord`). This module turns those records into findings in the model's terms:
which FSDP module's all-gather or reduce-scatter, which parameters it carries, which ranks
issued it and which did not. No torch, no I/O: unit tests feed it synthetic traces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdpcheck.records import Finding
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind, Snapshot

# What a rank was doing at a sequence number, besides issuing a collective.
FINISHED = "finished"  # its step returned: it issues no more collectives
RAISED = "raised"  # its step raised its own exception
_LISTED = 3


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the rank that issued it sees it, before it is issued."""

    seq: int  # this rank's count of watched collectives in the step, from 0
    op: str  # "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", ...
    group: str  # the process group's description ("default_pg", "mesh_shard", ...)
    group_ranks: tuple[int, ...]  # global ranks of the group
    numel: int  # elements this rank sends (-1: not compared, e.g. an uneven all_to_all)
    dtype: str
    module: str | None = None  # the FSDP module whose parameters move ("" the root), else None
    params: tuple[str, ...] = ()  # their names
    where: str = ""  # the script's line that issued it, when it is not FSDP's own

    def key(self) -> tuple:
        """What must agree across ranks: the group's description and size, not its members
        (an HSDP shard group holds other ranks on every replica)."""
        return (self.op, self.group, len(self.group_ranks), self.numel, self.dtype, self.module)

    def label(self) -> str:
        what = self.op.replace("_into_tensor", "").replace("_tensor", "").replace("_", "-")
        if self.module is not None:
            owner = f"`{self.module}`" if self.module else "the root module"
            return f"{what} of {owner}"
        return f"{what} at {self.where}" if self.where else what

    def size_text(self) -> str:
        size = f"{self.numel:,} elements" if self.numel >= 0 else "uneven sizes"
        return f"{size} {self.dtype} on {self.group} ({len(self.group_ranks)} ranks)"


@dataclass(frozen=True)
class StepNonFinite:
    """What was NaN or Inf on one rank after its step (names capped; counts exact)."""

    loss: str | None = None  # "nan", "inf", "-inf"; None when finite or not returned
    grads: tuple[str, ...] = ()
    grad_count: int = 0
    params: tuple[str, ...] = ()
    param_count: int = 0

    def __bool__(self) -> bool:
        return self.loss is not None or self.grad_count > 0 or self.param_count > 0


@dataclass(frozen=True)
class StepRecord:
    """One rank's step: how it ended, and at the divergence, what this rank was doing.

    ``outcome``: ``finished`` (every rank agreed on every collective), ``diverged`` (the ranks'
    descriptors differed at ``at``: no rank issued that collective) or ``raised``."""

    outcome: str
    collectives: int  # agreed and issued
    at: int | None = None  # the sequence number where the ranks differed
    doing: CollectiveCall | None = None  # this rank's collective there (None: ``state``)
    state: str = ""  # FINISHED or RAISED when this rank issued nothing there
    before: tuple[CollectiveCall, ...] = ()  # the last few agreed collectives, for context
    message: str = ""  # ``raised``: the exception
    loss: float | None = None
    non_finite: StepNonFinite = field(default_factory=StepNonFinite)
    # The watch's own cost on this rank: exchanges, bytes each sent on the side channel, seconds.
    exchanges: int = 0
    channel_bytes: int = 0
    watch_seconds: float = 0.0


def _what(record: StepRecord) -> tuple:
    return record.doing.key() if record.doing is not None else (record.state,)


def _doing_text(record: StepRecord) -> str:
    if record.doing is not None:
        return f"{record.doing.label()} ({record.doing.size_text()})"
    return "had finished its step" if record.state == FINISHED else "had raised in its step"


def divergence_finding(records: Mapping[int, StepRecord]) -> Finding | None:
    """The first collective where the ranks differ, named; ``None`` when they agreed.

    Ranks are grouped by what they were doing at that sequence number; the group holding the
    lowest rank is the reference, every other rank is reported."""
    diverged = {r: rec for r, rec in records.items() if rec.outcome == "diverged"}
    if not diverged:
        return None
    at = min(rec.at for rec in diverged.values() if rec.at is not None)
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(diverged):
        groups.setdefault(_what(diverged[rank]), []).append(rank)
    # Ranks that had finished are the reference for those that issue one more collective;
    # otherwise the lowest rank's side is.
    ordered = sorted(
        groups.values(), key=lambda ranks: (diverged[ranks[0]].state != FINISHED, ranks[0])
    )
    reference = ordered[0]
    others = sorted(r for ranks in ordered[1:] for r in ranks)
    sides = [(ranks, diverged[ranks[0]]) for ranks in ordered]
    issued = [(ranks, rec) for ranks, rec in sides if rec.doing is not None]
    idle = sorted(r for ranks, rec in sides if rec.doing is None for r in ranks)
    parts = [f"{ranks_label(ranks)} {_doing_text(rec)}" for ranks, rec in sides]
    summary = f"collective #{at} differs: " + "; ".join(parts)
    summary += f". {_consequence(issued, idle)}"
    tensors = tuple(dict.fromkeys(p for _, rec in issued for p in rec.doing.params))
    details: dict[str, Any] = {
        "seq": at,
        "ranks": {
            ranks_label(ranks): {"doing": _doing_text(rec), **_call_details(rec)}
            for ranks, rec in sides
        },
        "issued_by": sorted(r for ranks, _ in issued for r in ranks),
        "not_issued_by": idle,
        "modules": sorted({rec.doing.module for _, rec in issued if rec.doing.module is not None}),
        "caught": "before the collective was issued: no rank issued it",
    }
    before = diverged[reference[0]].before
    if before:
        details["agreed_before"] = [c.label() for c in before]
    return Finding(
        kind=FindingKind.STEP,
        ranks=tuple(others),
        reference_rank=reference[0],
        snapshot=Snapshot.STEP,
        cause=Cause.DIVERGENT,
        summary=summary,
        tensors=tensors[:64],
        details=details,
    )


def _call_details(record: StepRecord) -> dict[str, Any]:
    call = record.doing
    if call is None:
        return {"state": record.state}
    return {
        "op": call.op,
        "module": call.module,
        "params": list(call.params[:64]),
        "numel": call.numel,
        "dtype": call.dtype,
        "group": call.group,
        "group_ranks": list(call.group_ranks),
        "where": call.where,
    }


def _consequence(issued: Sequence[tuple[list[int], StepRecord]], idle: Sequence[int]) -> str:
    """What the unwatched job would have done there."""
    if idle:
        waiting = sorted(r for ranks, _ in issued for r in ranks)
        verb = "issues" if len(waiting) == 1 else "issue"
        return (
            f"{ranks_label(waiting)} {verb} more collectives than {ranks_label(idle)} (an extra "
            "micro-batch, or a module only some ranks run): unwatched, "
            f"{ranks_label(waiting)} would wait in it until the collective timeout"
        )
    sizes = {rec.doing.numel for _, rec in issued}
    if len(sizes) > 1:
        return (
            "their sizes differ (a module only some ranks run?): unwatched, gloo aborts the "
            "receiving rank (`op.preamble.length <= op.nbytes`), NCCL hangs or corrupts"
        )
    return (
        "same sizes, other tensors: unwatched, they pair silently and exchange the wrong "
        "parameters or gradients"
    )


def raised_errors(records: Mapping[int, StepRecord]) -> dict[int, str]:
    """Ranks whose own step raised, with the message."""
    return {r: rec.message for r, rec in sorted(records.items()) if rec.outcome == "raised"}


def non_finite_finding(records: Mapping[int, StepRecord]) -> Finding | None:
    """NaN or Inf in a loss, a gradient or a parameter after the step, on any rank."""
    bad = {r: rec.non_finite for r, rec in sorted(records.items()) if rec.non_finite}
    if not bad:
        return None
    lossy = [r for r, nf in bad.items() if nf.loss is not None]
    parts = []
    if lossy:
        values = sorted({bad[r].loss for r in lossy})
        parts.append(f"loss {'/'.join(values)} on {ranks_label(lossy)}")
    for what, names_of, count_of in (
        ("gradients", lambda nf: nf.grads, lambda nf: nf.grad_count),
        ("parameters", lambda nf: nf.params, lambda nf: nf.param_count),
    ):
        ranks = [r for r, nf in bad.items() if count_of(nf)]
        if ranks:
            names = list(dict.fromkeys(n for r in ranks for n in names_of(bad[r])))
            shown = ", ".join(f"`{n}`" for n in names[:_LISTED])
            more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
            total = max(count_of(bad[r]) for r in ranks)
            parts.append(f"{total} {what} on {ranks_label(ranks)} ({shown}{more})")
    summary = "non-finite after the step: " + "; ".join(parts)
    if lossy and len(bad) > len(lossy):
        summary += (
            f". The loss went first on {ranks_label(lossy)} (a batch with no label that counts, "
            "all -100?); the reduce-scatter spread it into every rank's gradients"
        )
    tensors = tuple(dict.fromkeys(n for nf in bad.values() for n in (*nf.grads, *nf.params)))
    return Finding(
        kind=FindingKind.NON_FINITE,
        ranks=tuple(bad),
        reference_rank=min(set(records) - set(bad), default=min(bad)),
        snapshot=Snapshot.STEP,
        cause=Cause.DIVERGENT,
        summary=summary,
        tensors=tensors[:64],
        details={
            "loss": {str(r): bad[r].loss for r in lossy},
            "ranks": {str(r): _nf_details(nf) for r, nf in bad.items()},
        },
    )


def _nf_details(nf: StepNonFinite) -> dict[str, Any]:
    return {
        "loss": nf.loss,
        "gradients": nf.grad_count,
        "parameters": nf.param_count,
        "first": list((*nf.grads, *nf.params)[:_LISTED]),
    }


def loss_word(value: float | None) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite loss; ``None`` otherwise."""
    if value is None or math.isfinite(value):
        return None
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def watch_cost(records: Mapping[int, StepRecord]) -> dict[str, Any]:
    """The watch's cost, worst rank: exchanges, microseconds and side-channel bytes each."""
    if not records:
        return {}
    worst = max(records.values(), key=lambda rec: rec.watch_seconds)
    exchanges = max(worst.exchanges, 1)
    return {
        "collectives": max(rec.collectives for rec in records.values()),
        "exchanges": worst.exchanges,
        "us_per_collective": round(1e6 * worst.watch_seconds / exchanges, 1),
        "channel_bytes": worst.channel_bytes,
        "channel_bytes_per_collective": worst.channel_bytes // exchanges,
    }
