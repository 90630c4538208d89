"""What one rank's live model holds beyond its layout: which parameters share storage, which
device meshes its DTensors live on, whether it holds NaN or Inf, and whether its buffers are
what its modules compute.

Collectors only: they look at the local model and return records; the cross-rank analysis is
in :mod:`fsdpcheck.checks` (pure functions over those records).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fsdpcheck.model.checksum import non_finite_counts
from fsdpcheck.model.fill import parameters_on_meta
from fsdpcheck.model.fingerprint import head_values, is_mask, mesh_record, non_persistent_buffers
from fsdpcheck.model.hazard import HazardForCausalLM
from fsdpcheck.model.wrap import model_class
from fsdpcheck.records import BufferProblem, MeshRecord, NonFinite, TieRecord
from fsdpcheck.vocab import Snapshot

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- ties


def shared_parameters(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names that are one tensor: the same Parameter object, or (real
    tensors) the same view of the same storage. Sorted, so equal ties compare equal."""
    named = model.named_parameters(remove_duplicate=False)
    return tuple(sorted(_same_keys((name, _storage_keys(p)) for name, p in named)))


def _same_keys(named_keys: Iterable[tuple[str, list[Any]]]) -> list[tuple[str, ...]]:
    """Groups (two or more, each sorted) of the names that share a key, directly or through
    other names: a union-find over every name's keys."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    owner: dict[Any, str] = {}
    for name, keys in named_keys:
        parent.setdefault(name, name)
        for key in keys:
            if key in owner:
                parent[find(name)] = find(owner[key])
            else:
                owner[key] = name
    groups: dict[str, list[str]] = {}
    for name in parent:
        groups.setdefault(find(name), []).append(name)
    return [tuple(sorted(g)) for g in groups.values() if len(g) > 1]


def _storage_keys(param: torch.Tensor) -> list[Any]:
    keys: list[Any] = [("object", id(param))]
    local = param.to_local() if hasattr(param, "placements") else param
    if local.device.type != "meta" and local.numel() > 0:
        # The same view of the same memory: a tie. Neighbouring views of one flat allocation
        # (some loaders allocate all weights at once) share the storage but not the view.
        ptr = local.untyped_storage().data_ptr()
        keys.append(("view", str(local.device), ptr, local.storage_offset(), tuple(local.shape)))
    return keys


def expected_ties(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(tied name, source name) pairs the model's config asks for, among its parameters."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pairs: dict[str, str] = {}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):  # transformers >= 5: a {target: source} mapping, config-aware
        with contextlib.suppress(Exception):
            pairs.update(expand(all_submodels=True))
    elif _ties_word_embeddings(model):  # transformers 4.x: a list of names, plus the config flag
        keys = getattr(model, "_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            pairs.update(keys)
        pair = _embedding_pair(model)
        if pair is not None:
            pairs[pair[0]] = pair[1]
    return tuple(sorted((t, s) for t, s in pairs.items() if t != s and {t, s} <= names))


def _ties_word_embeddings(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        return False
    if getattr(config, "tie_word_embeddings", None) is not None:
        return bool(config.tie_word_embeddings)
    text = getattr(config, "get_text_config", None)
    with contextlib.suppress(Exception):
        return bool(getattr(text(), "tie_word_embeddings", False)) if callable(text) else False
    return False


def _embedding_pair(model: nn.Module) -> tuple[str, str] | None:
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except Exception:
        log.debug("%s: no embedding pair to compare", type(model).__name__, exc_info=True)
        return None
    if out is None or inp is None:
        return None
    where = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    if id(out) not in where or id(inp) not in where:
        return None
    prefix = lambda n: f"{n}.weight" if n else "weight"  # noqa: E731
    return prefix(where[id(out)]), prefix(where[id(inp)])


def shared_buffers(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of names on one storage that hold a buffer: buffers that are views of another
    buffer or of a parameter, any view (a write through one is seen through the others), or
    one buffer under two names. On meta, where there is no storage, a view still knows its
    base. Sorted, so equal groups compare equal."""
    named = [(n, _local(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = list(model.named_buffers(remove_duplicate=False))
    names = {name for name, _ in buffers}
    groups = _same_keys((name, _buffer_storage_keys(t)) for name, t in [*named, *buffers])
    return tuple(sorted(g for g in groups if names.intersection(g)))


def _buffer_storage_keys(tensor: torch.Tensor) -> list[Any]:
    base = tensor._base if tensor._base is not None else tensor
    keys: list[Any] = [("object", id(tensor)), ("base", id(base))]
    if tensor.device.type != "meta" and tensor.numel() > 0:
        keys.append(("storage", str(tensor.device), tensor.untyped_storage().data_ptr()))
    return keys


def tie_record(model: nn.Module, stage: str) -> TieRecord:
    return TieRecord(
        snapshot=stage,
        shared=shared_parameters(model),
        expected=expected_ties(model),
        buffers=shared_buffers(model),
    )


# ---------------------------------------------------------------- meshes


def mesh_records(model: nn.Module) -> tuple[MeshRecord, ...]:
    """The device meshes ``model``'s DTensor parameters live on, one record each, in the order
    first met: which ranks must hold equal values follows from them (checks/value.py)."""
    found: dict[str, MeshRecord] = {}
    seen: set[int] = set()
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if getattr(param, "placements", None) is None or mesh is None or id(mesh) in seen:
            continue
        seen.add(id(mesh))
        record = mesh_record(mesh)
        found.setdefault(record.id, record)
    return tuple(found.values())


# ---------------------------------------------------------------- non-finite values


def non_finite_tensors(model: nn.Module, stage: Snapshot) -> tuple[NonFinite, ...]:
    """Parameters (this rank's local shards) and buffers holding NaN or ±Inf, in one pass over
    their values; a buffer of only 0 and ±inf (an attention mask) is not one of them."""
    named = [(n, _local(p), False) for n, p in model.named_parameters()]
    named += [(n, b, True) for n, b in model.named_buffers()]
    counts = non_finite_counts([tensor for _, tensor, _ in named])
    return tuple(
        NonFinite(name, stage, count, buffer=is_buffer)
        for (name, tensor, is_buffer), count in zip(named, counts, strict=True)
        if count and not (is_buffer and is_mask(tensor))
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if getattr(param, "placements", None) is not None else param


# ---------------------------------------------------------------- buffers


def _recomputable(model: nn.Module) -> bool:
    """Only classes whose constructor is ``cls(config)`` with no other effect: transformers
    models and fsdpcheck's own fixture. Anything else gets the garbage test only."""
    if getattr(model, "config", None) is None:
        return False

    cls = model_class(model)
    names = {c.__module__.split(".")[0] + "." + c.__name__ for c in cls.__mro__}
    return "transformers.PreTrainedModel" in names or issubclass(cls, HazardForCausalLM)


def _float_dtype(model: nn.Module) -> torch.dtype:
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return tensor.dtype
    return torch.float32


class BufferReference:
    """The buffers the model's class computes from the model's config, built on CPU with
    parameters on meta; built lazily, at most once per default dtype."""

    def __init__(self, model: nn.Module):
        self._cls = model_class(model)
        self._config = model.config
        self._dtype = _float_dtype(model)
        self._built: dict[torch.dtype, dict[str, torch.Tensor]] = {}

    def buffers(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Built under default dtype ``dtype`` (the live model's float dtype by default)."""
        dtype = dtype or self._dtype
        if dtype not in self._built:
            previous = torch.get_default_dtype()
            # Buffers computed for real on CPU, parameters on meta: their values at small cost.
            with torch.random.fork_rng(devices=[]), torch.device("cpu"), parameters_on_meta():
                torch.set_default_dtype(dtype)
                try:
                    reference = self._cls(self._config)
                finally:
                    torch.set_default_dtype(previous)
            self._built[dtype] = {n: b for n, b in reference.named_buffers() if not b.is_meta}
        return self._built[dtype]

    def matches(self, name: str, live: torch.Tensor) -> bool | None:
        """Whether ``live`` equals the recomputed buffer (None: nothing to compare with). Built
        in the live model's dtype, then in float32 and cast, as the two ways models are made."""
        for dtype in dict.fromkeys((self._dtype, torch.float32)):
            want = self.buffers(dtype).get(name)
            if want is None or tuple(want.shape) != tuple(live.shape):
                return None
            if _equal(live, want.to(live.dtype)):
                return True
        return False

    def head(self, name: str, live: torch.Tensor) -> tuple[str, ...]:
        want = self.buffers().get(name)
        return head_values(want.to(live.dtype)) or () if want is not None else ()


def buffer_reference(model: nn.Module) -> BufferReference | None:
    """A reference for the model's non-persistent buffers, when its class can recompute them."""
    return BufferReference(model) if _recomputable(model) else None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.detach().cpu()
    if a.is_complex() and b.is_complex():  # RoPE's freqs_cis: compare the parts
        a, b = torch.view_as_real(a), torch.view_as_real(b.detach().cpu())
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def buffer_problems(
    model: nn.Module, stage: str, reference: BufferReference | None
) -> tuple[BufferProblem, ...]:
    """Non-persistent buffers that differ from the reference; NaN, Inf or denormal values in any
    buffer the reference does not cover. Buffers on meta are skipped (nothing to check)."""
    non_persistent = set(non_persistent_buffers(model))
    problems = []
    for name, buf in model.named_buffers():
        if buf.is_meta:
            continue
        verdict = None
        if reference is not None and name in non_persistent:
            try:
                verdict = reference.matches(name, buf)
            except Exception:  # a class that cannot be rebuilt here: garbage test only
                log.debug("no reference for buffer %s: garbage test only", name, exc_info=True)
                reference, verdict = None, None
        if verdict is True:
            continue
        if verdict is False:
            expected = reference.head(name, buf) if reference is not None else ()
            problems.append(BufferProblem(name, stage, "differs", head_values(buf) or (), expected))
            continue
        reason = garbage(buf)
        if reason is not None:
            problems.append(BufferProblem(name, stage, reason, head_values(buf) or ()))
    return tuple(problems)


def garbage(tensor: torch.Tensor) -> str | None:
    """``"nan"``, ``"inf"`` or ``"denormal"`` when a float or complex buffer holds what
    uninitialised memory does (a complex one in its real or imaginary parts); an all-(0, ±inf)
    tensor is a mask, not garbage."""
    if tensor.is_complex():  # torchtitan's freqs_cis (complex64): judge the parts
        tensor = torch.view_as_real(tensor.detach())
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return None
    values = tensor.detach().cpu().float() if tensor.dtype.itemsize < 4 else tensor.detach().cpu()
    if bool(values.isnan().any()):
        return "nan"
    finite = values.isfinite()
    if not bool(finite.all()) and bool((values[finite] != 0).any()):
        return "inf"
    if tensor.dtype == torch.float16:
        # float16's normal range ends at 6.1e-5: real buffers (RoPE inv_freq with a large
        # base) go below it, so a denormal there says nothing about uninitialised memory.
        return None
    tiny = torch.finfo(tensor.dtype).tiny
    magnitude = values.abs()
    if bool(((magnitude > 0) & (magnitude < tiny)).any()):
        return "denormal"
    return None
