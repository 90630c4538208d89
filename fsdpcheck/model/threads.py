"""How many threads this rank's memory-bound work may use: its share of the host's cores."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


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


def receiver_threads() -> int:
    """Threads for each receiving rank's work while rank 0 only sends to them (the receivers
    faulting in their fresh shards before a load): the cores shared among the other ranks on
    the host."""
    return max(1, all_cores() // max(1, _local_ranks() - 1))


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
