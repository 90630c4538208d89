"""The names the loader pairs tensors by: the model's state-dict names, never module paths.

Wrappers applied before ``fully_shard`` add a level to ``named_parameters()``'s names that the
state dict leaves out (activation checkpointing's ``_checkpoint_wrapped_module.``), so a full
state dict, a checkpoint, matches the state dict's names only. The loader moves tensors by these
names and :func:`fsdpcheck.loader.verify.verify_load` checks them by the same ones."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


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
