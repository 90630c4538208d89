"""The names the loader pairs tensors by: the model's state-dict names, never module paths.

Wrappers applied before ``fully_shard`` add a level to ``named_parameters()``'s names that the
state dict leaves out (activation checkpointing's ``_checkpoint_wrapped_module.``), so a full
state dict, a checkpoint, matches the state dict's names only. The loader moves tensors by these
names and :func:`fsdpcheck.loader.verify.verify_load` checks them by the same ones."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpcheck.text import name_list

log = logging.getLogger(__name__)


def state_dict_names(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None = None
) -> dict[int, tuple[str, ...]]:
    """Every tensor of ``model``'s state dict (``state``, with ``keep_vars=True``, when the caller
    has it) by ``id``: its state-dict names, the one that names it first. That is the name
    ``named_parameters()`` or ``named_buffers()`` gives it where the state dict uses it (of tied
    weights, the owner's), else the first in sorted order; the others (tied aliases) follow,
    sorted."""
    state = model.state_dict(keep_vars=True) if state is None else state
    module_names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        module_names.setdefault(id(tensor), name)
    groups: dict[int, list[str]] = {}
    for name in sorted(state):
        groups.setdefault(id(state[name]), []).append(name)
    named = {}
    for key, names in groups.items():
        owner = module_names.get(key)
        owner = owner if owner in names else names[0]
        named[key] = (owner, *(n for n in names if n != owner))
    return named


@dataclass(frozen=True)
class Placement:
    """Where the state dict's entries land in ``model``. Plain models: every entry is one of the
    model's tensors (``placed`` is the state dict itself). A model whose state-dict hooks rewrite
    it (torchtitan's fused ``wqkv`` saved as ``wq``/``wk``/``wv``) has entries that are no tensor
    of it (``derived``); its load_state_dict pre-hooks turn them back into the tensors they came
    from (``fused``: those tensors' keys, module paths, as the hooks name them). ``unplaced``
    entries reach no tensor and ``unreached`` tensors get no entry, even through the hooks:
    loading cannot place them."""

    placed: Mapping[str, torch.Tensor]  # the model's own tensors by the names the loader moves
    derived: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()
    unplaced: tuple[str, ...] = ()
    unreached: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # in words: the hooks failed, or gave a tensor another shape

    @property
    def hooked(self) -> bool:
        return bool(self.derived or self.fused or self.unreached)


def placement(model: nn.Module, state: Mapping[str, Any] | None = None) -> Placement:
    """How ``model``'s state dict (``state``: with ``keep_vars=True``, when the caller has it)
    reaches its parameters and persistent buffers. Where some entry is no tensor of the model,
    the model's load_state_dict pre-hooks are run on meta placeholders of those entries, as
    ``load_state_dict`` would run them, to see which tensors they reach: nothing is written."""
    state = model.state_dict(keep_vars=True) if state is None else state
    own = own_tensors(model)
    derived = sorted(k for k, v in state.items() if torch.is_tensor(v) and id(v) not in own)
    reached = {id(v) for v in state.values() if torch.is_tensor(v)}
    unreached = {key: name for key, (name, _) in own.items() if key not in reached}
    if not derived and not unreached:
        return Placement(placed=state)
    placeholders = {
        k: torch.empty(state[k].shape, dtype=state[k].dtype, device="meta") for k in derived
    }
    problems: list[str] = []
    try:
        landed, leftover = through_load_hooks(model, placeholders)
    except Exception as exc:  # a hook that cannot run on meta: nothing can be placed through it
        log.debug("the model's load_state_dict pre-hooks failed on placeholders", exc_info=True)
        problems.append(
            f"its load_state_dict pre-hooks failed on the entries {name_list(derived)}: "
            f"{type(exc).__name__}: {exc}"
        )
        landed, leftover = {}, set(derived)
    placed = {k: v for k, v in state.items() if k not in derived}
    fused = []
    for key, (value, target) in sorted(landed.items()):
        if id(target) not in unreached:
            continue  # the hooks gave back an entry a tensor already has
        if tuple(value.shape) != tuple(target.shape):
            problems.append(
                f"its load_state_dict pre-hooks make {key} of shape {list(value.shape)}; the "
                f"tensor is {list(target.shape)}"
            )
            continue
        placed[key] = target
        fused.append(key)
        unreached.pop(id(target))
    return Placement(
        placed=placed,
        derived=tuple(derived),
        fused=tuple(fused),
        unplaced=tuple(sorted(set(derived) & leftover)),
        unreached=tuple(sorted(unreached.values())),
        problems=tuple(problems),
    )


def through_load_hooks(
    model: nn.Module, entries: Mapping[str, torch.Tensor]
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], set[str]]:
    """``entries`` as ``model.load_state_dict`` would see them after each module's pre-hooks,
    without loading anything: every key that lands on a parameter or persistent buffer, with its
    value and that tensor; and the keys no module takes (``load_state_dict``'s unexpected keys).
    The recursion is ``load_state_dict``'s: each module's hooks see only its own prefix's keys."""
    landed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    leftover: set[str] = set()

    def visit(module: nn.Module, local: dict[str, torch.Tensor], prefix: str) -> None:
        metadata = {"version": getattr(module, "_version", None)}
        for hook in list(module._load_state_dict_pre_hooks.values()):
            hook(local, prefix, metadata, True, [], [], [])
        tensors = {n: p for n, p in module._parameters.items() if p is not None}
        persistent = module._non_persistent_buffers_set
        tensors.update(
            (n, b) for n, b in module._buffers.items() if b is not None and n not in persistent
        )
        for key, value in local.items():
            head, dot, _ = key[len(prefix) :].partition(".")
            if dot:
                if module._modules.get(head) is None:
                    leftover.add(key)
            elif head in tensors:
                landed[key] = (value, tensors[head])
            elif head != _EXTRA_STATE or not _sets_extra_state(module):
                leftover.add(key)
        for name, child in module._modules.items():
            if child is not None:
                child_prefix = f"{prefix}{name}."
                visit(
                    child,
                    {k: v for k, v in local.items() if k.startswith(child_prefix)},
                    child_prefix,
                )

    visit(model, dict(entries), "")
    return landed, leftover


def through_hooks_source(
    placement: Placement, model: nn.Module, source: Mapping[str, Any]
) -> dict[str, Any]:
    """Rank 0's full state dict under the names the loader moves (``placement.placed``'s): the
    entries the model's state-dict hooks derived are given to its load_state_dict pre-hooks, and
    what those make of them replaces them."""
    if not placement.fused:
        return dict(source)
    derived = set(placement.derived)
    landed, _ = through_load_hooks(model, {k: v for k, v in source.items() if k in derived})
    out = {k: v for k, v in source.items() if k not in derived}
    for key in placement.fused:
        if key in landed:
            out[key] = landed[key][0]
    return out


_EXTRA_STATE = "_extra_state"


def _sets_extra_state(module: nn.Module) -> bool:
    return type(module).set_extra_state is not nn.Module.set_extra_state


def own_tensors(model: nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """The parameters and persistent buffers a state dict should reach, by ``id``: module path
    (the first, for tied ones) and tensor."""
    own: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                own.setdefault(id(param), (dot + name, param))
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                own.setdefault(id(buf), (dot + name, buf))
    return own


def placed_tensors(model: nn.Module, where: Placement) -> dict[str, torch.Tensor]:
    """The model's tensors now, under ``where.placed``'s names: after ``to_empty()`` the
    tensors are new objects, so they are looked up again (by state-dict name, or by module path
    for those its load_state_dict hooks reach)."""
    state = model.state_dict(keep_vars=True)
    fused = set(where.fused)
    out = {name: state[name] for name in where.placed if name not in fused}
    for key in where.fused:
        path, _, leaf = key.rpartition(".")
        module = model.get_submodule(path)
        out[key] = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
    return out
