"""Which launcher started this process, and so this rank's place in the job. Pure: env in.

| launcher          | rank                 | world size           | local rank                  |
|-------------------|----------------------|----------------------|-----------------------------|
| torchrun          | RANK                 | WORLD_SIZE           | LOCAL_RANK                  |
| accelerate launch | RANK                 | WORLD_SIZE           | LOCAL_RANK (it runs torch's |
|                   |                      |                      | elastic agent; ACCELERATE_* |
|                   |                      |                      | variables tell it apart)    |
| srun              | SLURM_PROCID         | SLURM_NTASKS         | SLURM_LOCALID               |
| mpirun (Open MPI) | OMPI_COMM_WORLD_RANK | OMPI_COMM_WORLD_SIZE | OMPI_COMM_WORLD_LOCAL_RANK  |

Every launcher with more than one rank also needs ``MASTER_ADDR`` and ``MASTER_PORT`` (srun and
mpirun do not set them). Launchers nest: torchrun inside an ``sbatch`` allocation still sees the
allocation's ``SLURM_*``, and mpirun inside one too, so the innermost launcher wins: torch's
variables, then Open MPI's, then SLURM's. Variables that contradict each other in a way no
nesting explains (``RANK``/``WORLD_SIZE`` exported in a shell that mpirun then starts, which
would make every process a lone rank 0), or a launcher's variables only in part, are bad input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fsdpcheck.errors import InputError

TORCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
# Variables a child job started by fsdpcheck itself must not inherit: it is a new job.
FOREIGN = SLURM + OMPI + ("SLURM_NPROCS",)

# The variables that hold this process's own numbers, whichever launcher set them (torchrun,
# accelerate, srun, Open MPI, MPICH/Intel MPI/PMIx, MVAPICH, Lightning): per-process by nature.
# A launcher script that puts them into arguments or paths (``--json r1.json``) makes those
# words differ per rank; fsdpcheck.distributed.environment.launch_record normalises them.
RANK_VARIABLES = (
    "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
)  # fmt: skip
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
)  # fmt: skip
NODE_RANK_VARIABLES = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def own_numbers(environ: Mapping[str, str], *known: int | None) -> frozenset[int]:
    """This process's rank, local rank and node rank: ``known`` (the process group's own) and
    every launcher variable above that holds an integer."""
    found = {n for n in known if n is not None}
    for name in (*RANK_VARIABLES, *LOCAL_RANK_VARIABLES, *NODE_RANK_VARIABLES):
        raw = environ.get(name, "").strip()
        if raw.isdigit():
            found.add(int(raw))
    return frozenset(found)


SRUN_HINT = (
    'in the sbatch script: export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
    "| head -n 1) MASTER_PORT=29500"
)
MPIRUN_HINT = "e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ..."


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, and which launcher said so."""

    launcher: str  # "torchrun" | "accelerate" | "srun" | "mpirun" | "none"
    rank: int
    local_rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def from_torch_env(self) -> bool:
        """Whether ``init_process_group``'s env:// finds the rank and world size by itself."""
        return self.launcher in ("torchrun", "accelerate")


def detect(environ: Mapping[str, str]) -> LaunchEnv:
    """The launcher and this rank's place, from ``environ``; one rank when nothing is set.

    Raises :class:`InputError` naming the variables at fault and the fix."""
    torch_set = [v for v in TORCH[:2] if environ.get(v, "") != ""]
    ompi_set = [v for v in OMPI[:2] if environ.get(v, "") != ""]
    slurm_set = [v for v in SLURM[:2] if _slurm(environ, v) is not None]
    if torch_set:
        _complete("torchrun", TORCH[:2], torch_set, "RANK and WORLD_SIZE (and LOCAL_RANK)")
        launcher = "accelerate" if _accelerate(environ) else "torchrun"
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local = _int(environ, "LOCAL_RANK") if environ.get("LOCAL_RANK") else rank
        if ompi_set:
            _agree(environ, rank, world, ompi_set)
    elif ompi_set:
        _complete("mpirun", OMPI[:2], ompi_set, "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE")
        launcher = "mpirun"
        rank, world = _int(environ, OMPI[0]), _int(environ, OMPI[1])
        local = _int(environ, OMPI[2]) if environ.get(OMPI[2]) else rank
    elif slurm_set:
        _complete("srun", SLURM[:2], slurm_set, "SLURM_PROCID and SLURM_NTASKS")
        launcher = "srun"
        rank = _int(environ, "SLURM_PROCID")
        world = int(_slurm(environ, "SLURM_NTASKS") or 0)
        if environ.get("SLURM_LOCALID", "") == "":
            raise InputError(
                f"SLURM_PROCID={rank} and SLURM_NTASKS={world} are set but SLURM_LOCALID is "
                "not: start each rank with srun (which sets all three), or export "
                "RANK, WORLD_SIZE and LOCAL_RANK yourself."
            )
        local = _int(environ, "SLURM_LOCALID")
    else:
        stray = [v for v in ("LOCAL_RANK", *OMPI[2:], "SLURM_LOCALID") if environ.get(v)]
        if stray:
            raise InputError(
                f"{stray[0]}={environ[stray[0]]} is set but no rank or world size is: launch "
                "with torchrun (RANK, WORLD_SIZE), srun (SLURM_PROCID, SLURM_NTASKS) or mpirun "
                f"(OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE), or unset {stray[0]} to run "
                "as one rank."
            )
        return LaunchEnv("none", 0, 0, 1, environ.get("MASTER_ADDR") or None, _port(environ))
    return _checked(launcher, rank, local, world, environ)


def _checked(launcher: str, rank: int, local: int, world: int, environ) -> LaunchEnv:
    names = {
        "torchrun": TORCH, "accelerate": TORCH, "srun": SLURM, "mpirun": OMPI,
    }[launcher]  # fmt: skip
    if world < 1:
        raise InputError(
            f"{names[1]}={world}: the world size must be at least 1; fix the launcher."
        )
    if not 0 <= rank < world:
        raise InputError(
            f"{names[0]}={rank} is outside {names[1]}={world} (ranks are 0..{world - 1}); "
            "fix the launcher."
        )
    if local < 0:
        raise InputError(f"{names[2]}={local} is negative; fix the launcher.")
    addr, port = environ.get("MASTER_ADDR") or None, _port(environ)
    if world > 1 and (addr is None or port is None):
        missing = " and ".join(v for v in RENDEZVOUS if not environ.get(v))
        hint = {"srun": SRUN_HINT, "mpirun": MPIRUN_HINT}.get(launcher, "torchrun sets them")
        raise InputError(
            f"{launcher} started {world} ranks but {missing} "
            f"{'is' if ' and ' not in missing else 'are'} not set, so the ranks cannot find "
            f"each other. Set MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port) in "
            f"every rank's environment ({hint})."
        )
    return LaunchEnv(launcher, rank, local, world, addr, port)


def _slurm(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "")
    if name == "SLURM_NTASKS" and value == "":
        value = environ.get("SLURM_NPROCS", "")  # older releases' name
    return value or None


def _accelerate(environ: Mapping[str, str]) -> bool:
    # accelerate launch sets these for every script it starts (utils/launch.py in 1.x).
    return any(k in environ for k in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND"))


def _complete(launcher: str, needed: tuple[str, ...], present: list[str], what: str) -> None:
    missing = [v for v in needed if v not in present]
    if missing:
        raise InputError(
            f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: a {launcher} job "
            f"sets {what} together. Launch with {launcher} as documented, or unset "
            f"{', '.join(present)} to run as one rank."
        )


def _agree(environ: Mapping[str, str], rank: int, world: int, ompi_set: list[str]) -> None:
    _complete("mpirun", OMPI[:2], ompi_set, "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE")
    o_rank, o_world = _int(environ, OMPI[0]), _int(environ, OMPI[1])
    if (o_rank, o_world) != (rank, world):
        raise InputError(
            f"mixed launcher variables: RANK={rank}, WORLD_SIZE={world} but mpirun says "
            f"OMPI_COMM_WORLD_RANK={o_rank}, OMPI_COMM_WORLD_SIZE={o_world}. RANK/WORLD_SIZE "
            "were probably exported in the shell that ran mpirun; unset them (fsdpcheck reads "
            "mpirun's own variables), or set them per rank from OMPI_COMM_WORLD_*."
        )


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise InputError(
            f"environment variable {name}={raw!r} is not an integer; fix the launcher or unset it."
        ) from None


def _port(environ: Mapping[str, str]) -> int | None:
    raw = environ.get("MASTER_PORT", "")
    if raw == "":
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise InputError(f"MASTER_PORT={raw!r} is not a port number (1-65535); fix it.")
    return port


def rank_hint(environ: Mapping[str, str]) -> int:
    """This process's rank for messages, even when :func:`detect` refuses the environment."""
    try:
        return detect(environ).rank
    except InputError:
        pass
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        try:
            return int(environ.get(name, ""))
        except ValueError:
            continue
    return 0


def local_rank_hint(environ: Mapping[str, str], rank: int) -> int:
    """This process's local rank from any launcher's variable, else ``rank`` (for a script that
    joined its own process group, whose launcher variables may be partial or gone)."""
    for name in ("LOCAL_RANK", OMPI[2], "SLURM_LOCALID"):
        try:
            return int(environ.get(name, ""))
        except ValueError:
            continue
    return rank


def world_hint(environ: Mapping[str, str]) -> int:
    try:
        return detect(environ).world_size
    except InputError:
        return 1
