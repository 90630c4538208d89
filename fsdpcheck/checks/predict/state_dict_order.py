"""``state-dict-order`` (accelerate): one broadcast per entry of each rank's own ``state_dict()``
order; non-persistent buffers kept per rank, never broadcast."""

from __future__ import annotations

from fsdpcheck.checks.layout import describe
from fsdpcheck.checks.predict.pairing import (
    Context,
    Issue,
    Slot,
    aggregate,
    canonical,
    kept_buffer_values,
    keys_of,
    loader_view,
    stops,
    tensor_of,
    walk,
    who,
    with_aliases,
    worse,
)
from fsdpcheck.records import EnvRecord, Fingerprint, Group, LoaderPrediction
from fsdpcheck.vocab import Loader, LoaderVerdict, Snapshot

DESCRIPTION = (
    "one broadcast per entry of each rank's own state_dict() order; "
    "non-persistent buffers kept per rank, never broadcast"
)
PRODUCTS = (
    "accelerate 1.7 to 1.15 (fsdp2_prepare_model with "
    "cpu_ram_efficient_loading: fsdp2_load_full_state_dict, then each rank's own non-persistent "
    "buffers put back); from 1.14 (PR #3982) rank 0 looks its keys up in the full state dict "
    "by name, before that by position: the same here, since the full state dict is rank 0's "
    "own state_dict()"
)


def installed(env: EnvRecord) -> str:
    """The accelerate installed on the reference rank, against the versions modelled."""
    version = env.accelerate
    if version is None:
        return "accelerate is not installed here"
    if _version(version) < (1, 7):
        return f"installed accelerate {version} predates it (not modelled)"
    return f"installed: accelerate {version}"


def predict(ctx: Context) -> LoaderPrediction:
    """accelerate: every state-dict entry in local order, each rank's own buffers kept."""
    results = []
    for group, ref_fp, other_fp in ctx.compared(Snapshot.POST_WRAP):
        a, b = _state_dict_slots(ref_fp), _state_dict_slots(other_fp)

        def refuse(i: int, x: Slot, y: Slot, group: Group = group) -> Issue | None:
            # Every entry needs a device_mesh: a persistent buffer (a plain tensor) raises.
            for side, slot in (("reference", x), ("other", y)):
                t = tensor_of(slot)
                if t is not None and t.persistent is not None:
                    where = f"rank {ctx.ref_rank}" if side == "reference" else who(group)
                    summary = (
                        f"index {i}: {describe(t)} is a persistent buffer on {where}, a plain "
                        "tensor with no device_mesh → fsdp2_load_full_state_dict raises "
                        "AttributeError"
                    )
                    ra, rb = tensor_of(x), tensor_of(y)
                    return Issue(LoaderVerdict.REFUSED, i, ra, rb, group.representative, summary)
            return None

        issue = walk(a, b, ctx, group, canonical(ref_fp), "state-dict", refuse)
        if not stops(issue):
            issue = worse(issue, kept_buffer_values(ref_fp, other_fp, ctx.ref_rank, group))
        results.append((group.ranks, issue))
    view = loader_view(ctx.ref)
    count = len(_state_dict_slots(view)) if view is not None else 0
    ok = (
        f"all {count} state-dict broadcasts pair the same tensor; non-persistent buffers keep "
        "each rank's own values, which agree wherever they were recorded"
    )
    return aggregate(Loader.STATE_DICT_ORDER, results, ok)


def _state_dict_slots(fp: Fingerprint) -> list[Slot]:
    by_name = {t.name: t for t in (*with_aliases(fp), *fp.buffers)}
    return [by_name.get(key, key) for key in keys_of(fp)]


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
