"""The walk every loader model shares: the reference against each other group, the issues one
broadcast (or one refusal) causes, and the worst of them as the loader's prediction.

Each loader pairs tensors across ranks its own way (its own module); what a pairing does to one
broadcast, and how issues add up to a verdict, is the same for all of them. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdpcheck.checks.layout import describe, format_shape
from fsdpcheck.checks.predict.sizes import sizes
from fsdpcheck.records import Fingerprint, Group, LoaderPrediction, RankRecord, TensorRecord
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Backend, Loader, LoaderVerdict, Snapshot

# What a broadcast of a message into a buffer of another size does, per backend (measured on
# torch 2.13 gloo; NCCL from its count check): a smaller buffer aborts gloo's receiver, a larger
# one gloo fills in front and carries on; NCCL blocks on any count mismatch.
HANG = (
    "smaller receiving buffer: gloo aborts the receiving rank (op.preamble.length <= "
    "op.nbytes), NCCL blocks until its watchdog"
)
LARGER_ON_NCCL = (
    "larger receiving buffer: NCCL blocks on the count mismatch until its watchdog (gloo fills "
    "its first bytes and carries on)"
)
LARGER_ON_GLOO = (
    "larger receiving buffer: gloo fills its first bytes, the rest keep old values, no error "
    "(NCCL blocks on the count mismatch)"
)
NO_PARTNER = "no partner: NCCL blocks until its watchdog, gloo times out"


@dataclass(frozen=True)
class Context:
    """What every loader model reads: the reference group, every other group, the backend."""

    reference: Group
    ref: RankRecord
    pairs: Sequence[tuple[Group, RankRecord]]
    backend: str
    records: Mapping[int, RankRecord]  # every record at hand, not only representatives'
    meta_ranks: frozenset[int] = frozenset()  # ranks built on meta (dcp-broadcast)

    @property
    def ref_rank(self) -> int:
        return self.reference.representative

    def compared(self, prefer: Snapshot) -> Iterator[tuple[Group, Fingerprint, Fingerprint]]:
        """Every other group with the reference's and its fingerprints (``prefer``'s stage where
        both have it); groups without a fingerprint to compare are left out."""
        for group, other in self.pairs:
            views = _views(self.ref, other, prefer=prefer)
            if views is not None:
                yield group, *views

    def issues(
        self,
        prefer: Snapshot,
        judge: Callable[[Context, Group, Fingerprint, Fingerprint], Issue | None],
    ) -> list[tuple[Sequence[int], Issue | None]]:
        """(ranks, ``judge``'s first issue or None) for every group :meth:`compared` yields:
        what :func:`aggregate` takes."""
        return [(group.ranks, judge(self, group, a, b)) for group, a, b in self.compared(prefer)]


# ---------------------------------------------------------------- issues and their aggregate


@dataclass(frozen=True)
class Issue:
    verdict: LoaderVerdict
    index: int
    reference: TensorRecord | None
    other: TensorRecord | None
    rank: int
    summary: str

    def first_issue(self) -> dict[str, Any]:
        a, b = self.reference, self.other
        return {
            "index": self.index,
            "reference_name": a.name if a else None,
            "other_name": b.name if b else None,
            # Lists, not tuples: equal after a JSON round trip.
            "reference_shape": list(a.shape) if a else None,
            "other_shape": list(b.shape) if b else None,
            "reference_dtype": a.dtype if a else None,
            "other_dtype": b.dtype if b else None,
            "rank": self.rank,
        }


def worse(current: Issue | None, new: Issue | None) -> Issue | None:
    # Strictly worse only, so the earliest offender of the worst kind is the one named.
    if new is not None and (
        current is None
        or LoaderVerdict(new.verdict).severity > LoaderVerdict(current.verdict).severity
    ):
        return new
    return current


def stops(issue: Issue | None) -> bool:
    """A hang or a refusal ends a loader's walk: nothing after it runs."""
    return issue is not None and issue.verdict in (LoaderVerdict.HANG, LoaderVerdict.REFUSED)


def aggregate(name: Loader, results: Sequence[tuple[Sequence[int], Issue | None]], ok: str):
    """The worst issue over all groups; ``ranks`` are every rank with any issue."""
    worst: Issue | None = None
    affected: set[int] = set()
    for ranks, issue in results:
        if issue is not None:
            worst = worse(worst, issue)
            affected.update(ranks)
    if worst is None:
        return LoaderPrediction(name=name, verdict=LoaderVerdict.OK, summary=ok)
    return LoaderPrediction(
        name=name,
        verdict=worst.verdict,
        summary=worst.summary,
        ranks=tuple(sorted(affected)),
        first_issue=worst.first_issue(),
    )


# ---------------------------------------------------------------- what a loader sees


def _fingerprint(record: RankRecord, stage: Snapshot) -> Fingerprint | None:
    return record.pre_wrap if stage == Snapshot.PRE_WRAP else record.post_wrap


def _views(
    a: RankRecord, b: RankRecord, prefer: Snapshot
) -> tuple[Fingerprint, Fingerprint] | None:
    """The fingerprints a loader sees on both sides: the ``prefer`` stage if both have it."""
    stages = (Snapshot.PRE_WRAP, Snapshot.POST_WRAP)
    for stage in stages if prefer == Snapshot.PRE_WRAP else reversed(stages):
        fa, fb = _fingerprint(a, stage), _fingerprint(b, stage)
        if fa is not None and fb is not None:
            return fa, fb
    return None


def loader_view(record: RankRecord) -> Fingerprint | None:
    return record.post_wrap or record.pre_wrap


def same(x: TensorRecord, y: TensorRecord) -> bool:
    return (x.name, x.shape, x.dtype) == (y.name, y.shape, y.dtype)


def who(group: Group) -> str:
    return ranks_label(group.ranks)


def plural(group: Group, singular: str, plural: str) -> str:
    return f"{who(group)} {singular if len(group.ranks) == 1 else plural}"


def layout_text(t: TensorRecord) -> str:
    return f"{format_shape(t.shape)} {t.dtype}"


def canonical(fp: Fingerprint) -> Callable[[str], str]:
    """Maps a tied parameter's every name to the one ``named_parameters()`` keeps."""
    table = dict(fp.aliases)
    return lambda name: table.get(name, name)


def with_aliases(fp: Fingerprint) -> list[TensorRecord]:
    """Parameters under every name they have: a tied weight once per name (state-dict view)."""
    by_name = {t.name: t for t in fp.params}
    extra = [replace(by_name[owner], name=alias) for alias, owner in fp.aliases if owner in by_name]
    return [*fp.params, *extra]


def keys_of(fp: Fingerprint) -> tuple[str, ...]:
    """The state dict's keys, in order."""
    if fp.state_dict_keys:
        return fp.state_dict_keys
    # Not recorded: approximate with params then persistent buffers.
    return tuple(t.name for t in fp.params) + tuple(
        t.name for t in fp.buffers if t.persistent is not False
    )


# ---------------------------------------------------------------- broadcast per tensor, local order

Slot = TensorRecord | str  # a bare name where the fingerprint has no record (size unknown)


def slot_name(slot: Slot) -> str:
    return slot if isinstance(slot, str) else slot.name


def tensor_of(slot: Slot | None) -> TensorRecord | None:
    return None if slot is None or isinstance(slot, str) else slot


def slot_text(slot: Slot) -> str:
    return f"{slot} (size not recorded)" if isinstance(slot, str) else describe(slot)


def broadcast(
    i: int, a: Slot, b: Slot, ctx: Context, group: Group, same_tensor: Callable[[str], str]
) -> Issue | None:
    """One broadcast: the reference sends ``a`` while ``group`` receives into ``b``."""
    ra, rb = tensor_of(a), tensor_of(b)
    if ra is not None and rb is not None and same(ra, rb):
        return None
    if ra is not None and rb is not None and (ra.shape, ra.dtype) == (rb.shape, rb.dtype):
        if same_tensor(ra.name) == same_tensor(rb.name):
            return None  # two names of one tied weight on the sender: the right values land
    size_a, size_b = sizes(ra, rb)
    verdict = LoaderVerdict.SILENT_CORRUPTION
    if size_a is None or size_b is None:
        if slot_name(a) == slot_name(b) and (ra is None or rb is None):
            return None  # the same entry on both sides; nothing recorded says otherwise
        verdict = LoaderVerdict.HANG
        outcome = "size unknown, assumed mismatch: the collective blocks"
    elif size_a > size_b:
        verdict, outcome = LoaderVerdict.HANG, HANG
    elif size_a < size_b and ctx.backend == Backend.NCCL:
        verdict, outcome = LoaderVerdict.HANG, LARGER_ON_NCCL
    elif size_a < size_b:
        outcome = LARGER_ON_GLOO
    elif slot_name(a) != slot_name(b):
        outcome = "same byte size, wrong tensor: values land there silently"
    else:
        outcome = "same byte size, different shape or dtype: values reinterpreted silently"
    summary = (
        f"index {i}: rank {ctx.ref_rank} sends {slot_text(a)} while "
        f"{plural(group, 'receives', 'receive')} into {slot_text(b)} → {outcome}"
    )
    return Issue(verdict, i, ra, rb, group.representative, summary)


def _count_issue(a: Sequence[Slot], b: Sequence[Slot], ref_rank: int, group: Group, noun: str):
    i = min(len(a), len(b))
    extra = a[i] if len(a) > len(b) else b[i]
    owner = f"rank {ref_rank}" if len(a) > len(b) else who(group)
    summary = (
        f"count mismatch: rank {ref_rank} makes {len(a)} {noun} broadcasts, "
        f"{plural(group, 'makes', 'make')} {len(b)} → broadcast {i} "
        f"({slot_text(extra)} on {owner}) has {NO_PARTNER}"
    )
    ra = tensor_of(a[i]) if i < len(a) else None
    rb = tensor_of(b[i]) if i < len(b) else None
    return Issue(LoaderVerdict.HANG, i, ra, rb, group.representative, summary)


def walk(
    a: Sequence[Slot],
    b: Sequence[Slot],
    ctx: Context,
    group: Group,
    same_tensor: Callable[[str], str],
    noun: str,
    refuse: Callable[[int, Slot, Slot], Issue | None] | None = None,
) -> Issue | None:
    """Broadcast ``a[i]`` into ``b[i]`` in turn until a hang or refusal ends it; the worst."""
    worst: Issue | None = None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        issue = refuse(i, x, y) if refuse is not None else None
        issue = issue or broadcast(i, x, y, ctx, group, same_tensor)
        worst = worse(worst, issue)
        if stops(issue):
            return worst
    if len(a) != len(b):
        n = min(len(a), len(b))
        extra = a[n] if len(a) > len(b) else b[n]
        issue = refuse(n, extra, extra) if refuse is not None else None
        worst = worse(worst, issue or _count_issue(a, b, ctx.ref_rank, group, noun))
    return worst


def kept_buffer_values(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group):
    """Buffers each rank keeps (accelerate; DCP, which leaves them alone): a recorded value that
    differs from rank 0's stays different. Digests come from materialised ranks only; ``None``
    (meta) is unknown and not judged here. Values are not in a group's digest, so only ranks
    that differ in layout too (or a value-aware gather) get compared."""
    theirs = {t.name: t for t in b.buffers if t.persistent is False}
    for i, x in enumerate(t for t in a.buffers if t.persistent is False):
        y = theirs.get(x.name)
        if y is None or x.digest is None or y.digest is None or x.digest == y.digest:
            continue
        summary = (
            f"non-persistent buffer {x.name} is kept per rank, and "
            f"{plural(group, 'holds', 'hold')} other values than rank {ref_rank} → the ranks "
            "train with different buffers"
        )
        return Issue(LoaderVerdict.SILENT_CORRUPTION, i, x, y, group.representative, summary)
    return None
