"""value, uninitialized and tie checks: pure analysis on synthetic records, and the collectors
on real (single-process) models."""

from __future__ import annotations

import json

import pytest
import torch
from synthetic import EMBED, FULL, SCALE, state_record, valued
from torch import nn

from fsdpcheck.checks.groups import group_ranks
from fsdpcheck.checks.loaded import load_errors, load_findings
from fsdpcheck.checks.ties import missing_ties, tie_findings
from fsdpcheck.checks.uninitialized import uninitialized_findings
from fsdpcheck.checks.value import not_compared, value_findings
from fsdpcheck.distributed.gather import SLOT_BYTES, _pack_slot, _unpack_slot
from fsdpcheck.model.keys import SENDER_LIMIT, value_digests, value_senders
from fsdpcheck.records import (
    BufferProblem,
    ExpertKey,
    Gathered,
    LoadOutcome,
    RankRecord,
    TieRecord,
    ValueKeys,
    from_dict,
    to_dict,
)
from fsdpcheck.report import AuditOutcome, assemble, headline, verdict
from fsdpcheck.vocab import FindingKind

SHARD = ("S(0)",)
HSDP = ("R", "S(0)")
LM_HEAD = "lm_head.weight"


def _digests(records):
    values, replicas = {}, {}
    for rank, record in records.items():
        values[rank], replicas[rank] = value_digests(record)
    return values, replicas


def _groups(records):
    return group_ranks({r: rec.group_digest() for r, rec in records.items()})


# ---------------------------------------------------------------- value


def test_meta_ranks_have_no_value_digest_and_are_not_compared():
    real = state_record(0, pre=([valued(FULL, "aa", ["1"])], [valued(EMBED, "bb")]))
    meta = state_record(1, pre=([valued(FULL, None)], [valued(EMBED, None)]))
    values, replicas = _digests({0: real, 1: meta})
    assert values[0] is not None and values[1] is None and replicas == {0: None, 1: None}
    assert value_senders(ValueKeys(values, replicas, {})) == set()
    assert value_findings({0: real, 1: meta}, ValueKeys(values, replicas, {})) == []
    assert not_compared(values, replicas) == (1,)


def test_equal_values_send_nothing_extra_and_find_nothing():
    records = {
        r: state_record(r, pre=([valued(FULL, "aa")], [valued(EMBED, "bb")])) for r in (0, 1, 2)
    }
    values, replicas = _digests(records)
    assert len(set(values.values())) == 1
    assert value_senders(ValueKeys(values, replicas, {})) == set()
    assert value_findings(records, ValueKeys(values, replicas, {})) == []


def test_per_rank_initial_values_name_ranks_tensors_and_first_values():
    def rec(rank, digest, head):
        return state_record(rank, pre=([valued(FULL, "aa", ["1"])], [valued(EMBED, digest, head)]))

    records = {
        0: rec(0, "e0", ["0.5", "1"]),
        1: rec(1, "e1", ["-1", "1"]),
        2: rec(2, "e0", ["0.5", "1"]),
    }
    values, replicas = _digests(records)
    assert value_senders(ValueKeys(values, replicas, {})) == {0, 1}
    (finding,) = value_findings(records, ValueKeys(values, replicas, {}))
    assert (finding.kind, finding.ranks, finding.reference_rank) == ("value", (1,), 0)
    assert (finding.snapshot, finding.cause, finding.tensors) == (
        "pre-wrap",
        "construction-time",
        (EMBED,),
    )
    assert f"param {EMBED} (first values 0.5, 1 on rank 0; -1, 1 on rank 1" in finding.summary
    (diff,) = finding.details["differences"]
    assert diff["max_abs_diff_first_values"] == 1.5
    assert json.loads(json.dumps(to_dict(finding))) == to_dict(finding)


def test_buffers_reported_uninitialized_are_not_reported_again_as_values():
    garbage = BufferProblem(SCALE, "post-wrap", "differs", ("1e-38",), ("8",))
    ref = state_record(0, post=([valued(SCALE, "ok", ["8"])], []))
    bad = state_record(1, post=([valued(SCALE, "junk", ["1e-38"])], []), uninitialized=[garbage])
    records = {0: ref, 1: bad}
    values, replicas = _digests(records)
    assert value_findings(records, ValueKeys(values, replicas, {})) == []


def test_hsdp_replicas_compare_local_shards_only_with_their_own_replicas():
    # mesh (2, 2): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1; rank 3's shard differs.
    shards = {0: "s0", 1: "s1", 2: "s0", 3: "bad"}
    keys = {0: "k0", 1: "k1", 2: "k0", 3: "k1"}
    records = {
        r: state_record(
            r, post=([], [valued(EMBED, shards[r], [str(r)], placements=HSDP)]), shard_key=keys[r]
        )
        for r in range(4)
    }
    values, replicas = _digests(records)
    assert set(values.values()) == {None}  # sharded parameters never enter the all-rank digest
    assert value_senders(ValueKeys(values, replicas, keys)) == {1, 3}
    (finding,) = value_findings(records, ValueKeys(values, replicas, keys))
    assert (finding.ranks, finding.reference_rank, finding.snapshot) == ((3,), 1, "post-wrap")
    assert finding.summary.startswith("values differ between HSDP replicas on rank 3")
    assert finding.details["replicas"] == [1, 3]


def test_plain_fsdp_shards_differ_by_design_and_are_never_compared():
    keys = {0: "k0", 1: "k1"}
    records = {
        r: state_record(r, post=([], [valued(EMBED, f"s{r}", placements=SHARD)]), shard_key=keys[r])
        for r in (0, 1)
    }
    values, replicas = _digests(records)
    assert value_senders(ValueKeys(values, replicas, keys)) == set()
    assert value_findings(records, ValueKeys(values, replicas, keys)) == []


def test_replica_difference_already_seen_before_wrapping_is_reported_once():
    def rec(rank, digest):
        return state_record(
            rank,
            pre=([], [valued(EMBED, digest)]),
            post=([], [valued(EMBED, digest + "-shard", placements=HSDP)]),
            shard_key="k0",
        )

    records = {0: rec(0, "a"), 1: rec(1, "b")}
    values, replicas = _digests(records)
    keys = {0: "k0", 1: "k0"}
    (finding,) = value_findings(records, ValueKeys(values, replicas, keys))
    assert finding.snapshot == "pre-wrap"


def test_value_senders_are_bounded_however_many_ranks_differ():
    values = {r: f"{r:032x}" for r in range(100)}
    senders = value_senders(ValueKeys(values, {}, {}))
    assert senders == set(range(SENDER_LIMIT))
    records = {r: state_record(r, pre=([valued(FULL, values[r], ["1"])], [])) for r in senders}
    findings = value_findings(records, ValueKeys(values, {}, {}))
    assert len(findings) == 99
    unexamined = [f for f in findings if not f.details["examined"]]
    assert len(unexamined) == 100 - SENDER_LIMIT and "not examined" in unexamined[0].summary


def test_slot_carries_value_fields_and_none_round_trips():
    raw = _pack_slot("ab" * 16, "node-7", 1, "cd" * 16, None, "ef" * 16, "12" * 8)
    assert len(raw) == SLOT_BYTES
    unpacked = (1, "ab" * 16, "node-7", "cd" * 16, None, "ef" * 16, "12" * 8, None, None, None)
    assert _unpack_slot(raw) == unpacked
    expert = ExpertKey("0a" * 8, "0b" * 8, None)
    raw = _pack_slot("ab" * 16, "node-7", 1, "cd" * 16, None, "ef" * 16, "12" * 8, expert)
    assert len(raw) == SLOT_BYTES and _unpack_slot(raw) == (*unpacked[:-3], expert, None, None)


# ---------------------------------------------------------------- uninitialized


def test_uninitialized_values_do_not_split_ranks_with_the_same_problem():
    def rec(rank, got):
        problem = BufferProblem(SCALE, "load", "differs", (got,), ("8",))
        return state_record(rank, uninitialized=[problem])

    records = {0: state_record(0), 1: rec(1, "1e-38"), 2: rec(2, "-7e-39")}
    groups = _groups(records)
    assert [g.ranks for g in groups] == [(0,), (1, 2)]
    (finding,) = uninitialized_findings(groups, records)
    assert (finding.kind, finding.ranks, finding.snapshot, finding.cause) == (
        "uninitialized",
        (1, 2),
        "load",
        "loading",
    )
    assert f"{SCALE} not what its module computes (first values 1e-38 on ranks 1" in finding.summary
    assert "expected 8" in finding.summary


# ---------------------------------------------------------------- ties


TIED = TieRecord("post-wrap", shared=((LM_HEAD, EMBED),), expected=((LM_HEAD, EMBED),))
UNTIED = TieRecord("post-wrap", shared=(), expected=((LM_HEAD, EMBED),))


def test_a_configured_tie_held_as_separate_tensors_is_a_finding_on_every_rank():
    assert missing_ties(UNTIED) == [(LM_HEAD, EMBED)] and missing_ties(TIED) == []
    records = {r: state_record(r, ties=[UNTIED]) for r in (0, 1)}
    (finding,) = tie_findings(_groups(records), records)
    assert (finding.kind, finding.ranks, finding.snapshot) == ("tie", (0, 1), "post-wrap")
    assert finding.cause == "unknown"  # no pre-wrap record to tell a loader from wrapping
    assert f"{LM_HEAD} and {EMBED} are separate tensors" in finding.summary


def test_ranks_that_tie_different_names_are_a_finding():
    extra = TieRecord("pre-wrap", shared=(("a.weight", "b.weight"),))
    records = {0: state_record(0, ties=[TieRecord("pre-wrap")]), 1: state_record(1, ties=[extra])}
    (finding,) = tie_findings(_groups(records), records)
    assert (finding.ranks, finding.snapshot, finding.cause) == (
        (1,),
        "pre-wrap",
        "construction-time",
    )
    assert "only rank 1 tie a.weight, b.weight" in finding.summary


def test_ties_kept_everywhere_are_consistent_and_share_one_group():
    records = {r: state_record(r, ties=[TIED]) for r in (0, 1)}
    groups = _groups(records)
    assert len(groups) == 1 and tie_findings(groups, records) == []


# ---------------------------------------------------------------- vocabulary, report


def test_new_kinds_are_in_the_vocabulary_and_headline():
    for kind in ("value", "uninitialized", "tie"):
        assert FindingKind(kind).phrase != kind
    records = {r: state_record(r, ties=[UNTIED]) for r in (0, 1)}
    findings = tie_findings(_groups(records), records)
    assert headline(findings, [], 2) == "tied weights differ on ranks 0,1 (unknown)"
    assert verdict(findings, []) == ("inconsistent", 1)


def test_records_with_state_round_trip_through_json():
    record = state_record(
        1,
        pre=([valued(FULL, "aa", ["1", "nan"])], []),
        ties=[TIED],
        uninitialized=[BufferProblem(SCALE, "load", "nan", ("nan",))],
        shard_key="k",
    )
    assert from_dict(RankRecord, json.loads(json.dumps(to_dict(record)))) == record


def test_a_refused_load_is_never_consistent():
    load = LoadOutcome(True, "refused", "ranks disagree on the state dict:\n  - x")
    (finding,) = load_findings(load, 2)
    assert (finding.kind, finding.snapshot, finding.ranks) == ("verify", "load", (0, 1))
    assert "refused to load" in finding.summary
    records = {r: state_record(r) for r in (0, 1)}
    gathered = Gathered({0: "d", 1: "d"}, {0: "h", 1: "h"}, {0: records[0]}, 81)
    report = assemble(AuditOutcome(gathered, load=load), None)
    assert (report.verdict, report.exit_code) == ("inconsistent", 1)


def test_a_failed_load_is_an_error_naming_the_ranks():
    message = "loading the state dict failed; partly loaded:\n  - rank 1: loading failed: boom"
    load = LoadOutcome(True, "failed", message)
    assert [(e.rank, e.stage) for e in load_errors(load)] == [(1, "load")]
    gathered = Gathered({0: "d", 1: "d"}, {0: "h", 1: "h"}, {0: state_record(0)}, 81)
    report = assemble(AuditOutcome(gathered, load=load), None)
    assert (report.verdict, report.exit_code) == ("error", 3)


# ---------------------------------------------------------------- collectors, on real models


@pytest.fixture(scope="module")
def gemma3():
    from fsdpcheck.model.build import _from_config
    from fsdpcheck.model.presets import PRESETS

    torch.manual_seed(0)
    return _from_config(PRESETS["tiny-gemma3"].make_config(), False)


def test_a_clean_model_has_no_buffer_problems_in_float32_and_bfloat16(gemma3):
    from fsdpcheck.model.state import buffer_problems, buffer_reference

    assert buffer_problems(gemma3, "pre-wrap", buffer_reference(gemma3)) == ()
    import copy

    half = copy.deepcopy(gemma3).to(torch.bfloat16)  # a model cast after building
    assert buffer_problems(half, "pre-wrap", buffer_reference(half)) == ()


def test_garbage_buffers_after_to_empty_differ_from_the_recomputed_reference(gemma3):
    import copy

    from fsdpcheck.model.state import buffer_problems, buffer_reference

    model = copy.deepcopy(gemma3)
    with torch.no_grad():
        model.model.embed_tokens.embed_scale.fill_(-7.0e-39)
    (problem,) = buffer_problems(model, "load", buffer_reference(model))
    assert (problem.name, problem.reason) == ("model.embed_tokens.embed_scale", "differs")
    assert problem.got == ("-7e-39",) and problem.expected == ("8",)


def test_garbage_test_without_a_reference():
    from fsdpcheck.model.state import buffer_problems, garbage

    assert garbage(torch.tensor([1.0, float("nan")])) == "nan"
    assert garbage(torch.tensor([1.0, float("inf")])) == "inf"
    assert garbage(torch.tensor([0.0, float("-inf")])) is None  # an attention mask
    assert garbage(torch.tensor([1.0, 1e-40])) == "denormal"
    assert garbage(torch.tensor([1.0, 1e-30], dtype=torch.bfloat16)) is None
    assert garbage(torch.arange(4)) is None

    module = nn.Module()
    module.register_buffer("table", torch.tensor([2.0, 4.5e-41]), persistent=False)
    (problem,) = buffer_problems(module, "post-wrap", None)
    assert (problem.name, problem.reason) == ("table", "denormal")


def test_ties_seen_on_a_real_model_and_a_loader_that_breaks_them(gemma3):
    import copy

    from fsdpcheck.model.state import tie_record

    pair = (("lm_head.weight", "model.embed_tokens.weight"),)
    assert tie_record(gemma3, "pre-wrap") == TieRecord("pre-wrap", pair, pair)
    model = copy.deepcopy(gemma3)
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    assert tie_record(model, "load") == TieRecord("load", (), pair)
    # Sharing the storage (same view) is a tie even through two Parameter objects.
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.data)
    assert tie_record(model, "load").shared == pair


def test_views_of_one_flat_allocation_are_not_ties():
    from fsdpcheck.model.state import shared_parameters

    flat = torch.zeros(8)
    module = nn.Module()
    module.a = nn.Parameter(flat[:4])
    module.b = nn.Parameter(flat[4:])
    assert shared_parameters(module) == ()


def test_float16_rope_frequencies_below_the_normal_range_are_not_garbage() -> None:
    import torch

    from fsdpcheck.model.state import garbage

    base, dim = 1e6, 256
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert garbage(inv_freq.to(torch.float16)) is None
    assert garbage(torch.tensor([8.0, -7.00649e-39])) == "denormal"


def test_the_hazard_fixture_is_checked_against_what_its_own_class_computes():
    # A swapped RoPE table (hazard-equal: equal sizes, other bases) is caught by the rebuild;
    # the clean twin is not.
    from fsdpcheck.model.build import _from_config
    from fsdpcheck.model.presets import PRESETS
    from fsdpcheck.model.state import buffer_problems, buffer_reference

    model = _from_config(PRESETS["hazard-equal"].make_config(), False)
    assert buffer_reference(model) is not None
    assert buffer_problems(model, "load", buffer_reference(model)) == ()
    rope = model.model.rotary_emb
    with torch.no_grad():
        full = rope.full_attention_inv_freq.clone()
        rope.full_attention_inv_freq.copy_(rope.sliding_attention_inv_freq)
        rope.sliding_attention_inv_freq.copy_(full)
    problems = buffer_problems(model, "load", buffer_reference(model))
    assert {(p.name, p.reason) for p in problems} == {
        ("model.rotary_emb.full_attention_inv_freq", "differs"),
        ("model.rotary_emb.sliding_attention_inv_freq", "differs"),
    }
