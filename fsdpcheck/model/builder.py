"""``audit --builder MODULE:FUNCTION``: the trainer's own model, built by the trainer's own code.

Every rank imports the user's function (``pkg.module:fn`` from ``sys.path``, or
``path/to/file.py:fn``) and calls it with one :class:`BuildContext`; it returns the model,
already wrapped in FSDP2 or not, optionally rank 0's full state dict to load, and optionally
this rank's own training step for ``--step`` (a model whose forward is not transformers'
``model(input_ids=, labels=).loss``, e.g. torchtitan's ``model(tokens)``):

- ``model``;
- ``(model, state_dict)`` (``state_dict`` may be None on ranks other than 0);
- ``{"model": model, "state_dict": state_dict, "step": step, "batch": batch}``, or any
  object with those attributes (only ``model`` is required): ``step()`` (or ``step(batch)``
  when a batch is given) runs one training step on this rank's own batch and returns the loss.

This runs the user's code: it is the trust boundary, as running the training script is. A
builder that raises on one rank is that rank's error in the gather (an input error when it
cannot be found or returns something else).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fsdpcheck.errors import InputError
from fsdpcheck.model.wrap import model_class
from fsdpcheck.records import ModelInfo
from fsdpcheck.vocab import ModelKind

log = logging.getLogger(__name__)

HINT = (
    "pass --builder MODULE:FUNCTION (an importable module, e.g. myproject.train:build_model) "
    "or FILE.py:FUNCTION, where FUNCTION(ctx) returns the model, or (model, state_dict)"
)
# What a builder's mapping (or returned object) may hold.
FIELDS = ("model", "state_dict", "step", "batch")


@dataclass(frozen=True)
class BuildContext:
    """What a builder is called with, on each rank."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device: this rank's
    # The --mesh (or --tp / --ep) as a DeviceMesh, or None: dims "replicate", "shard" for the
    # positional form, else the names given (dp_replicate, dp_shard, ep, tp).
    mesh: Any = None


@dataclass(frozen=True)
class Built:
    """A builder's answer, normalised."""

    model: nn.Module
    state_dict: Mapping[str, Any] | None = None
    # This rank's training step for --step (None: the synthetic transformers step), called as
    # step() or, with a batch, step(batch); it returns the loss.
    step: Callable[..., Any] | None = None
    batch: Any = None


def find_builder(spec: str, *, rank: int) -> Callable[[BuildContext], Any]:
    """The function ``spec`` names; an :class:`InputError` naming the rank, the input and the
    fix when it cannot be found."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise InputError(f"rank {rank}: --builder {spec!r} names no function; {HINT}.")
    try:
        module = _import(where)
    except InputError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, not a traceback
        log.debug("rank %d: importing %s failed", rank, where, exc_info=True)
        raise InputError(
            f"rank {rank}: --builder {spec!r}: importing {where!r} raised "
            f"{type(exc).__name__}: {exc}; fix that module, or {HINT}."
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"rank {rank}: --builder {spec!r}: {where!r} has no function {name!r}.")
    return fn


def _import(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise InputError(f"--builder: no file {where!r} on this host; {HINT}.")
        module_name = f"fsdpcheck_builder_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise InputError(f"--builder: no module {where!r} on sys.path; {HINT}.") from None
        raise


def builder_spec(build: str | Callable[..., Any]) -> str:
    """``MODULE:FUNCTION`` (or ``FILE.py:FUNCTION`` for a script run as ``__main__``) for a
    builder given as a function, so a child interpreter can import it; a string as it is."""
    if isinstance(build, str):
        return build
    module, name = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    if not callable(build) or module is None or not name.isidentifier():
        raise InputError(
            f"{build!r} cannot be imported by a child process (a lambda, a nested function or a "
            "method); define the builder at module level, or pass 'MODULE:FUNCTION'."
        )
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if not main_file:
            raise InputError(
                f"{name} is defined in an interactive session; put it in a file and pass "
                "'FILE.py:FUNCTION' or 'MODULE:FUNCTION'."
            )
        return f"{Path(main_file).resolve()}:{name}"
    return f"{module}:{name}"


def _call(fn: Callable[..., Any], ctx: BuildContext) -> Any:
    """``fn(ctx)``, or ``fn()`` for a builder that takes no arguments."""
    try:
        takes_none = not inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: called as a builder is
        takes_none = False
    return fn() if takes_none else fn(ctx)


def call_builder(spec: str, ctx: BuildContext) -> Built:
    """Find and call the builder; its answer as :class:`Built`."""
    fn = find_builder(spec, rank=ctx.rank)
    answer = _call(fn, ctx)
    fields = _fields(spec, answer, rank=ctx.rank)
    model, state_dict, step = fields.get("model"), fields.get("state_dict"), fields.get("step")
    if not isinstance(model, nn.Module):
        raise InputError(
            f"rank {ctx.rank}: --builder {spec!r} returned {type(answer).__name__}, not a model; "
            "return the torch.nn.Module, or (model, state_dict), or "
            '{"model": model, "state_dict": ..., "step": ...}.'
        )
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise InputError(
            f"rank {ctx.rank}: --builder {spec!r}: the state dict is a "
            f"{type(state_dict).__name__}, not a mapping of names to tensors."
        )
    if step is not None and not callable(step):
        raise InputError(
            f"rank {ctx.rank}: --builder {spec!r}: its step is a {type(step).__name__}, not "
            "callable; return as 'step' a function that runs one training step on this rank's "
            "batch and returns the loss, or leave 'step' out for the synthetic transformers step."
        )
    return Built(model, state_dict, step, fields.get("batch"))


def _fields(spec: str, answer: Any, *, rank: int) -> dict[str, Any]:
    """The builder's answer by field name (:data:`FIELDS`)."""
    if isinstance(answer, nn.Module):  # first: a model may have a ``.model`` of its own
        return {"model": answer}
    if isinstance(answer, tuple) and len(answer) == 2:
        return dict(zip(("model", "state_dict"), answer, strict=True))
    if isinstance(answer, Mapping):
        fields = dict(answer)
    elif hasattr(answer, "model"):  # the trainer's own dataclass or namespace
        fields = {name: getattr(answer, name, None) for name in FIELDS}
    else:
        return {"model": answer}
    unknown = sorted(str(k) for k in fields if k not in FIELDS)
    if unknown:  # ignored, as before steps were read: a builder may return more for itself
        log.warning(
            "rank %d: --builder %s returned %s, which fsdpcheck does not read (it reads %s)",
            rank,
            spec,
            ", ".join(unknown),
            ", ".join(FIELDS),
        )
    return fields


def wrapped(model: nn.Module) -> bool:
    """The builder already sharded it (its parameters are DTensors)."""
    return any(hasattr(p, "placements") for p in model.parameters())


def builder_info(spec: str, built: Built) -> ModelInfo:
    model = built.model
    dtypes = {p.dtype for p in model.parameters()}
    dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else None
    return ModelInfo(
        spec=spec,
        kind=ModelKind.BUILDER,
        name=spec.rpartition(":")[2],
        path=None,
        architecture=model_class(model).__name__,  # FSDP2 renames a class it wrapped
        dtype=dtype,
        init="builder",
        checkpoint=built.state_dict is not None,
    )
