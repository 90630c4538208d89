"""``fsdpcheck run`` on a real script against the bare script: the same job, the same arguments
(``examples/scripts/fsdp2_train.py``: meta init, ``fully_shard``, ``reset_parameters``, AdamW)."""

from __future__ import annotations

import re
import time

from bench.measure import marked, median, paired_ratio, require, rotated, run_ranks
from bench.result import Line, Row
from bench.settings import REPO, Settings, shown, worker
from bench.text import fmt_mib, fmt_s
from fsdpcheck.children.launch import LaunchResult  # torch-free

SCRIPT = REPO / "examples" / "scripts" / "fsdp2_train.py"
FIRST_GOAL, AFTER_GOAL, RSS_GOAL = 1.30, 1.01, 1.10
WARMUP_AND_EXTRA_ROUNDS = 4  # a warm-up round and 3 more than the noisy rows' count
_STEP = re.compile(r"^step (\d+) loss \S+ \(([\d.]+) s, at ([\d.]+)\)$", re.M)


def row_run(s: Settings) -> Row:
    layers, dim, steps = (2, 64, 6) if s.quick else (8, 512, 12)
    args = [str(SCRIPT), "--n-layers", str(layers), "--dim", str(dim), "--steps", str(steps)]
    row = Row(
        "run",
        "fsdpcheck run vs the bare script",
        f"`fsdpcheck run {shown(SCRIPT)}` against `python {shown(SCRIPT)}` ({layers} layers, "
        f"dim {dim}, {steps} steps, 2 ranks, gloo), both through {shown(worker('rss'))}: the "
        "time from launch to the end of step 1 (the watched step), the median of the steps "
        "after it, each process's peak RSS",
    )
    variants = {"bare": args, "run": ["-m", "fsdpcheck", "run", *args]}
    figures = {v: {"first": [], "after": [], "rss": []} for v in variants}
    aborts = dict.fromkeys(variants, 0)
    # From launch to launch the median step moves by up to 10 % here, and the host's load
    # moves whole minutes of launches: many short rounds of one launch each, each compared
    # within its round (paired_ratio), where 5 rounds of 24 steps gave 0.90x to 1.03x for
    # code that is not on the step's path.
    rounds = s.noisy_repeats + (0 if s.quick else WARMUP_AND_EXTRA_ROUNDS)
    run_first: list[bool] = []  # per measured round: did the run launch first
    for attempt in range(rounds):
        order = rotated(list(variants), attempt)
        warm_up = attempt == 0 and not s.quick  # page cache, .pyc files: not counted
        if not warm_up:
            run_first.append(order[0] == "run")
        for variant in order:
            started = time.time()
            result = run_ranks([worker("rss"), *variants[variant]], 2)
            found = [(int(n), float(took), float(at)) for n, took, at in _STEP.findall(
                result.ranks[0].stdout
            )]  # fmt: skip
            usage = marked(result, "@rss ", "stderr")
            if _aborted_at_exit(result, found, usage, steps):
                aborts[variant] += 1
            else:
                require(result, [0, 0], f"{variant} script")
            if len(found) != steps:
                raise RuntimeError(f"{variant}: {len(found)} step lines of {steps}")
            if warm_up:
                continue
            figures[variant]["first"].append(found[0][2] - started)
            figures[variant]["after"].append(median([took for _, took, _ in found[1:]]))
            figures[variant]["rss"].append(max(u["maxrss"] for u in usage))
    row.raw = {**figures, "aborted_at_exit": aborts, "run_first": run_first}
    bare, run = figures["bare"], figures["run"]
    first = paired_ratio(run["first"], bare["first"])
    after = paired_ratio(run["after"], bare["after"])
    rss = median(run["rss"]) / median(bare["rss"])
    row.lines.append(
        Line(
            "launch to the end of step 1",
            f"{first:.2f}×",
            f"≤ {FIRST_GOAL:.2f}×",
            first <= FIRST_GOAL,
            f"run {fmt_s(median(run['first']))}, bare {fmt_s(median(bare['first']))} (medians, "
            f"{median(run['first']) / median(bare['first']):.2f}×); "
            f"{_higher(run['first'], bare['first'])}; "
            f"{_by_order(run['first'], bare['first'], run_first)}",
            first,
        )
    )
    row.lines.append(
        Line(
            "a step after the watched one (median)",
            f"{after:.3f}×",
            f"≤ {AFTER_GOAL:.2f}×",
            after <= AFTER_GOAL,
            f"run {fmt_s(median(run['after']))}, bare {fmt_s(median(bare['after']))} (medians, "
            f"{median(run['after']) / median(bare['after']):.3f}×); "
            f"{_higher(run['after'], bare['after'])}; from launch to launch the median step "
            f"ranged {_spread(bare['after'])} bare and {_spread(run['after'])} run",
            after,
        )
    )
    row.lines.append(
        Line(
            "peak RSS per process",
            f"{rss:.2f}×",
            f"≤ {RSS_GOAL:.2f}×",
            rss <= RSS_GOAL,
            f"run {fmt_mib(median(run['rss']))}, bare {fmt_mib(median(bare['rss']))}",
            rss,
        )
    )
    row.notes.append(
        f"{len(run['first'])} rounds"
        + ("" if s.quick else " after one warm-up round")
        + ", each one launch of the bare script and one under `fsdpcheck run`, which goes "
        "first alternating; each time ratio is the median of the rounds' own ratios (a round's "
        "two launches run one after the other, so the host's load moves both alike), and the "
        "line shows the ratio of the medians beside it; peak RSS is the ratio of the medians. "
        "The time to "
        "step 1's end counts from the launch: it includes "
        "fsdpcheck's own imports, the side channel, the model check before the first forward "
        "and the watched step. After it no fsdpcheck code is on the step's path: no hook, "
        "patch, dispatch mode or thread of its own (tests/ranks/test_run.py reads them from "
        "inside a script after its watched steps)."
    )
    if any(aborts.values()):
        row.notes.append(
            "The script's own exit aborted (SIGABRT, `terminate called without an active "
            "exception`) in the interpreter's teardown in "
            f"{aborts['bare']} of {rounds} bare runs and {aborts['run']} of {rounds} under "
            "`fsdpcheck run`, every step and the peak RSS already reported; such a run counts "
            "like the others. It is torch's: DTensor's caches keep the destroyed process "
            "groups, whose gloo threads still run while the interpreter tears down; "
            "`fsdpcheck run` ends the process once the script's exit handlers have run, "
            "without that teardown (fsdpcheck/process.py)."
        )
    return row


def _aborted_at_exit(result: LaunchResult, found: list, usage: list, steps: int) -> bool:
    """The script finished (every step printed, every rank's peak RSS written by the exit
    handler) and then a rank died in torch's teardown abort, the others exiting 0."""
    codes = result.codes
    aborted = [r for r, code in enumerate(codes) if code != 0]
    return (
        bool(aborted)
        and all(result.aborted_in_teardown(r) for r in aborted)
        and len(found) == steps
        and len(usage) == len(codes)
    )


def _higher(run: list[float], bare: list[float]) -> str:
    higher = sum(a > b for a, b in zip(run, bare, strict=True))
    return f"the run took longer in {higher} of {len(run)} rounds"


def _by_order(run: list[float], bare: list[float], run_first: list[bool]) -> str:
    """The rounds' ratios by which launch went first: where they part, the order moves the
    figure more than the host does."""
    ratios = list(zip([a / b for a, b in zip(run, bare, strict=True)], run_first, strict=True))
    parts = [
        f"{who} first: {median(group):.2f}×"
        for who, group in (
            ("the run", [r for r, was in ratios if was]),
            ("the bare script", [r for r, was in ratios if not was]),
        )
        if group
    ]
    return "by the launch that went first, " + ", ".join(parts)


def _spread(values: list[float]) -> str:
    return f"{fmt_s(min(values))} to {fmt_s(max(values))}" if values else "—"
