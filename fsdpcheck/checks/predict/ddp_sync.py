"""``ddp-sync``: ``DistributedDataParallel(module)``'s start-up sync: parameter shapes checked
across ranks, then parameters and buffers in local order, coalesced into 250 MiB flat buckets."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fsdpcheck.checks.layout import describe
from fsdpcheck.checks.predict.pairing import (
    HANG,
    LARGER_ON_NCCL,
    NO_PARTNER,
    Context,
    Issue,
    aggregate,
    canonical,
    plural,
    same,
    walk,
    who,
    worse,
)
from fsdpcheck.checks.predict.sizes import nbytes
from fsdpcheck.records import EnvRecord, Fingerprint, Group, LoaderPrediction, TensorRecord
from fsdpcheck.vocab import Backend, Loader, LoaderVerdict, Snapshot

DESCRIPTION = (
    "parameter shapes checked across ranks, then parameters and buffers in local "
    "order, coalesced into 250 MiB flat buckets"
)
PRODUCTS = "torch DistributedDataParallel(module) (its constructor's start-up sync)"

DDP_BUCKET_BYTES = 250 * 1024 * 1024


def installed(env: EnvRecord) -> str:
    return f"installed: torch {env.torch}"


def predict(ctx: Context) -> LoaderPrediction:
    results = ctx.issues(Snapshot.PRE_WRAP, _judge)
    ok = "parameters and buffers fill the same flat buckets in the same order on every rank"
    return aggregate(Loader.DDP_SYNC, results, ok)


def _judge(ctx: Context, group: Group, ref_fp: Fingerprint, other_fp: Fingerprint) -> Issue | None:
    issue = _shape_check(ref_fp.params, other_fp.params, ctx.ref_rank, group)
    if issue is None:
        a = [*ref_fp.params, *ref_fp.buffers]
        b = [*other_fp.params, *other_fp.buffers]
        issue = _bucketed(a, b, ctx, group, canonical(ref_fp))
    return issue


def buckets(tensors: Sequence[TensorRecord]) -> list[list[int]]:
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


def _shape_check(pa, pb, ref_rank: int, group: Group) -> Issue | None:
    """DDP's constructor compares parameter counts (raising on every rank) and then each
    parameter's sizes by position (raising on the ranks that differ) before any broadcast."""
    if len(pa) != len(pb):
        summary = (
            f"rank {ref_rank} has {len(pa)} parameters, {plural(group, 'has', 'have')} "
            f"{len(pb)} → DDP raises 'DDP expects same model across all ranks' before any broadcast"
        )
        n = min(len(pa), len(pb))
        x = pa[n] if n < len(pa) else None
        y = pb[n] if n < len(pb) else None
        return Issue(LoaderVerdict.REFUSED, n, x, y, group.representative, summary)
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        if x.shape != y.shape:
            summary = (
                f"params[{i}]: {describe(x)} on rank {ref_rank}, {describe(y)} on {who(group)} "
                "→ DDP raises 'appears not to match sizes of the same param in process 0' on "
                f"{who(group)} before any broadcast"
            )
            return Issue(LoaderVerdict.REFUSED, i, x, y, group.representative, summary)
    return None


def _bucketed(
    a: Sequence[TensorRecord],
    b: Sequence[TensorRecord],
    ctx: Context,
    group: Group,
    same_tensor: Callable[[str], str],
) -> Issue | None:
    """The worst thing DDP's bucketed broadcast does, over every bucket it sends."""
    ref_rank = ctx.ref_rank

    def alike(x: TensorRecord, y: TensorRecord) -> bool:
        return same(x, y) or (
            (x.shape, x.dtype) == (y.shape, y.dtype) and same_tensor(x.name) == same_tensor(y.name)
        )

    diverged = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if not alike(x, y)]
    if not diverged and len(a) == len(b):
        return None
    if any(nbytes(t) is None for t in (*a, *b)):
        # A dtype without a known item size: no byte layout to replay, so pair one by one.
        return walk(a, b, ctx, group, same_tensor, "tensor")
    buckets_a, buckets_b = buckets(a), buckets(b)
    worst: Issue | None = None
    for k, (ia, ib) in enumerate(zip(buckets_a, buckets_b, strict=False)):
        spans_a, spans_b = _spans(a, ia), _spans(b, ib)
        sent, room = spans_a[-1][1], spans_b[-1][1]
        if sent > room or (sent < room and ctx.backend == Backend.NCCL):
            x, y = _first_unlike(a, ia, b, ib)
            ra, rb = (a[x] if x is not None else None), (b[y] if y is not None else None)
            summary = (
                f"bucket {k}: rank {ref_rank} broadcasts {sent} bytes, "
                f"{plural(group, 'receives', 'receive')} into {room}; first difference: "
                f"{describe(ra)} vs {describe(rb)} → {HANG if sent > room else LARGER_ON_NCCL}"
            )
            index = x if x is not None else y
            return worse(
                worst, Issue(LoaderVerdict.HANG, index, ra, rb, group.representative, summary)
            )
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
                f"but {plural(group, 'unpacks', 'unpack')} them into {describe(other)} → "
                "values scrambled, no error"
                + ("" if sent == room else f" (gloo fills {sent} of {room} bytes; NCCL blocks)")
            )
            issue = Issue(
                LoaderVerdict.SILENT_CORRUPTION, i, a[i], other, group.representative, summary
            )
            worst = worse(worst, issue)
            break
    if len(buckets_a) == len(buckets_b):
        return worst
    k = min(len(buckets_a), len(buckets_b))
    ra = a[buckets_a[k][0]] if k < len(buckets_a) else None
    rb = b[buckets_b[k][0]] if k < len(buckets_b) else None
    summary = (
        f"rank {ref_rank} broadcasts {len(buckets_a)} buckets, {who(group)} "
        f"{len(buckets_b)} → bucket {k} has {NO_PARTNER}"
    )
    index = buckets_a[k][0] if k < len(buckets_a) else len(a)
    return worse(worst, Issue(LoaderVerdict.HANG, index, ra, rb, group.representative, summary))


def _first_unlike(a, ia: Sequence[int], b, ib: Sequence[int]) -> tuple[int | None, int | None]:
    """Indices of the first pair of bucket members that differ (None past a bucket's end)."""
    for p in range(max(len(ia), len(ib))):
        x = ia[p] if p < len(ia) else None
        y = ib[p] if p < len(ib) else None
        if x is None or y is None or not same(a[x], b[y]):
            return x, y
    return ia[0], ib[0]  # same members, so this is unreachable for buckets of unequal size
