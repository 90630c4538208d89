"""``named-buffers-order``: DCP for the state dict, then one broadcast per buffer in each rank's
own ``named_buffers()`` order."""

from __future__ import annotations

from fsdpcheck.checks.predict.dcp_broadcast import dcp_refusal
from fsdpcheck.checks.predict.pairing import (
    Context,
    Issue,
    Slot,
    aggregate,
    canonical,
    loader_view,
    walk,
)
from fsdpcheck.records import Fingerprint, Group, LoaderPrediction
from fsdpcheck.vocab import Loader, Snapshot

DESCRIPTION = (
    "DCP for the state dict, then one broadcast per buffer in each rank's own named_buffers() order"
)
PRODUCTS = (
    "verl before PR #6405 (fsdp2_load_full_state_dict); lmms-engine, "
    "SkyRL and other trainers that broadcast named_buffers() in order after their state-dict load"
)


def predict(ctx: Context) -> LoaderPrediction:
    """DCP first (its refusals end the load on the ranks that differ), then the buffer loop."""
    results = ctx.issues(Snapshot.POST_WRAP, _judge)
    view = loader_view(ctx.ref)
    count = len(_buffer_slots(view)) if view is not None else 0
    ok = f"the state dict by name, then all {count} buffer broadcasts pair the same tensor"
    return aggregate(Loader.NAMED_BUFFERS_ORDER, results, ok)


def _judge(ctx: Context, group: Group, ref_fp: Fingerprint, other_fp: Fingerprint) -> Issue | None:
    issue = dcp_refusal(ref_fp, other_fp, ctx.ref_rank, group)
    if issue is None:
        a, b = _buffer_slots(ref_fp), _buffer_slots(other_fp)
        issue = walk(a, b, ctx, group, canonical(ref_fp), "buffer")
    return issue


def _buffer_slots(fp: Fingerprint) -> list[Slot]:
    return list(fp.buffers)
