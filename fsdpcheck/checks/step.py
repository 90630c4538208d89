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
STOPPED = "stopped"  # it stopped at a divergence on another of its groups
_LISTED = 3
# ``fsdpcheck run``'s points every rank must reach in the same place, agreed on like a
# collective (op name → what it is to a reader).
MARKS = {
    "first_forward": "the first forward of an FSDP model",
    "step_end": "the end of the watched step",
}
# The members' digests differ and no field compared names why: never issued all the same.
UNNAMED = "their digests differ but no compared field names the difference"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the rank that issued it sees it, before it is issued: everything that
    must agree across its group's members for it to be correct."""

    seq: int  # this rank's count of watched collectives on this group in the step, from 0
    op: str  # "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", ...
    group: str  # the process group's description ("default_pg", "mesh_shard", ...)
    group_ranks: tuple[int, ...]  # global ranks of the group
    numel: int  # elements this rank sends (-1: not compared, e.g. an all_to_all)
    dtype: str
    module: str | None = None  # the FSDP module whose parameters move ("" the root), else None
    params: tuple[str, ...] = ()  # their names
    where: str = ""  # the script's line that issued it, when it is not FSDP's own
    reduce_op: str = ""  # "sum", "max", ... for reductions
    root: int | None = None  # broadcast / reduce / gather / scatter: the root, a global rank
    sizes: tuple[int, ...] = ()  # each tensor's elements (coalesced ops list several)
    dtypes: tuple[str, ...] = ()  # each tensor's dtype
    # all_to_all: elements this rank sends to / expects from each member, in group order.
    send: tuple[int, ...] = ()
    recv: tuple[int, ...] = ()
    peer: int | None = None  # point-to-point: the other rank (global)
    tag: int = 0
    # torch.distributed.pipelining: the stage that moves it, "forward" (activations) or
    # "backward" (gradients), and the schedule's microbatch index (None: not a pipeline's).
    stage: int | None = None
    phase: str = ""
    microbatch: int | None = None

    def key(self) -> tuple:
        """What must agree across the group's members (all_to_all splits pair instead:
        :func:`disagreement`)."""
        return (
            self.op,
            self.group,
            len(self.group_ranks),
            self.numel,
            self.dtype,
            self.module,
            self.reduce_op,
            self.root,
            self.sizes,
            self.dtypes,
        )

    def label(self) -> str:
        if self.op in MARKS:
            return f"{MARKS[self.op]} at {self.where}" if self.where else MARKS[self.op]
        what = self.op.replace("_into_tensor", "").replace("_tensor", "").replace("_", "-")
        if self.peer is not None:
            what += f" {'to' if self.op == 'send' else 'from'} rank {self.peer}"
            if self.microbatch is not None:
                what += f" (stage {self.stage} {self.phase}, microbatch {self.microbatch})"
        if self.module is not None:
            owner = f"`{self.module}`" if self.module else "the root module"
            return f"{what} of {owner}"
        return f"{what} at {self.where}" if self.where else what

    def size_text(self) -> str:
        if self.op in MARKS:
            return "no tensor: fsdpcheck run's mark"
        if self.send:
            size = f"sends {list(self.send)}, expects {list(self.recv)} elements"
        else:
            size = f"{self.numel:,} elements" if self.numel >= 0 else "uneven sizes"
        extra = "".join(
            (
                f", {self.reduce_op}" if self.reduce_op else "",
                f", root rank {self.root}" if self.root is not None else "",
            )
        )
        return f"{size} {self.dtype}{extra} on {self.group} ({len(self.group_ranks)} ranks)"


def disagreement(a: CollectiveCall, a_rank: int, b: CollectiveCall, b_rank: int) -> str:
    """Why ``a`` (issued by ``a_rank``) and ``b`` (by ``b_rank``) cannot be one collective; ``""``
    when they can. Names the first field that differs, in the ranks' terms."""
    if a.op != b.op:
        return f"their ops differ ({a.op} on rank {a_rank}, {b.op} on rank {b_rank})"
    if a.reduce_op != b.reduce_op:
        return (
            f"their reduce ops differ ({a.reduce_op} on rank {a_rank}, {b.reduce_op} on rank "
            f"{b_rank})"
        )
    if a.root != b.root:
        return (
            f"their roots differ (rank {a_rank} names rank {a.root}, rank {b_rank} names rank "
            f"{b.root})"
        )
    if a.send or b.send:
        members = a.group_ranks
        # A rank's split to itself pairs with its own receive (an MoE rank that drops tokens
        # for its own experts after announcing its counts): the other rank's digest sees it,
        # no pair of two ranks does.
        for rank, own in ((a_rank, a), (b_rank, b)):
            if rank in members and len(own.send) == len(own.recv) == len(members):
                i = members.index(rank)
                if own.send[i] != own.recv[i]:
                    return (
                        f"their splits do not pair (rank {rank} sends itself {own.send[i]} "
                        f"elements and expects {own.recv[i]} from itself)"
                    )
        if a_rank in members and b_rank in members and len(a.send) == len(b.recv) == len(members):
            i, j = members.index(a_rank), members.index(b_rank)
            for src, dst, sent, expected in (
                (a_rank, b_rank, a.send[j], b.recv[i]),
                (b_rank, a_rank, b.send[i], a.recv[j]),
            ):
                if sent != expected:
                    return (
                        f"their splits do not pair (rank {src} sends rank {dst} {sent} "
                        f"elements, rank {dst} expects {expected})"
                    )
    if a.key() != b.key():
        if (a.numel, a.sizes) != (b.numel, b.sizes):
            return "their sizes differ"
        if (a.dtype, a.dtypes) != (b.dtype, b.dtypes):
            return f"their dtypes differ ({a.dtype} on rank {a_rank}, {b.dtype} on rank {b_rank})"
        return "they move other tensors"
    if a.dtype != b.dtype:
        return f"their dtypes differ ({a.dtype} on rank {a_rank}, {b.dtype} on rank {b_rank})"
    return ""


@dataclass(frozen=True)
class PeerView:
    """What a rank saw a member of its group doing at the collective where they differed."""

    rank: int
    doing: CollectiveCall | None = None
    state: str = ""  # FINISHED, RAISED or STOPPED when that member issued nothing there


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
    # The group where it stopped (its members; () when agreement ran over the whole world),
    # what this rank saw each other member doing there, and why they could not proceed.
    group_ranks: tuple[int, ...] = ()
    peers: tuple[PeerView, ...] = ()
    reason: str = ""


Side = tuple  # (CollectiveCall | None, state): what one rank was doing where its group stopped


def _what(side: Side) -> tuple:
    doing, state = side
    if doing is None:
        return (state,)
    return doing.key() + (doing.send, doing.recv, doing.peer, doing.phase, doing.microbatch)


def _doing_text(side: Side) -> str:
    doing, state = side
    if doing is not None:
        return f"{doing.label()} ({doing.size_text()})"
    return {
        FINISHED: "had finished its step",
        RAISED: "had raised in its step",
        STOPPED: "had stopped at a divergence on another of its groups",
    }.get(state, "issued nothing")


def divergence_finding(records: Mapping[int, StepRecord]) -> Finding | None:
    """The first group whose members' collectives differ, named; ``None`` when they agreed."""
    found = divergence_findings(records)
    return found[0] if found else None


def divergence_findings(records: Mapping[int, StepRecord]) -> list[Finding]:
    """One finding per group whose members differed at a collective, each naming the group.

    A group's picture joins what each of its stopped members issued there and what each saw the
    others doing; ranks doing the same thing are one side, the side holding the lowest rank (or
    the ranks that had finished) is the reference. Ranks that stopped only because a peer they
    needed had stopped elsewhere add nothing of their own."""
    diverged = {r: rec for r, rec in records.items() if rec.outcome == "diverged"}
    primary = {r: rec for r, rec in diverged.items() if rec.state != STOPPED} or diverged
    views: dict[tuple[int, ...], dict[int, Side]] = {}
    first: dict[tuple[int, ...], StepRecord] = {}
    for rank in sorted(primary):
        rec = primary[rank]
        view = views.setdefault(rec.group_ranks, {})
        first.setdefault(rec.group_ranks, rec)
        view[rank] = (rec.doing, rec.state)
        for peer in rec.peers:
            view.setdefault(peer.rank, (peer.doing, peer.state))
    return [_group_finding(members, views[members], first[members]) for members in views]


def _group_finding(members: tuple[int, ...], view: dict[int, Side], rec: StepRecord) -> Finding:
    at = rec.at
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(view):
        groups.setdefault(_what(view[rank]), []).append(rank)
    # Ranks that had finished are the reference for those that issue one more collective;
    # otherwise the lowest rank's side is.
    ordered = sorted(groups.values(), key=lambda ranks: (view[ranks[0]][1] != FINISHED, ranks[0]))
    reference = ordered[0]
    others = sorted(r for ranks in ordered[1:] for r in ranks)
    sides = [(ranks, view[ranks[0]]) for ranks in ordered]
    issued = [(ranks, side[0]) for ranks, side in sides if side[0] is not None]
    idle = sorted(r for ranks, side in sides if side[0] is None for r in ranks)
    reason = rec.reason or _reason(issued)
    parts = [f"{ranks_label(ranks)} {_doing_text(side)}" for ranks, side in sides]
    name = next((call.group for _, call in issued), "")
    where = f" on {name} ({ranks_label(list(members))})" if members else ""
    summary = f"collective #{at}{where} differs: " + "; ".join(parts)
    summary += f". {_consequence(issued, idle, reason)}"
    tensors = tuple(dict.fromkeys(p for _, call in issued for p in call.params))
    details: dict[str, Any] = {
        "seq": at,
        "group": name,
        "group_ranks": list(members),
        "reason": reason,
        "ranks": {
            ranks_label(ranks): {"doing": _doing_text(side), **_call_details(side)}
            for ranks, side in sides
        },
        "issued_by": sorted(r for ranks, _ in issued for r in ranks),
        "not_issued_by": idle,
        "modules": sorted({call.module for _, call in issued if call.module is not None}),
        "caught": _caught(issued),
    }
    if rec.before:
        details["agreed_before"] = [c.label() for c in rec.before]
    kind, shown = FindingKind.STEP, tensors[:64]
    return Finding.about(kind, others, reference[0], summary, tensors=shown, details=details)


def _caught(issued: Sequence[tuple[list[int], CollectiveCall]]) -> str:
    if any(call.peer is not None for _, call in issued):
        # A send or receive whose peer was itself waiting in the watch is posted ahead of its
        # pair, and confirmed before anyone waits on it.
        return (
            "before any rank waited on it: a send or receive posted ahead of its pair stays posted"
        )
    return "before the collective was issued: no rank issued it"


def _reason(issued: Sequence[tuple[list[int], CollectiveCall]]) -> str:
    for i, (ranks_a, a) in enumerate(issued):
        for ranks_b, b in issued[i + 1 :]:
            why = disagreement(a, ranks_a[0], b, ranks_b[0])
            if why:
                return why
    return ""


def _call_details(side: Side) -> dict[str, Any]:
    call, state = side
    if call is None:
        return {"state": state}
    details = {
        "op": call.op,
        "module": call.module,
        "params": list(call.params[:64]),
        "numel": call.numel,
        "dtype": call.dtype,
        "group": call.group,
        "group_ranks": list(call.group_ranks),
        "where": call.where,
    }
    if call.reduce_op:
        details["reduce_op"] = call.reduce_op
    if call.root is not None:
        details["root"] = call.root
    if len(call.sizes) > 1:
        details["sizes"] = list(call.sizes)
    if call.send or call.recv:
        details["send"], details["recv"] = list(call.send), list(call.recv)
    if call.peer is not None:
        details["peer"], details["tag"] = call.peer, call.tag
    if call.microbatch is not None:
        details["stage"], details["phase"] = call.stage, call.phase
        details["microbatch"] = call.microbatch
    return details


# Measured on torch 2.13 gloo (broadcast, send/recv, all-gather; tests/ranks/
# test_skew_claims.py runs them): a receive buffer larger than what arrives is filled in front
# and the op completes; only a smaller one aborts, so on an all-gather the peer of the rank
# with the larger shard aborts, and that rank most often carries on with a wrong result.
_SKEW = (
    "gloo fills a larger receive buffer in front and carries on silently, and aborts the rank "
    "whose buffer is smaller than what reaches it (`op.preamble.length <= op.nbytes`), "
    "perhaps only in a later collective; NCCL blocks on the count mismatch until its watchdog"
)


def _consequence(
    issued: Sequence[tuple[list[int], CollectiveCall]], idle: Sequence[int], reason: str
) -> str:
    """What the unwatched job would have done there."""
    marks = [(ranks, call) for ranks, call in issued if call.op in MARKS]
    if marks and len(marks) < len(issued):
        at = "; ".join(f"{ranks_label(ranks)} at {call.label()}" for ranks, call in marks)
        return (
            f"the ranks are at different places in the script ({at}; the others still issue "
            "collectives there: an extra micro-batch, a module only they run, or a checkpoint "
            "only they load): unwatched, each waits in its own collective until the timeout"
        )
    if reason.startswith("the pair never comes"):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, the rank waits for it until the "
            "collective timeout"
        )
    if idle:
        waiting = sorted(r for ranks, _ in issued for r in ranks)
        verb = "issues" if len(waiting) == 1 else "issue"
        return (
            f"{ranks_label(waiting)} {verb} more collectives than {ranks_label(idle)} (an extra "
            "micro-batch, or a module only some ranks run): unwatched, "
            f"{ranks_label(waiting)} would wait in it until the collective timeout"
        )
    if reason.startswith("their reduce ops"):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, the reduction runs with each rank's own "
            "op and the tensor ends as a mix of both, silently"
        )
    if reason.startswith("their roots"):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, each root sends and no rank receives "
            "its data, or ranks take another root's tensor; a hang until the collective timeout"
        )
    if reason.startswith("their splits") and "itself" in reason:
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, gloo raises on that rank "
            "(`inLengthPerRank[myRank] == outLengthPerRank[myRank]`) while the others wait in "
            "the all_to_all until the collective timeout; NCCL hangs or corrupts"
        )
    if reason.startswith("their splits"):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, gloo aborts the receiving rank "
            "(`Received data size doesn't match`), NCCL hangs or corrupts"
        )
    if "form a cycle" in reason:
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, every rank of the cycle waits until "
            "the collective timeout"
        )
    if reason.startswith("the sends and receives do not pair"):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, both stages wait until the "
            "collective timeout"
        )
    if reason.startswith("the send does not match"):
        return f"{reason[0].upper()}{reason[1:]}: unwatched, {_SKEW}"
    if reason.startswith(UNNAMED):
        return (
            f"{reason[0].upper()}{reason[1:]}: unwatched, it would have been issued with "
            "whatever differs"
        )
    sizes = {(call.numel, call.sizes) for _, call in issued}
    if len(sizes) > 1:
        return f"their sizes differ (a module only some ranks run?): unwatched, {_SKEW}"
    if reason and not reason.startswith("they move"):
        return f"{reason[0].upper()}{reason[1:]}: unwatched, they pair wrongly"
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
