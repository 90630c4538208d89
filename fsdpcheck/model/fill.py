"""Materialise a model without a checkpoint at memory speed: build it with its parameters on
``meta`` and its buffers real, then give every parameter storage filled from a small seeded
pattern.

transformers' weight init (``_init_weights``: normal and uniform draws, one tensor at a time)
runs single-threaded under torchrun's ``OMP_NUM_THREADS=1``: 25 s for a 1B model on one core.
The audit needs values that are the same on every rank for the same seed, not a trained
distribution, so the fill writes a seeded pattern at the speed of a copy. Buffers are never
filled: they keep the values the modules computed in ``__init__`` (RoPE ``inv_freq``, Gemma's
``embed_scale``), exactly as a full CPU build computes them. (accelerate's
``init_empty_weights()`` makes the same split: parameters on meta, buffers real.)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from fsdpcheck.model.threads import worker_threads

log = logging.getLogger(__name__)

FILL = "deterministic-fill"  # ModelInfo.init_values when this module made the values
TRANSFORMERS_INIT = "transformers-init"  # the model's own init ran (the fallback)

_PERIOD = 65521  # prime: a tensor's rows never line up with the pattern's period
_STD = 0.02  # the usual initializer_range: values a forward pass tolerates

_patterns: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}
_patterns_lock = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers moves to ``meta``; buffers stay where they
    were made, with their computed values. Initialisers then run on meta: no work."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            moved = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            moved.__dict__.update(kept.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_filled(
    make: Callable[[], nn.Module],
    *,
    seed: int,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> nn.Module | None:
    """``make()`` with parameters on meta, then every parameter filled on ``device``; None when
    the model cannot be built that way (its ``__init__`` needs real parameters, or it leaves a
    buffer on meta): the caller then builds it the ordinary way."""
    try:
        with parameters_on_meta():
            model = make()
    except Exception:
        log.debug("parameters on meta: no build; the ordinary one follows", exc_info=True)
        return None
    if any(b.is_meta for b in model.buffers()):
        return None  # no computed values to keep: the ordinary build must make them
    fill_parameters(model, seed=seed, device=device, threads=threads)
    return model


def fill_parameters(
    model: nn.Module,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> int:
    """Give every ``meta`` parameter storage on ``device`` filled with :func:`fill_`, keyed by its
    name in ``named_parameters()``; tied parameters stay one tensor. Returns how many it filled.
    The same model structure and seed give the same values on every rank. ``threads``: how many
    to fill with (default :func:`worker_threads`, this rank's share of the host's cores)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    made: dict[int, nn.Parameter] = {}
    fills: list[tuple[torch.Tensor, str]] = []
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = made.get(id(param))
            if new is None:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                new = type(param)(data, requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                made[id(param)] = new
                fills.append((data, names.get(id(param), attr)))
            module._parameters[attr] = new
    work = [(t, n) for t, n in fills if t.numel()]
    threads = threads if threads is not None else worker_threads()
    with torch.no_grad():
        if threads > 1 and len(work) > 1:  # copies release the GIL: fill tensors side by side
            with ThreadPoolExecutor(threads, thread_name_prefix="fsdpcheck-fill") as pool:
                list(pool.map(lambda job: fill_(job[0], seed=seed, name=job[1]), work))
        else:
            for tensor, name in work:
                fill_(tensor, seed=seed, name=name)
    return len(fills)


def fill_(tensor: torch.Tensor, *, seed: int, name: str) -> torch.Tensor:
    """Fill ``tensor`` in place with the seed's pattern, starting at a name-dependent offset:
    one pass of writes (a broadcast copy), no random number generation per element."""
    pattern = _pattern(seed, tensor.dtype, tensor.device)
    offset = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    offset %= _PERIOD
    row = pattern[offset : offset + _PERIOD]
    flat = tensor.view(-1)
    rows, rest = divmod(flat.numel(), _PERIOD)
    if rows:
        flat[: rows * _PERIOD].view(rows, _PERIOD).copy_(row.expand(rows, _PERIOD))
    if rest:
        flat[rows * _PERIOD :].copy_(row[:rest])
    return tensor


def _pattern(seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``2 * _PERIOD`` seeded values of ``dtype`` on ``device``: N(0, 0.02) for floating types,
    small integers otherwise, ``False``/``True`` for bool."""
    key = (seed, dtype, str(device))
    with _patterns_lock:
        pattern = _patterns.get(key)
        if pattern is None:
            gen = torch.Generator().manual_seed(seed)
            base = torch.empty(2 * _PERIOD, dtype=torch.float64).normal_(0, _STD, generator=gen)
            if dtype.is_floating_point or dtype.is_complex:
                pattern = base.to(dtype)
            elif dtype == torch.bool:
                pattern = base > 0
            else:
                pattern = (base * 1000).round().clamp(-100, 100).to(dtype)
            pattern = _patterns[key] = pattern.to(device)
    return pattern
