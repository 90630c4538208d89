"""State-check digests: what the value, tie, buffer and config checks cost on one rank of a
Gemma3-1B-shaped model, against its build and one-thread blake2b."""

from __future__ import annotations

import json

from bench.measure import median, run_worker
from bench.result import Line, Row
from bench.settings import Settings, shown, worker
from bench.shapes import GEMMA3_1B
from bench.text import fmt_ms, fmt_s


def row_digests(s: Settings) -> Row:
    row = Row(
        "digests",
        "state-check digests",
        "what the state checks (issue: values, ties, buffers, config) cost on one rank of a "
        "Gemma3-1B-shaped model (bfloat16, deterministic fill), against its build",
    )
    model = s.scratch / "gemma3-1b-shaped"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps(GEMMA3_1B if not s.quick else {**GEMMA3_1B, "num_hidden_layers": 2}, indent=2)
    )
    proc = run_worker("digests", "--model", str(model), "--repeats", str(s.repeats), timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@bench ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"workers/digests.py failed: {proc.stderr[-2000:]}")
    record = json.loads(lines[-1][len("@bench ") :])
    seconds = {k: median(v) for k, v in record["seconds"].items()}
    build = record["build_seconds"]
    gb = record["parameter_bytes"] / 1e9
    digests = seconds["fingerprint + parameter digests"] - seconds["layout fingerprint"]
    blake = seconds["blake2b of every parameter (one thread)"]
    row.raw = record
    row.lines.append(
        Line(
            "parameter digests / blake2b",
            f"{digests / blake:.2f}×",
            "< 1× (faster than one-thread blake2b)",
            digests < blake,
            f"{fmt_s(digests)} for {gb:.2f} GB ({gb / max(digests, 1e-9):.1f} GB/s) vs blake2b "
            f"{fmt_s(blake)} ({gb / max(blake, 1e-9):.1f} GB/s); build {fmt_s(build)} "
            f"({record['init_values']})",
            digests / blake,
        )
    )
    others = {k: v for k, v in seconds.items() if "blake2b" not in k and "parameter" not in k}
    total = sum(others.values())
    row.lines.append(
        Line(
            "other state checks / build",
            f"{total / build:.3f}×",
            "informational",
            None,
            "; ".join(f"{k} {fmt_ms(v)}" for k, v in others.items()),
            total / build,
        )
    )
    row.notes.append(
        "Parameter digests run only where values must agree across ranks and are real: "
        "`--init all`, and `check_model` on a script's own model (each rank digests its local "
        "shards, so a rank's work is model / world). They use the verify checksum "
        "(fsdpcheck/model/checksum.py: weighted row and column sums of a grid of 64-bit "
        "words, on the tensor's own device, over this rank's share of the cores). Buffers are "
        "digested in every fingerprint; the buffer check rebuilds the model's class from its "
        f"config with parameters on meta, so it costs about one meta build. Command: "
        f"{shown(worker('digests'))}."
    )
    return row
