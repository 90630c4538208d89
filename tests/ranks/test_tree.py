"""The agreement trees on 5 real gloo ranks (tests/workers/tree_worker.py): ``span`` over the
side channel, and the watch's store tree with its clean twin, a differing member, an ended
member and a silent one."""

from __future__ import annotations

import pytest
from conftest import run_worker_ranks

WORLD = 5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tree")
    result, records = run_worker_ranks(
        "tree_worker.py", out, [], seeds=(1,) * WORLD, nprocs=WORLD, timeout=180
    )
    assert result.codes == [0] * WORLD, result.output(0)[-3000:]
    return records


def test_span_gives_every_rank_each_words_least_and_greatest_and_the_roots_attachment(ranks):
    for rank in ranks:
        got = rank["span"]
        assert got["low"] == [7, 0, -(WORLD - 1)] and got["high"] == [7, WORLD - 1, 0]
        assert got["same"] == [True, False]
        assert got["attachment"] == "from 3"  # the root was group index 3, not 0
    # A binary tree: no rank sends more than three messages, whatever the world size.
    assert max(r["span"]["sent"] for r in ranks) <= 3 * 8 * (2 * 3 + 2)


def test_groups_of_four_and_three_span_as_a_star_with_receives_posted_ahead(ranks):
    for size, members in ((4, [0, 1, 2, 3]), (3, [1, 2, 4])):
        got = [ranks[m]["small"][str(size)] for m in members]
        for entry in got:
            assert entry["low"] == [7, 0, -(size - 1)] and entry["high"] == [7, size - 1, 0]
            assert entry["attachment"] == f"root {size - 2}"
        # A star: the root sends one message down to each other member, each of them one up
        down = 8 * (2 * 3 + 2)
        assert [e["sent"] for e in got if e["root"]] == [(size - 1) * down]
        assert all(e["sent"] == 8 * 2 * 3 for e in got if not e["root"])


def test_members_that_agree_cost_each_rank_a_few_store_calls_per_collective(ranks):
    for me, rank in enumerate(ranks):
        got = rank["agree"]
        assert got["raised"] == "" and got["at"] is None
        # At most four sets and reads per collective, whatever the group's size (polls apart)
        assert max(got["calls"]) <= 4, got["calls"]
        # 3 world collectives, and 3 on the group of ranks 0-2 for its members only
        assert got["exchanges"] == (6 if me < 3 else 3)
        assert got["bytes"] / got["exchanges"] < 200


def test_a_member_issuing_another_size_is_named_by_every_member(ranks):
    for rank in ranks:
        got = rank["differ"]
        assert got["raised"] == "diverged" and got["at"] == 2, got
        assert got["reason"] == "their sizes differ"


def test_a_member_that_finished_its_step_stops_every_other_member_there(ranks):
    for me, rank in enumerate(ranks):
        got = rank["ended"]
        if me == 3:
            assert got["raised"] == "" and got["at"] is None
            continue
        assert got["raised"] == "diverged" and got["at"] == 2, got
        assert got["peers"]["3"] == "finished", got


def test_a_silent_member_is_named_within_the_timeout(ranks):
    for me, rank in enumerate(ranks):
        if me == 3:
            continue
        got = rank["silent"]
        assert got["raised"] == "lost: silent [3]", got
        assert got["seconds"] < 3.0 + 2.0


def test_without_a_store_the_world_agrees_over_the_side_channel(ranks):
    for rank in ranks:
        got = rank["nostore-differ"]
        assert got["raised"] == "diverged" and got["at"] == 2, got
        assert got["exchanges"] == 3


def test_a_collective_whose_digests_differ_is_never_issued_even_when_no_field_says_why(ranks):
    # Issue 37: the members' digests differed, no compared field named why, and the
    # all_to_all was issued. Issued, gloo would raise (a list of one tensor too many).
    for rank in ranks:
        got = rank["unnamed"]
        assert got["raised"] == "diverged" and got["at"] == 2, got
        assert got["reason"].startswith("their digests differ but no compared field"), got
