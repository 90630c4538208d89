"""What each known weight loader would do with these ranks: ok, hang, corrupt, or refuse.

Each loader pairs tensors across ranks its own way. We replay that pairing on
the fingerprints of the reference group and every other usable group. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdpcheck.checks.layout import (
    describe,
    format_shape,
    ranks_label,
    reference_group,
    usable_groups,
)
from fsdpcheck.records import (
    EnvRecord,
    Fingerprint,
    Group,
    LoaderPrediction,
    RankRecord,
    TensorRecord,
)
from fsdpcheck.vocab import LoaderVerdict

LOADERS: dict[str, str] = {
    "named-buffers-order": "DCP for the state dict, then one broadcast per buffer in each rank's "
    "own named_buffers() order",
    "state-dict-order": "one broadcast per entry of each rank's own state_dict() order; "
    "non-persistent buffers kept per rank, never broadcast",
    "ddp-sync": "parameter shapes checked across ranks, then parameters and buffers in local "
    "order, coalesced into 250 MiB flat buckets",
    "dcp-broadcast": "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): "
    "keyed by rank 0's names; non-persistent buffers untouched",
    "sorted-names": "checks names, shapes and dtypes on every rank first, then DCP or "
    "rank 0's shards for the state dict and non-persistent buffers broadcast in name order",
}

# Who runs each algorithm: what a user reads to find their own row.
PRODUCTS: dict[str, str] = {
    "named-buffers-order": "verl before PR #6405 (fsdp2_load_full_state_dict); lmms-engine, "
    "SkyRL and other trainers that broadcast named_buffers() in order after their state-dict load",
    "state-dict-order": "accelerate 1.7 to 1.15 (fsdp2_prepare_model with "
    "cpu_ram_efficient_loading: fsdp2_load_full_state_dict, then each rank's own non-persistent "
    "buffers put back); from 1.14 (PR #3982) rank 0 looks its keys up in the full state dict "
    "by name, before that by position: the same here, since the full state dict is rank 0's "
    "own state_dict()",
    "ddp-sync": "torch DistributedDataParallel(module) (its constructor's start-up sync)",
    "dcp-broadcast": "torch.distributed.checkpoint.state_dict.set_model_state_dict, as "
    "torchtitan, verl (its first step) and others call it",
    "sorted-names": "fsdpcheck's load_full_state_dict; verl since PR #6405 broadcasts buffers "
    "in the same sorted order but without checking names, shapes and dtypes first",
}

BACKENDS = ("nccl", "gloo")

DDP_BUCKET_BYTES = 250 * 1024 * 1024

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits16": 2,
    "qint8": 1, "quint8": 1, "quint4x2": 1, "quint2x4": 1, "qint32": 4,
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
    backend: str = "nccl",
) -> list[LoaderPrediction]:
    """One prediction per loader in :data:`LOADERS` order; empty if no group is usable.

    ``records`` needs only each group's representative. Device is not part of the group digest,
    so a rank built on ``meta`` can share a group with a real rank 0: pass such ranks as
    ``meta_ranks`` (or their records) for ``dcp-broadcast`` to see them. ``backend`` decides
    what a broadcast into a larger buffer does: NCCL blocks (``hang``); gloo fills the first bytes
    and leaves the rest (``silent-corruption``); a larger message than the buffer aborts gloo.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
    reference = reference_group(groups, records)
    if reference is None:
        return []
    others = [g for g in usable_groups(groups, records) if g is not reference]
    ref = records[reference.representative]
    pairs = [(g, records[g.representative]) for g in others]
    ctx = _Context(reference, ref, pairs, backend)
    predictions = _predict(ctx, records, meta_ranks)
    if backend == "nccl":  # --reproduce runs on gloo: keep its verdict where it differs
        on_gloo = _predict(replace(ctx, backend="gloo"), records, meta_ranks)
        predictions = [
            replace(p, on_gloo=g.verdict) if g.verdict != p.verdict else p
            for p, g in zip(predictions, on_gloo, strict=True)
        ]
    return [replace(p, products=products(p.name, ref.env)) for p in predictions]


def _predict(ctx: _Context, records, meta_ranks) -> list[LoaderPrediction]:
    return [
        _named_buffers(ctx),
        _state_dict_order(ctx),
        _ddp(ctx),
        _dcp(ctx, records, meta_ranks),
        _sorted_names(ctx),
    ]


def products(name: str, env: EnvRecord | None = None) -> str:
    """Who runs loader ``name``, with the versions installed on the reference rank."""
    text = PRODUCTS.get(name, "")
    if env is None:
        return text
    if name == "state-dict-order":
        installed = env.accelerate
        if installed is None:
            return f"{text}; accelerate is not installed here"
        if _version(installed) < (1, 7):
            return f"{text}; installed accelerate {installed} predates it (not modelled)"
        return f"{text}; installed: accelerate {installed}"
    if name in ("ddp-sync", "dcp-broadcast"):
        return f"{text}; installed: torch {env.torch}"
    return text


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@dataclass(frozen=True)
class _Context:
    reference: Group
    ref: RankRecord
    pairs: Sequence[tuple[Group, RankRecord]]
    backend: str

    @property
    def ref_rank(self) -> int:
        return self.reference.representative

    def compared(self, prefer: str) -> Iterator[tuple[Group, Fingerprint, Fingerprint]]:
        """Every other group with the reference's and its fingerprints (``prefer``'s stage where
        both have it); groups without a fingerprint to compare are left out."""
        for group, other in self.pairs:
            views = _views(self.ref, other, prefer=prefer)
            if views is not None:
                yield group, *views


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


def _stops(issue: _Issue | None) -> bool:
    """A hang or a refusal ends a loader's walk: nothing after it runs."""
    return issue is not None and issue.verdict in ("hang", "refused")


def _aggregate(name: str, results: Sequence[tuple[Sequence[int], _Issue | None]], ok: str):
    """The worst issue over all groups; ``ranks`` are every rank with any issue."""
    worst: _Issue | None = None
    affected: set[int] = set()
    for ranks, issue in results:
        if issue is not None:
            worst = _worse(worst, issue)
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


def _canonical(fp: Fingerprint) -> Callable[[str], str]:
    """Maps a tied parameter's every name to the one ``named_parameters()`` keeps."""
    table = dict(fp.aliases)
    return lambda name: table.get(name, name)


def _with_aliases(fp: Fingerprint) -> list[TensorRecord]:
    """Parameters under every name they have: a tied weight once per name (state-dict view)."""
    by_name = {t.name: t for t in fp.params}
    extra = [replace(by_name[owner], name=alias) for alias, owner in fp.aliases if owner in by_name]
    return [*fp.params, *extra]


# ---------------------------------------------------------------- broadcast per tensor, local order

Slot = TensorRecord | str  # a bare name where the fingerprint has no record (size unknown)


def _buffer_slots(fp: Fingerprint) -> list[Slot]:
    return list(fp.buffers)


def _state_dict_slots(fp: Fingerprint) -> list[Slot]:
    by_name = {t.name: t for t in (*_with_aliases(fp), *fp.buffers)}
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


def _sizes(a: TensorRecord | None, b: TensorRecord | None) -> tuple[int | None, int | None]:
    """Bytes of both sides; for a dtype missing from :data:`ITEMSIZE` on both sides alike,
    element counts stand in (same dtype: bytes are proportional to elements)."""
    size_a, size_b = nbytes(a), nbytes(b)
    if (size_a is None or size_b is None) and a is not None and b is not None:
        if a.dtype == b.dtype:
            return a.numel, b.numel
    return size_a, size_b


def _pair(
    i: int, a: Slot, b: Slot, ctx: _Context, group: Group, same_tensor: Callable[[str], str]
) -> _Issue | None:
    """One broadcast: the reference sends ``a`` while ``group`` receives into ``b``."""
    ra, rb = _record(a), _record(b)
    if ra is not None and rb is not None and _same(ra, rb):
        return None
    if ra is not None and rb is not None and (ra.shape, ra.dtype) == (rb.shape, rb.dtype):
        if same_tensor(ra.name) == same_tensor(rb.name):
            return None  # two names of one tied weight on the sender: the right values land
    size_a, size_b = _sizes(ra, rb)
    verdict = "silent-corruption"
    if size_a is None or size_b is None:
        if _name(a) == _name(b) and (ra is None or rb is None):
            return None  # the same entry on both sides; nothing recorded says otherwise
        verdict, outcome = "hang", "size unknown, assumed mismatch: the collective blocks"
    elif size_a > size_b:
        verdict, outcome = "hang", _HANG
    elif size_a < size_b and ctx.backend == "nccl":
        verdict, outcome = "hang", _HANG
    elif size_a < size_b:
        outcome = "larger receiving buffer: gloo fills its first bytes, the rest keep old values"
    elif _name(a) != _name(b):
        outcome = "same byte size, wrong tensor: values land there silently"
    else:
        outcome = "same byte size, different shape or dtype: values reinterpreted silently"
    summary = (
        f"index {i}: rank {ctx.ref_rank} sends {_slot_text(a)} while "
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


def _walk(
    a: Sequence[Slot],
    b: Sequence[Slot],
    ctx: _Context,
    group: Group,
    same_tensor: Callable[[str], str],
    noun: str,
    refuse: Callable[[int, Slot, Slot], _Issue | None] | None = None,
) -> _Issue | None:
    """Broadcast ``a[i]`` into ``b[i]`` in turn until a hang or refusal ends it; the worst."""
    worst: _Issue | None = None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        issue = refuse(i, x, y) if refuse is not None else None
        issue = issue or _pair(i, x, y, ctx, group, same_tensor)
        worst = _worse(worst, issue)
        if _stops(issue):
            return worst
    if len(a) != len(b):
        n = min(len(a), len(b))
        extra = a[n] if len(a) > len(b) else b[n]
        issue = refuse(n, extra, extra) if refuse is not None else None
        worst = _worse(worst, issue or _count_issue(a, b, ctx.ref_rank, group, noun))
    return worst


def _named_buffers(ctx: _Context) -> LoaderPrediction:
    """DCP first (its refusals end the load on the ranks that differ), then the buffer loop."""
    results = []
    for group, ref_fp, other_fp in ctx.compared("post_wrap"):
        issue = _dcp_refusal(ref_fp, other_fp, ctx.ref_rank, group)
        if issue is None:
            a, b = _buffer_slots(ref_fp), _buffer_slots(other_fp)
            issue = _walk(a, b, ctx, group, _canonical(ref_fp), "buffer")
        results.append((group.ranks, issue))
    view = _loader_view(ctx.ref)
    count = len(_buffer_slots(view)) if view is not None else 0
    ok = f"the state dict by name, then all {count} buffer broadcasts pair the same tensor"
    return _aggregate("named-buffers-order", results, ok)


def _state_dict_order(ctx: _Context) -> LoaderPrediction:
    """accelerate: every state-dict entry in local order, each rank's own buffers kept."""
    results = []
    for group, ref_fp, other_fp in ctx.compared("post_wrap"):
        a, b = _state_dict_slots(ref_fp), _state_dict_slots(other_fp)

        def refuse(i: int, x: Slot, y: Slot, group: Group = group) -> _Issue | None:
            # Every entry needs a device_mesh: a persistent buffer (a plain tensor) raises.
            for side, slot in (("reference", x), ("other", y)):
                t = _record(slot)
                if t is not None and t.persistent is not None:
                    where = f"rank {ctx.ref_rank}" if side == "reference" else _who(group)
                    summary = (
                        f"index {i}: {describe(t)} is a persistent buffer on {where}, a plain "
                        "tensor with no device_mesh → fsdp2_load_full_state_dict raises "
                        "AttributeError"
                    )
                    ra, rb = _record(x), _record(y)
                    return _Issue("refused", i, ra, rb, group.representative, summary)
            return None

        issue = _walk(a, b, ctx, group, _canonical(ref_fp), "state-dict", refuse)
        if not _stops(issue):
            issue = _worse(issue, _kept_buffer_values(ref_fp, other_fp, ctx.ref_rank, group))
        results.append((group.ranks, issue))
    view = _loader_view(ctx.ref)
    count = len(_state_dict_slots(view)) if view is not None else 0
    ok = (
        f"all {count} state-dict broadcasts pair the same tensor; non-persistent buffers keep "
        "each rank's own values, which agree wherever they were recorded"
    )
    return _aggregate("state-dict-order", results, ok)


def _kept_buffer_values(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group):
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
            f"{_plural(group, 'holds', 'hold')} other values than rank {ref_rank} → the ranks "
            "train with different buffers"
        )
        return _Issue("silent-corruption", i, x, y, group.representative, summary)
    return None


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


def _ddp_shape_check(pa, pb, ref_rank: int, group: Group) -> _Issue | None:
    """DDP's constructor compares parameter counts (raising on every rank) and then each
    parameter's sizes by position (raising on the ranks that differ) before any broadcast."""
    if len(pa) != len(pb):
        summary = (
            f"rank {ref_rank} has {len(pa)} parameters, {_plural(group, 'has', 'have')} "
            f"{len(pb)} → DDP raises 'DDP expects same model across all ranks' before any broadcast"
        )
        n = min(len(pa), len(pb))
        x = pa[n] if n < len(pa) else None
        y = pb[n] if n < len(pb) else None
        return _Issue("refused", n, x, y, group.representative, summary)
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        if x.shape != y.shape:
            summary = (
                f"params[{i}]: {describe(x)} on rank {ref_rank}, {describe(y)} on {_who(group)} "
                "→ DDP raises 'appears not to match sizes of the same param in process 0' on "
                f"{_who(group)} before any broadcast"
            )
            return _Issue("refused", i, x, y, group.representative, summary)
    return None


def _ddp_pair(
    a: Sequence[TensorRecord],
    b: Sequence[TensorRecord],
    ctx: _Context,
    group: Group,
    same_tensor: Callable[[str], str],
) -> _Issue | None:
    """The worst thing DDP's bucketed broadcast does, over every bucket it sends."""
    ref_rank = ctx.ref_rank

    def alike(x: TensorRecord, y: TensorRecord) -> bool:
        return _same(x, y) or (
            (x.shape, x.dtype) == (y.shape, y.dtype) and same_tensor(x.name) == same_tensor(y.name)
        )

    diverged = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if not alike(x, y)]
    if not diverged and len(a) == len(b):
        return None
    if any(nbytes(t) is None for t in (*a, *b)):
        # A dtype without a known item size: no byte layout to replay, so pair one by one.
        return _walk(a, b, ctx, group, same_tensor, "tensor")
    buckets_a, buckets_b = _ddp_buckets(a), _ddp_buckets(b)
    worst: _Issue | None = None
    for k, (ia, ib) in enumerate(zip(buckets_a, buckets_b, strict=False)):
        spans_a, spans_b = _spans(a, ia), _spans(b, ib)
        sent, room = spans_a[-1][1], spans_b[-1][1]
        if sent > room or (sent < room and ctx.backend == "nccl"):
            x, y = _first_unlike(a, ia, b, ib)
            ra, rb = (a[x] if x is not None else None), (b[y] if y is not None else None)
            summary = (
                f"bucket {k}: rank {ref_rank} broadcasts {sent} bytes, "
                f"{_plural(group, 'receives', 'receive')} into {room}; first difference: "
                f"{describe(ra)} vs {describe(rb)} → {_HANG}"
            )
            index = x if x is not None else y
            return _worse(worst, _Issue("hang", index, ra, rb, group.representative, summary))
        # gloo with room to spare fills the first `sent` bytes: tensors past them keep theirs.
        for start, end, i in spans_a:
            if start == end:
                continue  # an empty tensor receives nothing
            lands = next(s for s in spans_b if s[0] <= start < s[1])
            if (lands[0], lands[1]) == (start, end) and alike(a[i], b[lands[2]]):
                continue
            other = b[lands[2]]
            summary = (
                f"bucket {k}: bytes [{start}, {end}) carry {describe(a[i])} from rank {ref_rank} "
                f"but {_plural(group, 'unpacks', 'unpack')} them into {describe(other)} → "
                "values scrambled, no error"
            )
            issue = _Issue("silent-corruption", i, a[i], other, group.representative, summary)
            worst = _worse(worst, issue)
            break
    if len(buckets_a) == len(buckets_b):
        return worst
    k = min(len(buckets_a), len(buckets_b))
    ra = a[buckets_a[k][0]] if k < len(buckets_a) else None
    rb = b[buckets_b[k][0]] if k < len(buckets_b) else None
    summary = (
        f"rank {ref_rank} broadcasts {len(buckets_a)} buckets, {_who(group)} "
        f"{len(buckets_b)} → bucket {k} has {_NO_PARTNER}"
    )
    index = buckets_a[k][0] if k < len(buckets_a) else len(a)
    return _worse(worst, _Issue("hang", index, ra, rb, group.representative, summary))


def _first_unlike(a, ia: Sequence[int], b, ib: Sequence[int]) -> tuple[int | None, int | None]:
    """Indices of the first pair of bucket members that differ (None past a bucket's end)."""
    for p in range(max(len(ia), len(ib))):
        x = ia[p] if p < len(ia) else None
        y = ib[p] if p < len(ib) else None
        if x is None or y is None or not _same(a[x], b[y]):
            return x, y
    return ia[0], ib[0]  # same members, so this is unreachable for buckets of unequal size


def _ddp(ctx: _Context) -> LoaderPrediction:
    results = []
    for group, ref_fp, other_fp in ctx.compared("pre_wrap"):
        issue = _ddp_shape_check(ref_fp.params, other_fp.params, ctx.ref_rank, group)
        if issue is None:
            a = [*ref_fp.params, *ref_fp.buffers]
            b = [*other_fp.params, *other_fp.buffers]
            issue = _ddp_pair(a, b, ctx, group, _canonical(ref_fp))
        results.append((group.ranks, issue))
    ok = "parameters and buffers fill the same flat buckets in the same order on every rank"
    return _aggregate("ddp-sync", results, ok)


# ---------------------------------------------------------------- keyed by name


def _layout(t: TensorRecord) -> str:
    return f"{format_shape(t.shape)} {t.dtype}"


def _dcp_refusal(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group) -> _Issue | None:
    """DCP follows rank 0's keys: a key the other ranks lack is skipped there, a dtype is
    converted; an extra key or an incompatible shape raises, on the ranks that have it."""
    keys_a, keys_b = _state_dict_keys(a), _state_dict_keys(b)
    by_a = {t.name: t for t in (*_with_aliases(a), *a.buffers)}
    by_b = {t.name: t for t in (*_with_aliases(b), *b.buffers)}
    extra = [k for k in keys_b if k not in set(keys_a)]
    reshaped = [k for k in keys_a if k in by_a and k in by_b and by_a[k].shape != by_b[k].shape]
    if extra:
        key, why = extra[0], f"{_plural(group, 'has', 'have')} extra state-dict key {extra[0]}"
    elif reshaped:
        key = reshaped[0]
        why = (
            f"{key} is {_layout(by_a[key])} on rank {ref_rank} but {_layout(by_b[key])} on "
            f"{_who(group)}"
        )
    else:
        return None
    index = keys_a.index(key) if key in keys_a else keys_b.index(key)
    summary = f"{why} → set_model_state_dict raises on {_who(group)}"
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


def _dcp(ctx: _Context, records, meta_ranks) -> LoaderPrediction:
    reference = ctx.reference
    results: list[tuple[Sequence[int], _Issue | None]] = []
    for group, ref_fp, other_fp in ctx.compared("post_wrap"):
        results.append((group.ranks, _dcp_refusal(ref_fp, other_fp, ctx.ref_rank, group)))
    if any(_stops(issue) for _, issue in results):
        return _aggregate("dcp-broadcast", results, "")
    for group, ref_fp, other_fp in ctx.compared("post_wrap"):  # untouched: a rank keeps its own
        results.append((group.ranks, _kept_buffer_values(ref_fp, other_fp, ctx.ref_rank, group)))

    # Not in the state dict, so DCP leaves these as built: garbage where built on meta.
    view = _loader_view(ctx.ref)
    volatile = [t for t in view.buffers if t.persistent is False] if view else []
    for group in [reference, *(g for g, _ in ctx.pairs)] if volatile else []:
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
    kinds = (
        ("buffer", a.buffers, b.buffers),
        ("parameter", _with_aliases(a), _with_aliases(b)),
    )
    for kind, xs, ys in kinds:
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


def _sorted_names(ctx: _Context) -> LoaderPrediction:
    results = []
    for group, ref_fp, other_fp in ctx.compared("post_wrap"):
        found = _first_name_difference(ref_fp, other_fp, ctx.ref_rank, group)
        issue = None
        if found is not None:
            index, x, y, what = found
            summary = f"{what} → the loader stops with a clear error before any broadcast"
            issue = _Issue("refused", index, x, y, group.representative, summary)
        results.append((group.ranks, issue))
    ok = "names, shapes and dtypes agree on every rank; buffers broadcast in name order"
    return _aggregate("sorted-names", results, ok)
