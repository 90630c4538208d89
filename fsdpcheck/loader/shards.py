"""Shard arithmetic: which part of a full tensor each rank of a DTensor mesh holds.

``Shard(d)`` on mesh dim i keeps chunk ``coordinate[i]`` of ``torch.chunk(t, mesh_shape[i], d)``,
as FSDP2 and DTensor cut it; ``Replicate()`` keeps the whole dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def mesh_coordinate(mesh: Any, rank: int) -> list[int] | None:
    """``rank``'s position in ``mesh``, one index per mesh dim; ``None`` if it is not there."""
    where = (mesh.mesh == rank).nonzero()
    return [int(c) for c in where[0].tolist()] if where.numel() else None


def local_shape(
    shape: Sequence[int],
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """The shape :func:`shard_of` cuts, from sizes alone: ``Shard(d)`` keeps
    chunk ``c`` of ``torch.chunk(t, n, d)``, ``ceil(L / n)`` long except at the end."""
    from torch.distributed.tensor import Replicate

    dims = [int(d) for d in shape]
    for size, coord, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim % max(len(dims), 1)
        length = dims[dim]
        chunk = -(-length // size)
        dims[dim] = max(0, min(chunk, length - coord * chunk)) if chunk else 0
    return tuple(dims)


def expected_shard(full: torch.Tensor, param: torch.Tensor, global_rank: int) -> torch.Tensor:
    """The part of ``full`` that ``global_rank`` holds for ``param`` (rank 0's view of it)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return full
    mesh = param.device_mesh
    coordinate = mesh_coordinate(mesh, global_rank)
    if coordinate is None:
        raise ValueError(f"rank {global_rank} is not in the parameter's device mesh")
    return shard_of(full, placements, tuple(mesh.mesh.shape), coordinate)


def shard_of(
    full: torch.Tensor,
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> torch.Tensor:
    """``Shard(d)`` on mesh dim i keeps ``torch.chunk(t, mesh_shape[i], d)[coordinate[i]]``, or an
    empty slice when the coordinate is past the last chunk (as FSDP2 and DTensor do)."""
    from torch.distributed.tensor import Replicate, Shard

    tensor = full
    for size, coord, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"placement {placement} is not supported by verify")
        dim = placement.dim % max(tensor.dim(), 1)
        chunks = torch.chunk(tensor, size, dim)
        tensor = chunks[coord] if coord < len(chunks) else tensor.narrow(dim, 0, 0)
    return tensor
