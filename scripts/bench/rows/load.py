"""Full load: fsdpcheck's bucketed loader against DCP, accelerate, a raw broadcast and the
point-to-point floor of the same bytes; then ``verify_load`` after the bucketed load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.machine import thp_mode, version
from bench.measure import marked, median, require, rotated, run_ranks
from bench.result import Line, Row, floor_met
from bench.rows.verify_floor import VERIFY_FLOOR, VERIFY_GOAL
from bench.settings import BUCKET_BYTES, GIB, MIB, RESULTS, Settings, shown, worker
from bench.text import fmt_mib, fmt_s, plural

METHODS = ("bucketed", "p2p-floor", "dcp", "accelerate", "raw")
SPEEDUP_GOAL = 2.0  # the bucketed loader against DCP and accelerate, in time or throughput
RAW_GOAL = 1.2  # the bucketed loader against one raw broadcast of the same bytes


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
    runs = _two_ranks(size, s, row)
    row.raw["runs"] = runs
    f = Figures.of(runs)
    row.raw["summary"] = f.summary()
    row.lines += _two_rank_lines(f)
    if f.verify / f.seconds["bucketed"] > VERIFY_GOAL:
        row.notes.append(VERIFY_FLOOR)
    four = _load_at(4, ("bucketed", "dcp", "accelerate"), size, s)
    row.raw["4 ranks"] = four
    row.lines += _four_rank_lines(four)
    row.lines += _floor_lines(f)
    row.lines += _peak_lines(f)
    row.notes += _notes(f, s, verified=row.raw["verified"])
    return row


def _two_ranks(size: str, s: Settings, row: Row) -> dict[str, list[list[dict]]]:
    """Every method on 2 ranks, rotating, a warm-up round first (full runs): per method, one
    list of rank records per run. Asserts verify_load passed after every bucketed load."""
    runs: dict[str, list[list[dict]]] = {m: [] for m in METHODS}
    rounds = s.repeats + (0 if s.quick else 1)  # 5 methods: 4 rounds keep the row near 5 min
    for attempt in range(rounds):
        warm_up = attempt == 0 and not s.quick
        for method in rotated(METHODS, attempt):
            argv = [worker("load"), "--method", method, "--size", size]
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
    return runs


def _load_at(world: int, methods: Sequence[str], size: str, s: Settings) -> dict:
    """The slower rank's load time per method at ``world`` ranks, rotating, median of rounds."""
    runs: dict[str, list[float]] = {m: [] for m in methods}
    rounds = s.repeats
    for attempt in range(rounds):
        for method in rotated(list(methods), attempt):
            argv = [worker("load"), "--method", method, "--size", size]
            result = run_ranks(argv, world)
            require(result, [0] * world, f"load {method} on {world} ranks")
            runs[method].append(max(r["seconds"] for r in marked(result, "@bench ")))
    return {"runs": runs, "seconds": {m: median(v) for m, v in runs.items()}, "rounds": rounds}


@dataclass(frozen=True)
class Figures:
    """What the 2-rank runs measured, summarised (medians over runs unless said otherwise)."""

    nbytes: int  # the model's state-dict bytes
    seconds: dict[str, float]  # per method, the slower rank's load time
    best: dict[str, float]  # per method, the best run's
    warm: float  # the raw broadcast into memory already touched
    touch: float  # rank 1's first touch of fresh memory after each load
    touched: int  # how many bytes that first touch covered
    peak: dict[str, list[float]]  # per method, each rank's peak RSS over the load
    base: dict[str, list[float]]  # per method, each rank's RSS before the load
    loaded: dict  # rank 1's record of the first bucketed run
    verify: float  # verify_load after the bucketed load, the slower rank
    read: float  # each rank reading what verify must read once (workers/load.py read_once)
    kernel: dict[str, tuple[float, float]]  # per method, rank 1's kernel seconds, minor faults
    floor_kernel: list[float]  # rank 1's kernel seconds in every p2p-floor run
    per_fault: list[float]  # kernel seconds per minor fault, every run with enough faults

    @classmethod
    def of(cls, runs: dict[str, list[list[dict]]]) -> Figures:
        per_run = {m: [max(r["seconds"] for r in run) for run in runs[m]] for m in METHODS}

        def each_rank(key: str) -> dict[str, list[float]]:
            return {
                m: [median([run[rank][key] for run in runs[m]]) for rank in (0, 1)] for m in METHODS
            }

        def rank1(key: str, m: str) -> float:
            return median([run[1]["rusage"][key] for run in runs[m]])

        return cls(
            nbytes=runs["bucketed"][0][0]["bytes"],
            seconds={m: median(per_run[m]) for m in METHODS},
            best={m: min(per_run[m]) for m in METHODS},
            warm=median([run[0]["seconds_warm"] for run in runs["raw"]]),
            touch=median([run[1]["first_touch"]["seconds"] for m in METHODS for run in runs[m]]),
            touched=runs["bucketed"][0][1]["first_touch"]["bytes"],
            peak=each_rank("peak_rss_load"),
            base=each_rank("rss_before"),
            loaded=runs["bucketed"][0][1],
            verify=median([max(r["verify_seconds"] for r in run) for run in runs["bucketed"]]),
            read=median([max(r["read_seconds"] for r in run) for run in runs["bucketed"]]),
            kernel={m: (rank1("system_seconds", m), rank1("minor_faults", m)) for m in METHODS},
            floor_kernel=[run[1]["rusage"]["system_seconds"] for run in runs["p2p-floor"]],
            per_fault=[
                run[1]["rusage"]["system_seconds"] / run[1]["rusage"]["minor_faults"]
                for m in METHODS
                for run in runs[m]
                if run[1]["rusage"]["minor_faults"] > 1000
            ],
        )

    def gib_s(self, method: str) -> float:
        return self.nbytes / GIB / self.seconds[method]

    @property
    def speedup(self) -> float:
        return self.gib_s("bucketed") / self.gib_s("dcp")

    @property
    def vs_raw(self) -> float:
        return self.seconds["bucketed"] / self.seconds["raw"]

    @property
    def vs_floor(self) -> float:
        return self.seconds["bucketed"] / self.seconds["p2p-floor"]

    def summary(self) -> dict:
        return {
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "best_seconds": self.best,
            "raw_warm_seconds": self.warm,
            "first_touch_seconds": self.touch,
            "first_touch_bytes": self.touched,
            "verify_seconds": self.verify,
            "read_seconds": self.read,
            "rank1_kernel": self.kernel,
        }


def _two_rank_lines(f: Figures) -> list[Line]:
    seconds, best = f.seconds, f.best
    vs_accelerate = seconds["accelerate"] / seconds["bucketed"]
    verify = f.verify / seconds["bucketed"]
    return [
        Line(
            "throughput vs DCP",
            f"{f.speedup:.2f}×",
            f"≥ {SPEEDUP_GOAL:g}×",
            f.speedup >= SPEEDUP_GOAL,
            f"{f.nbytes / GIB:.2f} GiB: bucketed {f.gib_s('bucketed'):.2f} GiB/s "
            f"({fmt_s(seconds['bucketed'])}), DCP {f.gib_s('dcp'):.2f} GiB/s "
            f"({fmt_s(seconds['dcp'])}); best runs {fmt_s(best['bucketed'])} vs "
            f"{fmt_s(best['dcp'])} ({best['dcp'] / best['bucketed']:.2f}×)",
            f.speedup,
        ),
        Line(
            "2 ranks: time, accelerate / bucketed",
            f"{vs_accelerate:.2f}×",
            f"≥ {SPEEDUP_GOAL:g}×",
            vs_accelerate >= SPEEDUP_GOAL,
            f"accelerate {fmt_s(seconds['accelerate'])}, bucketed {fmt_s(seconds['bucketed'])};"
            f" best runs {fmt_s(best['accelerate'])} vs {fmt_s(best['bucketed'])} "
            f"({best['accelerate'] / best['bucketed']:.2f}×)",
            vs_accelerate,
        ),
        Line(
            "verify / load (the same bucketed runs)",
            f"{verify:.2f}×",
            f"≤ {VERIFY_GOAL}×",
            verify <= VERIFY_GOAL,
            f"verify_load {fmt_s(f.verify)}, load {fmt_s(seconds['bucketed'])}; of the "
            f"{fmt_mib(f.nbytes)} source, rank 0 checksums rank 1's half and compares its own "
            "half in place while rank 1 checksums its shards; the floor of any verify (each "
            "rank reading once what it must, rank 0 the whole source and its own shards, as "
            f"64-bit sums) {fmt_s(f.read)}, {f.read / seconds['bucketed']:.2f}× the load: "
            f"verify is {f.verify / f.read:.2f}× that floor",
            verify,
        ),
    ]


def _four_rank_lines(four: dict) -> list[Line]:
    lines = []
    for other in ("dcp", "accelerate"):
        ratio = four["seconds"][other] / four["seconds"]["bucketed"]
        lines.append(
            Line(
                f"4 ranks: time, {other} / bucketed",
                f"{ratio:.2f}×",
                f"≥ {SPEEDUP_GOAL:g}×",
                ratio >= SPEEDUP_GOAL,
                f"{other} {fmt_s(four['seconds'][other])}, bucketed "
                f"{fmt_s(four['seconds']['bucketed'])}; median of {four['rounds']} rounds, 4 "
                "ranks on 2 cores",
                ratio,
            )
        )
    return lines


def _floor_lines(f: Figures) -> list[Line]:
    seconds, best = f.seconds, f.best
    raw = Line(
        "time vs one raw broadcast",
        f"{f.vs_raw:.2f}×",
        f"≤ {RAW_GOAL}×",
        f.vs_raw <= RAW_GOAL,
        f"bucketed {fmt_s(seconds['bucketed'])}, raw broadcast {fmt_s(seconds['raw'])} "
        f"(into fresh memory; {fmt_s(f.warm)} into memory already touched); best runs "
        f"{fmt_s(best['bucketed'])} vs {fmt_s(best['raw'])} "
        f"({best['bucketed'] / best['raw']:.2f}×)",
        f.vs_raw,
    )
    return [
        raw,
        Line(
            "time vs the point-to-point floor",
            f"{f.vs_floor:.2f}×",
            f"≤ {RAW_GOAL}× (where the line above is not met)",
            floor_met(f.vs_floor <= RAW_GOAL, raw),
            f"bucketed {fmt_s(seconds['bucketed'])}, bare point-to-point of rank 1's shards "
            f"{fmt_s(seconds['p2p-floor'])}; first touch of {fmt_mib(f.touched)} of fresh "
            f"memory on rank 1: {fmt_s(f.touch)}",
            f.vs_floor,
        ),
    ]


def _peak_lines(f: Figures) -> list[Line]:
    peak, base = f.peak, f.base
    return [
        Line(
            f"peak RSS, rank {rank}",
            f"{(peak['bucketed'][rank] - peak['dcp'][rank]) / MIB:+.0f} MiB vs DCP",
            f"≤ DCP + {BUCKET_BYTES // MIB} MiB (one bucket)",
            peak["bucketed"][rank] <= peak["dcp"][rank] + BUCKET_BYTES,
            f"bucketed {fmt_mib(peak['bucketed'][rank])}, DCP {fmt_mib(peak['dcp'][rank])}, "
            f"raw {fmt_mib(peak['raw'][rank])} (before the load: "
            f"{fmt_mib(base['bucketed'][rank])} / {fmt_mib(base['dcp'][rank])} / "
            f"{fmt_mib(base['raw'][rank])})",
            peak["bucketed"][rank] - peak["dcp"][rank],
        )
        for rank in (0, 1)
    ]


def _notes(f: Figures, s: Settings, *, verified: bool) -> list[str]:
    seconds, loaded, kernel = f.seconds, f.loaded, f.kernel
    notes = [
        f"Median of {plural(s.repeats, 'repeat')}"
        + ("" if s.quick else " after one warm-up round")
        + f", the {len(METHODS)} methods in rotating order, each run in fresh processes; the "
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
        f"{fmt_mib(f.nbytes)}); verify_load passed: {verified}. The point-to-point "
        f"floor (`p2p-floor` in {shown(worker('load'))}) moves the same bytes with nothing "
        "else: no layout check, no packing, rank 0's own shards left alone, rank 1's fresh "
        "pages faulted in ahead of the receives by a thread of its own as the loader does "
        "(without it gloo's receive thread faults them in one by one, several times dearer "
        "here); it is what any loader of this rank-1 data pays on this machine.",
        "Where rank 1's time goes (getrusage over the timed load, median): kernel time "
        + ", ".join(
            f"{m} {fmt_s(kernel[m][0])} ({kernel[m][1]:,.0f} minor faults)" for m in METHODS
        )
        + f". Every method faults in rank 1's fresh memory 4 KiB at a time (transparent huge "
        f"pages here: `{thp_mode()}`), and what a fault costs varies from run to run on this VM:"
        f" {min(f.per_fault) * 1e6:.1f} to {max(f.per_fault) * 1e6:.1f} µs of kernel time per "
        "fault across this row's runs; for the same bytes and the same code, rank 1's kernel "
        f"time in the point-to-point floor ranged from {fmt_s(min(f.floor_kernel))} to "
        f"{fmt_s(max(f.floor_kernel))}. A fault is cheap when the guest kernel recycles a page "
        "that was in use before and dear when it hands out one the VM's host has not backed "
        "yet, so the ratios below move with what ran before, not with fsdpcheck's code.",
        "What the time is made of, on this machine (a VM with 2 cores shared by both ranks): "
        f"rank 1 must fault in its {fmt_mib(f.touched)} of freshly allocated shards "
        f"(`to_empty()`), and first touch of fresh memory costs {fmt_s(f.touch)} for that much "
        "here (measured on rank 1 after each load, into a new allocation); the wire moves it "
        f"at the rate of the raw broadcast into touched memory ({fmt_s(f.warm)} for "
        f"{fmt_mib(f.nbytes)}). DCP pays the same first touch, moves every byte to every rank "
        "(twice the bytes on 2 ranks, one collective per tensor) and copies each shard out of "
        "a full-size temporary. The raw broadcast pays first touch of a full-size receive "
        "buffer. Timings of the loaders vary by tens of percent from run to run with the "
        "machine's memory state and other processes (see the load average above): compare "
        "the ratios, measured side by side, more than the absolute figures.",
    ]
    if f.speedup < SPEEDUP_GOAL:
        net = (seconds["dcp"] - f.touch) / max(seconds["bucketed"] - f.touch, 1e-9)
        notes.append(
            f"Throughput vs DCP is below {SPEEDUP_GOAL:g}× in this run. Both loaders pay rank "
            f"1's first touch ({fmt_s(f.touch)} of the bucketed {fmt_s(seconds['bucketed'])} "
            f"and of DCP's {fmt_s(seconds['dcp'])}); beyond it the bucketed loader takes "
            f"{fmt_s(seconds['bucketed'] - f.touch)} against DCP's "
            f"{fmt_s(seconds['dcp'] - f.touch)} ({net:.1f}×). The bucketed loader is "
            f"{f.vs_floor:.2f}× the point-to-point floor, the rest being its layout check, rank "
            "0's copy of its own shards and the buffer broadcast."
        )
    if f.vs_raw > RAW_GOAL:
        notes.append(
            f"Time vs the raw broadcast is above {RAW_GOAL}× in this run: the raw broadcast took "
            f"{fmt_s(seconds['raw'])}, the point-to-point floor for rank 1's half of the bytes "
            f"{fmt_s(seconds['p2p-floor'])} and the bucketed loader {fmt_s(seconds['bucketed'])}"
            f" ({f.vs_floor:.2f}× the floor). All three are dominated by rank 1 first touching "
            "fresh memory, whose price on this VM changes from run to run (see the per-run "
            f"first-touch times in {shown(RESULTS)}); what the loader adds over the floor is "
            "its layout check, rank 0's copy of its own shards and the buffer broadcast."
        )
    return notes
