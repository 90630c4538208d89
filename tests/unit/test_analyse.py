"""Cross-rank analysis on synthetic fingerprints (no torch, no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from synthetic import EMBED, FULL, K_PROJ, Q_PROJ, SCALE, SLIDING, analyse, tensor

from fsdpcheck.checks.groups import group_ranks, reference_group
from fsdpcheck.records import (
    EnvRecord,
    Finding,
    Fingerprint,
    RankError,
    RankRecord,
    from_dict,
    to_dict,
)
from fsdpcheck.report import headline, verdict
from fsdpcheck.text import ranks_label
from fsdpcheck.vocab import Cause, FindingKind


def buffers(order=(SCALE, FULL, SLIDING), **changes):
    """The hazard model's buffers in ``order``; ``changes`` maps a name to field overrides."""
    base = {
        SCALE: tensor(SCALE, (1,), persistent=True),
        FULL: tensor(FULL, (16,), persistent=False),
        SLIDING: tensor(SLIDING, (8,), persistent=False),
    }
    return tuple(dataclasses.replace(base[name], **changes.get(name, {})) for name in order)


def params(order=(EMBED, Q_PROJ, K_PROJ), wrapped=False, shapes=None):
    shapes = {EMBED: (32, 8), Q_PROJ: (8, 8), K_PROJ: (8, 8), **(shapes or {})}
    placements = ("Shard(dim=0)",) if wrapped else None
    return tuple(tensor(n, shapes[n], placements=placements) for n in order)


def fingerprint(stage, bufs=None, prms=None, keys=None):
    bufs = buffers() if bufs is None else bufs
    prms = params(wrapped=stage == "post-wrap") if prms is None else prms
    if keys is None:
        keys = tuple(p.name for p in prms) + tuple(b.name for b in bufs if b.persistent)
    return Fingerprint(snapshot=stage, buffers=bufs, params=prms, state_dict_keys=tuple(keys))


def env(rank, torch="2.13.0+cpu", host="node0"):
    return EnvRecord(
        rank=rank,
        local_rank=rank,
        world_size=8,
        host=host,
        backend="gloo",
        python="3.11.9",
        torch=torch,
        transformers="5.12.1",
        hash_seed=str(rank),
    )


def record(rank, pre="default", post="default", error=None, **env_kwargs):
    if pre == "default":
        pre = fingerprint("pre-wrap")
    if post == "default":
        post = fingerprint("post-wrap")
    return RankRecord(env=env(rank, **env_kwargs), pre_wrap=pre, post_wrap=post, error=error)


def swapped(rank, before=True, after=True, **kwargs):
    """A rank whose rotary buffers come out sliding-first (``before=None``: no pre-wrap print)."""
    order = (SCALE, SLIDING, FULL)
    pre = fingerprint("pre-wrap", buffers(order) if before else None)
    post = fingerprint("post-wrap", buffers(order) if after else None)
    return record(rank, pre=None if before is None else pre, post=post, **kwargs)


def gather(per_rank):
    """What the plumbing does: group by digest, keep each group's representative's record."""
    groups = group_ranks({r: rec.group_digest() for r, rec in per_rank.items()})
    return groups, {g.representative: per_rank[g.representative] for g in groups}


def run(per_rank):
    return analyse(*gather(per_rank))


def only(findings, kind):
    matching = [f for f in findings if f.kind == kind]
    assert len(matching) == 1, [f.kind for f in findings]
    return matching[0]


# ---------------------------------------------------------------- consistent


def test_identical_ranks_have_no_findings():
    per_rank = {r: record(r) for r in range(4)}
    groups, records = gather(per_rank)
    assert len(groups) == 1 and groups[0].ranks == (0, 1, 2, 3)
    findings = analyse(groups, records)
    assert findings == []
    assert verdict(findings, []) == ("consistent", 0)
    assert headline(findings, [], 4) == "all 4 ranks consistent"


# ---------------------------------------------------------------- buffers


def test_buffer_order_swap_with_different_sizes_is_construction_time():
    findings = run({0: record(0), 1: swapped(1)})
    assert [f.kind for f in findings] == ["buffer-order"]  # non-persistent: state dict unchanged
    f = findings[0]
    assert (f.ranks, f.reference_rank, f.snapshot, f.cause) == (
        (1,),
        0,
        "pre-wrap",
        "construction-time",
    )
    first = f.details["first_divergence"]
    assert first["index"] == 1
    assert first["reference"] == {"name": FULL, "shape": [16], "dtype": "float32"}
    assert first["other"] == {"name": SLIDING, "shape": [8], "dtype": "float32"}
    assert set(f.details["moved"]) == {FULL, SLIDING} == set(f.tensors)
    assert f.details["persists_after_wrap"] is True
    assert f"rank 0 has {FULL} (16,) float32" in f.summary
    assert f"rank 1 has {SLIDING} (8,) float32" in f.summary
    assert f.summary.startswith("buffer order differs at index 1")


def test_difference_only_after_wrapping_is_blamed_on_wrapping():
    findings = run({0: record(0), 1: swapped(1, before=False)})
    f = only(findings, "buffer-order")
    assert (f.snapshot, f.cause) == ("post-wrap", "wrapping")
    assert "persists_after_wrap" not in f.details


def test_difference_gone_after_wrapping_is_reported_once():
    findings = run({0: record(0), 1: swapped(1, after=False)})
    f = only(findings, "buffer-order")
    assert (f.snapshot, f.cause) == ("pre-wrap", "construction-time")
    assert f.details["persists_after_wrap"] is False


def test_without_pre_wrap_fingerprints_the_cause_is_unknown():
    findings = run({0: record(0, pre=None), 1: swapped(1, before=None)})
    f = only(findings, "buffer-order")
    assert (f.snapshot, f.cause) == ("post-wrap", "unknown")
    assert Cause("unknown") is Cause.UNKNOWN


def test_buffer_set_difference():
    mine = buffers((SCALE, FULL))
    theirs = record(1, pre=fingerprint("pre-wrap", mine), post=fingerprint("post-wrap", mine))
    f = only(run({0: record(0), 1: theirs}), "buffer-set")
    assert f.details["only_reference"] == [SLIDING]
    assert f.details["only_other"] == []
    assert f.details["first_divergence"] == {
        "index": 2,
        "reference": {"name": SLIDING, "shape": [8], "dtype": "float32"},
        "other": None,
    }
    assert f.tensors == (SLIDING,)
    assert f"only rank 0 has {SLIDING} (8,) float32" in f.summary


@pytest.mark.parametrize(
    ("field", "value", "kind", "text"),
    [
        ("shape", (12,), "buffer-shape", f"{FULL} is (16,) on rank 0 but (12,) on rank 1"),
        (
            "dtype",
            "bfloat16",
            "buffer-dtype",
            f"{FULL} is float32 on rank 0 but bfloat16 on rank 1",
        ),
        (
            "persistent",
            True,
            "buffer-persistence",
            f"{FULL} is non-persistent on rank 0 but persistent on rank 1",
        ),
    ],
)
def test_buffer_attribute_differences(field, value, kind, text):
    mine = buffers(**{FULL: {field: value}})
    theirs = record(1, pre=fingerprint("pre-wrap", mine), post=fingerprint("post-wrap", mine))
    findings = run({0: record(0), 1: theirs})
    f = only(findings, kind)
    assert f.tensors == (FULL,)
    reference = [16] if field == "shape" else to_dict(getattr(buffers()[1], field))
    other = list(value) if field == "shape" else value
    assert f.details["differences"] == [{"name": FULL, "reference": reference, "other": other}]
    assert text in f.summary
    assert (f.snapshot, f.cause) == ("pre-wrap", "construction-time")


# ---------------------------------------------------------------- parameters and state dict


def test_param_order_explains_state_dict_order():
    order = (EMBED, K_PROJ, Q_PROJ)
    theirs = record(
        1,
        pre=fingerprint("pre-wrap", prms=params(order)),
        post=fingerprint("post-wrap", prms=params(order, wrapped=True)),
    )
    findings = run({0: record(0), 1: theirs})
    assert [f.kind for f in findings] == ["param-order"]  # state-dict order follows from it
    f = findings[0]
    assert f.details["first_divergence"]["index"] == 1
    assert f.details["moved"] == [Q_PROJ, K_PROJ]


def test_state_dict_order_alone():
    keys = (EMBED, K_PROJ, Q_PROJ, SCALE)
    theirs = record(
        1, pre=fingerprint("pre-wrap", keys=keys), post=fingerprint("post-wrap", keys=keys)
    )
    f = only(run({0: record(0), 1: theirs}), "state-dict-order")
    assert f.details["first_divergence"] == {"index": 1, "reference": Q_PROJ, "other": K_PROJ}
    assert f"rank 0 walks {Q_PROJ}, rank 1 walks {K_PROJ}" in f.summary


def test_param_set_and_shape():
    prms_pre = params((EMBED, Q_PROJ), shapes={EMBED: (64, 8)})
    prms_post = params((EMBED, Q_PROJ), wrapped=True, shapes={EMBED: (64, 8)})
    theirs = record(
        1, pre=fingerprint("pre-wrap", prms=prms_pre), post=fingerprint("post-wrap", prms=prms_post)
    )
    findings = run({0: record(0), 1: theirs})
    assert [f.kind for f in findings] == ["param-set", "param-shape"]
    assert findings[0].details["only_reference"] == [K_PROJ]
    assert findings[1].details["differences"] == [
        {"name": EMBED, "reference": [32, 8], "other": [64, 8]}
    ]
    assert "(32, 8) on rank 0 but (64, 8) on rank 1" in findings[1].summary


def test_param_placement_differs_after_wrapping():
    prms = tuple(
        dataclasses.replace(p, placements=("Replicate()",)) if p.name == EMBED else p
        for p in params(wrapped=True)
    )
    theirs = record(1, post=fingerprint("post-wrap", prms=prms))
    f = only(run({0: record(0), 1: theirs}), "param-placement")
    assert (f.snapshot, f.cause) == ("post-wrap", "wrapping")
    assert f.details["differences"] == [
        {"name": EMBED, "reference": ["Shard(dim=0)"], "other": ["Replicate()"]}
    ]


# ---------------------------------------------------------------- environment and many ranks


def test_env_version_skew():
    per_rank = {
        0: record(0),
        1: record(1),
        2: record(2, torch="2.12.0"),
        3: record(3, torch="2.12.0"),
    }
    f = only(run(per_rank), "env")
    assert f.ranks == (2, 3)
    assert (f.snapshot, f.cause) == ("pre-wrap", "environment")
    assert f.details == {
        "differences": [{"field": "torch", "reference": "2.13.0+cpu", "other": "2.12.0"}]
    }
    assert "torch 2.13.0+cpu on rank 0 but 2.12.0 on ranks 2,3" in f.summary


def test_eight_ranks_in_three_groups():
    per_rank = {r: record(r) for r in (0, 1, 2, 4)}
    per_rank.update({r: swapped(r) for r in (3, 5)})
    per_rank.update({r: record(r, torch="2.12.0") for r in (6, 7)})
    groups, records = gather(per_rank)
    assert [g.ranks for g in groups] == [(0, 1, 2, 4), (3, 5), (6, 7)]
    findings = analyse(groups, records)
    assert [(f.kind, f.ranks) for f in findings] == [("buffer-order", (3, 5)), ("env", (6, 7))]
    assert all(f.reference_rank == 0 for f in findings)
    assert "ranks 3,5 have" in findings[0].summary
    assert headline(findings, [], 8) == (
        "buffer order differs on ranks 3,5 (construction-time); 1 other difference"
    )


def test_findings_are_sorted_by_group_then_kind():
    mine = buffers((SCALE, SLIDING, FULL), **{FULL: {"dtype": "bfloat16"}})
    per_rank = {
        0: record(0),
        1: record(1, torch="2.12.0"),
        2: record(2, pre=fingerprint("pre-wrap", mine), post=fingerprint("post-wrap", mine)),
    }
    kinds = [(f.ranks, f.kind) for f in run(per_rank)]
    assert kinds == [((1,), "env"), ((2,), "buffer-order"), ((2,), "buffer-dtype")]
    order = [k.value for k in FindingKind]
    assert order.index("buffer-order") < order.index("buffer-dtype")


# ---------------------------------------------------------------- grouping, reference, errors


def test_group_ranks_groups_by_digest_and_collects_hosts():
    digests = {3: "b", 0: "a", 2: "a", 1: "b", 4: "c"}
    hosts = {0: "node0", 1: "node0", 2: "node1", 3: "node1", 4: "node1"}
    groups = group_ranks(digests, hosts)
    assert [(g.ranks, g.digest, g.hosts) for g in groups] == [
        ((0, 2), "a", ("node0", "node1")),
        ((1, 3), "b", ("node0", "node1")),
        ((4,), "c", ("node1",)),
    ]
    assert [g.hosts for g in group_ranks(digests)] == [(), (), ()]


def test_error_groups_are_skipped_and_reference_moves_off_a_failed_rank_0():
    boom = RankError(rank=0, stage="build", message="boom")
    per_rank = {0: record(0, error=boom), 1: record(1), 2: swapped(2)}
    groups, records = gather(per_rank)
    assert reference_group(groups, records).ranks == (1,)
    findings = analyse(groups, records)
    assert [(f.kind, f.ranks, f.reference_rank) for f in findings] == [("buffer-order", (2,), 1)]
    assert "rank 1 has" in findings[0].summary


def test_verdict_exit_codes():
    finding = run({0: record(0), 1: swapped(1)})
    input_error = RankError(rank=1, stage="resolve", message="no such model", kind="input")
    runtime_error = RankError(rank=2, stage="build", message="oom")
    assert verdict([], []) == ("consistent", 0)
    assert verdict(finding, []) == ("inconsistent", 1)
    assert verdict(finding, [input_error]) == ("error", 2)
    assert verdict([], [input_error, runtime_error]) == ("error", 3)


def test_headline_for_errors():
    e2 = RankError(rank=2, stage="build", message="CUDA out of memory\ntraceback...")
    assert headline([], [e2], 4) == "rank 2 failed at build: CUDA out of memory"
    e3 = RankError(rank=3, stage="build", message="CUDA out of memory\ntraceback...")
    e1 = RankError(rank=1, stage="wrap", message="bad mesh")
    assert headline([], [e3, e2], 4) == "ranks 2,3 failed at build: CUDA out of memory"
    assert (
        headline([], [e3, e2, e1], 4)
        == "rank 1 failed at wrap: bad mesh; 2 more ranks failed differently"
    )


def test_an_error_headline_names_the_rank_that_failed_not_the_ones_waiting_on_it():
    # Issue 37: rank 1 raised in its step; rank 0, waiting for it, was named "stuck" and led.
    stuck = RankError(0, "step", "rank 0 is stuck in stage 'step' (rank 1 gave up waiting)")
    after = RankError(0, "step", "rank 0's step raised only after rank 1's had: Connection closed")
    own = RankError(1, "step", "rank 1's step raised: ValueError: boom")
    for errors in ([stuck, own], [after, stuck, own]):
        assert headline([], errors, 2).startswith(
            "rank 1 failed at step: rank 1's step raised: ValueError: boom"
        )
    # With no rank failing on its own, the stuck one is named.
    assert headline([], [stuck], 2).startswith("rank 0 failed at step: rank 0 is stuck")


def test_headline_prefers_construction_time_and_merges_ranks_by_cause():
    per_rank = {0: record(0), 3: swapped(3, before=False), 4: swapped(4), 5: swapped(5)}
    per_rank.update({1: record(1), 2: record(2)})
    findings = run(per_rank)
    assert [(f.ranks, f.cause) for f in findings] == [
        ((3,), "wrapping"),
        ((4, 5), "construction-time"),
    ]
    assert headline(findings, [], 6) == (
        "buffer order differs on ranks 4,5 (construction-time); 1 other difference"
    )


def test_headline_single_rank():
    assert headline([], [], 1) == "1 rank: nothing to compare across ranks"


def test_ranks_label_collapses_runs():
    assert ranks_label([1]) == "rank 1"
    assert ranks_label([3, 1]) == "ranks 1,3"
    assert ranks_label([1, 2, 3, 5, 7, 8]) == "ranks 1-3,5,7,8"


# ---------------------------------------------------------------- records


def test_findings_round_trip_through_json():
    mine = buffers(
        (SCALE, SLIDING),
        **{SCALE: {"shape": (2,), "dtype": "bfloat16", "persistent": False}},
    )
    prms = params((K_PROJ, EMBED, Q_PROJ), wrapped=True)
    per_rank = {
        0: record(0),
        1: record(1, pre=fingerprint("pre-wrap", mine), post=fingerprint("post-wrap", mine)),
        2: record(2, torch="2.12.0", post=fingerprint("post-wrap", prms=prms)),
        3: swapped(3, before=False),
    }
    findings = run(per_rank)
    assert len({f.kind for f in findings}) >= 6
    for f in findings:
        again = from_dict(Finding, json.loads(json.dumps(to_dict(f))))
        assert again == f
        assert f.summary and f.cause in set(Cause) and f.kind in set(FindingKind)
