"""Which modules of a live model are activation-checkpointed or compiled, and the levels those
wrappers add to its tensor names (:class:`WrapperRecord`): read on the rank, compared by
:mod:`fsdpcheck.checks.wrapper`.

Each way is feature-detected, so a torch or transformers release that lacks one records
nothing for it rather than failing the rank.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fsdpcheck.model.names import DDP_LEVEL, WRAPPER_LEVELS, canonical_name
from fsdpcheck.records import Renamed, WrappedModule, WrapperRecord
from fsdpcheck.vocab import Wrapper

log = logging.getLogger(__name__)


def wrapper_record(model: nn.Module) -> WrapperRecord:
    """``model``'s wrappers as they are now."""
    ddp = _is_ddp(model)
    modules = []
    for name, module in model.named_modules():
        for how in _wrapped_how(module):
            modules.append(WrappedModule(canonical_name(name, ddp_root=ddp), how))
    names = Counter()
    keys = Counter()
    for name in (*(n for n, _ in model.named_parameters()), *(n for n, _ in model.named_buffers())):
        names.update(_levels(name, ddp))
    for key in model.state_dict(keep_vars=True):
        keys.update(_levels(key, ddp))
    renamed = tuple(
        Renamed(level, names[level], keys[level])
        for level in (*WRAPPER_LEVELS, DDP_LEVEL)
        if names[level] or keys[level]
    )
    return WrapperRecord(modules=tuple(modules), renamed=renamed)


def _levels(name: str, ddp: bool) -> set[str]:
    parts = name.split(".")
    found = {p for p in parts if p in WRAPPER_LEVELS}
    if ddp and parts[0] == DDP_LEVEL:
        found.add(DDP_LEVEL)
    return found


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)


def _wrapped_how(module: nn.Module) -> list[Wrapper]:
    found = []
    # By child name, not attribute: both wrappers forward unknown attributes to what they wrap.
    if "_checkpoint_wrapped_module" in module._modules:
        found.append(Wrapper.CHECKPOINT_WRAPPER)
    if _composable(module, "checkpoint"):
        found.append(Wrapper.CHECKPOINT)
    # transformers: gradient_checkpointing_enable() sets this on each layer that checkpoints
    # (GradientCheckpointingLayer); a model's own attribute of the name is read the same way.
    if getattr(module, "gradient_checkpointing", False) is True and _is_layer(module):
        found.append(Wrapper.GRADIENT_CHECKPOINTING)
    if "_orig_mod" in module._modules:
        found.append(Wrapper.COMPILE)
    if module.__dict__.get("_compiled_call_impl") is not None:
        found.append(Wrapper.COMPILE_IN_PLACE)
    return found


def _is_layer(module: nn.Module) -> bool:
    """A layer that checkpoints itself, not a model that only passes the flag on (transformers
    sets ``gradient_checkpointing`` on the base model and on each layer)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except Exception:  # an older transformers: the flag sits on the model, read it there
        log.debug("no GradientCheckpointingLayer in this transformers", exc_info=True)
        return True
    return isinstance(module, GradientCheckpointingLayer)


def _composable(module: nn.Module, api: str) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except Exception:  # a torch without the composable registry: nothing to read
        log.debug("no composable registry in this torch", exc_info=True)
        return False
    registry = _get_registry(module)
    return bool(registry) and api in registry
