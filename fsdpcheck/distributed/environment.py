"""What software a rank runs, from an allowlist only (no arbitrary variables, no secrets)."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata

from fsdpcheck.records import EnvRecord, LaunchRecord

log = logging.getLogger(__name__)


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_record(rank: int, local_rank: int, world_size: int, backend: str) -> EnvRecord:
    """The allowlisted environment of this rank: versions and placement, nothing else."""
    import torch

    return EnvRecord(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        host=socket.gethostname(),
        backend=backend,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=package_version("transformers"),
        hash_seed=os.environ.get("PYTHONHASHSEED", "random"),
        accelerate=package_version("accelerate"),
        nccl=nccl_version(),
        cuda=torch.version.cuda,
    )


def nccl_version() -> str | None:
    """The NCCL version torch was built with, ``2.21.5``; None without NCCL (CPU builds)."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this build, or no CUDA runtime: nothing to compare
        log.debug("no NCCL version", exc_info=True)
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def all_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Inside, torch's intra-op kernels (copies, fills) use ``count`` threads: for work only
    this rank does while the others on the host wait (rank 0 materialising the model)."""
    import torch

    previous = torch.get_num_threads()
    if count > previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


def worker_threads() -> int:
    """Threads for memory-bound work on this rank: this process's cores, shared with the other
    ranks on the host (torchrun's LOCAL_WORLD_SIZE), at least one."""
    return max(1, all_cores() // _local_ranks())


def lead_threads() -> int:
    """Threads for the rank with the most work while the others on the host do a small share
    each (rank 0 checksumming every other rank's slices): every core but one per other rank."""
    return max(worker_threads(), all_cores() - (_local_ranks() - 1))


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


# ---------------------------------------------------------------- how the rank was started

# The variables a launcher, torch or NCCL reads that change what a rank does: a rank started
# with one of them set differently trains differently (another algorithm, allocator, thread
# count or FSDP setting). A deliberate list: no other variable is ever read into a record.
LAUNCH_VARIABLES = frozenset(
    {
        "TORCH_DISTRIBUTED_DEBUG",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_DEVICE_MAX_CONNECTIONS",  # TP/SP comm-compute overlap (Megatron, torchtitan)
        "CUBLAS_WORKSPACE_CONFIG",  # deterministic cuBLAS
        "NVIDIA_TF32_OVERRIDE",
        "HF_HUB_OFFLINE",  # what a hub id resolves to
        "TRANSFORMERS_OFFLINE",
    }
)
LAUNCH_PREFIXES = ("NCCL_", "TORCH_NCCL_", "ACCELERATE_", "FSDP_")
# Variables under those prefixes that differ per host or process by design (the network
# interface, the HCAs, a debug file name) or only change what is logged: never a skew.
PER_HOST_VARIABLES = frozenset(
    {
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_TOPO_FILE",
        "NCCL_HOSTID",
        "NCCL_COMM_ID",
        "NCCL_DEBUG",
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_SUBSYS",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_TRACE_CPP_STACK",
    }
)
# Recorded as the number of devices it lists: which devices a rank sees differs per rank by
# design (one GPU per process), how many it sees does not.
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# A flag whose name says it holds a secret: its value never enters a record.
_SECRET_FLAG = re.compile(r"token|key|secret|passw|credential|auth", re.IGNORECASE)
# Flags a launcher sets to each rank's own value (torch.distributed.launch, deepspeed).
_PER_RANK_FLAGS = frozenset({"--local-rank", "--local_rank"})
PER_RANK = "<per-rank>"


def launch_record(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LaunchRecord:
    """How this process was started: ``sys.argv`` and the allowlisted environment (by default),
    safe to put in a report."""
    argv = list(sys.argv if argv is None else argv)
    environ = os.environ if environ is None else environ
    return LaunchRecord(argv=tuple(launch_argv(argv)), env=launch_env(environ))


def launch_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the program by its base name (install paths differ per node), the values
    of secret-looking flags and token-like words redacted, and per-rank flags' values masked."""
    from fsdpcheck.model.config_record import REDACTED, secret_value

    out: list[str] = []
    hide = ""  # the mask for the next word: the value of the flag before it
    for i, word in enumerate(argv):
        if i == 0:
            out.append(os.path.basename(word))
            continue
        if hide and not word.startswith("-"):
            out.append(hide)
            hide = ""
            continue
        hide = ""
        if word.startswith("-"):
            name, eq, _ = word.partition("=")
            mask = _mask_for(name)
            if mask and eq:
                out.append(f"{name}={mask}")
                continue
            hide = mask
            out.append(word)
            continue
        out.append(REDACTED if secret_value(word) else word)
    return out


def _mask_for(flag: str) -> str:
    from fsdpcheck.model.config_record import REDACTED

    if flag in _PER_RANK_FLAGS:
        return PER_RANK
    return REDACTED if _SECRET_FLAG.search(flag.lstrip("-")) else ""


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allowlisted variables that are set, sorted; ``CUDA_VISIBLE_DEVICES`` as a count."""
    from fsdpcheck.model.config_record import REDACTED

    found: dict[str, str] = {}
    for key in sorted(environ):
        if key == VISIBLE_DEVICES:
            found[key] = str(len([d for d in environ[key].split(",") if d.strip()]))
        elif key in LAUNCH_VARIABLES or (
            key.startswith(LAUNCH_PREFIXES) and key not in PER_HOST_VARIABLES
        ):
            found[key] = REDACTED if _SECRET_FLAG.search(key) else environ[key]
    return found
