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

from fsdpcheck.children.harness import usable_cores  # noqa: E402  (torch-free)
from fsdpcheck.children.launch import LaunchResult, launch  # noqa: E402  (torch-free)

SCRIPTS = REPO / "scripts"
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
GIB, MIB = 2**30, 2**20
NCCL_TIMEOUT_S = 600.0  # torch.distributed's default NCCL collective timeout
BUCKET_BYTES = 256 * MIB  # load_full_state_dict's default
ROWS = ("audit", "cli", "buffers", "load", "gather", "probe", "verdict")

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
        per, coalesced, flat = (median(times[k]) for k in ("per-buffer", "coalesced", "flat-only"))
        ratio = median(ratios)
        how = (
            "the layout check, the values riding with it"
            if records[0]["inline"]
            else "the layout check + one flat broadcast per dtype"
        )
        row.lines.append(
            Line(
                f"{world} ranks: per-buffer / coalesced",
                f"{ratio:.1f}×",
                "≥ 20×",
                ratio >= 20,
                f"per-buffer {fmt_ms(per)} (200 collectives), broadcast_buffers {fmt_ms(coalesced)}"
                f" ({collectives}: {how}), flat broadcast alone {fmt_ms(flat)} "
                f"({per / flat:.1f}×); the median of {launches} "
                f"launch{'es' if launches > 1 else ''} of {repeats} repeats each, "
                f"{min(ratios):.1f}× to {max(ratios):.1f}×",
                ratio,
            )
        )
        if ratio < 20:
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
                f"{world} ranks: below 20×. `broadcast_buffers` makes {collectives} "
                f"collective(s) ({how}), the unvalidated flat broadcast one; {cost}: describing "
                "and digesting 200 buffers on every rank, and an all_to_all of layout slots in "
                "place of a broadcast. The flat broadcast alone is "
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
        "vs one raw broadcast of the same bytes; Llama-shaped fp32 model, 2 ranks, rank 1 on "
        "meta",
    )
    methods = ("bucketed", "p2p-floor", "dcp", "raw")
    runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
    rounds = s.noisy_repeats + (0 if s.quick else 1)
    for attempt in range(rounds):
        warm_up = attempt == 0 and not s.quick
        for method in rotated(methods, attempt):
            argv = [str(SCRIPTS / "bench_load.py"), "--method", method, "--size", size]
            if method == "bucketed" and attempt == 0:
                argv.append("--verify")
            result = run_ranks(argv, 2)
            require(result, [0, 0], f"load {method}")
            records = sorted(marked(result, "@bench "), key=lambda r: r["rank"])
            if method == "bucketed" and attempt == 0:
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
        f"Median of {plural(s.noisy_repeats, 'repeat')}"
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


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (the bracketed word), or "unknown"."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def row_gather(s: Settings) -> Row:
    from fsdpcheck.dist.gather import SLOT_BYTES

    row = Row(
        "gather",
        "gather scaling",
        "`gather_records`: bytes each rank sends and wall time, all agreeing vs one divergent",
    )
    worlds = (2, 4) if s.quick else (2, 4, 8)
    repeats = 3 if s.quick else 10
    per_rank_agree = {}
    for world in worlds:
        # One hash seed for every rank: hazard's buffer order follows it, and only the
        # divergent rank may differ.
        result = run_ranks(
            [str(SCRIPTS / "bench_gather.py"), "--repeats", str(repeats)],
            world,
            PYTHONHASHSEED="0",
        )
        require(result, [0] * world, f"gather on {world} ranks")
        records = sorted(marked(result, "@bench "), key=lambda r: r["rank"])
        row.raw[f"{world} ranks"] = records
        for variant in ("agree", "one-divergent"):
            sent = [r["results"][variant]["bytes"] for r in records]
            wall = median(records[0]["results"][variant]["seconds"])
            groups = records[0]["results"][variant]["groups"]
            if variant == "agree":
                per_rank_agree[world] = max(sent)
            row.lines.append(
                Line(
                    f"{world} ranks, {variant}",
                    f"{max(sent)} B max per rank",
                    "constant when all agree" if variant == "agree" else "—",
                    None,
                    f"bytes per rank {sent}; {groups} group(s) at rank 0; gather {fmt_ms(wall)}",
                    float(max(sent)),
                )
            )
    constant = len(set(per_rank_agree.values())) == 1
    row.lines.append(
        Line(
            "per-rank bytes, all agreeing, across world sizes",
            f"{'constant' if constant else 'varies'}: {sorted(set(per_rank_agree.values()))} B",
            "constant",
            constant,
            ", ".join(f"{w} ranks: {b} B" for w, b in per_rank_agree.items()),
        )
    )
    row.notes.append(
        f"Records: the hazard preset's pre- and post-wrap fingerprints "
        f"({records[0]['record_bytes']} bytes of JSON). When all agree each rank sends one "
        f"{SLOT_BYTES}-byte slot (digest, host, flags, value digest, shard key, replica "
        "digest); one divergent rank also sends its full record. "
        "The wall time is one gather (barrier to barrier), rank 0's view; with 8 processes on "
        "2 cores it is dominated by scheduling."
    )
    return row


def row_probe(s: Settings) -> Row:
    from fsdpcheck.children import probe as probe_module
    from fsdpcheck.children.harness import ChildRunner

    row = Row("probe", "probe", "`probe(tiny-gemma4, seeds=8)` vs one meta build in a child")
    model = "tiny-gemma4"
    argv = ["-m", "fsdpcheck.children.probe", "--child", "--model", model]
    times: dict[str, list[float]] = {"probe (8 seeds)": [], "one build": []}
    verdicts = set()
    for _ in range(s.repeats):
        start = time.perf_counter()
        outcome = ChildRunner().run(argv, 0, 300.0)
        times["one build"].append(time.perf_counter() - start)
        if outcome.returncode != 0:
            raise RuntimeError(f"one build failed: {outcome.stderr_tail}")
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
        "`audit --model hazard --vary-hash-seed`, 2 divergent ranks, vs the 600 s NCCL default "
        "timeout a naive loader waits",
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
            "600 s / audit wall",
            f"{ratio:.0f}×",
            "≥ 50×",
            ratio >= 50,
            f"audit {fmt_s(wall)} to exit code 1 (findings) on both ranks, launch to exit",
            ratio,
        )
    )
    return row


RUNNERS: dict[str, Callable[[Settings], Row]] = {
    "audit": row_audit,
    "cli": row_cli,
    "buffers": row_buffers,
    "load": row_load,
    "gather": row_gather,
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
        out += ["", f"## {row.title}", "", f"{row.compare}. ({fmt_s(row.seconds)} for this row.)"]
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
    out += ["", "Raw figures for every repeat: `docs/benchmarks.json`.", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, smaller model")
    parser.add_argument("--only", action="append", choices=ROWS, help="run this row (repeatable)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="default docs/ (full runs)")
    args = parser.parse_args(argv)

    repeats = args.repeats or (1 if args.quick else 3)
    out = args.out
    if out is None:
        partial = args.quick or args.only or args.repeats is not None and args.repeats < 3
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
            try:
                row = RUNNERS[name](settings)
            except Exception as exc:  # one broken row must not lose the others
                row = Row(name, name, "", error=f"{type(exc).__name__}: {exc}")
            row.seconds = time.perf_counter() - began
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
    (out / "benchmarks.json").write_text(json.dumps(to_json(rows, meta), indent=2) + "\n")
    (out / "benchmarks.md").write_text(to_markdown(rows, meta))
    print(f"bench: wrote {out / 'benchmarks.md'} and benchmarks.json", file=sys.stderr)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
