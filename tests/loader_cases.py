"""Predictions for a fixture built in this process, one rank at a time (no process group).

Fixtures decide their per-rank difference from ``RANK`` at construction, so each rank's
pre-wrap fingerprint can be taken here by setting it; the loaders' real runs then happen in
child jobs (:func:`fsdpcheck.children.observe.observe_loaders`).
"""

from __future__ import annotations

import os

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.predict import predict_loaders
from fsdpcheck.model.build import build
from fsdpcheck.model.fingerprint import fingerprint
from fsdpcheck.model.resolve import resolve
from fsdpcheck.records import EnvRecord, LoaderPrediction, RankRecord


def fixture_records(model: str, init: str = "rank0", world: int = 2) -> dict[int, RankRecord]:
    records = {}
    saved = os.environ.get("RANK")
    try:
        for rank in range(world):
            os.environ["RANK"] = str(rank)
            built = build(resolve(model, rank=rank), rank=rank, init=init)
            env = EnvRecord(rank, rank, world, "node0", "gloo", "3.11", "2.13.0+cpu", None, "1")
            pre = fingerprint(built.model, "pre-wrap")
            records[rank] = RankRecord(env=env, pre_wrap=pre)
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
    return records


def fixture_predictions(model: str, init: str = "rank0") -> dict[str, LoaderPrediction]:
    records = fixture_records(model, init)
    groups = group_ranks({r: rec.group_digest() for r, rec in records.items()})
    return {p.name: p for p in predict_loaders(groups, records, meta_ranks=())}
