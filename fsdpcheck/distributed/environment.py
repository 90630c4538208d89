"""What software a rank runs, from an allowlist only (no arbitrary variables, no secrets)."""

from __future__ import annotations

import logging
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata

from fsdpcheck.distributed.launcher import own_numbers
from fsdpcheck.model.config_record import REDACTED, secret_value, without_addresses
from fsdpcheck.records import HOST_WORD, RANK_WORD, EnvRecord, LaunchRecord

log = logging.getLogger(__name__)


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_record(rank: int, local_rank: int, world_size: int, backend: str) -> EnvRecord:
    """The allowlisted environment of this rank: versions and placement, nothing else."""
    import torch  # here only: the checks and `diff` import this module and never torch

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
    import torch  # here only: the checks and `diff` import this module and never torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this build, or no CUDA runtime: nothing to compare
        log.debug("no NCCL version", exc_info=True)
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


_TAGS = 127  # seed tags 1..127 fit the gather slot's 7 spare flag bits; 0: randomised


def seed_tag(hash_seed: str) -> int:
    """A rank's hash seed in 7 bits for the gather slot: 0 with hash randomisation on, else
    1 + seed mod 127. Different tags prove different seeds; equal tags almost always mean equal
    ones (two seeds 127 apart collide: the note is then missed, never raised wrongly)."""
    if not hash_seed.isdigit():
        return 0
    return 1 + int(hash_seed) % _TAGS


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
# Flags whose value is the process's own number (torch.distributed.launch and deepspeed pass
# --local_rank; launcher scripts pass --rank, --node-rank, ...).
_PER_RANK_FLAG = re.compile(
    r"^--?((local|node|global|group|machine)[-_]?)?rank$|^--?(proc|process|task)[-_]?id$",
    re.IGNORECASE,
)
PER_RANK = "<per-rank>"
PID_WORD = "<pid>"
RAY_WORKER = "<ray worker>"
# Where a digit run is a rank's own number rather than a value: after a word that names a rank
# (``r1.json``, ``rank_1/``, ``node0``, ``worker-1``, ``cuda:1``); as a file's or directory's
# whole name (``1.json``, ``out/1/``); or ending a file name after ``-`` or ``_`` (srun's
# ``report-%t.json``, ``log_1.txt``; not a directory's: ``pytest-0/`` is no rank's); between
# dots after a name (``report.1.json``, ``trace.1``). Never a
# bare number (``--seed 0``, ``--mesh 2,1``), one inside a decimal, version or exponent
# (``0.1``, ``3.1``, ``1e-3``), one followed by a letter (``8B``), nor any other digit in a
# name (``gpt2``, ``Llama-3-8B``, a ``run0/`` directory).
_END = r"(?![0-9A-Za-z])(?!\.\d)"
_OWN_NUMBER = re.compile(
    r"(?<![A-Za-z])(?:rank|r|node|proc|process|task|worker|gpu|cuda|device|dev|local|host)"
    rf"[-_:]?(\d+){_END}"
    r"|(?:^|(?<=/))(\d+)(?=/|\.[A-Za-z])|(?<=/)(\d+)$"
    r"|(?<=[A-Za-z][-_])(?<![0-9][eE][-+])(\d+)(?=\.[A-Za-z]|$)"
    r"|(?<=[A-Za-z]\.)(\d+)(?=\.[A-Za-z]|$)",
    re.IGNORECASE,
)
# Ray's worker process: its command line is Ray's (default_worker.py --worker-id=...
# --runtime-env-hash=... --worker-launch-time-ms=...), never the user's program.
_RAY_WORKER = re.compile(r"(^|[/\\])ray[/\\]_private[/\\]workers[/\\]default_worker\.py$")


def launch_record(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    host: str | None = None,
) -> LaunchRecord:
    """How this process was started: ``sys.argv`` and the allowlisted environment (by default),
    safe to put in a report, with what differs per process by nature normalised away: this
    process's own rank, local rank and node rank (``rank``, ``local_rank`` and the launcher's
    variables) where they name something in an argument or a value, its host name, its pid
    (as ``pid1234``) and memory addresses."""
    argv = list(sys.argv if argv is None else argv)
    environ = os.environ if environ is None else environ
    per_process = _PerProcess(own_numbers(environ, rank, local_rank), host)
    return LaunchRecord(
        argv=tuple(launch_argv(argv, per_process)),
        env=launch_env(environ, per_process),
        numbers=tuple(sorted(per_process.numbers)),
    )


class _PerProcess:
    """Replaces, in one word, what is this process's own: its numbers, host, pid, addresses."""

    def __init__(self, numbers: frozenset[int] = frozenset(), host: str | None = None) -> None:
        self.numbers = numbers
        host = host or socket.gethostname()
        names = {host, host.split(".")[0]}
        self.hosts = sorted((h for h in names if len(h) >= 2), key=len, reverse=True)
        self.pid = str(os.getpid())

    def __call__(self, word: str) -> str:
        word = without_addresses(word)
        for host in self.hosts:
            word = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", HOST_WORD, word)
        # Only where a word names it as a pid: in a container pids are small numbers that any
        # value (--steps 100) can equal.
        word = re.sub(rf"(?<![A-Za-z])(pid[-_:.]?){self.pid}(?!\d)", rf"\g<1>{PID_WORD}", word)
        if not self.numbers:
            return word
        return _OWN_NUMBER.sub(self._own, word)

    def _own(self, match: re.Match[str]) -> str:
        digits = match.group(match.lastindex or 0)
        if int(digits) not in self.numbers:
            return match.group(0)
        start = match.start(match.lastindex or 0) - match.start()
        return match.group(0)[:start] + RANK_WORD


def launch_argv(argv: Sequence[str], per_process: _PerProcess | None = None) -> list[str]:
    """``argv`` with the program by its base name (install paths differ per node), the values
    of secret-looking flags and token-like words redacted, per-rank flags' values masked and
    per-process words normalised (:func:`launch_record`). A Ray worker's is ``<ray worker>``."""
    if argv and _RAY_WORKER.search(argv[0]):
        return [RAY_WORKER]
    own = per_process or _PerProcess()
    out: list[str] = []
    hide = ""  # the mask for the next word: the value of the flag before it
    for i, word in enumerate(argv):
        if i == 0:
            out.append(own(os.path.basename(word)))
            continue
        if hide and not word.startswith("-"):
            out.append(hide)
            hide = ""
            continue
        hide = ""
        if word.startswith("-"):
            name, eq, value = word.partition("=")
            mask = _mask_for(name)
            if mask and eq:
                out.append(f"{name}={mask}")
                continue
            hide = mask
            out.append(f"{name}={own(value)}" if eq else word)
            continue
        out.append(REDACTED if secret_value(word) else own(word))
    return out


def _mask_for(flag: str) -> str:
    if _PER_RANK_FLAG.match(flag):
        return PER_RANK
    return REDACTED if _SECRET_FLAG.search(flag.lstrip("-")) else ""


def launch_env(
    environ: Mapping[str, str], per_process: _PerProcess | None = None
) -> dict[str, str]:
    """The allowlisted variables that are set, sorted; ``CUDA_VISIBLE_DEVICES`` as a count;
    per-process words in values normalised (:func:`launch_record`)."""
    own = per_process or _PerProcess()
    found: dict[str, str] = {}
    for key in sorted(environ):
        if key == VISIBLE_DEVICES:
            found[key] = str(len([d for d in environ[key].split(",") if d.strip()]))
        elif key in LAUNCH_VARIABLES or (
            key.startswith(LAUNCH_PREFIXES) and key not in PER_HOST_VARIABLES
        ):
            found[key] = REDACTED if _SECRET_FLAG.search(key) else own(environ[key])
    return found
