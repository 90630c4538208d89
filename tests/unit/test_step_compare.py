"""The step comparison on synthetic traces (fsdpcheck.checks.step): no ranks, no torch."""

from __future__ import annotations

from fsdpcheck.checks.step import (
    FINISHED,
    RAISED,
    CollectiveCall,
    StepNonFinite,
    StepRecord,
    disagreement,
    divergence_finding,
    loss_word,
    non_finite_finding,
    raised_errors,
    watch_cost,
)


def call(module: str | None, numel: int, op: str = "all_gather_into_tensor", seq: int = 3):
    params = (f"{module}.weight",) if module else ()
    return CollectiveCall(seq, op, "default_pg", (0, 1), numel, "float32", module, params)


def diverged(doing: CollectiveCall | None = None, state: str = "") -> StepRecord:
    return StepRecord("diverged", 3, at=3, doing=doing, state=state)


def test_a_clean_step_has_no_finding():
    clean = StepRecord("finished", 8)
    assert divergence_finding({0: clean, 1: clean}) is None
    assert non_finite_finding({0: clean, 1: clean}) is None


def test_an_extra_collective_names_the_rank_that_issued_it_whichever_rank():
    for extra in (0, 1):
        records = {extra: diverged(call("", 1032)), 1 - extra: diverged(state=FINISHED)}
        found = divergence_finding(records)
        assert found.kind == "step" and found.ranks == (extra,)
        assert found.reference_rank == 1 - extra
        assert found.details["issued_by"] == [extra]
        assert found.details["not_issued_by"] == [1 - extra]
        assert "all-gather of the root module" in found.summary
        assert f"rank {extra} issues more collectives" in found.summary


def test_different_modules_of_different_sizes_abort_on_gloo():
    records = {0: diverged(call("layers.0", 1296)), 1: diverged(call("tower", 1064))}
    found = divergence_finding(records)
    assert found.ranks == (1,) and found.details["modules"] == ["layers.0", "tower"]
    assert "sizes differ" in found.summary and "`tower`" in found.summary
    assert found.tensors == ("layers.0.weight", "tower.weight")
    # gloo fills the larger side's buffer and aborts only the smaller side (measured, issue 37).
    assert "gloo fills a larger receive buffer in front and carries on" in found.summary
    assert "aborts the rank whose buffer is smaller" in found.summary
    assert "NCCL blocks on the count mismatch" in found.summary


def test_same_sizes_other_modules_are_a_silent_pairing():
    records = {0: diverged(call("layers.0", 1296)), 1: diverged(call("layers.1", 1296))}
    assert "pair silently" in divergence_finding(records).summary


def test_ranks_doing_the_same_thing_are_one_side():
    records = {
        0: diverged(call("a", 8)),
        1: diverged(call("a", 8)),
        2: diverged(call("b", 8)),
        3: diverged(call("b", 8)),
    }
    found = divergence_finding(records)
    assert found.ranks == (2, 3) and set(found.details["ranks"]) == {"ranks 0,1", "ranks 2,3"}


def test_a_collective_no_fsdp_module_owns_is_named_by_the_script_line():
    mine = CollectiveCall(3, "all_reduce", "default_pg", (0, 1), 1, "float32", where="train.py:42")
    found = divergence_finding({0: diverged(mine), 1: diverged(state=RAISED)})
    assert "all-reduce at train.py:42" in found.summary and "had raised" in found.summary


def test_raised_steps_are_errors():
    records = {0: StepRecord("finished", 2), 1: StepRecord("raised", 2, message="ValueError: x")}
    assert raised_errors(records) == {1: "ValueError: x"}


def test_non_finite_says_where_it_went_first():
    spread = StepNonFinite(grads=("w",), grad_count=4, params=("w",), param_count=4)
    records = {
        0: StepRecord("finished", 6, non_finite=spread),
        1: StepRecord(
            "finished", 6, non_finite=StepNonFinite(loss="nan", grads=("w",), grad_count=4)
        ),
    }
    found = non_finite_finding(records)
    assert found.kind == "non-finite" and found.ranks == (0, 1)
    assert found.details["loss"] == {"1": "nan"}
    assert "loss nan on rank 1" in found.summary and "4 gradients on ranks 0,1" in found.summary
    assert "went first on rank 1" in found.summary


def test_loss_words_and_cost():
    assert [loss_word(v) for v in (1.0, float("nan"), float("inf"), None)] == [
        None,
        "nan",
        "inf",
        None,
    ]
    cost = watch_cost(
        {0: StepRecord("finished", 8, exchanges=9, channel_bytes=576, watch_seconds=0.009)}
    )
    assert cost["us_per_collective"] == 1000.0 and cost["channel_bytes_per_collective"] == 64


def _a2a(send: tuple[int, ...], recv: tuple[int, ...]) -> CollectiveCall:
    return CollectiveCall(
        8, "all_to_all_single", "default_pg", (0, 1), -1, "float32", send=send, recv=recv
    )


def test_a_rank_whose_split_to_itself_shrank_is_named_whichever_rank_compares():
    # Issue 37: rank 1 announced 2 tokens for its own experts and sends itself 1. Every split
    # between two ranks pairs; only the rank's own does not.
    zero, one = _a2a((3, 1), (3, 2)), _a2a((2, 1), (1, 2))
    said = "their splits do not pair (rank 1 sends itself 1 elements and expects 2 from itself)"
    assert disagreement(zero, 0, one, 1) == said
    assert disagreement(one, 1, zero, 0) == said
    # Its clean twin: the same uneven routing with the split to itself kept.
    assert disagreement(zero, 0, _a2a((2, 2), (1, 2)), 1) == ""
    records = {0: diverged(zero), 1: diverged(one)}
    found = divergence_finding(records)
    assert found.ranks == (1,) and "gloo raises on that rank" in found.summary
