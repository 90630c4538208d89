"""What each known weight loader would do with these ranks: ok, hang, corrupt, or refuse.

Each loader pairs tensors across ranks its own way. We replay that pairing on
the fingerprints of the reference group and every other usable group. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdpcheck.checks.layout import (
    describe,
    format_shape,
    ranks_label,
    reference_group,
    usable_groups,
)
from fsdpcheck.records import Fingerprint, Group, LoaderPrediction, RankRecord, TensorRecord
from fsdpcheck.vocab import LoaderVerdict

LOADERS: dict[str, str] = {
    "named-buffers-order": "one broadcast per buffer in each rank's own named_buffers() order "
    "(verl before its fix)",
    "state-dict-order": "one broadcast per entry of each rank's own state_dict() order "
    "(accelerate fsdp2_load_full_state_dict)",
    "ddp-sync": "parameters then buffers in local order, coalesced into 250 MiB flat buckets "
    "(DDP _sync_module_states)",
    "dcp-broadcast": "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): "
    "keyed by rank 0's names; non-persistent buffers untouched",
    "sorted-names": "this project's loader: DCP for the state dict, then non-persistent buffers "
    "broadcast in name order after validating names, shapes and dtypes",
}


DDP_BUCKET_BYTES = 250 * 1024 * 1024

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}  # fmt: skip

_HANG = "size mismatch: NCCL blocks until its watchdog, gloo aborts"
_NO_PARTNER = "no partner: NCCL blocks until its watchdog, gloo times out"


def itemsize(dtype: str | None) -> int | None:
    """Bytes per element of a torch dtype name (``float32`` or ``torch.float32``)."""
    if dtype is None:
        return None
    return ITEMSIZE.get(dtype.removeprefix("torch."))


def nbytes(t: TensorRecord | None) -> int | None:
    size = itemsize(t.dtype) if t is not None else None
    return None if size is None else t.numel * size


def predict_loaders(
    groups: Sequence[Group],
    records: Mapping[int, RankRecord],
    meta_ranks: Iterable[int] = (),
) -> list[LoaderPrediction]:
    """One prediction per loader in :data:`LOADERS` order; empty if no group is usable.

    ``records`` needs only each group's representative. Device is not part of the group digest,
    so a rank built on ``meta`` can share a group with a real rank 0: pass such ranks as
    ``meta_ranks`` (or their records) for ``dcp-broadcast`` to see them.
    """
    reference = reference_group(groups, records)
    if reference is None:
        return []
    others = [g for g in usable_groups(groups, records) if g is not reference]
    ref = records[reference.representative]
    pairs = [(g, records[g.representative]) for g in others]
    return [
        _sequential("named-buffers-order", reference, ref, pairs, _buffer_slots, "buffer"),
        _sequential("state-dict-order", reference, ref, pairs, _state_dict_slots, "state-dict"),
        _ddp(reference, ref, pairs),
        _dcp(reference, ref, pairs, records, meta_ranks),
        _sorted_names(reference, ref, pairs),
    ]


# ---------------------------------------------------------------- pairing and aggregation


@dataclass(frozen=True)
class _Issue:
    verdict: str
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


def _worse(current: _Issue | None, new: _Issue | None) -> _Issue | None:
    # Strictly worse only, so the earliest offender of the worst kind is the one named.
    if new is not None and (
        current is None
        or LoaderVerdict(new.verdict).severity > LoaderVerdict(current.verdict).severity
    ):
        return new
    return current


def _aggregate(name: str, results: Sequence[tuple[Sequence[int], _Issue | None]], ok: str):
    """The worst issue over all groups; ``ranks`` are every rank with any issue."""
    worst: _Issue | None = None
    affected: set[int] = set()
    for ranks, issue in results:
        if issue is not None:
            worst = _worse(worst, issue)
            affected.update(ranks)
    if worst is None:
        return LoaderPrediction(name=name, verdict="ok", summary=ok)
    return LoaderPrediction(
        name=name,
        verdict=worst.verdict,
        summary=worst.summary,
        ranks=tuple(sorted(affected)),
        first_issue=worst.first_issue(),
    )


def _views(a: RankRecord, b: RankRecord, prefer: str) -> tuple[Fingerprint, Fingerprint] | None:
    """The fingerprints a loader sees on both sides: the ``prefer`` stage if both have it."""
    order = ("pre_wrap", "post_wrap") if prefer == "pre_wrap" else ("post_wrap", "pre_wrap")
    for attr in order:
        fa, fb = getattr(a, attr), getattr(b, attr)
        if fa is not None and fb is not None:
            return fa, fb
    return None


def _loader_view(record: RankRecord) -> Fingerprint | None:
    return record.post_wrap or record.pre_wrap


def _same(x: TensorRecord, y: TensorRecord) -> bool:
    return (x.name, x.shape, x.dtype) == (y.name, y.shape, y.dtype)


def _who(group: Group) -> str:
    return ranks_label(group.ranks)


def _plural(group: Group, singular: str, plural: str) -> str:
    return f"{_who(group)} {singular if len(group.ranks) == 1 else plural}"


# ---------------------------------------------------------------- broadcast per tensor, local order

Slot = TensorRecord | str  # a bare name where the fingerprint has no record (size unknown)


def _buffer_slots(fp: Fingerprint) -> list[Slot]:
    return list(fp.buffers)


def _state_dict_slots(fp: Fingerprint) -> list[Slot]:
    by_name = {t.name: t for t in (*fp.params, *fp.buffers)}
    return [by_name.get(key, key) for key in _state_dict_keys(fp)]


def _state_dict_keys(fp: Fingerprint) -> tuple[str, ...]:
    if fp.state_dict_keys:
        return fp.state_dict_keys
    # Not recorded: approximate with params then persistent buffers.
    return tuple(t.name for t in fp.params) + tuple(
        t.name for t in fp.buffers if t.persistent is not False
    )


def _name(slot: Slot) -> str:
    return slot if isinstance(slot, str) else slot.name


def _record(slot: Slot | None) -> TensorRecord | None:
    return None if slot is None or isinstance(slot, str) else slot


def _slot_text(slot: Slot) -> str:
    return f"{slot} (size not recorded)" if isinstance(slot, str) else describe(slot)


def _pair(i: int, a: Slot, b: Slot, ref_rank: int, group: Group) -> _Issue | None:
    """One broadcast: the reference sends ``a`` while ``group`` receives into ``b``."""
    ra, rb = _record(a), _record(b)
    if ra is not None and rb is not None and _same(ra, rb):
        return None
    size_a, size_b = nbytes(ra), nbytes(rb)
    verdict = "silent-corruption"
    if size_a is None or size_b is None:
        if _name(a) == _name(b):
            return None  # the same entry on both sides; assume its size matches
        verdict, outcome = "hang", "size unknown, assumed mismatch: the collective blocks"
    elif size_a != size_b:
        verdict, outcome = "hang", _HANG
    elif _name(a) != _name(b):
        outcome = "same byte size, wrong tensor: values land there silently"
    else:
        outcome = "same byte size, different shape or dtype: values reinterpreted silently"
    summary = (
        f"index {i}: rank {ref_rank} sends {_slot_text(a)} while "
        f"{_plural(group, 'receives', 'receive')} into {_slot_text(b)} → {outcome}"
    )
    return _Issue(verdict, i, ra, rb, group.representative, summary)


def _count_issue(a: Sequence[Slot], b: Sequence[Slot], ref_rank: int, group: Group, noun: str):
    i = min(len(a), len(b))
    extra = a[i] if len(a) > len(b) else b[i]
    owner = f"rank {ref_rank}" if len(a) > len(b) else _who(group)
    summary = (
        f"count mismatch: rank {ref_rank} makes {len(a)} {noun} broadcasts, "
        f"{_plural(group, 'makes', 'make')} {len(b)} → broadcast {i} "
        f"({_slot_text(extra)} on {owner}) has {_NO_PARTNER}"
    )
    ra = _record(a[i]) if i < len(a) else None
    rb = _record(b[i]) if i < len(b) else None
    return _Issue("hang", i, ra, rb, group.representative, summary)


def _sequential(
    name: str,
    reference: Group,
    ref: RankRecord,
    pairs: Sequence[tuple[Group, RankRecord]],
    slots: Callable[[Fingerprint], list[Slot]],
    noun: str,
) -> LoaderPrediction:
    results = []
    for group, other in pairs:
        views = _views(ref, other, prefer="post_wrap")
        if views is None:
            continue
        a, b = slots(views[0]), slots(views[1])
        worst: _Issue | None = None
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            worst = _worse(worst, _pair(i, x, y, reference.representative, group))
        if len(a) != len(b):
            worst = _worse(worst, _count_issue(a, b, reference.representative, group, noun))
        results.append((group.ranks, worst))
    view = _loader_view(ref)
    count = len(slots(view)) if view is not None else 0
    return _aggregate(
        name, results, f"all {count} {noun} broadcasts pair the same tensor on every rank"
    )


# ---------------------------------------------------------------- DDP start-up sync


def _ddp_buckets(tensors: Sequence[TensorRecord]) -> list[list[int]]:
    """Indices per bucket, as c10d ``compute_bucket_assignment_by_size`` assigns them.

    One open bucket per dtype; a tensor always joins its dtype's bucket, which closes once it
    reaches the cap; buckets are then ordered by their lowest index.
    """
    closed: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        indices, size = open_.pop(t.dtype, ([], 0))
        indices.append(i)
        size += nbytes(t) or 0
        if size >= DDP_BUCKET_BYTES:
            closed.append(indices)
        else:
            open_[t.dtype] = (indices, size)
    closed.extend(indices for indices, _ in open_.values())
    return sorted(closed, key=min)


def _spans(tensors: Sequence[TensorRecord], bucket: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, index) of each tensor's bytes inside its flat bucket."""
    spans, offset = [], 0
    for i in bucket:
        spans.append((offset, offset + nbytes(tensors[i]), i))
        offset += nbytes(tensors[i])
    return spans


def _ddp_pair(a: Sequence[TensorRecord], b: Sequence[TensorRecord], ref_rank: int, group: Group):
    diverged = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if not _same(x, y)]
    if not diverged and len(a) == len(b):
        return None
    if any(nbytes(t) is None for t in (*a, *b)):
        # A dtype without a known item size: no byte layout to replay, so judge by name only.
        for i in diverged:
            issue = _pair(i, a[i].name, b[i].name, ref_rank, group)
            if issue is not None:
                return issue
        return _count_issue(a, b, ref_rank, group, "tensor") if len(a) != len(b) else None
    buckets_a, buckets_b = _ddp_buckets(a), _ddp_buckets(b)
    for k, (ia, ib) in enumerate(zip(buckets_a, buckets_b, strict=False)):
        spans_a, spans_b = _spans(a, ia), _spans(b, ib)
        if spans_a[-1][1] != spans_b[-1][1]:
            x, y = _first_unlike(a, ia, b, ib)
            ra, rb = (a[x] if x is not None else None), (b[y] if y is not None else None)
            summary = (
                f"bucket {k}: rank {ref_rank} broadcasts {spans_a[-1][1]} bytes, "
                f"{_plural(group, 'broadcasts', 'broadcast')} {spans_b[-1][1]}; first difference: "
                f"{describe(ra)} vs {describe(rb)} → {_HANG}"
            )
            index = x if x is not None else y
            return _Issue("hang", index, ra, rb, group.representative, summary)
        for start, end, i in spans_a:
            if start == end:
                continue  # an empty tensor receives nothing
            lands = next(s for s in spans_b if s[0] <= start < s[1])
            if (lands[0], lands[1]) == (start, end) and _same(a[i], b[lands[2]]):
                continue
            other = b[lands[2]]
            summary = (
                f"bucket {k}: bytes [{start}, {end}) carry {describe(a[i])} from rank {ref_rank} "
                f"but {_plural(group, 'unpacks', 'unpack')} them into {describe(other)} → "
                "values scrambled, no error"
            )
            return _Issue("silent-corruption", i, a[i], other, group.representative, summary)
    k = min(len(buckets_a), len(buckets_b))
    ra = a[buckets_a[k][0]] if k < len(buckets_a) else None
    rb = b[buckets_b[k][0]] if k < len(buckets_b) else None
    summary = (
        f"rank {ref_rank} broadcasts {len(buckets_a)} buckets, {_who(group)} "
        f"{len(buckets_b)} → bucket {k} has {_NO_PARTNER}"
    )
    index = buckets_a[k][0] if k < len(buckets_a) else len(a)
    return _Issue("hang", index, ra, rb, group.representative, summary)


def _first_unlike(a, ia: Sequence[int], b, ib: Sequence[int]) -> tuple[int | None, int | None]:
    """Indices of the first pair of bucket members that differ (None past a bucket's end)."""
    for p in range(max(len(ia), len(ib))):
        x = ia[p] if p < len(ia) else None
        y = ib[p] if p < len(ib) else None
        if x is None or y is None or not _same(a[x], b[y]):
            return x, y
    return ia[0], ib[0]  # same members, so this is unreachable for buckets of unequal size


def _ddp(reference: Group, ref: RankRecord, pairs) -> LoaderPrediction:
    results = []
    for group, other in pairs:
        views = _views(ref, other, prefer="pre_wrap")
        if views is None:
            continue
        a = [*views[0].params, *views[0].buffers]
        b = [*views[1].params, *views[1].buffers]
        results.append((group.ranks, _ddp_pair(a, b, reference.representative, group)))
    ok = "parameters and buffers fill the same flat buckets in the same order on every rank"
    return _aggregate("ddp-sync", results, ok)


# ---------------------------------------------------------------- keyed by name


def _layout(t: TensorRecord) -> str:
    return f"{format_shape(t.shape)} {t.dtype}"


def _dcp_refusal(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group) -> _Issue | None:
    keys_a, keys_b = _state_dict_keys(a), _state_dict_keys(b)
    by_a = {t.name: t for t in (*a.params, *a.buffers)}
    by_b = {t.name: t for t in (*b.params, *b.buffers)}
    missing = [k for k in keys_a if k not in set(keys_b)]
    extra = [k for k in keys_b if k not in set(keys_a)]
    changed = [
        k for k in keys_a if k in by_a and k in by_b and _layout(by_a[k]) != _layout(by_b[k])
    ]
    if missing:
        key, why = missing[0], f"{_plural(group, 'lacks', 'lack')} state-dict key {missing[0]}"
    elif extra:
        key, why = extra[0], f"{_plural(group, 'has', 'have')} extra state-dict key {extra[0]}"
    elif changed:
        key = changed[0]
        why = (
            f"{key} is {_layout(by_a[key])} on rank {ref_rank} but {_layout(by_b[key])} on "
            f"{_who(group)}"
        )
    else:
        return None
    index = keys_a.index(key) if key in keys_a else keys_b.index(key)
    summary = f"{why} → set_model_state_dict raises before loading"
    return _Issue("refused", index, by_a.get(key), by_b.get(key), group.representative, summary)


def _meta_buffer(record: RankRecord | None) -> TensorRecord | None:
    """The first non-persistent buffer this rank built on ``meta`` (pre-wrap), if any."""
    fp = record.pre_wrap if record is not None else None
    if fp is None:
        return None
    return next((t for t in fp.buffers if t.persistent is False and t.device == "meta"), None)


def _meta_hits(group: Group, records: Mapping[int, RankRecord], meta_ranks: set[int]):
    if _meta_buffer(records[group.representative]) is not None:
        return list(group.ranks)  # grouped ranks were built like their representative
    return [r for r in group.ranks if r in meta_ranks or _meta_buffer(records.get(r)) is not None]


def _dcp(reference: Group, ref: RankRecord, pairs, records, meta_ranks) -> LoaderPrediction:
    results: list[tuple[Sequence[int], _Issue | None]] = []
    for group, other in pairs:
        views = _views(ref, other, prefer="post_wrap")
        if views is not None:
            results.append((group.ranks, _dcp_refusal(*views, reference.representative, group)))

    # Not in the state dict, so DCP leaves these as built: garbage where built on meta.
    view = _loader_view(ref)
    volatile = [t for t in view.buffers if t.persistent is False] if view else []
    for group in [reference, *(g for g, _ in pairs)] if volatile else []:
        hits = _meta_hits(group, records, set(meta_ranks))
        if not hits:
            continue
        found = [_meta_buffer(records.get(r)) for r in hits]
        buffer = next((t for t in found if t is not None), volatile[0])
        index = next((i for i, t in enumerate(view.buffers) if t.name == buffer.name), 0)
        summary = (
            f"non-persistent buffer {describe(buffer)} is not in the state dict and "
            f"{ranks_label(hits)} built it on meta → after to_empty() it holds uninitialised "
            "memory"
        )
        results.append((hits, _Issue("uninitialized", index, buffer, buffer, hits[0], summary)))
    if volatile:
        tail = f"its {len(volatile)} non-persistent buffers were built for real on every rank"
    else:
        tail = "the model has no non-persistent buffers"
    ok = f"keyed by rank 0's state-dict names, so order does not matter; {tail}"
    return _aggregate("dcp-broadcast", results, ok)


def _first_name_difference(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group):
    """(index, reference, other, what) for the first mismatch by sorted name, or None."""
    mine, theirs = f"rank {ref_rank}", _who(group)
    for kind, xs, ys in (("buffer", a.buffers, b.buffers), ("parameter", a.params, b.params)):
        left, right = {t.name: t for t in xs}, {t.name: t for t in ys}
        for i, name in enumerate(sorted(left.keys() | right.keys())):
            x, y = left.get(name), right.get(name)
            if x is None or y is None:
                where = mine if y is None else theirs
                what = f"{kind} {describe(x or y)} exists only on {where}"
            elif _layout(x) != _layout(y):
                what = f"{kind} {name} is {_layout(x)} on {mine} but {_layout(y)} on {theirs}"
            elif x.persistent != y.persistent:
                what = (
                    f"{kind} {name} is {_persistence(x)} on {mine} but {_persistence(y)} on "
                    f"{theirs}"
                )
            else:
                continue
            return i, x, y, what
    return None


def _persistence(t: TensorRecord) -> str:
    return {True: "persistent", False: "non-persistent"}.get(t.persistent, "of unknown persistence")


def _sorted_names(reference: Group, ref: RankRecord, pairs) -> LoaderPrediction:
    results = []
    for group, other in pairs:
        views = _views(ref, other, prefer="post_wrap")
        if views is None:
            continue
        found = _first_name_difference(*views, reference.representative, group)
        issue = None
        if found is not None:
            index, x, y, what = found
            summary = f"{what} → the loader stops with a clear error before any broadcast"
            issue = _Issue("refused", index, x, y, group.representative, summary)
        results.append((group.ranks, issue))
    ok = "names, shapes and dtypes agree on every rank; buffers broadcast in name order"
    return _aggregate("sorted-names", results, ok)
