"""Prove a load: every rank's buffers equal rank 0's, every parameter shard equals its slice of the
source state dict. Digests travel to rank 0 over a gloo group; values never leave their rank."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpcheck.errors import FsdpcheckError
from fsdpcheck.loader.shards import expected_shard
from fsdpcheck.model.fingerprint import value_digest
from fsdpcheck.records import VerifyResult

# Status codes rank 0 broadcasts with its verdict.
_RAN, _NOT_RUN, _FAILED = 0, 1, 2


@dataclass(frozen=True)
class _Entry:
    digest: str | None  # None: still on meta
    shape: tuple[int, ...]  # local shape (a parameter's shard)
    placements: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _Digests:
    global_rank: int
    buffers: dict[str, _Entry]
    params: dict[str, _Entry]


def verify_load(
    model: nn.Module, full_state_dict_on_rank0: Mapping[str, torch.Tensor] | None, *, group: Any
) -> VerifyResult:
    """Collective over ``group`` (gloo); rank 0 (the group's first rank) returns the mismatches."""
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    root = ranks[0]
    rank = dist.get_rank()
    mine = _digests(model, rank)
    gathered: list[Any] | None = [None] * len(ranks) if rank == root else None
    dist.gather_object(mine, gathered, dst=root, group=group)

    result = VerifyResult(ran=False, passed=False, checked=0)
    status = torch.tensor([_FAILED, 0, 0], dtype=torch.int64)
    failure: BaseException | None = None
    if rank == root:
        try:
            if full_state_dict_on_rank0 is not None:
                result = _check(model, full_state_dict_on_rank0, gathered, root)
                status = torch.tensor([_RAN, int(result.passed), result.checked])
            else:
                status = torch.tensor([_NOT_RUN, 0, 0])
        except Exception as exc:  # the verdict broadcast below must still happen
            failure = exc
    # Every rank waits here for rank 0's verdict, including when rank 0 failed to reach one.
    dist.broadcast(status, src=root, group=group)
    code, passed, checked = (int(v) for v in status.tolist())
    if code == _FAILED:
        if failure is not None:
            raise failure
        raise FsdpcheckError(f"rank {rank}: verification failed on rank {root}; see its error.")
    if rank == root:
        return result
    return VerifyResult(ran=code == _RAN, passed=bool(passed), checked=checked)


def _digests(model: nn.Module, rank: int) -> _Digests:
    buffers = {
        name: _Entry(value_digest(buf), tuple(buf.shape)) for name, buf in model.named_buffers()
    }
    params = {}
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", None)
        local = param.to_local() if placements is not None else param
        params[name] = _Entry(
            value_digest(local),
            tuple(local.shape),
            tuple(str(p) for p in placements) if placements is not None else None,
        )
    return _Digests(rank, buffers, params)


def _check(
    model: nn.Module,
    source: Mapping[str, torch.Tensor],
    gathered: Sequence[_Digests],
    root: int,
) -> VerifyResult:
    """Rank 0: compare every rank's digests with what that rank must hold."""
    found: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    own_buffers = dict(model.named_buffers())
    own_params = dict(model.named_parameters())

    for name, buf in own_buffers.items():
        if name in source:  # persistent: the source is the truth, rank 0 included
            want = _Entry(value_digest(source[name].to(buf.dtype)), tuple(source[name].shape))
            differs = "values differ from the source state dict"
        else:
            want = _Entry(value_digest(buf), tuple(buf.shape))
            differs = f"values differ from rank {root}'s"
        for digests in gathered:
            reason = _compare(digests.buffers.get(name), want, differs)
            if reason:
                found[(name, "buffer", reason)].append(digests.global_rank)

    for name, param in own_params.items():
        full = source.get(name)
        if full is not None:
            full = full.to(param.dtype)
        for digests in gathered:
            got = digests.params.get(name)
            if full is None:
                reason = "not in the source state dict"
            elif got is not None and got.placements != _placements(param):
                reason = f"sharded as {got.placements}, on rank {root} as {_placements(param)}"
            else:
                try:
                    shard = expected_shard(full, param, digests.global_rank)
                    want = _Entry(value_digest(shard), tuple(shard.shape))
                    reason = _compare(got, want, "values differ from the source state dict")
                except ValueError as exc:
                    reason = str(exc)
            if reason:
                found[(name, "param", reason)].append(digests.global_rank)

    for digests in gathered:  # tensors rank 0 does not have at all
        for kind, entries, own in (
            ("buffer", digests.buffers, own_buffers),
            ("param", digests.params, own_params),
        ):
            for name in entries.keys() - own.keys():
                found[(name, kind, f"not on rank {root}")].append(digests.global_rank)

    mismatches = tuple(
        {"name": name, "kind": kind, "ranks": sorted(ranks), "reason": reason}
        for (name, kind, reason), ranks in sorted(found.items())
    )
    checked = len(own_buffers) + len(own_params)
    return VerifyResult(ran=True, passed=not mismatches, checked=checked, mismatches=mismatches)


def _compare(got: _Entry | None, want: _Entry, differs: str) -> str | None:
    if got is None:
        return "missing on this rank"
    if got.digest is None:
        return "still on meta (never materialised)"
    if got.shape != want.shape:
        return f"local shape {list(got.shape)}, expected {list(want.shape)}"
    if got.digest != want.digest:
        return differs
    return None


def _placements(param: torch.Tensor) -> tuple[str, ...] | None:
    placements = getattr(param, "placements", None)
    return tuple(str(p) for p in placements) if placements is not None else None
