"""What a live model and its process hold beyond their tensors that changes what a forward
computes: each module's ``training`` flag, hooks and non-tensor settings
(:class:`ModuleStateRecord`), and the process-wide numerics switches (:class:`NumericsRecord`).

Collectors only; the cross-rank comparison is :mod:`fsdpcheck.checks.module_state`. Nothing
recorded here may differ per process on a clean job (DESIGN fact 11): no addresses (callables by
qualified name), no devices, no ranks, no paths.
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from fsdpcheck.model.wrap import model_class
from fsdpcheck.records import ModuleKind, ModuleStateRecord, NumericsRecord

log = logging.getLogger(__name__)

# (kind, the module's dict of hooks). Each dict maps a handle id to the hook, in the order the
# hooks run.
_HOOK_DICTS = (
    ("forward-pre", "_forward_pre_hooks"),
    ("forward", "_forward_hooks"),
    ("backward-pre", "_backward_pre_hooks"),
    ("backward", "_backward_hooks"),
    ("state-dict-pre", "_state_dict_pre_hooks"),
    ("state-dict", "_state_dict_hooks"),
    ("load-state-dict-pre", "_load_state_dict_pre_hooks"),
    ("load-state-dict-post", "_load_state_dict_post_hooks"),
)
_GLOBAL_HOOKS = (
    ("forward-pre", "_global_forward_pre_hooks"),
    ("forward", "_global_forward_hooks"),
    ("backward-pre", "_global_backward_pre_hooks"),
    ("backward", "_global_backward_hooks"),
)
# Hooks that wrapping itself installs, the same on every rank that wraps alike: FSDP2's and
# tensor parallelism's (the wrap-plan and placement checks compare how each rank wrapped).
_OWN_HOOKS = ("torch.distributed.",)
_MAX_TEXT = 200  # a setting's text stays short whatever the attribute holds
_SCALARS = (bool, int, float, str, type(None))


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function, a bound method's function, a partial's function, or a
    callable object's class: never an address."""
    seen = 0
    while seen < 8:  # unwrap partials, bound methods and torch's hook wrappers
        seen += 1
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif type(obj).__name__ == "_WrappedHook" and hasattr(obj, "hook"):
            obj = obj.hook
        else:
            break
    target = obj if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)) else None
    if target is None and isinstance(obj, type):
        target = obj
    if target is None:
        target = type(obj)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
    return f"{module}.{name}" if module else name


def _hooks(module: nn.Module) -> tuple[str, ...]:
    return _hooks_of(module, _HOOK_DICTS)


def global_hooks() -> tuple[str, ...]:
    return _hooks_of(torch_module, _GLOBAL_HOOKS)


def _hooks_of(owner: object, dicts: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """``kind:qualified name`` of every hook in ``owner``'s hook dicts but fsdpcheck's own."""
    out = []
    for kind, attribute in dicts:
        for hook in (getattr(owner, attribute, None) or {}).values():
            name = qualified_name(hook)
            if not name.startswith(_OWN_HOOKS):
                out.append(f"{kind}:{name}")
    return tuple(out)


def _per_process(name: str) -> bool:
    # A module that keeps its device or its rank holds what differs per process by nature.
    return name == "device" or name.endswith("rank")


def _setting(value: Any) -> str | None:
    """The text a setting is compared by; None for what is not a setting (tensors, modules,
    configs and other objects: compared elsewhere, or with no stable value)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, _SCALARS):
        if isinstance(value, str) and ("/" in value or "\\" in value):
            return None  # a path: where a rank reads from, per node by design
        return repr(value)[:_MAX_TEXT]
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        if any(isinstance(v, str) and "/" in v for v in value):
            return None
        return repr(tuple(value))[:_MAX_TEXT]
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        return qualified_name(value)  # an activation chosen as a function (F.gelu)
    return None


def _settings(module: nn.Module) -> tuple[tuple[str, str], ...]:
    out = []
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training" or _per_process(name):
            continue
        text = _setting(value)
        if text is not None:
            out.append((name, text))
    return tuple(sorted(out))


def _class_name(module: nn.Module) -> str:
    return qualified_name(model_class(module))


# Attributes that say how much randomness a module adds in training mode (HF attention's
# ``attention_dropout``, ``hidden_dropout_prob``, ``drop_path_rate``, a router's jitter).
_RATE_WORDS = ("dropout", "drop_prob", "drop_path", "drop_rate", "jitter")


def mode_matters(module: nn.Module) -> bool:
    """Whether ``module``'s forward depends on its ``training`` flag: dropout with ``p > 0``,
    batch and instance norms (running statistics), a module whose own code reads
    ``self.training`` with a non-zero dropout-like rate or gradient checkpointing on (the
    recompute issues FSDP2's all-gathers again), or reads it with no rate to say what for.
    A model loaded with ``from_pretrained`` is in eval mode and one built with ``from_config``
    in training mode: where no module's forward depends on it, that is no difference."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return True
    if not _reads_training(type(module)):
        return False
    own = vars(module)
    if own.get("gradient_checkpointing") is True:
        return True
    rates = [
        value
        for name, value in own.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and any(word in name.lower() for word in _RATE_WORDS)
    ]
    if rates or "gradient_checkpointing" in own:
        return any(rate > 0 for rate in rates)
    return True


@functools.lru_cache(maxsize=512)
def _reads_training(cls: type) -> bool:
    """Whether a ``forward`` or ``__call__`` of ``cls`` (or a base class outside torch.nn)
    reads ``self.training``; True where the source cannot be read (unknown: assume it does)."""
    for base in cls.__mro__:
        if base is nn.Module or base.__module__.startswith("torch.nn."):
            continue
        for attribute in ("forward", "__call__"):
            method = base.__dict__.get(attribute)
            if method is None:
                continue
            try:
                source = inspect.getsource(method)
            except (OSError, TypeError):
                log.debug("no source for %s.%s", base.__qualname__, attribute, exc_info=True)
                return True
            if "self.training" in source:
                return True
    return False


def module_kind(module: nn.Module) -> ModuleKind:
    return ModuleKind(
        cls=_class_name(module),
        training=bool(module.training) if mode_matters(module) else None,
        hooks=_hooks(module),
        settings=_settings(module),
    )


def module_state(model: nn.Module) -> ModuleStateRecord:
    """Every module of ``model`` (shared modules once, under their first name)."""
    kinds: dict[ModuleKind, int] = {}
    modules = []
    for name, module in model.named_modules():
        kind = module_kind(module)
        modules.append((name, kinds.setdefault(kind, len(kinds))))
    return ModuleStateRecord(
        kinds=tuple(kinds), modules=tuple(modules), global_hooks=global_hooks()
    )


# ---------------------------------------------------------------- process-wide numerics

_UNAVAILABLE = "unavailable"


def _read(get: Callable[[], Any]) -> str:
    try:
        with warnings.catch_warnings():
            # Newer torch warns when the old TF32 switches are read next to the new API.
            warnings.simplefilter("ignore")
            value = get()
    except Exception:
        # A switch this torch build does not have: said, and equal only to another such.
        log.debug("numerics switch not readable here", exc_info=True)
        return _UNAVAILABLE
    return str(value)


def _autocast(device: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(enabled, dtype) readers for ``device``: torch >= 2.4 takes the device type; older
    releases had one function per device."""

    def enabled() -> Any:
        try:
            return torch.is_autocast_enabled(device)
        except TypeError:
            old = torch.is_autocast_cpu_enabled if device == "cpu" else torch.is_autocast_enabled
            return old()

    def dtype() -> Any:
        get = getattr(torch, "get_autocast_dtype", None)
        if get is not None:
            return get(device)
        if device == "cpu":
            return torch.get_autocast_cpu_dtype()
        return torch.get_autocast_gpu_dtype()

    return enabled, dtype


def _matmul_fp32_precision() -> str:
    """The new API's word (torch >= 2.9); ``"none"`` defers to the legacy switch, so it reads
    as what that switch says: a process that set and restored the precision reads ``"ieee"``
    where one that never touched it reads ``"none"``, with the same kernels."""
    matmul = torch.backends.cuda.matmul
    value = matmul.fp32_precision
    if value == "none":
        return "tf32" if matmul.allow_tf32 else "ieee"
    return value


def numerics_record() -> NumericsRecord:
    """This process's numerics switches, read now (none of them needs a GPU to read)."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    readers: list[tuple[str, Callable[[], Any]]] = [
        ("default_dtype", torch.get_default_dtype),
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("cuda.matmul.allow_tf32", lambda: cuda.matmul.allow_tf32),
        ("cuda.matmul.fp32_precision", _matmul_fp32_precision),
        (
            "cuda.matmul.allow_fp16_reduced_precision_reduction",
            lambda: cuda.matmul.allow_fp16_reduced_precision_reduction,
        ),
        (
            "cuda.matmul.allow_bf16_reduced_precision_reduction",
            lambda: cuda.matmul.allow_bf16_reduced_precision_reduction,
        ),
        ("cudnn.enabled", lambda: cudnn.enabled),
        ("cudnn.benchmark", lambda: cudnn.benchmark),
        ("cudnn.deterministic", lambda: cudnn.deterministic),
        ("cudnn.allow_tf32", lambda: cudnn.allow_tf32),
        ("deterministic_algorithms", torch.are_deterministic_algorithms_enabled),
        (
            "deterministic_algorithms_warn_only",
            torch.is_deterministic_algorithms_warn_only_enabled,
        ),
        ("sdpa.flash", lambda: cuda.flash_sdp_enabled()),
        ("sdpa.mem_efficient", lambda: cuda.mem_efficient_sdp_enabled()),
        ("sdpa.math", lambda: cuda.math_sdp_enabled()),
        ("sdpa.cudnn", lambda: cuda.cudnn_sdp_enabled()),
    ]
    for device in ("cpu", "cuda"):
        enabled, dtype = _autocast(device)
        readers += [(f"autocast.{device}", enabled), (f"autocast.{device}.dtype", dtype)]
    return NumericsRecord(flags=tuple((name, _read(get)) for name, get in readers))
