"""Shard arithmetic: which part of a full tensor each rank of a DTensor mesh holds.

``Shard(d)`` on mesh dim i keeps chunk ``coordinate[i]`` of ``torch.chunk(t, mesh_shape[i], d)``,
as FSDP2 and DTensor cut it; ``Replicate()`` keeps the whole dim. ``_StridedShard(d)`` (FSDP2 over
a tensor-parallel DTensor: TP cut it first, then FSDP2 cut TP's local piece) is cut after every
plain ``Shard``, innermost mesh dim first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from fsdpcheck.model.parallel import sibling_root


def mesh_coordinate(mesh: Any, rank: int) -> list[int] | None:
    """``rank``'s position in ``mesh``, one index per mesh dim, or on its sibling sub-mesh (the
    same dims of the same root mesh, across a tp dim) where ``rank`` holds the same tensor;
    ``None`` if it is in neither."""
    where = (mesh.mesh == rank).nonzero()
    if where.numel():
        return [int(c) for c in where[0].tolist()]
    return _sibling_coordinate(mesh, rank)


def _sibling_coordinate(mesh: Any, rank: int) -> list[int] | None:
    root = sibling_root(mesh)
    if root is None:
        return None
    names, root_names = tuple(mesh.mesh_dim_names), tuple(root.mesh_dim_names)
    where = (root.mesh == rank).nonzero()
    if not where.numel():
        return None
    coordinate = [int(c) for c in where[0].tolist()]
    return [coordinate[root_names.index(n)] for n in names]


def _cuts(
    placements: Sequence[Any], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> Iterator[tuple[int, int, Any]]:
    """(mesh dim size, coordinate, placement) of every cut, in the order they apply: plain
    placements left to right, then the strided ones right to left (they were cut after the dims
    to their right); ``Replicate`` dims cut nothing and are left out."""
    from torch.distributed.tensor import Replicate

    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError("placements, mesh shape and coordinate differ in length")
    strided = [i for i, p in enumerate(placements) if is_strided(p)]
    plain = [i for i in range(len(placements)) if i not in strided]
    for i in plain + strided[::-1]:
        if not isinstance(placements[i], Replicate):
            yield mesh_shape[i], coordinate[i], placements[i]


def is_strided(placement: Any) -> bool:
    return type(placement).__name__ == "_StridedShard"


def supported(placement: Any) -> bool:
    """A placement :func:`shard_of` can cut."""
    return type(placement) in (Shard, Replicate) or is_strided(placement)


def local_shape(
    shape: Sequence[int],
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """The shape :func:`shard_of` cuts, from sizes alone: ``Shard(d)`` keeps
    chunk ``c`` of ``torch.chunk(t, n, d)``, ``ceil(L / n)`` long except at the end."""
    dims = [int(d) for d in shape]
    for size, coord, placement in _cuts(placements, mesh_shape, coordinate):
        dim = placement.dim % max(len(dims), 1)
        length = dims[dim]
        chunk = -(-length // size)
        dims[dim] = max(0, min(chunk, length - coord * chunk)) if chunk else 0
    return tuple(dims)


def expected_shard(
    full: torch.Tensor, param: torch.Tensor, global_rank: int, cache: dict | None = None
) -> torch.Tensor:
    """The part of ``full`` that ``global_rank`` holds for ``param`` (rank 0's view of it).
    ``cache``: where a rank's mesh coordinate is kept across calls (``DeviceMesh.mesh``
    rebuilds its tensor on every access: a quarter of verify's time on a small model)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return full
    mesh = param.device_mesh
    key = (id(mesh), global_rank)
    found = cache.get(key) if cache is not None else None
    if found is None:
        found = (mesh_coordinate(mesh, global_rank), tuple(mesh.mesh.shape))
        if cache is not None:
            cache[key] = found
    coordinate, mesh_shape = found
    if coordinate is None:
        raise ValueError(f"rank {global_rank} is not in the parameter's device mesh")
    return shard_of(full, placements, mesh_shape, coordinate)


def shard_of(
    full: torch.Tensor,
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> torch.Tensor:
    """``Shard(d)`` on mesh dim i keeps ``torch.chunk(t, mesh_shape[i], d)[coordinate[i]]``, or an
    empty slice when the coordinate is past the last chunk (as FSDP2 and DTensor do)."""
    tensor = full
    for size, coord, placement in _cuts(placements, mesh_shape, coordinate):
        if not supported(placement):
            raise ValueError(f"placement {placement} is not supported by verify")
        dim = placement.dim % max(tensor.dim(), 1)
        chunks = torch.chunk(tensor, size, dim)
        tensor = chunks[coord] if coord < len(chunks) else tensor.narrow(dim, 0, 0)
    return tensor
