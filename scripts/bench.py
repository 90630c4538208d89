"""fsdpcheck's benchmarks (``make bench``): each comparison measured side by side in one run.

Every row runs its variants interleaved (A, B, A, B, ...) so that drift on a shared machine hits
both alike, takes the median of the repeats, and reports the ratio and the raw figures. Ranks are
started by ``fsdpcheck.children.launch`` with the env:// variables and ``OMP_NUM_THREADS=1``
(as torchrun sets it). Writes ``docs/benchmarks.md`` and ``docs/benchmarks.json``.

    .venv/bin/python scripts/bench.py                  # every row, 3 repeats (make bench)
    .venv/bin/python scripts/bench.py --quick          # smoke run: 1 repeat, a smaller model
    .venv/bin/python scripts/bench.py --only load      # one row (repeatable)

``--quick`` and ``--only`` write to a temporary directory unless ``--out`` is given, so a smoke
run never replaces the committed figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdpcheck.children.launch import LaunchResult, launch, usable_cores  # noqa: E402  (torch-free)

SCRIPTS = REPO / "scripts"
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
GIB, MIB = 2**30, 2**20
NCCL_TIMEOUT_S = 600.0  # torch.distributed's default NCCL collective timeout
BUCKET_BYTES = 256 * MIB  # load_full_state_dict's default
ROWS = (
    "audit", "init", "trainer", "cli", "buffers", "load", "gather", "scale", "digests", "probe",
    "verdict",
)  # fmt: skip

# A Llama-3-70B-shaped config: built on meta, it costs what any 70B model costs to describe.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# A Gemma3-1B-shaped text config (google/gemma-3-1b-pt's shapes): 1.0B parameters, bfloat16.
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "sliding_window": 512,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


VERIFY_FLOOR = (
    "Where verify misses 0.5× the load: verify must read every byte twice over, once where it "
    "landed and once in rank 0's source, which only rank 0 holds. Every rank checksums its own "
    "shards (fsdpcheck/model/checksum.py: weighted row and column sums of a grid of 64-bit "
    "words, no multiplication over the data; the digests row measures its speed); meanwhile, "
    "before the "
    "gather, rank 0 checksums the other ranks' slices of its source and compares its own shards "
    "with its source bitwise on a second thread. So on 2 ranks rank 0 reads 1.5× the model "
    "where the load writes 0.5× into each rank, and the three streams share the host's 2 "
    "cores: the ratio moves with how fast the load happened to be (rank 1's page faults, see "
    "below). On a host with more cores each rank's checksum spreads over its share of them. "
    "Profiled: no single-threaded pass over the whole model and no host copy remain; the floor "
    "is rank 0's memory bandwidth over its source."
)


@dataclass
class Line:
    """One measured comparison: the main table shows one line each."""

    what: str
    result: str  # the ratio or value, as shown
    goal: str
    met: bool | None  # None: informational
    figures: str  # the raw figures behind it
    value: float | None = None


@dataclass
class Row:
    name: str
    title: str
    compare: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    date: str | None = None  # when this row was measured
    load: list[float] | None = None  # the load average as it started


@dataclass
class Settings:
    quick: bool
    repeats: int
    scratch: Path
    noisy_repeats: int  # the rows whose runs vary most on a shared machine: audit, load


def rotated(items: Sequence[str], turn: int) -> list[str]:
    """``items`` starting at ``turn``: no variant always runs right after the same other one."""
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_ranks(argv: list[str], n: int, timeout: float = 600.0, **env: str) -> LaunchResult:
    return launch(argv, n, env={**ENV, **env}, timeout=timeout, cwd=str(REPO))


def marked(result: LaunchResult, mark: str, stream: str = "stdout") -> list[dict]:
    """The ``mark {json}`` lines every rank printed, in rank order."""
    found = []
    for rank in result.ranks:
        text = rank.stdout if stream == "stdout" else rank.stderr
        found += [json.loads(ln[len(mark) :]) for ln in text.splitlines() if ln.startswith(mark)]
    return found


def require(result: LaunchResult, codes: Sequence[int | None], what: str) -> None:
    if result.codes != list(codes):
        tail = (result.output(0) + result.output(len(result.ranks) - 1))[-3000:]
        raise RuntimeError(f"{what}: exit codes {result.codes}, expected {list(codes)}\n{tail}")


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.0f} MiB"


# --- rows --------------------------------------------------------------------------------------


def row_audit(s: Settings) -> Row:
    row = Row(
        "audit",
        "audit overhead",
        "`audit --init meta` vs a bare job (import, build on meta, fully_shard, exit), 2 ranks",
    )
    llama = s.scratch / "llama-70b-shaped"
    llama.mkdir(exist_ok=True)
    (llama / "config.json").write_text(json.dumps(LLAMA_70B, indent=2))
    models = {"tiny-gemma4": "tiny-gemma4", "Llama-70B-shaped (meta)": str(llama)}
    rss = [str(SCRIPTS / "bench_rss.py")]
    variants = {
        "bare": lambda m: [*rss, str(SCRIPTS / "bench_bare.py"), "--model", m],
        "audit": lambda m: [*rss, "-m", "fsdpcheck", "audit", "--model", m, "--init", "meta"],
    }
    for label, model in models.items():
        figures: dict[str, dict[str, list]] = {
            v: {"wall": [], "rss": [], "cpu": []} for v in variants
        }
        for attempt in range(s.noisy_repeats + (0 if s.quick else 1)):
            for variant in rotated(list(variants), attempt):
                result = run_ranks(variants[variant](model), 2)
                require(result, [0, 0], f"{variant} {label}")
                usage = marked(result, "@rss ", "stderr")
                if attempt == 0 and not s.quick:
                    continue  # warm-up: page cache, .pyc files
                figures[variant]["wall"].append(result.elapsed)
                figures[variant]["rss"].append(max(u["maxrss"] for u in usage))
                figures[variant]["cpu"].append(max(u["cpu"] for u in usage))
        row.raw[label] = figures
        bare, audit = figures["bare"], figures["audit"]
        wall = median(audit["wall"]) / median(bare["wall"])
        peak = median(audit["rss"]) / median(bare["rss"])
        row.lines.append(
            Line(
                f"{label}: wall",
                f"{wall:.2f}×",
                "≤ 1.10×",
                wall <= 1.10,
                f"audit {fmt_s(median(audit['wall']))}, bare {fmt_s(median(bare['wall']))}; "
                f"best runs {fmt_s(min(audit['wall']))} vs {fmt_s(min(bare['wall']))} "
                f"({min(audit['wall']) / min(bare['wall']):.2f}×); CPU time per process "
                f"{fmt_s(median(audit['cpu']))} vs {fmt_s(median(bare['cpu']))} "
                f"({median(audit['cpu']) / median(bare['cpu']):.2f}×)",
                wall,
            )
        )
        row.lines.append(
            Line(
                f"{label}: peak RSS per process",
                f"{peak:.2f}×",
                "≤ 1.10×",
                peak <= 1.10,
                f"audit {fmt_mib(median(audit['rss']))}, bare {fmt_mib(median(bare['rss']))}",
                peak,
            )
        )
    row.notes.append(
        f"Median of {plural(s.noisy_repeats, 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + ", the two variants in alternating order. "
        "Wall: from starting both ranks to the last one exiting (fsdpcheck.children.launch), "
        "interpreter start-up and imports included, the same for both. Peak RSS: `ru_maxrss` of "
        "each rank "
        "process (scripts/bench_rss.py wraps both alike), the larger of the two ranks. CPU time: "
        "user + system time of the busier rank process, which other work on the machine "
        "stretches far less than wall time."
    )
    if any(line.met is False for line in row.lines):
        row.notes.append(
            "Where the wall ratio misses 1.10×: the audit's own stages (fingerprint, gather, "
            "analyse, render) take tens of milliseconds (cProfile of rank 0: gather 0.3 s, of "
            "which nearly all is waiting for the other rank to finish building; fingerprints and "
            "rendering under 0.05 s); both jobs spend most of their time importing torch and "
            "transformers and building the model. The audit also imports typer and rich and "
            "creates its gloo side channel. The CPU-time ratio above is the cost; on 2 cores "
            "shared with other processes (load average above 1 means ranks wait for a core) "
            "every extra CPU-second of the audit can cost more than a second of wall time."
        )
    return row


def row_cli(s: Settings) -> Row:
    row = Row("cli", "CLI start-up", "`fsdpcheck --help`, `fsdpcheck presets` (wall, one process)")
    exe = Path(sys.executable).with_name("fsdpcheck")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "fsdpcheck"]
    commands = {
        "fsdpcheck --help": [*base, "--help"],
        "fsdpcheck presets": [*base, "presets"],
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(max(3, 2 * s.repeats) + 1):
        for label, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, env={**os.environ, **ENV})
            times[label].append(time.perf_counter() - start)
    for label in times:
        times[label] = times[label][1:]  # the first: cold page cache
    probe = "import sys, fsdpcheck.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    row.raw = {"seconds": times, "heavy_modules_imported_by_cli": heavy.strip()}
    floor = median(times["python -c pass (floor)"])
    for label in ("fsdpcheck --help", "fsdpcheck presets"):
        value = median(times[label])
        row.lines.append(
            Line(
                label,
                fmt_s(value),
                "≤ 0.5 s",
                value <= 0.5,
                f"median of {len(times[label])}; interpreter alone {fmt_s(floor)}",
                value,
            )
        )
    row.notes.append(
        f"Importing `fsdpcheck.cli` loads neither torch nor transformers ({heavy.strip()} of "
        "them in sys.modules): the commands that need them import them when they run."
    )
    return row


def loglog_slope(points: dict[int, float]) -> float | None:
    """Least-squares slope of log(value) over log(key): the exponent of a power law; None with
    fewer than two distinct keys."""
    xs = [math.log(k) for k in points]
    ys = [math.log(max(v, 1e-12)) for v in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def spans_to_seconds(records: list[dict]) -> dict[str, list[float]]:
    """Per method and repeat: the latest rank's end minus the earliest rank's start (every rank
    reads the same monotonic clock), so no closing barrier is timed."""
    out: dict[str, list[float]] = {}
    for method, first in records[0]["spans"].items():
        out[method] = [
            max(r["spans"][method][i][1] for r in records)
            - min(r["spans"][method][i][0] for r in records)
            for i in range(len(first))
        ]
    return out


def row_buffers(s: Settings) -> Row:
    row = Row(
        "buffers",
        "buffer broadcast",
        "200 non-persistent buffers: one broadcast each vs `broadcast_buffers` (validated, "
        "coalesced)",
    )
    repeats = 5 if s.quick else 30
    # Several launches: a launch's processes can land badly on the cores for all its repeats.
    launches = 1 if s.quick else 3
    for world in (2, 4):
        times: dict[str, list[float]] = {}
        ratios = []
        for _ in range(launches):
            argv = [str(SCRIPTS / "bench_buffers.py"), "--repeats", str(repeats)]
            result = run_ranks(argv, world)
            require(result, [0] * world, f"buffers on {world} ranks")
            records = marked(result, "@bench ")
            assert all(r["equal_to_rank0"] for r in records), "buffers differ from rank 0's"
            launch_times = spans_to_seconds(records)
            ratios.append(median(launch_times["per-buffer"]) / median(launch_times["coalesced"]))
            for method, spans in launch_times.items():
                times.setdefault(method, []).extend(spans)
        collectives = records[0]["collectives"]["coalesced"]
        row.raw[f"{world} ranks"] = {
            "times": times,
            "ratios_per_launch": ratios,
            "collectives": records[0]["collectives"],
            "inline": records[0]["inline"],
        }
        per, coalesced, flat, described, exchanged = (
            median(times[k])
            for k in ("per-buffer", "coalesced", "flat-only", "describe", "exchange")
        )
        ratio = median(ratios)
        how = (
            "the layout check, the values riding with it"
            if records[0]["inline"]
            else "the layout check + one flat broadcast per dtype"
        )
        row.lines.append(
            Line(
                f"{world} ranks: validated / flat broadcast alone",
                f"{coalesced / flat:.2f}×",
                "≤ 1.5×",
                coalesced / flat <= 1.5,
                f"broadcast_buffers {fmt_ms(coalesced)}, flat broadcast alone {fmt_ms(flat)}",
                coalesced / flat,
            )
        )
        row.lines.append(
            Line(
                f"{world} ranks: per-buffer / validated",
                f"{ratio:.1f}×",
                "≥ 5×",
                ratio >= 5,
                f"per-buffer {fmt_ms(per)} (200 collectives), broadcast_buffers {fmt_ms(coalesced)}"
                f" ({collectives}: {how}), flat broadcast alone {fmt_ms(flat)} "
                f"({per / flat:.1f}×); the median of {launches} "
                f"launch{'es' if launches > 1 else ''} of {repeats} repeats each, "
                f"{min(ratios):.1f}× to {max(ratios):.1f}×",
                ratio,
            )
        )
        if coalesced / flat > 1.5:
            check = coalesced - flat
            crowded = (
                f" With {world} ranks on {usable_cores()} cores every collective also waits for "
                "processes to be scheduled."
                if world > usable_cores()
                else ""
            )
            cost = (
                f"the safety check costs {fmt_ms(check)} here (the difference to the flat "
                "broadcast alone)"
                if check > 0.05e-3
                else "the safety check is within the noise of the flat broadcast alone here"
            )
            row.notes.append(
                f"{world} ranks: validated over 1.5× the flat broadcast alone. "
                f"`broadcast_buffers` makes {collectives} "
                f"collective(s) ({how}), the unvalidated flat broadcast one; {cost}. Its parts, "
                f"measured alone in the same launches: describing and digesting the 200 buffers "
                f"{fmt_ms(described)} (every rank at once, no collective: a walk of the module "
                "tree, a (name, shape, dtype) per buffer, sorted, and a blake2b of the names, "
                "shapes and dtypes), and the all_to_all of layout slots "
                f"with rank 0's packed values attached {fmt_ms(exchanged)} where the flat "
                f"broadcast with its packing and unpacking takes {fmt_ms(flat)} (the slots are "
                "fixed-size, so the values travel padded to the inline capacity: a rank whose "
                "layout differs must still receive exactly what was sent, or gloo aborts). "
                "Profiled (cProfile, this script's model): what is left is Python work per "
                "buffer and torch's per-call overhead. The flat broadcast alone is "
                f"{per / flat:.1f}× faster than one broadcast per buffer in this run "
                f"({fmt_ms(per / 200)} per collective). The check is the floor of the validated "
                f"path: without it a rank with a different buffer set hangs or is silently "
                f"corrupted.{crowded}"
            )
    return row


def row_load(s: Settings) -> Row:
    size = "quick" if s.quick else "full"
    row = Row(
        "load",
        "full load",
        "fsdpcheck's loader (bucketed) vs DCP `set_model_state_dict(broadcast_from_rank0=True)` "
        "vs accelerate's own `fsdp2_load_full_state_dict` (accelerate "
        f"{version('accelerate')}) vs one raw broadcast of the same bytes; then `verify_load` "
        "after the bucketed load; Llama-shaped fp32 model, 2 ranks (and 4), rank 0 real, the "
        "others on meta",
    )
    methods = ("bucketed", "p2p-floor", "dcp", "accelerate", "raw")
    runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
    rounds = s.repeats + (0 if s.quick else 1)  # 5 methods: 4 rounds keep the row near 5 min
    for attempt in range(rounds):
        warm_up = attempt == 0 and not s.quick
        for method in rotated(methods, attempt):
            argv = [str(SCRIPTS / "bench_load.py"), "--method", method, "--size", size]
            if method == "bucketed":  # verify is timed apart, after the load's closing barrier
                argv.append("--verify")
            result = run_ranks(argv, 2)
            require(result, [0, 0], f"load {method}")
            records = sorted(marked(result, "@bench "), key=lambda r: r["rank"])
            if method == "bucketed":
                row.raw["verified"] = all(r["verified"] for r in records)
                assert row.raw["verified"], "verify_load failed after the bucketed load"
            if not warm_up:
                runs[method].append(records)
    row.raw["runs"] = runs
    nbytes = runs["bucketed"][0][0]["bytes"]
    per_run = {m: [max(r["seconds"] for r in run) for run in runs[m]] for m in methods}
    seconds = {m: median(per_run[m]) for m in methods}
    best = {m: min(per_run[m]) for m in methods}
    warm = median([run[0]["seconds_warm"] for run in runs["raw"]])
    touch = median([run[1]["first_touch"]["seconds"] for m in methods for run in runs[m]])
    touched = runs["bucketed"][0][1]["first_touch"]["bytes"]
    peak = {
        m: [median([run[rank]["peak_rss_load"] for run in runs[m]]) for rank in (0, 1)]
        for m in methods
    }
    base = {
        m: [median([run[rank]["rss_before"] for run in runs[m]]) for rank in (0, 1)]
        for m in methods
    }
    gib_s = {m: nbytes / GIB / seconds[m] for m in methods}
    speedup = gib_s["bucketed"] / gib_s["dcp"]
    vs_raw = seconds["bucketed"] / seconds["raw"]
    vs_floor = seconds["bucketed"] / seconds["p2p-floor"]
    loaded = runs["bucketed"][0][1]
    row.raw["summary"] = {
        "bytes": nbytes,
        "seconds": seconds,
        "best_seconds": best,
        "raw_warm_seconds": warm,
        "first_touch_seconds": touch,
        "first_touch_bytes": touched,
    }
    row.lines.append(
        Line(
            "throughput vs DCP",
            f"{speedup:.2f}×",
            "≥ 2×",
            speedup >= 2,
            f"{nbytes / GIB:.2f} GiB: bucketed {gib_s['bucketed']:.2f} GiB/s "
            f"({fmt_s(seconds['bucketed'])}), DCP {gib_s['dcp']:.2f} GiB/s "
            f"({fmt_s(seconds['dcp'])}); best runs {fmt_s(best['bucketed'])} vs "
            f"{fmt_s(best['dcp'])} ({best['dcp'] / best['bucketed']:.2f}×)",
            speedup,
        )
    )
    vs_accelerate = seconds["accelerate"] / seconds["bucketed"]
    row.lines.append(
        Line(
            "2 ranks: time, accelerate / bucketed",
            f"{vs_accelerate:.2f}×",
            "≥ 2×",
            vs_accelerate >= 2,
            f"accelerate {fmt_s(seconds['accelerate'])}, bucketed {fmt_s(seconds['bucketed'])};"
            f" best runs {fmt_s(best['accelerate'])} vs {fmt_s(best['bucketed'])} "
            f"({best['accelerate'] / best['bucketed']:.2f}×)",
            vs_accelerate,
        )
    )
    verify = median([max(r["verify_seconds"] for r in run) for run in runs["bucketed"]])
    row.raw["summary"]["verify_seconds"] = verify
    row.lines.append(
        Line(
            "verify / load (the same bucketed runs)",
            f"{verify / seconds['bucketed']:.2f}×",
            "≤ 0.5×",
            verify / seconds["bucketed"] <= 0.5,
            f"verify_load {fmt_s(verify)}, load {fmt_s(seconds['bucketed'])}; of the "
            f"{fmt_mib(nbytes)} source, rank 0 checksums rank 1's half and compares its own "
            "half in place while rank 1 checksums its shards",
            verify / seconds["bucketed"],
        )
    )
    if verify / seconds["bucketed"] > 0.5:
        row.notes.append(VERIFY_FLOOR)
    four = _load_at(4, ("bucketed", "dcp", "accelerate"), size, s)
    row.raw["4 ranks"] = four
    for other in ("dcp", "accelerate"):
        ratio = four["seconds"][other] / four["seconds"]["bucketed"]
        row.lines.append(
            Line(
                f"4 ranks: time, {other} / bucketed",
                f"{ratio:.2f}×",
                "≥ 2×",
                ratio >= 2,
                f"{other} {fmt_s(four['seconds'][other])}, bucketed "
                f"{fmt_s(four['seconds']['bucketed'])}; median of {four['rounds']} rounds, 4 "
                "ranks on 2 cores",
                ratio,
            )
        )
    row.lines.append(
        Line(
            "time vs one raw broadcast",
            f"{vs_raw:.2f}×",
            "≤ 1.2×",
            vs_raw <= 1.2,
            f"bucketed {fmt_s(seconds['bucketed'])}, raw broadcast {fmt_s(seconds['raw'])} "
            f"(into fresh memory; {fmt_s(warm)} into memory already touched); best runs "
            f"{fmt_s(best['bucketed'])} vs {fmt_s(best['raw'])} "
            f"({best['bucketed'] / best['raw']:.2f}×)",
            vs_raw,
        )
    )
    row.lines.append(
        Line(
            "time vs the point-to-point floor",
            f"{vs_floor:.2f}×",
            "—",
            None,
            f"bucketed {fmt_s(seconds['bucketed'])}, bare point-to-point of rank 1's shards "
            f"{fmt_s(seconds['p2p-floor'])}; first touch of {fmt_mib(touched)} of fresh memory "
            f"on rank 1: {fmt_s(touch)}",
            vs_floor,
        )
    )
    for rank in (0, 1):
        limit = peak["dcp"][rank] + BUCKET_BYTES
        ok = peak["bucketed"][rank] <= limit
        row.lines.append(
            Line(
                f"peak RSS, rank {rank}",
                f"{(peak['bucketed'][rank] - peak['dcp'][rank]) / MIB:+.0f} MiB vs DCP",
                "≤ DCP + 256 MiB (one bucket)",
                ok,
                f"bucketed {fmt_mib(peak['bucketed'][rank])}, DCP {fmt_mib(peak['dcp'][rank])}, "
                f"raw {fmt_mib(peak['raw'][rank])} (before the load: "
                f"{fmt_mib(base['bucketed'][rank])} / {fmt_mib(base['dcp'][rank])} / "
                f"{fmt_mib(base['raw'][rank])})",
                peak["bucketed"][rank] - peak["dcp"][rank],
            )
        )
    row.notes.append(
        f"Median of {plural(s.repeats, 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + f", the {len(methods)} methods in rotating order, each run in fresh processes; the "
        "best run of each is shown too, since interference from other work only ever adds "
        "time. "
        f"Model: {loaded['params'] / 1e6:.0f}M fp32 parameters in {loaded['params_loaded']} "
        "state-dict entries (Llama shapes, untied embeddings, one RoPE buffer), rank 0 real, "
        "rank 1 on meta, every decoder layer and the root `fully_shard`-ed over gloo. Time: "
        "from a barrier before the load to a barrier after it (materialising rank 1 included); "
        "the slower rank's figure. Peak RSS: VmHWM of each rank, reset (`/proc/self/clear_refs`) "
        "just before the load, so it covers the load alone. "
        f"The bucketed loader sent rank 1 {loaded['state_messages']} messages, "
        f"{fmt_mib(loaded['state_bytes'])} (its own shards only; a broadcast moves "
        f"{fmt_mib(nbytes)}); verify_load passed: {row.raw['verified']}. The point-to-point "
        "floor (`p2p-floor` in scripts/bench_load.py) moves the same bytes with nothing else: no "
        "layout check, no packing, rank 0's own shards left alone; it is what any loader of this "
        "rank-1 data pays on this machine."
    )
    kernel = {
        m: (
            median([run[1]["rusage"]["system_seconds"] for run in runs[m]]),
            median([run[1]["rusage"]["minor_faults"] for run in runs[m]]),
        )
        for m in methods
    }
    row.raw["summary"]["rank1_kernel"] = kernel
    floor_kernel = [run[1]["rusage"]["system_seconds"] for run in runs["p2p-floor"]]
    per_fault = [
        run[1]["rusage"]["system_seconds"] / run[1]["rusage"]["minor_faults"]
        for m in methods
        for run in runs[m]
        if run[1]["rusage"]["minor_faults"] > 1000
    ]
    row.notes.append(
        "Where rank 1's time goes (getrusage over the timed load, median): kernel time "
        + ", ".join(
            f"{m} {fmt_s(kernel[m][0])} ({kernel[m][1]:,.0f} minor faults)" for m in methods
        )
        + f". Every method faults in rank 1's fresh memory 4 KiB at a time (transparent huge "
        f"pages here: `{thp_mode()}`), and what a fault costs varies from run to run on this VM:"
        f" {min(per_fault) * 1e6:.1f} to {max(per_fault) * 1e6:.1f} µs of kernel time per fault"
        " across this row's runs; for the same bytes and the same code, rank 1's kernel time in "
        f"the point-to-point floor ranged from {fmt_s(min(floor_kernel))} to "
        f"{fmt_s(max(floor_kernel))}. A fault is cheap when the guest kernel recycles a page "
        "that was in use before and dear when it hands out one the VM's host has not backed "
        "yet, so the ratios below move with what ran before, not with fsdpcheck's code."
    )
    row.notes.append(
        "What the time is made of, on this machine (a VM with 2 cores shared by both ranks): "
        f"rank 1 must fault in its {fmt_mib(touched)} of freshly allocated shards "
        f"(`to_empty()`), and first touch of fresh memory costs {fmt_s(touch)} for that much "
        "here (measured on rank 1 after each load, into a new allocation); the wire moves it "
        f"at the rate of the raw broadcast into touched memory ({fmt_s(warm)} for "
        f"{fmt_mib(nbytes)}). DCP pays the same first touch, moves every byte to every rank "
        "(twice the bytes on 2 ranks, one collective per tensor) and copies each shard out of "
        "a full-size temporary. The raw broadcast pays first touch of a full-size receive "
        "buffer. Timings of the loaders vary by tens of percent from run to run with the "
        "machine's memory state and other processes (see the load average above): compare "
        "the ratios, measured side by side, more than the absolute figures."
    )
    if speedup < 2:
        net = (seconds["dcp"] - touch) / max(seconds["bucketed"] - touch, 1e-9)
        row.notes.append(
            f"Throughput vs DCP is below 2× in this run. Both loaders pay rank 1's first touch "
            f"({fmt_s(touch)} of the bucketed {fmt_s(seconds['bucketed'])} and of DCP's "
            f"{fmt_s(seconds['dcp'])}); beyond it the bucketed loader takes "
            f"{fmt_s(seconds['bucketed'] - touch)} against DCP's "
            f"{fmt_s(seconds['dcp'] - touch)} ({net:.1f}×). The bucketed loader is "
            f"{vs_floor:.2f}× the point-to-point floor, the rest being its layout check, rank "
            "0's copy of its own shards and the buffer broadcast."
        )
    if vs_raw > 1.2:
        row.notes.append(
            f"Time vs the raw broadcast is above 1.2× in this run: the raw broadcast took "
            f"{fmt_s(seconds['raw'])}, the point-to-point floor for rank 1's half of the bytes "
            f"{fmt_s(seconds['p2p-floor'])} and the bucketed loader {fmt_s(seconds['bucketed'])}"
            f" ({vs_floor:.2f}× the floor). All three are dominated by rank 1 first touching "
            "fresh memory, whose price on this VM changes from run to run (see the per-run "
            "first-touch times in docs/benchmarks.json); what the loader adds over the floor is "
            "its layout check, rank 0's copy of its own shards and the buffer broadcast."
        )
    return row


def _load_at(world: int, methods: Sequence[str], size: str, s: Settings) -> dict:
    """The slower rank's load time per method at ``world`` ranks, rotating, median of rounds."""
    runs: dict[str, list[float]] = {m: [] for m in methods}
    rounds = s.repeats
    for attempt in range(rounds):
        for method in rotated(list(methods), attempt):
            argv = [str(SCRIPTS / "bench_load.py"), "--method", method, "--size", size]
            result = run_ranks(argv, world)
            require(result, [0] * world, f"load {method} on {world} ranks")
            runs[method].append(max(r["seconds"] for r in marked(result, "@bench ")))
    return {"runs": runs, "seconds": {m: median(v) for m, v in runs.items()}, "rounds": rounds}


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (the bracketed word), or "unknown"."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def row_gather(s: Settings) -> Row:
    from fsdpcheck.distributed.gather import SLOT_BYTES

    row = Row(
        "gather",
        "gather bytes on the wire",
        "`gather_records`, one process per rank (no model: a synthetic record of 64 buffers and "
        "256 parameters): bytes each rank sent, measured at the socket and at the call site, "
        "all agreeing vs one divergent",
    )
    worlds = (2, 4) if s.quick else (2, 4, 8)
    repeats = 3 if s.quick else 10
    per_rank_agree = {}
    for world in worlds:
        result = run_ranks([str(SCRIPTS / "bench_gather.py"), "--repeats", str(repeats)], world)
        require(result, [0] * world, f"gather on {world} ranks")
        records = sorted(marked(result, "@bench "), key=lambda r: r["rank"])
        row.raw[f"{world} ranks"] = records
        for variant in ("agree", "one-divergent"):
            socket_bytes = [max(r["results"][variant]["socket_bytes"]) for r in records]
            call_bytes = [max(r["results"][variant]["call_bytes"]) for r in records]
            wall = median(records[0]["results"][variant]["seconds"])
            groups = records[0]["results"][variant]["groups"]
            if variant == "agree":
                per_rank_agree[world] = max(call_bytes[1:])
            row.lines.append(
                Line(
                    f"{world} ranks, {variant}",
                    f"{max(socket_bytes[1:])} B max per rank at the socket",
                    "—",
                    None,
                    f"at the socket (headers included) per rank {socket_bytes}; at the call "
                    f"site {call_bytes}; {groups} group(s) at rank 0; rank 0 {fmt_ms(wall)}",
                    float(max(socket_bytes[1:])),
                )
            )
    constant = len(set(per_rank_agree.values())) == 1
    row.lines.append(
        Line(
            "payload per rank, all agreeing, across world sizes",
            f"{'constant' if constant else 'varies'}: {sorted(set(per_rank_agree.values()))} B",
            "constant",
            constant,
            ", ".join(f"{w} ranks: {b} B" for w, b in per_rank_agree.items()),
        )
    )
    row.notes.append(
        "At the socket: the growth of each rank process's `wchar` (/proc/self/io) over one "
        "`gather_records` call: every byte gloo wrote with writev, its message headers "
        f"included (so a few hundred bytes where the payload is {SLOT_BYTES}). At the call "
        "site: the "
        "payload handed to torch.distributed (scripts/bench_scale.py's wrapper). When all agree "
        f"each rank sends rank 0 one {SLOT_BYTES}-byte slot (digest, host, flags, value digest, "
        "shard key, replica digest) and receives an 8-byte "
        "header; gloo's broadcast is a tree, so a rank also forwards that header to its "
        "children (the socket figures). The divergent rank also sends its full record. "
        "Rank 0's figure at the call site is the header it broadcasts."
    )
    return row


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
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_digests.py"), "--model", str(model),
         "--repeats", str(s.repeats)],
        capture_output=True, text=True, env={**os.environ, **ENV}, timeout=1800,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@bench ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_digests failed: {proc.stderr[-2000:]}")
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
        "config with parameters on meta, so it costs about one meta build. Command: "
        "scripts/bench_digests.py."
    )
    return row


def row_probe(s: Settings) -> Row:
    from fsdpcheck.children import probe as probe_module
    from fsdpcheck.children.launch import JOB_ENV

    row = Row("probe", "probe", "`probe(tiny-gemma4, seeds=8)` vs one meta build in a child")
    model = "tiny-gemma4"
    argv = ["-m", "fsdpcheck.children.probe", "--child", "--model", model]
    times: dict[str, list[float]] = {"probe (8 seeds)": [], "one build": []}
    verdicts = set()
    for _ in range(s.repeats):
        start = time.perf_counter()
        outcome = launch(argv, 1, env={**JOB_ENV, "PYTHONHASHSEED": "0"}, timeout=300.0)
        times["one build"].append(time.perf_counter() - start)
        if outcome.codes != [0]:
            raise RuntimeError(f"one build failed: {outcome.ranks[0].stderr[-2000:]}")
        start = time.perf_counter()
        result = probe_module.probe(model, seeds=8)
        times["probe (8 seeds)"].append(time.perf_counter() - start)
        verdicts.add(result.verdict)
    row.raw = {"seconds": times, "verdicts": sorted(verdicts), "cores": usable_cores()}
    one, eight = median(times["one build"]), median(times["probe (8 seeds)"])
    ratio = eight / one
    row.lines.append(
        Line(
            "8 seeds / one build",
            f"{ratio:.2f}×",
            "≤ 5×",
            ratio <= 5,
            f"probe {fmt_s(eight)}, one build {fmt_s(one)} ({usable_cores()} cores, "
            f"{min(8, usable_cores())} children at a time); verdict {', '.join(sorted(verdicts))}",
            ratio,
        )
    )
    row.notes.append(
        "fsdpcheck.children.probe builds the model on meta in one child interpreter per hash "
        "seed; on 2 cores 8 children run 2 at a time, so the floor is about 4 × one child "
        "(interpreter, "
        "torch and transformers imports dominate a child)."
    )
    return row


def row_verdict(s: Settings) -> Row:
    row = Row(
        "verdict",
        "time to verdict",
        "`audit --model hazard --vary-hash-seed`, 2 divergent ranks, vs a naive loader "
        "(scripts/bench_naive.py, measured) and vs NCCL's watchdog (600 s, torch's documented "
        "default collective timeout: not measured, no GPU here)",
    )
    walls = []
    for _ in range(s.repeats):
        argv = ["-m", "fsdpcheck", "audit", "--model", "hazard", "--vary-hash-seed"]
        result = run_ranks(argv, 2)
        require(result, [1, 1], "audit --vary-hash-seed")  # findings, on every rank
        walls.append(result.elapsed)
    wall = median(walls)
    ratio = NCCL_TIMEOUT_S / wall
    row.raw = {"seconds": walls}
    row.lines.append(
        Line(
            "audit, gloo: measured",
            fmt_s(wall),
            "—",
            None,
            f"audit {fmt_s(wall)} to exit code 1 (findings) on both ranks, launch to exit",
            wall,
        )
    )
    row_verdict_naive(walls, s, row)
    row.lines.append(
        Line(
            "600 s (NCCL watchdog default, documented) / audit wall",
            f"{ratio:.0f}×",
            "≥ 50×",
            ratio >= 50,
            "the 600 s is torch's documented default NCCL timeout, what a naive loader whose "
            "broadcasts mismatch in size waits on NCCL; it is not a measurement",
            ratio,
        )
    )
    row.notes.append(
        "On gloo the naive loader does not hang: the rank that receives a differently sized "
        "tensor aborts within seconds of the mismatched broadcast (SIGABRT, an uncatchable "
        "C++ abort, no report), and its peer then fails on the closed connection. Its wall "
        "time is mostly interpreter start-up and building the model, like the audit's. The "
        "audit takes about as long and ends with a report naming the divergent buffers; on "
        "NCCL the naive loader would wait for the watchdog instead."
    )
    return row


def audit_runs(
    variants: dict[str, list[str]], rounds: int, row: Row, s: Settings, label: str
) -> dict[str, dict[str, list]]:
    """Each variant (argv after bench_rss.py) as 2 ranks, ``rounds`` times, rotating; wall, peak
    RSS and CPU of the busier rank, and rank 0's JSON report where the argv writes one."""
    figures: dict[str, dict[str, list]] = {
        v: {"wall": [], "rss": [], "cpu": [], "report": []} for v in variants
    }
    for attempt in range(rounds):
        for variant in rotated(list(variants), attempt):
            report = s.scratch / f"{label}-{variant}.json"
            report.unlink(missing_ok=True)
            argv = [str(SCRIPTS / "bench_rss.py"), *variants[variant]]
            if "fsdpcheck" in argv and "audit" in argv:
                argv += ["--json", str(report)]
            result = run_ranks(argv, 2)
            require(result, [0, 0], f"{variant} ({label})")
            usage = marked(result, "@rss ", "stderr")
            figures[variant]["wall"].append(result.elapsed)
            figures[variant]["rss"].append(max(u["maxrss"] for u in usage))
            figures[variant]["cpu"].append(max(u["cpu"] for u in usage))
            if report.exists():
                data = json.loads(report.read_text())
                figures[variant]["report"].append(
                    {"timings": data.get("timings"), "model": data.get("model"),
                     "verify": data.get("verify"), "load": data.get("load")}
                )  # fmt: skip
    row.raw[label] = figures
    return figures


def row_init(s: Settings) -> Row:
    row = Row(
        "init",
        "init rank0 vs meta",
        "`audit --init rank0` vs `audit --init meta` on a Gemma3-1B-shaped config (1.0B "
        "parameters, bfloat16, no weights), 2 ranks",
    )
    model = s.scratch / "gemma3-1b-shaped"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(GEMMA3_1B, indent=2))
    audit = ["-m", "fsdpcheck", "audit", "--model", str(model)]
    variants = {
        "meta": [*audit, "--init", "meta"],
        "rank0, no load": [*audit, "--init", "rank0", "--no-load"],
        "rank0 (default: load + verify)": [*audit, "--init", "rank0"],
    }
    # Two rounds of three 1B-parameter audits: this row is the slowest of `make bench`.
    figures = audit_runs(variants, max(1, s.repeats - 1), row, s, "gemma3-1b")
    meta = figures["meta"]
    for variant, goal in (("rank0, no load", 1.3), ("rank0 (default: load + verify)", None)):
        f = figures[variant]
        ratio = median(f["wall"]) / median(meta["wall"])
        build = median([r["timings"]["build"] for r in f["report"]])
        row.lines.append(
            Line(
                f"{variant} / meta: wall",
                f"{ratio:.2f}×",
                f"≤ {goal}×" if goal else "—",
                ratio <= goal if goal else None,
                f"{variant} {fmt_s(median(f['wall']))}, meta {fmt_s(median(meta['wall']))}; best "
                f"runs {fmt_s(min(f['wall']))} vs {fmt_s(min(meta['wall']))} "
                f"({min(f['wall']) / min(meta['wall']):.2f}×); rank 0's build stage "
                f"{fmt_s(build)} (meta: "
                f"{fmt_s(median([r['timings']['build'] for r in meta['report']]))}); CPU time "
                f"of the busier rank {fmt_s(median(f['cpu']))} vs {fmt_s(median(meta['cpu']))};"
                f" peak RSS {fmt_mib(median(f['rss']))} vs {fmt_mib(median(meta['rss']))}",
                ratio,
            )
        )
    default = figures["rank0 (default: load + verify)"]["report"]
    values = sorted({r["model"].get("init_values") or "none" for r in default})
    load = median([r["timings"]["load"] for r in default])
    verify = median([r["timings"]["verify"] for r in default])
    passed = all(r["verify"]["passed"] for r in default)
    row.lines.append(
        Line(
            "verify / load (default audit, rank 0's stage times)",
            f"{verify / load:.2f}×",
            "≤ 0.5×",
            verify / load <= 0.5,
            f"load {fmt_s(load)}, verify {fmt_s(verify)} (2.0 GiB of bfloat16; verify passed: "
            f"{passed})",
            verify / load,
        )
    )
    row.raw["init_values"] = values
    if verify / load > 0.5:
        row.notes.append(VERIFY_FLOOR)
    row.notes.append(
        f"Values rank 0 materialised: `init_values` = {', '.join(values)} in the JSON report "
        "(`--init rank0` without a checkpoint builds with parameters on meta and buffers real, "
        "then fills every parameter from a seeded pattern in one pass of writes: "
        "fsdpcheck/model/fill.py; buffers such as RoPE `inv_freq` and `embed_scale` keep the "
        "values the modules computed). On CPU: the fill does not use a GPU even where there "
        f"is one. Median of {plural(s.repeats, 'round')}, the variants in rotating order; "
        "wall from launch to the last rank's exit."
    )
    row.notes.append(
        "What `--init rank0` adds over `--init meta`: rank 0 writes the 2.0 GiB of parameters "
        "(the fill) and FSDP2 copies its 1.0 GiB of shards out of them (`fully_shard` on real "
        "tensors, as in a trainer); `--init meta` allocates nothing. While rank 0 does this the "
        "other ranks have built on meta and wait for it, so rank 0 fills and shards with every "
        "core of the host (fsdpcheck/model/build.py `materialising_threads`). What is left is "
        "first touch of that fresh memory, whose cost on this VM varies from run to run (the "
        "full load row measures the per-fault cost), not the fill's arithmetic (a broadcast "
        "copy of a seeded pattern). transformers' own "
        "init, which the fill replaces, took 25 s of CPU for this model (issue 13: 32.2 s vs "
        "6.9 s audit wall)."
    )
    return row


def row_trainer(s: Settings) -> Row:
    row = Row(
        "trainer",
        "default audit vs trainer start",
        "`audit --model CKPT` (default: `--init rank0`, load, verify) vs a trainer-start job "
        "(rank 0 `from_pretrained`, others meta, `fully_shard`, DCP broadcast load, sorted "
        "buffer broadcast: scripts/bench_trainer.py); Llama-shaped 267M bfloat16 checkpoint, "
        "2 ranks",
    )
    ckpt = s.scratch / "llama-267m"
    made = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_trainer.py"), "--make-checkpoint", str(ckpt)],
        capture_output=True, text=True, env={**os.environ, **ENV}, cwd=str(REPO),
    )  # fmt: skip
    if made.returncode:
        raise RuntimeError(f"making the checkpoint failed: {made.stderr[-2000:]}")
    variants = {
        "trainer": [str(SCRIPTS / "bench_trainer.py"), "--model", str(ckpt)],
        "audit": ["-m", "fsdpcheck", "audit", "--model", str(ckpt)],
    }
    rounds = s.repeats + (0 if s.quick else 1)
    figures = audit_runs(variants, rounds, row, s, "llama-267m")
    if not s.quick:
        for f in figures.values():
            for key in f:
                f[key] = f[key][1:]  # the warm-up round: page cache, .pyc files
    trainer, audit = figures["trainer"], figures["audit"]
    wall = median(audit["wall"]) / median(trainer["wall"])
    peak = median(audit["rss"]) / median(trainer["rss"])
    timings = {
        k: median([r["timings"].get(k, 0.0) for r in audit["report"]])
        for k in ("build", "gather", "load", "verify")
    }
    row.lines.append(
        Line(
            "wall",
            f"{wall:.2f}×",
            "≤ 1.10×",
            wall <= 1.10,
            f"audit {fmt_s(median(audit['wall']))}, trainer {fmt_s(median(trainer['wall']))}; "
            f"best runs {fmt_s(min(audit['wall']))} vs {fmt_s(min(trainer['wall']))} "
            f"({min(audit['wall']) / min(trainer['wall']):.2f}×); CPU time of the busier rank "
            f"{fmt_s(median(audit['cpu']))} vs {fmt_s(median(trainer['cpu']))}; audit stages "
            "on rank 0: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in timings.items()),
            wall,
        )
    )
    row.lines.append(
        Line(
            "peak RSS per process",
            f"{peak:.2f}×",
            "≤ 1.10×",
            peak <= 1.10,
            f"audit {fmt_mib(median(audit['rss']))}, trainer {fmt_mib(median(trainer['rss']))}",
            peak,
        )
    )
    row.notes.append(
        f"Median of {plural(len(audit['wall']), 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + ", the two in alternating order. The audit does everything the trainer does (its "
        "loader in place of DCP's), plus fingerprints, the gather, the analysis, verify and "
        "the report; the trainer job is the floor."
    )
    return row


def row_scale(s: Settings) -> Row:
    row = Row(
        "scale",
        "scale (simulated)",
        "`gather_records`, `exchange_slots` (the layout check's exchange) and failure diagnosis "
        "with many lightweight ranks: threads on real gloo groups and a real TCPStore, no model "
        "(scripts/bench_scale.py)",
    )
    gather_worlds = (2, 8, 64) if s.quick else (2, 8, 64, 256)
    slot_worlds = (2, 8) if s.quick else (2, 64, 256)
    diagnose_worlds = (64,) if s.quick else (64, 256)

    def scale(*argv: str) -> dict:
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "bench_scale.py"), *argv],
            capture_output=True, text=True, env={**os.environ, **ENV}, cwd=str(REPO),
            timeout=900,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"bench_scale {' '.join(argv)}: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    repeats = "3"
    gathered = {w: scale("gather", "--world", str(w), "--repeats", repeats) for w in gather_worlds}
    slots = {w: scale("slots", "--world", str(w), "--repeats", repeats) for w in slot_worlds}
    diagnosed = {w: scale("diagnose", "--world", str(w)) for w in diagnose_worlds}
    row.raw = {"gather": gathered, "slots": slots, "diagnose": diagnosed}
    agree = {w: g["variants"]["agree"] for w, g in gathered.items()}
    per_rank = sorted({a["sent_max_other"] for a in agree.values()})
    row.lines.append(
        Line(
            "gather, all agree: bytes per rank (call site)",
            f"{per_rank} B",
            "constant",
            len(per_rank) == 1,
            "; ".join(
                f"{w} ranks: {a['sent_max_other']} B per rank, rank 0 {a['sent_rank0']} B, "
                f"rank 0 {fmt_ms(a['rank0_seconds_median'])}"
                for w, a in agree.items()
            ),
        )
    )
    first, last = min(agree), max(agree)
    growth = agree[last]["rank0_seconds_median"] / max(agree[first]["rank0_seconds_median"], 1e-9)
    slope = loglog_slope({w: a["rank0_seconds_median"] for w, a in agree.items()})
    row.lines.append(
        Line(
            f"gather, all agree: rank-0 time {first} → {last} ranks",
            f"∝ ranks^{slope:.2f} ({growth:.0f}× for {last // first}× the ranks)"
            if slope is not None
            else "one world size only",
            "linear (fitted exponent ≤ 1.1)",
            slope <= 1.1 if slope is not None else None,
            "; ".join(f"{w}: {fmt_ms(a['rank0_seconds_median'])}" for w, a in agree.items())
            + " (the exponent is the least-squares slope of log time over log ranks across all "
            "these world sizes, rather than the two ends alone: with up to 256 threads on this "
            "host's cores, scheduling moves any one size's median by tens of percent)",
            slope,
        )
    )
    divergent = {w: g["variants"]["one-divergent"] for w, g in gathered.items()}
    row.lines.append(
        Line(
            "gather, one divergent rank: bytes",
            f"{max(d['sent_max_other'] for d in divergent.values())} B max per rank",
            "—",
            None,
            "; ".join(
                f"{w} ranks: {d['groups']} groups, rank 0 {fmt_ms(d['rank0_seconds_median'])}"
                for w, d in divergent.items()
            )
            + " (the divergent rank also sends its full record)",
        )
    )
    slot = {w: g["variants"]["agree"] for w, g in slots.items()}
    row.lines.append(
        Line(
            "slot exchange (all_to_all): bytes per rank (call site)",
            ", ".join(f"{w}: {a['sent_max_other']} B" for w, a in slot.items()),
            "—",
            None,
            "; ".join(
                f"{w} ranks: rank 0 {fmt_ms(a['rank0_seconds_median'])}" for w, a in slot.items()
            )
            + " (49-byte slots: 49 × (world − 1) per rank, by design)",
        )
    )
    for w, d in diagnosed.items():
        row.lines.append(
            Line(
                f"diagnosis after a failure, {w} ranks: store calls in all",
                f"{d['store_calls']} ({d['store_calls'] / w:.1f} per rank)",
                "O(world)",
                d["store_calls"] <= 8 * w and d["every_rank_names_the_dead_rank"],
                f"by kind {d['store_calls_by_kind']}; every live rank names the dead rank: "
                f"{d['every_rank_names_the_dead_rank']}; slowest rank "
                f"{fmt_s(d['slowest_rank_seconds'])} (three heartbeat intervals of "
                f"{d['heartbeat_interval']:g} s dominate)",
                float(d["store_calls"]),
            )
        )
    row.notes.append(
        "How: each rank is a thread with its own c10d world (torch's ThreadLocalWorld) and its "
        "own gloo group on one TCPStore, at most 32 ranks per process (a rank holds one socket "
        "per peer it talks to, and the slot exchange connects every pair: 65,280 sockets at 256 "
        "ranks, 8,160 per process). Bytes: the payload each rank hands to "
        "torch.distributed calls (a wrapper counts send, gather, broadcast and all_to_all_single"
        "), per rank; the gather row below also measures them at the socket, one process per "
        "rank. Times are rank 0's, from a barrier to the call's return, with up to 256 threads "
        "on 2 cores: scheduling, not the network, dominates."
    )
    from fsdpcheck.distributed.gather import SLOT_BYTES

    row.notes.append(
        "Paper estimate to 4096 ranks (from the figures above, per-rank costs measured, "
        f"rank-0 costs linear): all agreeing, every rank sends rank 0 one {SLOT_BYTES}-byte "
        "slot and receives an 8-byte header (the broadcast is a tree: a rank forwards it to at "
        f"most log2(4096) = 12 children); rank 0 receives 4096 × {SLOT_BYTES} B = "
        f"{4096 * SLOT_BYTES // 1024} KiB and parses 4096 "
        "slots (about 1 µs each), so the gather stays far below a second. The layout check's "
        "all_to_all costs each rank 49 × 4095 B = 196 KiB and 4095 messages: tolerable, but "
        "the one place that grows with world size per rank. Diagnosis after a failure: one "
        "rank reads 2 × 4096 heartbeat counters and 4096 stage marks (two `multi_get` calls "
        "each when every key exists, else one call per key: about 16k calls, a few seconds at "
        "~0.1 ms a call) and waits three heartbeat intervals (4096 / 512 = 8 s each, 24 s); "
        "every other rank makes three calls (an `add`, a `wait`, a `get`): about 30k calls in "
        "all, where every rank reading every rank's keys made 4096² × 4 = 67M."
    )
    return row


def row_verdict_naive(walls_audit: list[float], s: Settings, row: Row) -> None:
    """The naive loader, measured: on gloo the receiving rank aborts."""
    walls, codes = [], []
    for _ in range(s.repeats):
        result = launch(
            [str(SCRIPTS / "bench_naive.py")], 2, env=ENV, timeout=300.0, cwd=str(REPO),
            rank_env=lambda r: {"PYTHONHASHSEED": str(r)},
        )  # fmt: skip
        walls.append(result.elapsed)
        codes.append(result.codes)
    aborted = any(-6 in c for c in codes)
    row.raw["naive"] = {"seconds": walls, "codes": codes}
    row.lines.append(
        Line(
            "naive loader (named_buffers order), gloo: measured",
            fmt_s(median(walls)),
            "—",
            None,
            f"exit codes {codes[0]} (-6: SIGABRT, gloo's `op.preamble.length <= op.nbytes`"
            f"{'' if aborted else '; no abort seen'}); the audit {fmt_s(median(walls_audit))} "
            "ends with a named verdict instead of a crash",
            median(walls),
        )
    )


RUNNERS: dict[str, Callable[[Settings], Row]] = {
    "audit": row_audit,
    "init": row_init,
    "trainer": row_trainer,
    "cli": row_cli,
    "buffers": row_buffers,
    "load": row_load,
    "gather": row_gather,
    "scale": row_scale,
    "digests": row_digests,
    "probe": row_probe,
    "verdict": row_verdict,
}


# --- the machine and the report ----------------------------------------------------------------


def meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    total = meminfo("MemTotal")
    return {
        "cores": usable_cores(),
        "cpu": cpu_model(),
        "memory_gib": round(total / GIB, 1) if total else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "fsdpcheck": version("fsdpcheck"),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def to_json(rows: list[Row], meta: dict) -> dict:
    return {
        "schema": "fsdpcheck.benchmarks/1",
        **meta,
        "rows": [
            {
                "row": r.name,
                "title": r.title,
                "compare": r.compare,
                "seconds": round(r.seconds, 1),
                "error": r.error,
                "date": r.date,
                "load": r.load,
                "lines": [vars(line) for line in r.lines],
                "notes": r.notes,
                "raw": r.raw,
            }
            for r in rows
        ],
    }


def mark(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "—"}[met]


def to_markdown(rows: list[Row], meta: dict) -> str:
    m = meta["machine"]
    out = [
        "# Benchmarks",
        "",
        "Generated by `scripts/bench.py` (`make bench`); do not edit by hand. Each row measures "
        "its variants side by side in one run, interleaved, and reports the median of "
        f"{plural(meta['repeats'], 'repeat')} (more where noted) as a ratio with the raw "
        "figures behind it.",
        "",
        f"- Command: `{meta['command']}`" + (" (`make bench`)" if meta["make"] else ""),
        f"- Date: {meta['date']}, {fmt_s(meta['seconds'])} in all",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB memory, {m['os']}",
        f"- Versions: Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"fsdpcheck {m['fsdpcheck']}",
        f"- Load average (1, 5, 15 min) before: {meta['load_before']}, after: "
        f"{meta['load_after']} (other work on the machine shows here; it adds noise to every "
        "row alike)",
        "- Ranks: `fsdpcheck.children.launch` with env:// variables, gloo, `OMP_NUM_THREADS=1`",
        *(
            [
                "- The machine was loaded (load average above its core count: other work ran "
                "alongside, here other engineers' test suites): absolute times are inflated and "
                "noisy; read the ratios, measured side by side, and each row's own load average"
            ]
            if (meta["load_before"] or [0])[0] > m["cores"]
            else []
        ),
        "",
        "| row | compared | result | goal | |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.error:
            out.append(f"| {row.title} | {row.compare} | failed | | **error** |")
            continue
        for line in row.lines:
            out.append(
                f"| {row.title} | {line.what} | {line.result} | {line.goal} | {mark(line.met)} |"
            )
    for row in rows:
        when = f"; measured {row.date}, load average {row.load}" if row.date else ""
        out += [
            "",
            f"## {row.title}",
            "",
            f"{row.compare}. ({fmt_s(row.seconds)} for this row{when}.)",
        ]
        if row.error:
            out += ["", "```", row.error.strip()[-3000:], "```"]
            continue
        out += [""]
        out += [
            f"- **{line.what}**: {line.result} ({mark(line.met)}; goal {line.goal}). "
            f"{line.figures}."
            for line in row.lines
        ]
        for note in row.notes:
            out += ["", note]
    out += [
        "",
        "## Gemma3-27B-shaped audit on one GPU (NCCL)",
        "",
        "Not run: no GPU lent this session. The target is a bfloat16 `--init rank0` audit under "
        "60 s on one H200 (issue 13); `--init rank0` now fills parameters at memory speed on "
        "the CPU with every core of the host (fsdpcheck/model/fill.py) and verify checksums "
        "CUDA shards on the GPU (fsdpcheck/model/checksum.py), the two stages that dominated "
        "there. scripts/gpu_check.sh is the prepared check for a session that has one.",
        "",
        "Raw figures for every repeat: `docs/benchmarks.json`.",
        "",
    ]
    return "\n".join(out)


def merged(fresh: list[Row], previous: Path) -> list[Row]:
    """``fresh`` rows, and the previous run's rows for every other row, in ROWS order."""
    by_name = {r.name: r for r in fresh}
    if previous.exists():
        old = json.loads(previous.read_text())
        for r in old.get("rows", []):
            if r["row"] in by_name or r["row"] not in ROWS:
                continue
            by_name[r["row"]] = Row(
                r["row"], r["title"], r["compare"],
                lines=[Line(**line) for line in r["lines"]], notes=r["notes"], raw=r["raw"],
                seconds=r["seconds"], error=r["error"], date=r.get("date") or old.get("date"),
                load=r.get("load") or old.get("load_before"),
            )  # fmt: skip
    return [by_name[name] for name in ROWS if name in by_name]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, smaller model")
    parser.add_argument("--only", action="append", choices=ROWS, help="run this row (repeatable)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="default docs/ (full runs)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows not run from docs/benchmarks.json and write docs/ (each row says "
        "when it was measured)",
    )
    args = parser.parse_args(argv)

    repeats = args.repeats or (1 if args.quick else 3)
    out = args.out
    if out is None:
        partial = args.quick or args.only or args.repeats is not None and args.repeats < 3
        if args.merge:
            partial = False
        out = Path(tempfile.mkdtemp(prefix="fsdpcheck-bench-")) if partial else REPO / "docs"
    out.mkdir(parents=True, exist_ok=True)
    selected = [r for r in ROWS if not args.only or r in args.only]
    command = " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO), "scripts/bench.py"]
    )
    command = " ".join([command, *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    load_before = load_average()
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdpcheck-bench-") as scratch:
        noisy = repeats if args.quick or args.repeats else max(repeats, 5)
        settings = Settings(args.quick, repeats, Path(scratch), noisy)
        for name in selected:
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            began = time.perf_counter()
            start_wall, load = time.time(), load_average()
            try:
                row = RUNNERS[name](settings)
            except Exception as exc:  # one broken row must not lose the others
                row = Row(name, name, "", error=f"{type(exc).__name__}: {exc}")
            row.seconds = time.perf_counter() - began
            row.date, row.load = time.strftime("%Y-%m-%d %H:%M %Z", time.gmtime(start_wall)), load
            rows.append(row)
            for line in row.lines:
                print(
                    f"  {line.what}: {line.result} ({mark(line.met)}; goal {line.goal})",
                    file=sys.stderr,
                )
            if row.error:
                print(f"  error: {row.error[-2000:]}", file=sys.stderr)
    meta = {
        "command": command.strip(),
        "make": not (args.quick or args.only or args.out or args.repeats),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "seconds": round(time.perf_counter() - start, 1),
        "repeats": repeats,
        "quick": args.quick,
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
    }
    if args.merge:
        rows = merged(rows, REPO / "docs" / "benchmarks.json")
        meta["command"] += " (rows not run kept from the previous docs/benchmarks.json)"
    (out / "benchmarks.json").write_text(json.dumps(to_json(rows, meta), indent=2) + "\n")
    (out / "benchmarks.md").write_text(to_markdown(rows, meta))
    print(f"bench: wrote {out / 'benchmarks.md'} and benchmarks.json", file=sys.stderr)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
