"""Probe one model for a latent, hash-seed-dependent tensor order, on one host, without ranks.

A model whose ``named_buffers()`` / ``named_parameters()`` order follows the interpreter's string
hash seed (``PYTHONHASHSEED``) is consistent on every run where the ranks happen to agree and
breaks on the runs where they do not. :func:`probe` makes the dependence show up deterministically:
it builds the model on ``meta`` in ``seeds`` child interpreters with the fixed hash seeds
``0 .. seeds-1`` and compares the orders they produce.

Why 8 seeds by default: a two-element ``set`` of strings (``{"sliding_attention",
"full_attention"}``) iterates in one of its 2 orders, each with probability about 1/2 per seed, so
all 8 seeds agree by chance with probability ``2 * 2**-8 = 1/128`` (< 1 %). Seeds 0 and 1 alone
already give different orders for that pair, so the known cases are found every time.

Each child runs ``python -m fsdpcheck.children.probe --child`` and prints its fingerprint as one JSON line
(never pickle). Children run in parallel (at most ``jobs`` at a time), each bounded by ``timeout``
and killed when it expires. Library code: returns frozen records, never prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpcheck.records import Finding, Fingerprint, TensorRecord, from_dict, to_dict
from fsdpcheck.text import int_ranges
from fsdpcheck.vocab import ExitCode, Verdict

DEFAULT_SEEDS = 8
DEFAULT_TIMEOUT = 180.0
MARK = "@fsdpcheck "  # prefix of the JSON lines a child prints (other output is ignored)


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class TensorShape:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class OrderVariant:
    """One order of a module's reordering tensors, and the hash seeds that produced it."""

    seeds: tuple[int, ...]
    order: tuple[str, ...]  # the module's reordering tensors, in iteration order
    positions: tuple[int, ...]  # their indices in the model's named_buffers()/named_parameters()


@dataclass(frozen=True)
class ModuleReorder:
    """A module whose buffers (or parameters) come out in an order that follows the hash seed."""

    kind: str  # "buffer" | "param"
    module: str  # name prefix up to the last dot ("" for the root module)
    tensors: tuple[TensorShape, ...]  # the reordering tensors, by name
    variants: tuple[OrderVariant, ...]
    sizes_differ: bool  # tensors paired by position differ in shape

    @property
    def outcome(self) -> str:
        """What a loader that pairs tensors by local order would do."""
        return "hang" if self.sizes_differ else "silent-corruption"


@dataclass(frozen=True)
class SeedError:
    seed: int
    kind: str  # "input" | "runtime" | "timeout"
    message: str


@dataclass(frozen=True)
class ProbeResult:
    model: str
    architecture: str | None
    seeds: tuple[int, ...]
    verdict: str  # "latent" | "consistent" | "error"
    exit_code: int
    reorders: tuple[ModuleReorder, ...]
    errors: tuple[SeedError, ...]
    orders: int  # distinct (buffer order, parameter order) pairs among the seeds that built
    transformers: str | None = None
    text_only: bool = False
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(t.name for r in self.reorders for t in r.tensors)

    @property
    def sizes_differ(self) -> bool:
        return any(r.sizes_differ for r in self.reorders)


# ---------------------------------------------------------------- comparison (pure)


def module_of(name: str) -> str:
    return name.rpartition(".")[0]


def compare_orders(fingerprints: Mapping[int, Fingerprint]) -> tuple[ModuleReorder, ...]:
    """The modules whose buffer or parameter order differs between the seeds' fingerprints."""
    out: list[ModuleReorder] = []
    for kind, attr in (("buffer", "buffers"), ("param", "params")):
        seqs = {seed: getattr(fp, attr) for seed, fp in sorted(fingerprints.items())}
        out.extend(_reorders(kind, seqs))
    return tuple(out)


def _reorders(kind: str, seqs: Mapping[int, Sequence[TensorRecord]]) -> list[ModuleReorder]:
    if len({tuple(t.name for t in seq) for seq in seqs.values()}) <= 1:
        return []
    involved: dict[str, TensorRecord] = {}
    sizes_differ: dict[str, bool] = {}
    for i in range(max(len(seq) for seq in seqs.values())):
        at = [seq[i] if i < len(seq) else None for seq in seqs.values()]
        if len({t.name if t else None for t in at}) == 1:
            continue
        # The i-th broadcast pairs these tensors: different shapes (or a missing one) hang.
        differ = len({t.shape if t else None for t in at}) > 1
        for t in at:
            if t is not None:
                involved.setdefault(t.name, t)
                module = module_of(t.name)
                sizes_differ[module] = sizes_differ.get(module, False) or differ
    reference = next(iter(seqs.values()))
    modules = list(dict.fromkeys(module_of(t.name) for t in reference if t.name in involved))
    modules += [m for m in dict.fromkeys(module_of(n) for n in involved) if m not in modules]
    result = []
    for module in modules:
        names = {n for n in involved if module_of(n) == module}
        by_key: dict[tuple, list[int]] = {}
        for seed, seq in seqs.items():
            picked = [(i, t.name) for i, t in enumerate(seq) if t.name in names]
            key = (tuple(n for _, n in picked), tuple(i for i, _ in picked))
            by_key.setdefault(key, []).append(seed)
        variants = sorted(
            (OrderVariant(tuple(s), order, positions) for (order, positions), s in by_key.items()),
            key=lambda v: v.seeds,
        )
        tensors = tuple(TensorShape(n, involved[n].shape, involved[n].dtype) for n in sorted(names))
        result.append(
            ModuleReorder(kind, module, tensors, tuple(variants), sizes_differ.get(module, False))
        )
    return result


# ---------------------------------------------------------------- child processes


@dataclass(frozen=True)
class ChildOutcome:
    seed: int
    lines: tuple[Mapping[str, Any], ...]  # the JSON records the child printed
    returncode: int | None  # None: killed at the deadline
    timed_out: bool
    stderr_tail: str
    elapsed: float


def child_env(seed: int) -> dict[str, str]:
    """The parent's environment with a fixed hash seed, offline, one thread per child."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env.update(
        PYTHONHASHSEED=str(seed),
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
    )
    return env


class ChildRunner:
    """Run ``python <argv>`` children with a deadline each; :meth:`kill_all` on the way out."""

    def __init__(self) -> None:
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def run(
        self,
        argv: Sequence[str],
        seed: int,
        timeout: float,
        on_line: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> ChildOutcome:
        start = time.monotonic()
        expired = threading.Event()
        lines: list[Mapping[str, Any]] = []
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                env=child_env(seed),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            with self._lock:
                self._live.add(proc)

            def expire() -> None:
                expired.set()
                proc.kill()

            timer = threading.Timer(timeout, expire)
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    record = _parse(line)
                    if record is not None:
                        lines.append(record)
                        if on_line is not None:
                            on_line(record)
                proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                with self._lock:
                    self._live.discard(proc)
            err.seek(0)
            tail = err.read()[-2000:]
        code = None if expired.is_set() else proc.returncode
        return ChildOutcome(
            seed, tuple(lines), code, expired.is_set(), tail, round(time.monotonic() - start, 3)
        )

    def kill_all(self) -> None:
        with self._lock:
            for proc in self._live:
                if proc.poll() is None:
                    proc.kill()


def run_seeds(
    argv: Sequence[str],
    seeds: Sequence[int],
    *,
    jobs: int | None,
    timeout: float,
    on_line: Callable[[int, Mapping[str, Any]], None] | None = None,
) -> dict[int, ChildOutcome]:
    """Run ``argv`` once per hash seed, at most ``jobs`` at a time (default: the usable cores)."""
    runner = ChildRunner()
    lock = threading.Lock()

    def one(seed: int) -> ChildOutcome:
        def report(record: Mapping[str, Any]) -> None:
            if on_line is not None:
                with lock:
                    on_line(seed, record)

        return runner.run(argv, seed, timeout, report)

    workers = max(1, min(jobs or usable_cores(), len(seeds)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsdpcheck-seed")
    try:
        outcomes = list(pool.map(one, seeds))
    except BaseException:
        runner.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {o.seed: o for o in outcomes}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def failure_message(outcome: ChildOutcome, timeout: float) -> str:
    if outcome.timed_out:
        return f"timed out after {timeout:g} s (killed)"
    last = [ln for ln in outcome.stderr_tail.strip().splitlines() if ln.strip()]
    detail = last[-1] if last else "no output"
    return f"child exited with code {outcome.returncode} without a result: {detail}"


def _parse(line: str) -> Mapping[str, Any] | None:
    if not line.startswith(MARK):
        return None
    try:
        record = json.loads(line[len(MARK) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def emit(record: Mapping[str, Any]) -> None:
    """Child side: one JSON line on stdout (the only thing a child prints on purpose)."""
    sys.stdout.write(MARK + json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- the probe


def probe(
    model: str,
    *,
    seeds: int = DEFAULT_SEEDS,
    text_only: bool = False,
    trust_remote_code: bool = False,
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> ProbeResult:
    """Build ``model`` on meta under PYTHONHASHSEED = 0 .. seeds-1 and compare tensor orders.

    Verdict ``latent`` (exit 1) when any buffer or parameter order differs between seeds, even if
    some seeds failed (the difference is real); ``consistent`` (exit 0) when every seed built and
    all orders agree; ``error`` otherwise (exit 2 when every failure is bad input such as an
    unknown preset, else 3). With the default 8 seeds a two-way set order goes unnoticed with
    probability 2*2^-8 = 1/128 (< 1 %).
    """
    if seeds < 2:
        from fsdpcheck.errors import InputError

        raise InputError(f"--seeds {seeds}: comparing orders needs at least 2 hash seeds.")
    start = time.monotonic()
    argv = ["-m", "fsdpcheck.children.probe", "--child", "--model", model]
    argv += ["--text-only"] * text_only + ["--trust-remote-code"] * trust_remote_code
    seed_list = tuple(range(seeds))
    outcomes = run_seeds(argv, seed_list, jobs=jobs, timeout=timeout)

    fingerprints: dict[int, Fingerprint] = {}
    errors: list[SeedError] = []
    architecture = None
    for seed in seed_list:
        outcome = outcomes[seed]
        record = outcome.lines[-1] if outcome.lines else None
        if record is not None and record.get("ok"):
            fingerprints[seed] = from_dict(Fingerprint, record["fingerprint"])
            architecture = architecture or record.get("architecture")
        elif record is not None:
            errors.append(SeedError(seed, record.get("kind", "runtime"), record["message"]))
        else:
            kind = "timeout" if outcome.timed_out else "runtime"
            errors.append(SeedError(seed, kind, failure_message(outcome, timeout)))

    reorders = compare_orders(fingerprints)
    orders = len({(_names(fp.buffers), _names(fp.params)) for fp in fingerprints.values()})
    if reorders:
        verdict, code = Verdict.LATENT, ExitCode.FINDINGS
    elif errors:
        bad_input = all(e.kind == "input" for e in errors)
        verdict, code = Verdict.ERROR, ExitCode.BAD_INPUT if bad_input else ExitCode.RUNTIME
    else:
        verdict, code = Verdict.CONSISTENT, ExitCode.CONSISTENT
    return ProbeResult(
        model=model,
        architecture=architecture,
        seeds=seed_list,
        verdict=verdict,
        exit_code=code,
        reorders=reorders,
        errors=tuple(errors),
        orders=orders,
        transformers=installed_version("transformers"),
        text_only=text_only,
        timings={
            "total": round(time.monotonic() - start, 3),
            "slowest_child": max((o.elapsed for o in outcomes.values()), default=0.0),
        },
    )


def _names(records: Sequence[TensorRecord]) -> tuple[str, ...]:
    return tuple(t.name for t in records)


def probe_finding(result: ProbeResult) -> Finding | None:
    """The probe's result as an audit :class:`Finding` (kind ``hash-seed``); None if nothing
    reorders. ``ranks`` is empty and ``reference_rank`` is -1: the comparison is between hash
    seeds on one host, not between ranks."""
    if not result.reorders:
        return None
    modules = list(dict.fromkeys(r.module for r in result.reorders))
    outcome = "hang" if result.sizes_differ else "corrupt them silently"
    summary = (
        f"{len(result.tensors)} tensor(s) in {', '.join(m or '<root>' for m in modules)} change "
        f"order with PYTHONHASHSEED (seeds {int_ranges(result.seeds)}); sizes "
        f"{'differ' if result.sizes_differ else 'are equal'}, so a loader that broadcasts in "
        f"local order would {outcome}"
    )
    return Finding(
        kind="hash-seed",
        ranks=(),
        reference_rank=-1,
        stage="probe",
        cause="construction-time",
        summary=summary,
        tensors=result.tensors,
        details={
            "modules": modules,
            "seeds": list(result.seeds),
            "orders": [
                {
                    "kind": r.kind,
                    "module": r.module,
                    "seeds": list(v.seeds),
                    "order": list(v.order),
                }
                for r in result.reorders
                for v in r.variants
            ],
            "sizes_differ": result.sizes_differ,
        },
    )


# ---------------------------------------------------------------- rendering (no printing)


def probe_table(result: ProbeResult) -> Any:
    """A rich Table of the reordering modules: one row per (module, order variant)."""
    from rich.table import Table

    table = Table(title="tensor orders under each PYTHONHASHSEED", title_justify="left")
    for column in ("module", "kind", "seeds", "order", "shapes", "loader outcome"):
        table.add_column(column, overflow="fold")
    for r in result.reorders:
        shapes = {t.name: t.shape for t in r.tensors}
        for i, v in enumerate(r.variants):
            short = [n.rpartition(".")[2] for n in v.order]
            table.add_row(
                (r.module or "<root>") if i == 0 else "",
                r.kind if i == 0 else "",
                int_ranges(v.seeds),
                ", ".join(short),
                ", ".join(str(list(shapes[n])) for n in v.order),
                (
                    "[red]hang (sizes differ)[/]"
                    if r.sizes_differ
                    else "[red]silent corruption (same sizes)[/]"
                )
                if i == 0
                else "",
            )
    return table


def probe_summary(result: ProbeResult) -> str:
    """The verdict line, as rich markup."""
    style = {"latent": "bold red", "consistent": "bold green"}.get(result.verdict, "bold red")
    what = {
        "latent": (
            f"{len(result.tensors)} tensor(s) change order with the hash seed "
            f"({result.orders} distinct orders over {len(result.seeds)} seeds); a loader pairing "
            f"them by local order would {'hang' if result.sizes_differ else 'corrupt silently'}"
        ),
        "consistent": (
            f"the same buffer and parameter order under all {len(result.seeds)} hash seeds"
        ),
        "error": f"{len(result.errors)} of {len(result.seeds)} seeds failed",
    }[result.verdict]
    return f"[bold]verdict:[/] [{style}]{result.verdict}[/] (exit {result.exit_code}) · {what}"


def probe_errors(result: ProbeResult) -> list[str]:
    """The failed seeds as rich markup lines, one per distinct message."""
    from rich.markup import escape

    grouped: dict[tuple[str, str], list[int]] = {}
    for e in result.errors:
        grouped.setdefault((e.kind, e.message), []).append(e.seed)
    return [
        f"[bold red]✗ seed{'s' if len(s) > 1 else ''} {int_ranges(s)} ({kind})[/]: {escape(msg)}"
        for (kind, msg), s in grouped.items()
    ]


def write_json(record: Any, path: Path) -> None:
    """Write any record as JSON, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(to_dict(record), out, indent=2)
        out.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- child entry point


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdpcheck.children.probe")
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text-only", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)

    from fsdpcheck.errors import FsdpcheckError

    try:
        from fsdpcheck.model.resolve import resolve

        resolved = resolve(args.model, rank=0)  # before importing torch: bad input fails fast

        from fsdpcheck.model.build import build
        from fsdpcheck.model.fingerprint import fingerprint

        built = build(
            resolved,
            rank=0,
            init="meta",
            text_only=args.text_only,
            trust_remote_code=args.trust_remote_code,
        )
        fp = fingerprint(built.model, "pre-wrap", with_values=False)
    except FsdpcheckError as exc:
        # resolve() speaks to ranks; here there is one process per hash seed.
        emit({"ok": False, "kind": exc.kind, "message": str(exc).removeprefix("rank 0: ")})
        return exc.exit_code
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        emit({"ok": False, "kind": "runtime", "message": f"{type(exc).__name__}: {first}"})
        return ExitCode.RUNTIME
    emit({"ok": True, "architecture": built.info.architecture, "fingerprint": to_dict(fp)})
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
