"""Hash-seed dependence: which modules' tensor order follows PYTHONHASHSEED (pure).

Compares fingerprints built under fixed hash seeds (``fsdpcheck.children.probe`` builds them)
and turns a dependence into a ``hash-seed`` finding for the audit; says when the ranks share no
PYTHONHASHSEED at all (:func:`hash_seed_note`), where agreement now proves nothing about the
next run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fsdpcheck.distributed.environment import seed_tag
from fsdpcheck.records import Finding, Fingerprint, RankError, TensorRecord
from fsdpcheck.text import int_ranges, ranks_label
from fsdpcheck.vocab import ErrorKind, FindingKind, LoaderVerdict, Stage, Verdict


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
        return LoaderVerdict.HANG if self.sizes_differ else LoaderVerdict.SILENT_CORRUPTION


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


# ---------------------------------------------------------------- the probe


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


def tensor_names(records: Sequence[TensorRecord]) -> tuple[str, ...]:
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
    return Finding.about(
        FindingKind.HASH_SEED,
        (),
        -1,
        summary,
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


# ---------------------------------------------------------------- ranks without a common seed

RANDOM = "random"  # EnvRecord.hash_seed where PYTHONHASHSEED is unset (or "random")


def hash_seed_note(
    tags: Mapping[int, int],
    seeds: Mapping[int, str],
    *,
    probed: bool = False,
    orders_differ: bool = False,
) -> tuple[str, ...]:
    """A warning when the ranks run with no common PYTHONHASHSEED: some have hash randomisation
    on, or their fixed seeds differ. ``tags``: every rank's :func:`seed_tag` (from the gather);
    ``seeds``: the exact seeds of the ranks whose records rank 0 holds. ``probed``: the probe
    already built the model under other seeds (its result is in the report); ``orders_differ``:
    this run already found tensor orders that differ (the seeds may be why)."""
    tags = dict(tags) or {rank: seed_tag(seed) for rank, seed in seeds.items()}
    for rank, seed in seeds.items():
        tags.setdefault(rank, seed_tag(seed))
    if len(tags) < 2:
        return ()
    randomised = sorted(r for r, t in tags.items() if t == 0)
    exact = {seed for seed in seeds.values() if seed != RANDOM}
    if not randomised and len(set(tags.values())) == 1 and len(exact) <= 1:
        return ()
    if randomised:
        whom = "every rank" if len(randomised) == len(tags) else ranks_label(randomised)
        verb = "runs" if whom == "every rank" or len(randomised) == 1 else "run"
        who = f"{whom} {verb} with hash randomisation on (PYTHONHASHSEED unset)"
    else:
        by_tag: dict[int, list[int]] = {}
        for rank, tag in sorted(tags.items()):
            by_tag.setdefault(tag, []).append(rank)
        shown = "; ".join(
            f"{ranks_label(ranks)}: "
            + next((seeds[r] for r in ranks if r in seeds), "another value")
            for ranks in by_tag.values()
        )
        who = f"the ranks run with different PYTHONHASHSEED values ({shown})"
    check = (
        "--probe built this model under other seeds (its result is in this report)"
        if probed
        else "check the model with `fsdpcheck probe --model M`, `audit --probe 8` (with --model "
        "or --builder) or `fsdpcheck.probe(build)` from a script or Ray driver"
    )
    when = (
        "between ranks: the order findings of this run may come from it"
        if orders_differ
        else "between ranks on another run, even though this run agrees"
    )
    return (
        f"no common hash seed: {who}, so a model that iterates a set of strings while "
        f"registering its tensors can order them differently {when}; {check}, or set one "
        "PYTHONHASHSEED on every rank",
    )


def probe_error(seeds: int, result: ProbeResult | None, why: str | None = None) -> RankError | None:
    """``--probe`` was asked for but did not answer: rank 0's error (the verdict ``error``, exit
    3), never a silent ``consistent``. ``why``: why there is no result at all (its deadline
    passed, it raised). A probe that found reorders answered, whatever else failed."""
    if result is None:
        message = f"--probe {seeds} did not run: {why or 'no result'}"
    elif result.verdict == Verdict.ERROR:
        first = result.errors[0]
        lines = first.message.strip().splitlines()
        failed = f"{len(result.errors)} of {len(result.seeds)} hash seeds did not build"
        message = (
            f"--probe {seeds}: {failed} (seed {first.seed}, {first.kind}: "
            f"{lines[0] if lines else ''}), so the tensor order under other hash seeds was not "
            "checked"
        )
    else:
        return None
    return RankError(0, Stage.PROBE, message, ErrorKind.RUNTIME)
