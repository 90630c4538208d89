"""Every collective op torch registers is watched by the first-step watch or listed as unwatched
with why, here and in docs/checks.md: a new op in a new torch fails this test, not a user."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers its Python ops)
import torch.distributed.tensor  # noqa: F401  (DTensor registers its own)

from fsdpcheck.step.watch import UNWATCHED, WATCHED

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "checks.md"


def registered() -> set[str]:
    names = set()
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        if namespace in NAMESPACES:
            names.add(f"{namespace}::{rest.split('.')[0]}")
    return names


def test_every_registered_collective_op_is_watched_or_listed_unwatched_with_why():
    ops = registered()
    assert "c10d::allreduce_" in ops and "_c10d_functional::all_reduce" in ops  # the query works
    left = sorted(ops - set(WATCHED) - set(UNWATCHED))
    assert not left, f"torch registers collectives the watch neither watches nor lists: {left}"
    assert set(WATCHED).isdisjoint(UNWATCHED)
    assert all(why.strip() for why in UNWATCHED.values())


def test_the_ops_issue_31_found_unwatched_are_watched_now():
    for op in (
        "c10d::monitored_barrier_",
        "c10d::allreduce_coalesced_",
        "c10d::allgather_coalesced_",
        "_c10d_functional::all_gather_into_tensor_out",
        "_c10d_functional::reduce_scatter_tensor_out",
        "_c10d_functional::broadcast_",
        "_dtensor::shard_dim_alltoall",
        "c10d::gather_into_tensor_",  # torch 2.15's dist.gather_single
    ):
        assert op in WATCHED, op


def test_the_docs_list_every_unwatched_op():
    text = DOCS.read_text()
    section = text[text.index("#### Collectives the watch does not see") :]
    listed = set(re.findall(r"`([a-z_0-9]+::[a-z_0-9]+)`", section))
    assert set(UNWATCHED) <= listed, sorted(set(UNWATCHED) - listed)
