"""Where the benchmarks' files are, the environment every rank runs with, one run's settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKERS = HERE / "workers"
NAIVE = REPO / "scripts" / "bench_naive.py"  # the naive loader the verdict row measures
RESULTS = HERE / "results.json"  # the raw figures; the next ``--merge`` keeps rows from it
REPORT = REPO / "docs" / "benchmarks.md"

ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
GIB, MIB = 2**30, 2**20
NCCL_TIMEOUT_S = 600.0  # torch.distributed's default NCCL collective timeout
BUCKET_BYTES = 256 * MIB  # load_full_state_dict's default


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeats: int
    scratch: Path
    noisy_repeats: int  # the rows whose runs vary most on a shared machine: audit, load


def worker(name: str) -> str:
    """The path of ``workers/<name>.py``, as an argv entry."""
    return str(WORKERS / f"{name}.py")


def shown(path: str | Path) -> str:
    """``path`` as the report names it: relative to the repository."""
    return Path(path).resolve().relative_to(REPO).as_posix()
