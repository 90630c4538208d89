"""The benchmarks' own code (scripts/bench): the entry point, and the report's words, which must
say what was measured (an estimate is never a goal met; a slot size is the bytes counted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # ``bench`` as ``python scripts/bench`` imports it

from bench.markdown import to_markdown  # noqa: E402
from bench.result import Row  # noqa: E402
from bench.rows import ROWS  # noqa: E402
from bench.rows.scale import paper_estimate, span_lines, tree_projection  # noqa: E402
from bench.rows.verdict import watchdog_estimate  # noqa: E402
from bench.rows.weight_sync import slow_reads  # noqa: E402
from bench.text import byte_size  # noqa: E402

META = {
    "command": "python scripts/bench",
    "make": True,
    "date": "today",
    "seconds": 1.0,
    "repeats": 3,
    "quick": False,
    "machine": {
        "cores": 2, "cpu": "cpu", "memory_gib": 1, "os": "os", "python": "3",
        "torch": "2", "transformers": "5", "fsdpcheck": "0",
    },
    "load_before": [0.1, 0.1, 0.1],
    "load_after": [0.1, 0.1, 0.1],
}  # fmt: skip


def test_every_row_module_is_registered_and_the_entry_point_lists_them() -> None:
    modules = {p.stem for p in (ROOT / "scripts" / "bench" / "rows").glob("*.py")}
    assert modules - {"__init__", "verify_floor"} == set(ROWS)
    shown = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench"), "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for flag in ("--quick", "--only", "--repeats", "--out", "--merge"):
        assert flag in shown
    assert all(name in shown for name in ROWS)


def test_the_watchdog_ratio_is_an_estimate_and_no_goal_met() -> None:
    line = watchdog_estimate(4.0)
    assert line.met is None
    assert "estimate" in line.what and "estimate" in line.result
    assert line.value == 150.0
    row = Row("verdict", "time to verdict", "compare", lines=[line])
    table = [ln for ln in to_markdown([row], META).splitlines() if ln.startswith("| time to")]
    assert table == [f"| time to verdict | {line.what} | 150× (estimate) | {line.goal} | — |"]


def test_the_agreement_rounds_are_judged_on_bytes_per_rank_and_projected_from_the_depth() -> None:
    def spans(total: dict[int, int], words: dict[int, int] | None = None) -> dict[int, dict]:
        out = {}
        for w, b in total.items():
            variants = {
                "layout": {"sent_max_other": b, "rank0_seconds_median": 0.001,
                           "attached": 4096},
                "watch": {"sent_max_other": 384, "rank0_seconds_median": 0.001, "attached": 0},
            }  # fmt: skip
            if words is not None:
                variants["layout-words"] = {
                    "sent_max_other": words[w], "rank0_seconds_median": 0.001, "attached": 0
                }  # fmt: skip
            out[w] = {"variants": variants}
        return out

    # The measured figures of issue 37: the words are constant, the total is the capacity
    # forwarded twice, and 160 B at 2 ranks (no rank forwards) is no baseline for it.
    issue = spans({2: 160, 8: 8672, 256: 8672}, words={2: 160, 8: 480, 256: 480})
    words, total, watch = span_lines(issue)
    assert words.met and "2: 160 B, 8: 480 B, 256: 480 B" == words.result
    assert total.met and total.goal.startswith("≤ the words + 2 × the inline capacity")
    assert "2: 160 B, 8: 8672 B, 256: 8672 B" == total.result and watch.met
    grown, _, _ = span_lines(spans({2: 160, 256: 9000}, words={2: 160, 256: 600}))
    assert grown.met is False
    over, _ = span_lines(spans({2: 160, 256: 9000}, words={2: 160, 256: 480}))[1:]
    assert over.met is False  # more than the words and the capacity twice
    # Results from before the words were measured apart: nothing is judged on the total.
    old_words, old_total, _ = span_lines(spans({2: 160, 8: 131552, 256: 8672}))
    assert old_words.met is None and old_total.met is None
    trees = {
        2: {"slowest_seconds_per_collective": 0.002, "sets_and_reads_per_rank_max": 4,
            "bytes_per_rank_max": 108},
        256: {"slowest_seconds_per_collective": 0.2, "sets_and_reads_per_rank_max": 4,
              "bytes_per_rank_max": 108},
    }  # fmt: skip
    text = tree_projection(trees)
    # one level measured at 2 ranks (depth 1), 14 levels at 16,384 ranks
    assert "Projection, not a measurement" in text and "14 levels" in text
    assert "about 28.00 ms per collective" in text and "65,536 calls" in text
    estimate = paper_estimate({2: {"sent_max_other": 121, "sent_rank0": 8}})
    assert "one 121-byte slot and receives rank 0's 8-byte header" in estimate


def test_a_float32_sum_in_its_slow_mode_is_named_and_not_taken_for_one_read() -> None:
    def rank(r: int, as_float32: list[float], own: list[float]) -> dict:
        return {"rank": r, "seconds": {"torch.sum": as_float32, "torch.sum, no dtype": own}}

    # Measured on this VM: 718-810 ms against 42-44 ms in one process, 77 ms in the other.
    ranks = [rank(0, [0.077, 0.071, 0.119], [0.044, 0.042]), rank(1, [0.759, 0.71], [0.042])]
    assert slow_reads(ranks) == [1]
    assert slow_reads(ranks[:1]) == []  # 1.8x its own sum: the conversion's cost, not the mode


def test_byte_size_names_one_size_or_the_range() -> None:
    assert byte_size([121, 121]) == "121-byte"
    assert byte_size([130, 121]) == "121- to 130-byte"


def test_the_rss_wrapper_reports_a_command_that_ends_with_os_exit(tmp_path: Path) -> None:
    """fsdpcheck's CLI ends with os._exit once its exit handlers ran; the peak RSS still comes
    out (the audit, init and trainer rows read it)."""
    script = tmp_path / "ends.py"
    script.write_text(
        "from fsdpcheck.process import exit_skipping_teardown\nexit_skipping_teardown(0)\n"
    )
    wrapper = ROOT / "scripts" / "bench" / "workers" / "rss.py"
    done = subprocess.run(
        [sys.executable, str(wrapper), str(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("@rss ")], done.stderr


def test_the_init_rows_stages_add_up_to_the_wall() -> None:
    """Rank 0's stages, the other stages and the time outside them make up each run's wall."""
    from bench.rows.init import _stage_medians

    run = {"build": 2.0, "wrap": 0.5, "load": 3.0, "verify": 0.5, "resolve": 0.1}
    figures = {"wall": [10.0], "report": [{"timings": run}]}
    stages = _stage_medians(figures)
    assert stages["load"] == 3.0 and stages["gather"] == 0.0
    assert stages["other stages"] == 0.1
    assert abs(sum(stages.values()) - 10.0) < 1e-9


def test_rotated_puts_each_variant_first_in_turn_and_varies_successors() -> None:
    from bench.measure import rotated

    two = [rotated(["a", "b"], turn) for turn in range(4)]
    assert [order[0] for order in two] == ["a", "b", "a", "b"]
    three = [rotated(["a", "b", "c"], turn) for turn in range(6)]
    assert {order[0] for order in three} == {"a", "b", "c"}
    after_a = {order[order.index("a") + 1] for order in three if order[-1] != "a"}
    assert after_a == {"b", "c"}


def test_a_paired_ratio_cancels_what_moves_both_launches_of_a_round() -> None:
    from bench.measure import median, paired_ratio

    # The host was 20 % slower for all of round 3 and for round 2's bare launch: medians taken
    # apart compare the run's quiet minutes with the bare script's slow ones.
    bare, run = [1.0, 1.2, 1.2], [1.01, 1.01, 1.212]
    assert round(paired_ratio(run, bare), 3) == 1.01
    assert round(median(run) / median(bare), 3) == 0.842


def test_detail_costs_nothing_when_its_collectives_add_under_one_percent() -> None:
    from bench.rows.step import against_detail_met, detail_share

    # DETAIL's job ran 3 % slower than the plain job (launch to launch), its check of each
    # collective 1.3 ms: 80 collectives are 0.26 % of a 40 s step.
    share = detail_share(0.0013, 80, 40.0)
    assert round(share, 4) == 0.0026
    assert against_detail_met(40.0, 42.4, 41.2, share)  # 1.06x the plain step
    assert not against_detail_met(40.0, 50.0, 41.2, share)  # 1.25x: past the floor's goal
    # A DETAIL that costs 5 % of the step: check_step must then match it.
    costly = detail_share(0.025, 80, 40.0)
    assert not against_detail_met(40.0, 42.4, 41.2, costly)
    assert against_detail_met(40.0, 42.4, 42.5, costly)
    assert detail_share(-0.0001, 80, 40.0) == 0.0


def test_detail_s_cost_per_collective_compares_the_two_jobs_small_all_reduces() -> None:
    from bench.rows.step import detail_per_collective

    def job(rank: int, small_plain: list[float]) -> dict:  # workers/step.py's record, in part
        return {"rank": rank, "small": {"n": 200, "plain": small_plain, "watched": []}}

    # The slower rank's time per repeat, then the median: 0.37 s under DETAIL, against the
    # plain job's 0.11 s.
    theirs = [job(0, [0.36, 0.37, 0.40]), job(1, [0.37, 0.35, 0.38])]
    total, per = detail_per_collective(0.11, theirs)
    assert round(total, 3) == 0.37
    assert round(per * 1e6) == 1300  # (0.37 - 0.11) s over 200 all_reduces
