"""Build the model on this rank, as real training jobs do.

``rank0``: rank 0 materialises weights on CPU (from the checkpoint, else a deterministic fill
with ``seed``: see :mod:`fsdpcheck.model.fill`), other ranks build on ``meta``; ``meta``: every
rank on meta; ``all``: every rank materialises (the same values on every rank for one seed).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from fsdpcheck.errors import InputError
from fsdpcheck.model.fill import FILL, TRANSFORMERS_INIT, build_filled
from fsdpcheck.model.hazard import HazardConfig, HazardForCausalLM
from fsdpcheck.model.resolve import ResolvedModel
from fsdpcheck.model.threads import all_cores, worker_threads
from fsdpcheck.records import ModelInfo
from fsdpcheck.vocab import Init

log = logging.getLogger(__name__)

INIT_MODES = ("rank0", "meta", "all")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltModel:
    model: nn.Module
    info: ModelInfo
    materialised: bool
    # Rank 0's full state dict, captured before wrapping (what a trainer broadcasts).
    full_state_dict: dict[str, torch.Tensor] | None = None
    config: Any = None  # the resolved config, as read (before model construction mutates it)
    # --builder: the trainer's own step for --step (model.builder.Built.step), and its batch.
    step: Any = None
    batch: Any = None


def build(
    resolved: ResolvedModel,
    *,
    rank: int,
    init: str = "rank0",
    dtype: str | None = None,
    seed: int = 0,
    text_only: bool = False,
    trust_remote_code: bool = False,
    config_changes: Mapping[str, Any] | None = None,
) -> BuiltModel:
    if init not in INIT_MODES:
        raise InputError(f"--init {init!r}: choose one of {', '.join(INIT_MODES)}.")
    materialise = init == Init.ALL or (init == Init.RANK0 and rank == 0)
    config = _load_config(resolved, text_only=text_only, trust_remote_code=trust_remote_code)
    if config_changes:
        config = _changed(config, config_changes)
    torch_dtype = _resolve_dtype(dtype, config)
    # A checkpoint fits the config it was saved with: one with changed keys fills instead.
    use_checkpoint = materialise and resolved.has_checkpoint and not text_only
    use_checkpoint = use_checkpoint and not config_changes
    init_values = None
    if use_checkpoint:
        model = _from_checkpoint(resolved, torch_dtype, rank, trust_remote_code)
        init_values = "checkpoint"
    elif materialise:
        torch.manual_seed(seed)
        with _default_dtype(torch_dtype):
            model = build_filled(
                lambda: _from_config(config, trust_remote_code),
                seed=seed,
                threads=materialising_threads(init),
            )
        init_values = FILL
        if model is None:  # its __init__ needs real parameters: the model's own init, slowly
            torch.manual_seed(seed)
            with torch.device("cpu"), _default_dtype(torch_dtype):
                model = _from_config(config, trust_remote_code)
            init_values = TRANSFORMERS_INIT
    else:
        with torch.device("meta"), _default_dtype(torch_dtype):
            model = _from_config(config, trust_remote_code)
    # from_pretrained leaves a model in eval mode, from_config in training mode: under --init
    # rank0 only rank 0 reads the checkpoint, and the module-state check would name the mode
    # fsdpcheck chose. One mode on every rank, the checkpoint's (no dropout in a forward).
    model.eval()
    info = ModelInfo(
        spec=resolved.spec,
        kind=resolved.kind,
        name=resolved.name,
        path=str(resolved.path) if resolved.path else None,
        architecture=type(model).__name__,
        dtype=str(torch_dtype).removeprefix("torch."),
        init=init,
        checkpoint=resolved.has_checkpoint and not text_only,
        text_only=text_only,
        init_values=init_values,
    )
    full = dict(model.state_dict()) if materialise else None
    return BuiltModel(
        model=model, info=info, materialised=materialise, full_state_dict=full, config=config
    )


def materialising_threads(init: str) -> int:
    """Threads for filling and sharding real weights: with ``rank0`` the other ranks build on
    meta and then wait for rank 0, so rank 0 may use every core of the host; with ``all``
    every rank materialises, each on its share."""
    return all_cores() if init == Init.RANK0 else worker_threads()


def _load_config(resolved: ResolvedModel, *, text_only: bool, trust_remote_code: bool) -> Any:
    if resolved.preset is not None:
        config = resolved.preset.make_config()
    else:
        from transformers import AutoConfig  # HF models only: see _from_config

        try:  # huggingface_hub 1.x validates config values against their declared types
            from huggingface_hub.errors import StrictDataclassError as InvalidValue
        except ImportError:
            InvalidValue = ValueError  # noqa: N806
        try:
            config = AutoConfig.from_pretrained(
                str(resolved.path), trust_remote_code=trust_remote_code
            )
        except (ValueError, InvalidValue) as exc:
            raise InputError(
                f"{resolved.path}/config.json could not be used: {' '.join(str(exc).split())}. "
                "Correct config.json where that points; if the model needs its own code, review "
                "it and pass --trust-remote-code."
            ) from None
    if text_only and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def _changed(config: Any, changes: Mapping[str, Any]) -> Any:
    """``config`` with ``changes`` (top-level keys, as another rank read them) set, through
    the config class's own ``from_dict``, so nested configs are rebuilt as they are read (a
    config class without one, such as the presets' own, gets them as attributes)."""
    if hasattr(config, "from_dict") and hasattr(config, "to_dict"):
        return type(config).from_dict({**config.to_dict(), **changes})
    changed = copy.copy(config)
    for key, value in changes.items():
        setattr(changed, key, value)
    return changed


def _resolve_dtype(dtype: str | None, config: Any) -> torch.dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise InputError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
        return DTYPES[dtype]
    # transformers >= 4.56 names it `dtype` and warns when `torch_dtype` is read.
    name = "dtype" if hasattr(config, "dtype") else "torch_dtype"
    configured = getattr(config, name, None)
    if isinstance(configured, torch.dtype):
        return configured
    return DTYPES.get(str(configured).removeprefix("torch."), torch.float32)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _from_config(config: Any, trust_remote_code: bool) -> nn.Module:
    if hasattr(config, "build_model"):  # fixtures build themselves (fsdpcheck.model.fixtures)
        return config.build_model()
    if isinstance(config, HazardConfig):
        return HazardForCausalLM(config)
    # transformers only where a Hugging Face model is built: check_model, --builder and the
    # fixtures import no framework (tests/unit/test_integration_extras.py).
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError:
        log.debug("no causal-LM class for %s: AutoModel", type(config).__name__, exc_info=True)
        return AutoModel.from_config(config, trust_remote_code=trust_remote_code)


def _dtype_kwarg() -> str:
    import transformers  # HF models only: see _from_config

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _from_checkpoint(
    resolved: ResolvedModel, dtype: torch.dtype, rank: int, trust_remote_code: bool
) -> nn.Module:
    from transformers import AutoModelForCausalLM  # HF models only: see _from_config

    kwargs = {_dtype_kwarg(): dtype}
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            str(resolved.path),
            use_safetensors=not resolved.pickle_weights,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise InputError(
            f"rank {rank}: the checkpoint in {resolved.path} could not be loaded: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. The weight files "
            "may be truncated or not match config.json; re-download or re-save them."
        ) from None
    problems = {k: v for k, v in loading.items() if v and k in ("missing_keys", "unexpected_keys")}
    if problems:
        listed = "; ".join(f"{k}: {', '.join(sorted(v)[:5])}" for k, v in problems.items())
        raise InputError(
            f"rank {rank}: the checkpoint in {resolved.path} does not match its config "
            f"({listed}). Check that config.json and the weights come from the same model."
        )
    return model
