"""verl's own released loader, run for real before and after its PR #6405 (0.7.1: one broadcast
per buffer in each rank's ``named_buffers()`` order; 0.8.0: sorted by name) on the hazard
models, two ranks on gloo with hash seeds 0 and 1: what verl's code did equals fsdpcheck's
prediction for the loader it is (``named-buffers-order`` for 0.7.1, ``sorted-names`` for 0.8.0).

The prediction comes from each rank's fingerprint as it builds under its hash seed (the probe's
child builds, one per seed); the observation from one 2-rank child job per release
(tests/workers/verl_loader.py, verl's function read from its wheel; ``make install`` downloads
the wheels, so nothing here needs the network).
"""

from __future__ import annotations

import pytest
from conftest import REPO

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.observed import classify
from fsdpcheck.checks.predict import predict_loaders
from fsdpcheck.children.jobs import ChildSpec, StandIn, run_job
from fsdpcheck.children.launch import JOB_ENV, run_each
from fsdpcheck.records import EnvRecord, RankRecord, SeedBuild

WORKER = str(REPO / "tests" / "workers" / "verl_loader.py")
SEEDS = (0, 1)
# Which of fsdpcheck's loaders each release is: 0.8.0 pairs buffers by sorted name, and DCP
# pairs the state dict by rank 0's names, as the sorted loader does.
AS = {"verl-0.7.1": "named-buffers-order", "verl-0.8.0": "sorted-names"}


def seeded_predictions(model: str) -> dict:
    """fsdpcheck's prediction for two ranks built under hash seeds 0 and 1 (rank 1 on meta)."""
    argv = ["-m", "fsdpcheck.children.probe", "--child", "--model", model]
    envs = [{**JOB_ENV, "PYTHONHASHSEED": str(seed)} for seed in SEEDS]
    records = {}
    for rank, outcome in enumerate(run_each(argv, envs, jobs=2, timeout=120, record=SeedBuild)):
        assert outcome.result and outcome.result.built, outcome.failure(120)
        env = EnvRecord(rank, rank, 2, "node0", "gloo", "3.11", "2.13", None, str(SEEDS[rank]))
        records[rank] = RankRecord(env=env, pre_wrap=outcome.result.fingerprint)
    groups = group_ranks({r: rec.group_digest() for r, rec in records.items()})
    return {p.name: p for p in predict_loaders(groups, records, meta_ranks=(1,))}


def verl_did(model: str, release: str):
    stand_ins = [StandIn(rank, seed) for rank, seed in enumerate(SEEDS)]
    runs, elapsed = run_job(
        WORKER, release, ChildSpec(model), stand_ins=stand_ins, deadline=90, collective_timeout=30
    )
    return classify(release, runs, elapsed)


@pytest.mark.parametrize(
    ("model", "before", "after"),
    [("hazard", "hang", "ok"), ("hazard-equal", "silent-corruption", "ok")],
)
def test_verl_before_and_after_its_fix_does_what_fsdpcheck_predicts(model, before, after):
    assert (REPO / ".venv" / "verl-wheels").is_dir(), "run `make install` (it downloads verl)"
    predicted = seeded_predictions(model)
    for release, expected in (("verl-0.7.1", before), ("verl-0.8.0", after)):
        seen = verl_did(model, release)
        prediction = predicted[AS[release]]
        assert seen.verdict == expected, (release, dict(seen.detail))
        assert (prediction.on_gloo or prediction.verdict) == expected, prediction.summary
