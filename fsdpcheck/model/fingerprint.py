"""Record a rank's buffers and parameters, in iteration order."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdpcheck.model.checksum import checksum, checksums_and_non_finite
from fsdpcheck.model.parallel import sibling_root
from fsdpcheck.records import Fingerprint, MeshRecord, TensorRecord, short_digest


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def value_digest(tensor: torch.Tensor) -> str | None:
    """A digest of the values, or None where there are none (meta): the memory-speed checksum
    verify uses, on the tensor's own device (see :mod:`fsdpcheck.model.checksum`)."""
    return checksum(tensor)


HEAD_VALUES = 4  # values a record carries per tensor: enough for a hint, bounded bytes


def head_values(tensor: torch.Tensor, count: int = HEAD_VALUES) -> tuple[str, ...] | None:
    """The first ``count`` values as short text (``"8"``, ``"-7.00649e-39"``, ``"nan"``)."""
    if tensor.device.type == "meta":
        return None
    flat = tensor.detach().reshape(-1)[:count].cpu()
    if flat.is_complex():
        return tuple(str(complex(v)) for v in flat.tolist())
    if flat.dtype.is_floating_point:
        flat = flat.double()
    return tuple(f"{v:.6g}" if isinstance(v, float) else str(v) for v in flat.tolist())


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers by name, as ``named_buffers()`` names them, in one pass."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))  # shared tensors: the first name only, as named_buffers() does
            if name in skip:
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


def fingerprint(
    model: nn.Module, stage: str, *, with_values: bool = True, param_values: bool = False
) -> Fingerprint:
    """``with_values``: buffer digests and first values; ``param_values``: parameters' too (of
    the local shard, for DTensors), for comparing them across ranks. Digests are taken in one
    batch, so the checksum spreads over this rank's cores; NaN and Inf are counted in the same
    pass (``TensorRecord.non_finite``)."""
    non_persistent = non_persistent_buffers(model)
    named_buffers = list(model.named_buffers())
    named_params = [(name, p, _local(p)) for name, p in model.named_parameters()]
    to_digest = [buf for _, buf in named_buffers] if with_values else []
    if param_values:
        to_digest += [local for _, _, local in named_params]
    digests = iter(checksums_and_non_finite(to_digest))
    none = (None, None)
    buffers = tuple(
        _buffer_record(
            name, buf, name not in non_persistent, next(digests) if with_values else none
        )
        for name, buf in named_buffers
    )
    mesh_ids: dict[int, str] = {}  # id(DeviceMesh) → its record's id: one per mesh, not param
    params = tuple(
        _param_record(
            name, p, local, next(digests) if param_values else none, param_values, mesh_ids
        )
        for name, p, local in named_params
    )
    keys = tuple(model.state_dict(keep_vars=True).keys())
    return Fingerprint(
        snapshot=stage, buffers=buffers, params=params, state_dict_keys=keys, aliases=aliases(model)
    )


def aliases(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(name, canonical name) of every parameter that another name already holds (tied)."""
    first: dict[int, str] = {}
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name:
            out.append((name, owner))
    return tuple(out)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``: its local shard for a DTensor, else the tensor."""
    return param.to_local() if getattr(param, "placements", None) is not None else param


def _described(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """What every tensor's record says of it: name, global shape, dtype and device type."""
    return {
        "name": name,
        "shape": tuple(tensor.shape),
        "dtype": dtype_name(tensor.dtype),
        "device": tensor.device.type,
    }


def _buffer_record(
    name: str, buf: torch.Tensor, persistent: bool, digested: tuple[str | None, int | None]
) -> TensorRecord:
    digest, non_finite = digested
    if non_finite and is_mask(buf):
        non_finite = 0
    return TensorRecord(
        **_described(name, buf),
        persistent=persistent,
        digest=digest,
        head=head_values(buf) if digest is not None else None,
        non_finite=non_finite,
    )


def is_mask(tensor: torch.Tensor) -> bool:
    """Only 0 and ±inf (no NaN): an additive attention mask, whose infinities are meant."""
    values = tensor.detach()
    if values.is_complex() or not values.dtype.is_floating_point:
        return False
    values = values.float() if values.dtype.itemsize < 4 else values
    if bool(values.isnan().any()):
        return False
    return not bool((values[values.isfinite()] != 0).any())


def mesh_record(mesh: object) -> MeshRecord:
    """A DeviceMesh as a record: its global ranks, shape and this rank's coordinate."""
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    shape = tuple(mesh.mesh.shape)
    coordinate = mesh.get_coordinate()
    names = getattr(mesh, "mesh_dim_names", None)
    return MeshRecord(
        id=mesh_id(shape, ranks),
        shape=shape,
        ranks=ranks,
        coordinate=tuple(coordinate) if coordinate is not None else None,
        dim_names=tuple(names) if names else None,
        family=_family(mesh, shape, names),
    )


def _family(mesh: object, shape: tuple[int, ...], names: object) -> str | None:
    root = sibling_root(mesh)
    if root is None:
        return None
    root_ranks = tuple(int(r) for r in root.mesh.reshape(-1).tolist())
    return mesh_id(shape, (*root_ranks, *names))


def mesh_id(shape: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    """Equal for one mesh on every rank of it (same shape, same global ranks), short: every
    DTensor's record names it."""
    return short_digest(repr(shape), repr(ranks), size=6)


def _param_record(
    name: str,
    param: torch.Tensor,
    local: torch.Tensor,
    digested: tuple[str | None, int | None],
    with_values: bool,
    mesh_ids: dict[int, str],
) -> TensorRecord:
    digest, non_finite = digested
    placements = getattr(param, "placements", None)
    local_shape = mesh = None
    if placements is not None:
        local_shape = tuple(local.shape)
        placements = tuple(str(p) for p in placements)
        device_mesh = getattr(param, "device_mesh", None)
        if device_mesh is not None:
            mesh = mesh_ids.get(id(device_mesh)) or mesh_record(device_mesh).id
            mesh_ids[id(device_mesh)] = mesh
    return TensorRecord(
        **_described(name, param),
        placements=placements,
        local_shape=local_shape,
        digest=digest,
        head=head_values(local) if with_values else None,
        requires_grad=bool(param.requires_grad),
        mesh=mesh,
        non_finite=non_finite,
    )
