"""Record a rank's buffers and parameters, in iteration order."""

from __future__ import annotations

import torch
from torch import nn

from fsdpcheck.model.checksum import checksum, checksums
from fsdpcheck.records import Fingerprint, TensorRecord


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
    batch, so the checksum spreads over this rank's cores."""
    non_persistent = non_persistent_buffers(model)
    named_buffers = list(model.named_buffers())
    named_params = [(name, p, _local(p)) for name, p in model.named_parameters()]
    to_digest = [buf for _, buf in named_buffers] if with_values else []
    if param_values:
        to_digest += [local for _, _, local in named_params]
    digests = iter(checksums(to_digest))
    buffers = tuple(
        TensorRecord(
            name=name,
            shape=tuple(buf.shape),
            dtype=dtype_name(buf.dtype),
            device=buf.device.type,
            persistent=name not in non_persistent,
            digest=next(digests) if with_values else None,
            head=head_values(buf) if with_values else None,
        )
        for name, buf in named_buffers
    )
    params = tuple(
        _param_record(name, p, local, next(digests) if param_values else None, param_values)
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


def _param_record(
    name: str, param: torch.Tensor, local: torch.Tensor, digest: str | None, with_values: bool
) -> TensorRecord:
    placements = getattr(param, "placements", None)
    local_shape = None
    if placements is not None:
        local_shape = tuple(local.shape)
        placements = tuple(str(p) for p in placements)
    return TensorRecord(
        name=name,
        shape=tuple(param.shape),
        dtype=dtype_name(param.dtype),
        device=param.device.type,
        placements=placements,
        local_shape=local_shape,
        digest=digest,
        head=head_values(local) if with_values else None,
        requires_grad=bool(param.requires_grad),
    )
