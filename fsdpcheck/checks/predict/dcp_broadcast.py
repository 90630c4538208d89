"""``dcp-broadcast``: ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``,
keyed by rank 0's names; non-persistent buffers are left as each rank built them."""

from __future__ import annotations

from collections.abc import Mapping

from fsdpcheck.checks.layout import describe
from fsdpcheck.checks.predict.pairing import (
    Context,
    Issue,
    aggregate,
    kept_buffer_values,
    keys_of,
    layout_text,
    loader_view,
    plural,
    stops,
    who,
    with_aliases,
)
from fsdpcheck.records import (
    EnvRecord,
    Fingerprint,
    Group,
    LoaderPrediction,
    RankRecord,
    TensorRecord,
)
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Loader, LoaderVerdict, Snapshot

DESCRIPTION = (
    "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True): "
    "keyed by rank 0's names; non-persistent buffers untouched"
)
PRODUCTS = (
    "torch.distributed.checkpoint.state_dict.set_model_state_dict, as "
    "torchtitan, verl (its first step) and others call it"
)


def installed(env: EnvRecord) -> str:
    return f"installed: torch {env.torch}"


def predict(ctx: Context) -> LoaderPrediction:
    reference = ctx.reference
    results = ctx.issues(
        Snapshot.POST_WRAP, lambda ctx, group, a, b: dcp_refusal(a, b, ctx.ref_rank, group)
    )
    if any(stops(issue) for _, issue in results):
        return aggregate(Loader.DCP_BROADCAST, results, "")
    results += ctx.issues(  # a rank keeps its own
        Snapshot.POST_WRAP, lambda ctx, group, a, b: kept_buffer_values(a, b, ctx.ref_rank, group)
    )

    # Not in the state dict, so DCP leaves these as built: garbage where built on meta.
    view = loader_view(ctx.ref)
    volatile = [t for t in view.buffers if t.persistent is False] if view else []
    for group in [reference, *(g for g, _ in ctx.pairs)] if volatile else []:
        hits = _meta_hits(group, ctx.records, ctx.meta_ranks)
        if not hits:
            continue
        found = [_meta_buffer(ctx.records.get(r)) for r in hits]
        buffer = next((t for t in found if t is not None), volatile[0])
        index = next((i for i, t in enumerate(view.buffers) if t.name == buffer.name), 0)
        summary = (
            f"non-persistent buffer {describe(buffer)} is not in the state dict and "
            f"{ranks_label(hits)} built it on meta → after to_empty() it holds uninitialised "
            "memory"
        )
        issue = Issue(LoaderVerdict.UNINITIALIZED, index, buffer, buffer, hits[0], summary)
        results.append((hits, issue))
    if volatile:
        tail = f"its {len(volatile)} non-persistent buffers were built for real on every rank"
    else:
        tail = "the model has no non-persistent buffers"
    ok = f"keyed by rank 0's state-dict names, so order does not matter; {tail}"
    return aggregate(Loader.DCP_BROADCAST, results, ok)


def dcp_refusal(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group) -> Issue | None:
    """DCP follows rank 0's keys: a key the other ranks lack is skipped there, a dtype is
    converted; an extra key or an incompatible shape raises, on the ranks that have it."""
    keys_a, keys_b = keys_of(a), keys_of(b)
    by_a = {t.name: t for t in (*with_aliases(a), *a.buffers)}
    by_b = {t.name: t for t in (*with_aliases(b), *b.buffers)}
    extra = [k for k in keys_b if k not in set(keys_a)]
    reshaped = [k for k in keys_a if k in by_a and k in by_b and by_a[k].shape != by_b[k].shape]
    if extra:
        key, why = extra[0], f"{plural(group, 'has', 'have')} extra state-dict key {extra[0]}"
    elif reshaped:
        key = reshaped[0]
        why = (
            f"{key} is {layout_text(by_a[key])} on rank {ref_rank} but {layout_text(by_b[key])} "
            f"on {who(group)}"
        )
    else:
        return None
    index = keys_a.index(key) if key in keys_a else keys_b.index(key)
    summary = f"{why} → set_model_state_dict raises on {who(group)}"
    return Issue(
        LoaderVerdict.REFUSED, index, by_a.get(key), by_b.get(key), group.representative, summary
    )


def _meta_buffer(record: RankRecord | None) -> TensorRecord | None:
    """The first non-persistent buffer this rank built on ``meta`` (pre-wrap), if any."""
    fp = record.pre_wrap if record is not None else None
    if fp is None:
        return None
    return next((t for t in fp.buffers if t.persistent is False and t.device == "meta"), None)


def _meta_hits(group: Group, records: Mapping[int, RankRecord], meta_ranks: frozenset[int]):
    if _meta_buffer(records[group.representative]) is not None:
        return list(group.ranks)  # grouped ranks were built like their representative
    return [r for r in group.ranks if r in meta_ranks or _meta_buffer(records.get(r)) is not None]
