"""The report's note when ranks share no PYTHONHASHSEED (Ray actors, a launcher that sets none):
agreement on this run says nothing about the next one, so the report says so and points to the
probe. Synthetic records and slots; the audit's own assembly."""

from __future__ import annotations

from dataclasses import replace

from synthetic import FULL, SLIDING, state_record, tensor

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.checks.hash_seed import hash_seed_note
from fsdpcheck.distributed.environment import seed_tag
from fsdpcheck.distributed.gather import _pack_slot, _unpack_slot
from fsdpcheck.report import AuditOutcome, assemble

BUFFERS = [tensor(FULL, (16,), persistent=False), tensor(SLIDING, (8,), persistent=False)]


def _record(rank: int, hash_seed: str):
    record = state_record(rank, pre=(BUFFERS, []))
    return replace(record, env=replace(record.env, hash_seed=hash_seed))


def _warnings(*seeds: str) -> list[str]:
    records = {rank: _record(rank, seed) for rank, seed in enumerate(seeds)}
    report = assemble(AuditOutcome(gathered_from(records)), None)
    return [w for w in report.warnings if w.startswith("no common hash seed")]


def test_randomised_ranks_get_the_note_naming_the_risk_and_the_probe():
    [note] = _warnings("random", "random")
    assert "every rank runs with hash randomisation on" in note
    assert "differently between ranks on another run" in note
    assert "fsdpcheck.probe(build)" in note and "--probe" in note


def test_one_randomised_rank_or_different_fixed_seeds_get_the_note():
    [note] = _warnings("0", "random")
    assert "rank 1 runs with hash randomisation on" in note
    [note] = _warnings("0", "1")
    assert "different PYTHONHASHSEED values (rank 0: 0; rank 1: another value)" in note


def test_a_fixed_common_seed_gets_no_note_and_neither_does_one_rank():
    assert _warnings("0", "0") == []
    assert _warnings("17", "17", "17") == []
    assert _warnings("random") == []


def test_the_note_reads_every_rank_from_the_gather_slots():
    # Agreeing ranks send rank 0 only their slot: the seed's tag travels in its flags byte.
    raw = _pack_slot("ab" * 16, "host", 1 | seed_tag("random") << 1)
    assert _unpack_slot(raw)[0] == 1  # meta flag only: randomised is tag 0
    raw = _pack_slot("ab" * 16, "host", 1 | seed_tag("42") << 1)
    flags = _unpack_slot(raw)[0]
    assert flags & 1 and flags >> 1 == seed_tag("42") == 43
    # Rank 0 holds only its own record (seed 0); rank 3's slot says it is randomised.
    tags = {0: seed_tag("0"), 1: seed_tag("0"), 2: seed_tag("0"), 3: seed_tag("random")}
    [note] = hash_seed_note(tags, {0: "0"})
    assert "rank 3 runs with hash randomisation on" in note
    assert hash_seed_note({r: seed_tag("5") for r in range(4)}, {0: "5"}) == ()
    [note] = hash_seed_note({0: seed_tag("5"), 1: seed_tag("6")}, {0: "5"})
    assert "different PYTHONHASHSEED values" in note


def test_after_a_probe_the_note_points_to_its_result():
    [note] = hash_seed_note({}, {0: "random", 1: "random"}, probed=True)
    assert "--probe built this model under other seeds" in note


def test_a_builder_function_is_named_so_a_child_interpreter_can_import_it():
    import pytest

    from fsdpcheck.errors import InputError
    from fsdpcheck.model.builder import builder_spec
    from fsdpcheck.model.hazard import HazardForCausalLM

    assert (
        builder_spec("examples/verl_worker.py:build_actor") == "examples/verl_worker.py:build_actor"
    )
    assert builder_spec(hash_seed_note) == "fsdpcheck.checks.hash_seed:hash_seed_note"
    assert builder_spec(HazardForCausalLM) == "fsdpcheck.model.hazard:HazardForCausalLM"
    for unimportable in (lambda: None, HazardForCausalLM.forward):
        with pytest.raises(InputError, match="cannot be imported by a child process"):
            builder_spec(unimportable)


def test_where_this_run_found_orders_that_differ_the_note_says_they_may_come_from_it():
    # The README's demo: seeds 0 and 1, and the two RoPE buffers in another order on rank 1.
    records = {0: _record(0, "0"), 1: _record(1, "1")}
    swapped = replace(records[1].pre_wrap, buffers=tuple(reversed(records[1].pre_wrap.buffers)))
    records[1] = replace(records[1], pre_wrap=swapped)
    report = assemble(AuditOutcome(gathered_from(records)), None)
    assert "buffer-order" in [f.kind for f in report.findings]
    [note] = [w for w in report.warnings if w.startswith("no common hash seed")]
    assert "the order findings of this run may come from it" in note
    assert "even though this run agrees" not in note
