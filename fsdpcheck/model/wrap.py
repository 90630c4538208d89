"""Choose FSDP2 wrap targets and apply ``fully_shard``, leaves first, then the root.

A requested layer class the model does not contain is a warning, and when none is present the
plan falls back to size-based wrapping. That fallback is fsdpcheck's choice: verl's released code
(0.8.0, 0.9.1) has none (its FSDP2 target selection matches class names and never raises; its
FSDP1 wrap policy skips missing classes with a warning and raises when none resolve).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from fsdpcheck.options import DEFAULT_MIN_PARAMS
from fsdpcheck.records import WrapPlan


def model_class(model: nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass named ``FSDP<class>``."""
    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls
    return type(model)


@dataclass(frozen=True)
class WrapTargets:
    """What to shard: the plan as reported, and the modules it names (children first)."""

    plan: WrapPlan
    modules: list[tuple[str, nn.Module]]


def plan(
    model: nn.Module, wrap_classes: Iterable[str] = (), *, min_params: int = DEFAULT_MIN_PARAMS
) -> WrapTargets:
    """Decide what to shard, without touching the model."""
    requested = tuple(dict.fromkeys(wrap_classes))
    source = "--wrap-class"
    if not requested:
        requested = tuple(sorted(getattr(model, "_no_split_modules", None) or ()))
        source = "_no_split_modules" if requested else "none"
    present = {type(m).__name__ for m in model.modules()}
    found = tuple(c for c in requested if c in present)
    missing = tuple(c for c in requested if c not in present)
    # Reversed pre-order puts children before parents, which fully_shard requires.
    modules = list(reversed(list(model.named_modules())))
    if found:
        targets = [(n, m) for n, m in modules if n and type(m).__name__ in found]
    else:
        targets = _size_based(model, min_params)
    targets.append(("", model))
    wrap_plan = WrapPlan(
        requested=requested,
        source=source,
        found=found,
        missing=missing,
        wrapped=tuple(n or "<root>" for n, _ in targets),
        fallback=not found,
        min_params=min_params,
    )
    return WrapTargets(wrap_plan, targets)


def _size_based(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    """Wrap, bottom-up, each module whose not-yet-wrapped parameters reach ``min_params``."""
    targets: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            count += visit(f"{prefix}.{name}" if prefix else name, child)
        if prefix and count >= min_params:
            targets.append((prefix, module))
            return 0
        return count

    visit("", model)
    return targets


def apply(targets: list[tuple[str, nn.Module]], mesh: Any, *, cpu_offload: bool = False) -> None:
    kwargs: dict[str, Any] = {}
    if cpu_offload:
        # Pinned host memory needs CUDA; a CPU mesh offloads to plain memory.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for _, module in targets:
        fully_shard(module, mesh=mesh, **kwargs)
