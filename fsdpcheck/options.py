"""What the audit is asked to do, and the time budgets every stage derives from ``--timeout``."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, fields

from fsdpcheck.vocab import Backend, DType, Init

DEFAULT_MIN_PARAMS = 100_000_000  # size-based wrapping threshold, when no wrap class is present


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
    backend: Backend = Backend.AUTO
    timeout: float = 60.0
    wrap_classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS
    mesh: tuple[int, ...] | None = None  # (replicate, shard) for HSDP; default: 1-D, all ranks
    cpu_offload: bool = False  # every fully_shard with FSDP2's CPUOffloadPolicy
    load: bool = True  # run the project's loader and verify every rank afterwards
    reproduce: bool = False  # also run every known loader for real, each in a child job
    probe: int = 0  # rank 0 also probes the build under this many hash seeds (0: off)
    download: bool = False  # rank 0 fetches a hub id into the cache first; the others wait
    step: bool = False  # after the load: one synthetic training step under the collective watch
    builder: str | None = None  # MODULE:FUNCTION or FILE.py:FUNCTION builds the model (not --model)
    resume: str | None = None  # a DCP checkpoint directory every rank loads after wrapping

    @property
    def build_spec(self) -> BuildSpec:
        """Just the fields that say how to build the model (what a child job is handed)."""
        return BuildSpec(**{f.name: getattr(self, f.name) for f in fields(BuildSpec)})

    @property
    def budgets(self) -> Budgets:
        return Budgets.from_timeout(self.timeout)


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


def mesh_problem(mesh: tuple[int, ...], world_size: int | None = None) -> str:
    """What is wrong with ``--mesh`` (one paragraph), or "" when it is a mesh fsdpcheck builds:
    one size (FSDP over every rank) or REPLICATE,SHARD (HSDP), positive, and, once the world
    size is known, covering exactly every rank."""
    given = ",".join(map(str, mesh))
    example = "pass REPLICATE,SHARD whose product is the world size (e.g. --mesh 2,4 on 8 ranks)"
    if not 1 <= len(mesh) <= 2:
        return (
            f"--mesh {given}: {len(mesh)} sizes, but fsdpcheck builds a mesh of one dim (FSDP) or "
            f"two (HSDP: replicate, shard); {example}, or omit --mesh."
        )
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
