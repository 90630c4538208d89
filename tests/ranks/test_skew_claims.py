"""What a ``step`` finding on a size skew says the unwatched job would have done on gloo
(``checks/step.py``'s ``_SKEW``: a larger receive buffer filled in front, silently; the rank
whose buffer is smaller aborted; on an all-gather, the rank with the larger shard left with a
wrong result), checked against real gloo collectives on two ranks with no fsdpcheck in the
job (issue 37: the finding said gloo aborts the receiver, while gloo filled rank 1's larger
buffer silently). One job per case: an abort ends its process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpcheck.checks.step import _SKEW
from fsdpcheck.children.launch import LaunchResult, launch
from tests.conftest import QUIET_ENV, REPO

WORKER = REPO / "tests" / "workers" / "gloo_skew_worker.py"
ABORT = "op.preamble.length <= op.nbytes"
SENT = [1.0, 2.0, 3.0, 4.0]  # rank 0's 4 elements; a receiver's buffer starts as -1s


def _run(case: str, out: Path) -> tuple[LaunchResult, dict[int, list[float]]]:
    result = launch([str(WORKER), case, str(out)], 2, env=QUIET_ENV, timeout=90)
    held = {
        rank: json.loads((out / f"rank{rank}.json").read_text())["held"]
        for rank in (0, 1)
        if (out / f"rank{rank}.json").is_file()
    }
    return result, held


@pytest.mark.parametrize("case", ["broadcast-larger", "send-larger"])
def test_a_larger_receive_buffer_is_filled_in_front_and_both_ranks_carry_on(tmp_path, case):
    result, held = _run(case, tmp_path)
    assert result.codes == [0, 0], result.output(1)[-2000:]
    assert held[1] == SENT + [-1.0] * 4
    assert "fills a larger receive buffer in front and carries on silently" in _SKEW


def test_a_smaller_receive_buffer_aborts_that_rank(tmp_path):
    result, held = _run("broadcast-smaller", tmp_path)
    assert result.codes[1] not in (0, None), result.output(1)[-2000:]
    assert ABORT in result.output(1)
    assert 1 not in held
    if 0 in held:  # the source's side completed (or its peer's abort reached it first)
        assert held[0] == SENT
    assert f"aborts the rank whose buffer is smaller than what reaches it (`{ABORT}`)" in _SKEW


def test_on_an_all_gather_the_smaller_slot_aborts_and_the_larger_shard_is_never_right(tmp_path):
    # rank 0 expects 4 elements from rank 1, which sends 8: rank 0 aborts. Rank 1 most often
    # carries on holding a gather that is not one (measured 3 runs in 4); otherwise its read
    # fails when rank 0's process is gone. Never a correct result on either rank.
    result, held = _run("all-gather-larger", tmp_path)
    assert result.codes[0] not in (0, None), result.output(0)[-2000:]
    assert ABORT in result.output(0)
    if 1 in held:
        assert result.codes[1] == 0 and held[1] != SENT + [-1.0] * 8
    else:
        # gloo words a vanished peer either way, by whether the socket saw a reset or an EOF
        gone = ("Connection reset by peer", "Connection closed by peer")
        assert any(m in result.output(1) for m in gone), result.output(1)[-2000:]
