"""Read a wrapped model's live FSDP2 plan: which module's ``fully_shard`` manages each
parameter, with which mixed-precision, resharding and offload policies, on which mesh.

FSDP2 keeps this in private state (``FSDPModule._get_fsdp_state()`` and its parameter groups),
which moves between torch releases. Every attribute is feature-detected. The mixed-precision
policy is read where each torch keeps it: the parameter group's ``mp_policy`` (torch 2.6 to
2.14), else each ``FSDPParam``'s (2.15 moved it there), else the state's ``_mp_policy`` (what
``fully_shard`` was given). A policy found nowhere is recorded as unread (``unread``), never as
``None``: an unread dtype is not an unset one, so it is never compared and the report says so.
A plan that cannot be read at all says why instead of failing the audit.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from fsdpcheck.records import FsdpGroupRecord, FsdpPlanRecord

log = logging.getLogger(__name__)


def fsdp_plan(model: nn.Module) -> FsdpPlanRecord | None:
    """The plan of every ``fully_shard``-ed module in ``model``; None when nothing is wrapped."""
    try:
        states = _fsdp_states(model)
    except Exception as exc:  # private API: a changed torch must not fail the audit
        log.debug("no FSDP states readable from this torch", exc_info=True)
        return FsdpPlanRecord(groups=(), unavailable=f"{type(exc).__name__}: {exc}")
    if not states:
        return None
    module_names = {id(m): name for name, m in model.named_modules()}
    groups: list[FsdpGroupRecord] = []
    unavailable = None
    for state in states:
        try:
            groups.extend(_state_groups(state, module_names))
        except Exception as exc:
            log.debug("an FSDP state's groups are unreadable", exc_info=True)
            unavailable = f"{type(exc).__name__}: {exc}"
    return FsdpPlanRecord(groups=tuple(groups), unavailable=unavailable)


def _fsdp_states(model: nn.Module) -> list[Any]:
    """Each distinct FSDP state, in ``named_modules()`` order (one per fully_shard call)."""
    states: list[Any] = []
    seen: set[int] = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.6-2.11: one or None
    return [] if group is None else [group]


def _state_groups(state: Any, module_names: dict[int, str]) -> list[FsdpGroupRecord]:
    modules = tuple(module_names.get(id(m), "?") for m in getattr(state, "_modules", None) or ())
    param_groups = _param_groups(state)
    if not param_groups:  # fully_shard on a module without parameters of its own
        return [
            FsdpGroupRecord(modules=modules, params=(), **_mp(getattr(state, "_mp_policy", None)))
        ]
    return [_group_record(g, state, modules, module_names) for g in param_groups]


MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _mp_policy(group: Any, state: Any) -> Any:
    """The group's MixedPrecisionPolicy wherever this torch keeps it; None when nowhere."""
    policy = getattr(group, "mp_policy", None)  # torch 2.6-2.14: on the parameter group
    if policy is not None:
        return policy
    for fsdp_param in getattr(group, "fsdp_params", None) or ():  # 2.15: on each FSDPParam
        policy = getattr(fsdp_param, "mp_policy", None)
        if policy is not None:
            return policy
    return getattr(state, "_mp_policy", None)  # the policy fully_shard was given


def _group_record(group: Any, state: Any, modules: tuple[str, ...], module_names: dict[int, str]):
    params = tuple(_param_name(p, module_names) for p in getattr(group, "fsdp_params", ()))
    mesh_info = getattr(group, "mesh_info", None)
    mesh = getattr(mesh_info, "mesh", None)
    offload = getattr(group, "offload_policy", None)
    return FsdpGroupRecord(
        modules=modules,
        params=params,
        **_mp(_mp_policy(group, state)),
        reshard_after_forward=_reshard(group, mesh_info),
        offload=None if offload is None else type(offload).__name__,
        pin_memory=_optional_bool(getattr(offload, "pin_memory", None)),
        mesh_shape=_mesh_shape(mesh),
        mesh_dim_names=_tuple_or_none(getattr(mesh, "mesh_dim_names", None)),
        mesh_device_type=getattr(mesh, "device_type", None),
    )


def _param_name(fsdp_param: Any, module_names: dict[int, str]) -> str:
    info = getattr(fsdp_param, "_module_info", None)
    module = module_names.get(id(getattr(info, "module", None)), "?")
    name = getattr(info, "param_name", "?")
    return f"{module}.{name}" if module else name


def _mp(policy: Any) -> dict[str, Any]:
    if policy is None:
        return {"unread": MP_FIELDS}
    out: dict[str, Any] = {}
    unread = []
    for name in MP_FIELDS:
        if not hasattr(policy, name):
            unread.append(name)
            continue
        value = getattr(policy, name)
        out[name] = _optional_bool(value) if name == "cast_forward_inputs" else _dtype(value)
    if unread:
        out["unread"] = tuple(unread)
    return out


def _reshard(group: Any, mesh_info: Any) -> bool | int | None:
    """True: reshard to the full shard group; False: keep unsharded; int: that world size."""
    if not hasattr(group, "post_forward_mesh_info"):
        return None
    post = group.post_forward_mesh_info
    if post is None:
        return False
    if post is mesh_info:
        return True
    size = getattr(post, "shard_mesh_size", None)
    return size if isinstance(size, int) else None


def _mesh_shape(mesh: Any) -> tuple[int, ...] | None:
    shape = getattr(mesh, "shape", None)
    try:
        return tuple(int(d) for d in shape) if shape is not None else None
    except TypeError:
        return None


def _tuple_or_none(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _dtype(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
