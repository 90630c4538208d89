"""The probe: ``probe(tiny-gemma4, seeds=8)`` against one meta build in a child."""

from __future__ import annotations

import time

from bench.measure import median
from bench.result import Line, Row
from bench.settings import Settings
from bench.text import fmt_s
from fsdpcheck.children.launch import usable_cores  # torch-free

SEEDS = 8
GOAL = 5  # 8 seeds / one build


def row_probe(s: Settings) -> Row:
    from fsdpcheck.children import probe as probe_module
    from fsdpcheck.children.launch import JOB_ENV, launch

    row = Row("probe", "probe", f"`probe(tiny-gemma4, seeds={SEEDS})` vs one meta build in a child")
    model = "tiny-gemma4"
    argv = ["-m", "fsdpcheck.children.probe", "--child", "--model", model]
    probed = f"probe ({SEEDS} seeds)"
    times: dict[str, list[float]] = {probed: [], "one build": []}
    verdicts = set()
    for _ in range(s.repeats):
        start = time.perf_counter()
        outcome = launch(argv, 1, env={**JOB_ENV, "PYTHONHASHSEED": "0"}, timeout=300.0)
        times["one build"].append(time.perf_counter() - start)
        if outcome.codes != [0]:
            raise RuntimeError(f"one build failed: {outcome.ranks[0].stderr[-2000:]}")
        start = time.perf_counter()
        result = probe_module.probe(model, seeds=SEEDS)
        times[probed].append(time.perf_counter() - start)
        verdicts.add(result.verdict)
    row.raw = {"seconds": times, "verdicts": sorted(verdicts), "cores": usable_cores()}
    one, many = median(times["one build"]), median(times[probed])
    ratio = many / one
    row.lines.append(
        Line(
            f"{SEEDS} seeds / one build",
            f"{ratio:.2f}×",
            f"≤ {GOAL}×",
            ratio <= GOAL,
            f"probe {fmt_s(many)}, one build {fmt_s(one)} ({usable_cores()} cores, "
            f"{min(SEEDS, usable_cores())} children at a time); verdict "
            f"{', '.join(sorted(verdicts))}",
            ratio,
        )
    )
    cores = usable_cores()
    row.notes.append(
        "fsdpcheck.children.probe builds the model on meta in one child interpreter per hash "
        f"seed; on {cores} cores {SEEDS} children run {min(SEEDS, cores)} at a time, so the "
        f"floor is about {-(-SEEDS // min(SEEDS, cores))} × one child (interpreter, torch and "
        "transformers imports dominate a child)."
    )
    return row
