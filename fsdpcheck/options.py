"""What the audit is asked to do, and the time budgets every stage derives from ``--timeout``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, fields

from fsdpcheck.errors import OptionError
from fsdpcheck.vocab import Backend, DType, Init, Loader

DEFAULT_MIN_PARAMS = 100_000_000  # size-based wrapping threshold, when no wrap class is present
DEFAULT_MODEL = "hazard"  # the embedded preset audited when given neither model nor builder


@dataclass(frozen=True)
class BuildSpec:
    """How a model is built on a rank: the audit's, a child job's and ``fingerprint``'s."""

    model: str
    _: KW_ONLY  # everything after the model by name: subclasses add fields of their own
    init: Init = Init.RANK0
    dtype: DType | None = None  # None: the config's
    seed: int = 0
    text_only: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False


@dataclass(frozen=True, kw_only=True)
class AuditOptions(BuildSpec):
    """What ``fsdpcheck audit`` runs, checked when made: a combination the audit cannot run raises
    :class:`~fsdpcheck.errors.OptionError` (bad input, exit 2; the CLI's usage error) with the
    paragraph the CLI prints, so ``run_audit(AuditOptions(...))`` refuses what the CLI refuses."""

    model: str | None = None  # None: the builder's model, or DEFAULT_MODEL without a builder
    backend: Backend = Backend.AUTO
    timeout: float = 60.0
    wrap_classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS
    mesh: tuple[int, ...] | None = None  # (replicate, shard) for HSDP; default: 1-D, all ranks
    cpu_offload: bool = False  # every fully_shard with FSDP2's CPUOffloadPolicy
    load: bool = True  # run the project's loader and verify every rank afterwards
    reproduce: bool = False  # also run every known loader for real, each in a child job
    loaders: tuple[Loader, ...] = ()  # --loader: the ones --reproduce runs (empty: every one)
    probe: int = 0  # rank 0 also probes the build under this many hash seeds (0: off)
    download: bool = False  # rank 0 fetches a hub id into the cache first; the others wait
    step: bool = False  # after the load: one synthetic training step under the collective watch
    builder: str | None = None  # MODULE:FUNCTION or FILE.py:FUNCTION builds the model (not --model)
    resume: str | None = None  # a DCP checkpoint directory every rank loads after wrapping
    source: str | None = None  # a checkpoint every rank's tensors are checked against, by slice
    mesh_dims: tuple[str, ...] | None = None  # --mesh's dim names (MESH_DIMS), one per size
    tp: int | None = None  # --tp N: the model's own TP plan over N ranks, FSDP2 over the rest
    ep: int | None = None  # --ep N: the model's own EP plan over N ranks (model/parallel.py)

    def __post_init__(self) -> None:
        for problem, option in _refusals(self):
            raise OptionError(problem, option)
        if self.model is None and not self.builder:
            object.__setattr__(self, "model", DEFAULT_MODEL)
        if self.resume is not None:  # a resume builds on meta and loads into it, as trainers do
            object.__setattr__(self, "init", Init.META)

    @property
    def build_spec(self) -> BuildSpec:
        """Just the fields that say how to build the model (what a child job is handed)."""
        return BuildSpec(**{f.name: getattr(self, f.name) for f in fields(BuildSpec)})

    @property
    def budgets(self) -> Budgets:
        return Budgets.from_timeout(self.timeout)


def _refusals(o: AuditOptions) -> Iterator[tuple[str, str | None]]:
    """Why ``o`` cannot run (one paragraph, and the flag it is about), first problem first."""
    if o.timeout < 1:
        yield (
            f"--timeout {o.timeout}: every collective may wait this many seconds, and under 1 "
            "no rank can answer in time; give --timeout 1 or more, or omit it.",
            "--timeout",
        )
    if o.probe < 0:
        yield (
            f"--probe {o.probe}: give the number of hash seeds to build under (8 is a good "
            "choice), or 0 for no probe.",
            "--probe",
        )
    if problem := _positive_problem(o.tp, o.ep):
        yield problem, "--tp" if o.tp is not None and o.tp < 1 else "--ep"
    if o.builder and o.model:
        yield (
            "--builder builds the model itself; drop --model (or drop --builder to audit --model).",
            "--builder",
        )
    if o.builder and o.reproduce:
        yield (
            "--reproduce rebuilds the model in 2-rank child jobs, which cannot call a builder; "
            "audit the builder's model without it (--probe works with --builder), or audit "
            "--model.",
            "--builder",
        )
    try:  # what the world size alone can tell is checked on every rank once it is known
        resolve_mesh(o.mesh, o.mesh_dims, tp=o.tp, ep=o.ep)
    except ValueError as exc:
        yield str(exc), "--mesh" if o.mesh else None
    parallel = [d for d in ("tp", "ep") if getattr(o, d) or d in (o.mesh_dims or ())]
    if parallel and (o.reproduce or o.probe):
        yield (
            f"--reproduce and --probe rebuild the model in child jobs with 1-D FSDP, not with "
            f"the {' and '.join(parallel)} dims of this mesh; audit without them, or drop "
            f"--tp/--ep and the {'/'.join(parallel)} dims of --mesh.",
            "--reproduce" if o.reproduce else "--probe",
        )
    if o.loaders and not o.reproduce:
        yield (
            "--loader chooses which loaders --reproduce runs for real; add --reproduce, or drop "
            "--loader (every loader is predicted either way).",
            "--loader",
        )
    yield from _resume_refusals(o)
    if o.reproduce and o.init == Init.META:
        yield (
            "--reproduce with --init meta: rank 0 then holds no weights, so no loader has "
            "anything to load; use --init rank0 (the default) or --init all, or drop --reproduce.",
            "--reproduce",
        )


def _resume_refusals(o: AuditOptions) -> Iterator[tuple[str, str | None]]:
    """``resume`` builds on meta, as trainers that resume do; what it cannot go with."""
    if o.resume is not None and o.reproduce:
        yield (
            f"--resume {o.resume} with --reproduce: the real loaders load rank 0's full weights "
            "in child jobs, and a resumed audit has none (every rank loads its own shards); drop "
            "--reproduce, or audit without --resume.",
            "--resume",
        )
    if o.resume is not None and o.init == Init.ALL:
        yield (
            f"--resume {o.resume} with --init all: a resume builds every rank on meta and loads "
            "the checkpoint into it; drop --init (or use --init meta).",
            "--resume",
        )


@dataclass(frozen=True)
class Budgets:
    """Seconds each bounded piece of work may take, all from one ``--timeout``.

    Work that rank 0 does while the other ranks wait for its decision (the probe, the real
    loaders of ``--reproduce``) must finish well inside the collective timeout those ranks wait
    under: ``extras`` is that share, one deadline for all of them together.
    """

    collective: float  # any collective on the side channel
    probe: float  # rank 0's --probe children, alongside the audit
    reproduce: float  # the --reproduce child jobs, in all
    extras: float  # everything rank 0 does while the others wait for its decision

    @classmethod
    def from_timeout(cls, timeout: float) -> Budgets:
        return cls(
            collective=timeout,
            probe=0.8 * timeout,
            reproduce=0.75 * timeout,
            extras=0.8 * timeout,
        )


def child_collective_timeout(job_timeout: float) -> float:
    """One collective inside a child job: it gives up (and says so) before the job is killed."""
    return max(2.0, 0.5 * job_timeout)


def mesh_problem(
    mesh: tuple[int, ...],
    world_size: int | None = None,
    *,
    names: tuple[str, ...] | None = None,
    tp: int | None = None,
    ep: int | None = None,
) -> str:
    """What is wrong with ``--mesh`` (one paragraph), or "" when it is a mesh fsdpcheck builds:
    one size (FSDP over every rank) or REPLICATE,SHARD (HSDP), or named dims (:data:`MESH_DIMS`,
    with ``dp_shard``), positive, and, once the world size is known, covering exactly every
    rank; ``--tp`` / ``--ep`` must match its ``tp`` / ``ep`` dim."""
    if names is not None or tp or ep:
        problem = _named_problem(mesh, names, tp=tp, ep=ep)
        if problem:
            return problem
    given = (
        ",".join(f"{n}={d}" for n, d in zip(names, mesh, strict=True))
        if names
        else ",".join(map(str, mesh))
    )
    if names:
        return _size_problem(given, mesh, world_size, _NAMED_EXAMPLE)
    example = "pass REPLICATE,SHARD whose product is the world size (e.g. --mesh 2,4 on 8 ranks)"
    if not 1 <= len(mesh) <= 2:
        return (
            f"--mesh {given}: {len(mesh)} sizes, but fsdpcheck builds a mesh of one dim (FSDP) or "
            f"two (HSDP: replicate, shard); {example}, or omit --mesh."
        )
    return _size_problem(given, mesh, world_size, example)


def _size_problem(given: str, mesh: tuple[int, ...], world_size: int | None, example: str) -> str:
    bad = [d for d in mesh if d < 1]
    if bad:
        return (
            f"--mesh {given}: every size must be a positive number of ranks, not "
            f"{', '.join(map(str, bad))}; {example}, or omit --mesh."
        )
    product = 1
    for d in mesh:
        product *= d
    if world_size is not None and product != world_size:
        return (
            f"--mesh {given} covers {product} ranks but WORLD_SIZE is {world_size}; {example}, "
            "or omit --mesh."
        )
    return ""


# torchtitan's dim names, outermost first: tp innermost, so TP peers are neighbouring ranks.
MESH_DIMS = ("dp_replicate", "dp_shard", "ep", "tp")
DATA_DIMS = ("dp_replicate", "dp_shard")  # what FSDP2 shards over (both: HSDP)
# Dims whose ranks split one tensor and one batch: what they leave whole is one copy per rank.
TP_DIMS = ("tp",)
_NAMED_EXAMPLE = "e.g. --mesh dp_replicate=2,dp_shard=2,tp=2 on 8 ranks"


@dataclass(frozen=True)
class MeshSpec:
    """The DeviceMesh to build: sizes, and their dim names (None: positional, 1-D or HSDP)."""

    sizes: tuple[int, ...]
    names: tuple[str, ...] | None = None


def parse_mesh(text: str) -> MeshSpec:
    """``--mesh``: ``2,4`` (REPLICATE,SHARD) or ``dp_shard=2,tp=2`` (named, laid out in
    :data:`MESH_DIMS` order whatever order they are given in); ValueError with one paragraph."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")] if "=" not in text else None
    if parts is not None:
        try:
            return MeshSpec(tuple(int(p) for p in parts))
        except ValueError:
            raise ValueError(
                f"--mesh {text}: expected REPLICATE,SHARD (e.g. 2,4) or named dims "
                f"({_NAMED_EXAMPLE}); dim names: {', '.join(MESH_DIMS)}."
            ) from None
    named: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not size.lstrip("-").isdigit():
            raise ValueError(
                f"--mesh {text}: {part.strip()!r} is not NAME=SIZE; name every dim "
                f"({_NAMED_EXAMPLE}), or give sizes only (REPLICATE,SHARD)."
            )
        if name not in MESH_DIMS:
            raise ValueError(
                f"--mesh {text}: no dim {name!r}; fsdpcheck builds {', '.join(MESH_DIMS)} "
                f"(torchtitan's names), {_NAMED_EXAMPLE}."
            )
        if name in named:
            raise ValueError(f"--mesh {text}: {name} is given twice; give each dim once.")
        named[name] = int(size)
    order = tuple(n for n in MESH_DIMS if n in named)
    return MeshSpec(tuple(named[n] for n in order), order)


def resolve_mesh(
    sizes: tuple[int, ...] | None,
    names: tuple[str, ...] | None,
    *,
    tp: int | None = None,
    ep: int | None = None,
    world: int | None = None,
) -> MeshSpec | None:
    """The mesh ``--mesh``, ``--tp`` and ``--ep`` ask for together (``--tp N`` alone: data dims
    world/N, tp N); ValueError with :func:`mesh_problem`'s paragraph when they do not fit."""
    if not sizes and not (tp or ep):
        return None
    if not sizes:
        asked = {"tp": tp, "ep": ep}
        rest = 1
        for n in asked.values():
            rest *= n or 1
        if world is not None and (rest < 1 or world % rest):
            flags = " ".join(f"--{k} {v}" for k, v in asked.items() if v)
            raise ValueError(
                f"{flags}: {rest} ranks per data-parallel group do not divide WORLD_SIZE "
                f"{world}; pick sizes whose product divides {world}, or give the whole mesh "
                f"({_NAMED_EXAMPLE})."
            )
        order = ("dp_shard", *(k for k in ("ep", "tp") if asked[k]))
        spec = MeshSpec(
            ((world or rest) // rest, *(asked[k] for k in ("ep", "tp") if asked[k])), order
        )
    else:
        spec = MeshSpec(tuple(sizes), tuple(names) if names else None)
    problem = mesh_problem(spec.sizes, world, names=spec.names, tp=tp, ep=ep)
    if problem:
        raise ValueError(problem)
    return spec


def _positive_problem(tp: int | None, ep: int | None) -> str:
    for flag, size in (("--tp", tp), ("--ep", ep)):
        if size is not None and size < 1:
            return f"{flag} {size}: give a positive number of ranks, or omit {flag}."
    return ""


def _named_problem(
    mesh: tuple[int, ...], names: tuple[str, ...] | None, *, tp: int | None, ep: int | None
) -> str:
    if problem := _positive_problem(tp, ep):
        return problem
    if names is None:
        flags = " ".join(f"{f} {v}" for f, v in (("--tp", tp), ("--ep", ep)) if v)
        return (
            f"{flags} with --mesh {','.join(map(str, mesh))}: sizes alone say replicate, shard; "
            f"name the dims instead ({_NAMED_EXAMPLE} with --tp 2), or drop --mesh."
        )
    if len(names) != len(mesh) or len(set(names)) != len(names):
        return (
            f"mesh dims {', '.join(names)} for sizes {','.join(map(str, mesh))}: give one "
            f"distinct name per size ({_NAMED_EXAMPLE})."
        )
    given = ",".join(f"{n}={d}" for n, d in zip(names, mesh, strict=True))
    if unknown := [n for n in names if n not in MESH_DIMS]:
        return (
            f"--mesh {given}: no dim {unknown[0]!r}; fsdpcheck builds {', '.join(MESH_DIMS)} "
            f"(torchtitan's names), {_NAMED_EXAMPLE}."
        )
    if "dp_shard" not in names:
        return (
            f"--mesh {given}: no dp_shard dim, and fsdpcheck shards with FSDP2 over dp_shard "
            f"(with dp_replicate: HSDP); add dp_shard=N (1 for none), {_NAMED_EXAMPLE}."
        )
    sizes = dict(zip(names, mesh, strict=True))
    for flag, dim, size in (("--tp", "tp", tp), ("--ep", "ep", ep)):
        if size and sizes.get(dim) != size:
            has = f"{dim}={sizes[dim]}" if dim in sizes else f"no {dim} dim"
            return (
                f"{flag} {size} with --mesh {given}: the mesh has {has}; give {dim}={size} in "
                f"--mesh, or drop {flag} (the mesh's {dim} dim says it)."
            )
    return ""


@dataclass(frozen=True)
class RunOptions:
    """``fsdpcheck run``: how a script is watched (the script and its arguments apart)."""

    timeout: float = 60.0  # every exchange with the other ranks, as the audit's --timeout
    watch_steps: int = 1  # optimizer steps watched, from the first forward
    steps: int | None = None  # stop the job after this many steps, the verdict as exit code
    # The checkpoint the model is checked against: None for the one the script was seen to
    # load, "none" for no source check.
    source: str | None = None
    strict: bool = False  # what was not checked is bad input (exit 2), not a note

    def __post_init__(self) -> None:
        if self.watch_steps < 1:
            raise OptionError("--watch-steps must be at least 1.", "--watch-steps")
        if self.steps is not None and self.steps < self.watch_steps:
            raise OptionError(
                f"--steps {self.steps} ends the job before its {self.watch_steps} watched "
                "steps are over: give --steps at least --watch-steps.",
                "--steps",
            )
