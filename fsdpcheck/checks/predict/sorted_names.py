"""``sorted-names`` (fsdpcheck's own loader): names, shapes and dtypes checked on every rank
first, then the state dict and non-persistent buffers broadcast in name order."""

from __future__ import annotations

from fsdpcheck.checks.layout import describe
from fsdpcheck.checks.predict.pairing import (
    Context,
    Issue,
    aggregate,
    layout_text,
    who,
    with_aliases,
)
from fsdpcheck.records import Fingerprint, Group, LoaderPrediction, TensorRecord
from fsdpcheck.vocab import Loader, LoaderVerdict, Snapshot

DESCRIPTION = (
    "checks names, shapes and dtypes on every rank first, then DCP or "
    "rank 0's shards for the state dict and non-persistent buffers broadcast in name order"
)
# It pairs by model.state_dict()'s keys (fsdpcheck.loader.names): torch.compile's _orig_mod in.
NAMES = "state-dict"
PRODUCTS = (
    "fsdpcheck's load_full_state_dict; verl since PR #6405 broadcasts buffers "
    "in the same sorted order but without checking names, shapes and dtypes first"
)


def predict(ctx: Context) -> LoaderPrediction:
    """Every difference in names, shapes or dtypes stops the load before a byte moves."""
    results = ctx.issues(Snapshot.POST_WRAP, _judge)
    ok = "names, shapes and dtypes agree on every rank; buffers broadcast in name order"
    return aggregate(Loader.SORTED_NAMES, results, ok)


def _judge(ctx: Context, group: Group, ref_fp: Fingerprint, other_fp: Fingerprint) -> Issue | None:
    found = _first_name_difference(ref_fp, other_fp, ctx.ref_rank, group)
    if found is None:
        return None
    index, x, y, what = found
    summary = f"{what} → the loader stops with a clear error before any broadcast"
    return Issue(LoaderVerdict.REFUSED, index, x, y, group.representative, summary)


def _first_name_difference(a: Fingerprint, b: Fingerprint, ref_rank: int, group: Group):
    """(index, reference, other, what) for the first mismatch by sorted name, or None."""
    mine, theirs = f"rank {ref_rank}", who(group)
    kinds = (
        ("buffer", a.buffers, b.buffers),
        ("parameter", with_aliases(a), with_aliases(b)),
    )
    for kind, xs, ys in kinds:
        left, right = {t.name: t for t in xs}, {t.name: t for t in ys}
        for i, name in enumerate(sorted(left.keys() | right.keys())):
            x, y = left.get(name), right.get(name)
            if x is None or y is None:
                where = mine if y is None else theirs
                what = f"{kind} {describe(x or y)} exists only on {where}"
            elif layout_text(x) != layout_text(y):
                what = (
                    f"{kind} {name} is {layout_text(x)} on {mine} but {layout_text(y)} on {theirs}"
                )
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
