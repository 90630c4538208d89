"""Turn ``--model`` into something buildable (preset, local directory or cached hub id)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fsdpcheck.errors import InputError
from fsdpcheck.model.presets import PRESETS, Preset
from fsdpcheck.text import name_list
from fsdpcheck.vocab import ModelKind

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Shard indexes, the weights' own first: a pickle index only counts where no safetensors are.
_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class ResolvedModel:
    spec: str
    kind: ModelKind  # PRESET, LOCAL or HUB
    name: str
    path: Path | None = None
    preset: Preset | None = None
    weight_files: tuple[str, ...] = ()
    pickle_weights: bool = False  # weights are pickle files (refused unless --allow-pickle)

    @property
    def has_checkpoint(self) -> bool:
        return bool(self.weight_files)


def resolve(
    spec: str, *, rank: int = 0, allow_pickle: bool = False, config_values: bool = True
) -> ResolvedModel:
    """Resolve ``spec``; raise :class:`InputError` naming the rank, the input and the fix.
    ``config_values``: also check config.json's values against the model type's config class
    (imports transformers; the probe's caller leaves that to its children)."""
    preset = PRESETS.get(spec)
    if preset is not None:
        return ResolvedModel(spec=spec, kind=ModelKind.PRESET, name=spec, preset=preset)
    path = Path(spec).expanduser()
    checks = {"rank": rank, "allow_pickle": allow_pickle, "values": config_values}
    if path.is_dir():
        return _local(spec, path, ModelKind.LOCAL, spec, **checks)
    if _HUB_ID.match(spec) and not path.exists():
        return _local(spec, _from_hub_cache(spec, rank=rank), ModelKind.HUB, spec, **checks)
    if path.exists():
        raise InputError(
            f"rank {rank}: --model {spec!r} is a file; pass the directory that holds "
            "config.json (and *.safetensors weights)."
        )
    raise InputError(
        f"rank {rank}: --model {spec!r} is not a preset, not an existing directory on this "
        f"host and not a hub id (org/name). Presets: {', '.join(PRESETS)} "
        "(`fsdpcheck presets`); on multi-node jobs the directory must exist on every host."
    )


def download(spec: str, *, rank: int = 0, allow_pickle: bool = False) -> Path | None:
    """``--download``: fetch a hub id into the local cache (rank 0 only; the others wait and then
    read the cache). Config, tokenizer files and safetensors only, unless ``allow_pickle``."""
    if spec in PRESETS or Path(spec).expanduser().exists() or not _HUB_ID.match(spec):
        return None
    from huggingface_hub import snapshot_download  # 0.15 s of imports: only on the hub path

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
    if allow_pickle:
        patterns += [f"*{suffix}" for suffix in _PICKLE_SUFFIXES]
    try:
        return Path(snapshot_download(spec, allow_patterns=patterns))
    except Exception as exc:  # network, auth, offline mode: all the user's to fix
        log.debug("rank %d: snapshot_download(%r) failed", rank, spec, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InputError(
            f"rank {rank}: --download {spec!r} failed ({type(exc).__name__}: {first}). Check "
            "the id, your network and HF_TOKEN for gated models, or download it yourself and "
            "drop --download."
        ) from None


def _from_hub_cache(repo_id: str, *, rank: int) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise InputError(
            f"rank {rank}: hub id {repo_id!r} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). fsdpcheck downloads only when asked: pass --download, "
            f"or fetch it first with `hf download {repo_id}` (set HF_HOME to use another "
            f"cache), or pass a local directory. ({type(exc).__name__})"
        ) from None


def _local(
    spec: str,
    path: Path,
    kind: ModelKind,
    name: str,
    *,
    rank: int,
    allow_pickle: bool,
    values: bool = True,
) -> ResolvedModel:
    config = path / "config.json"
    if not config.is_file():
        raise InputError(
            f"rank {rank}: {path} has no config.json; pass a Hugging Face model directory "
            "(config.json plus optional *.safetensors weights)."
        )
    try:
        raw = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"rank {rank}: {config} is not readable JSON ({exc}); the file is corrupt or "
            "truncated. Re-download or re-save the model."
        ) from None
    if values:
        _check_config_values(config, raw, rank=rank)
    files = sorted(os.listdir(path))
    _check_shards(path, files, rank=rank)
    safetensors = tuple(f for f in files if f.endswith(".safetensors"))
    pickles = tuple(f for f in files if f.endswith(_PICKLE_SUFFIXES))
    if safetensors:
        return ResolvedModel(spec, kind, name, path=path, weight_files=safetensors)
    if pickles and not allow_pickle:
        raise InputError(
            f"rank {rank}: {path} holds only pickle weights ({', '.join(pickles[:3])}); "
            "loading pickle can run arbitrary code. Convert them to safetensors, or pass "
            "--allow-pickle if you trust this checkpoint."
        )
    return ResolvedModel(
        spec, kind, name, path=path, weight_files=pickles, pickle_weights=bool(pickles)
    )


def _check_shards(path: Path, files: list[str], *, rank: int) -> None:
    """A shard index whose shards are not all there is an incomplete download or copy: refused,
    rather than audited as a model without weights (filled deterministically) or half of one."""
    for suffix in _INDEX_SUFFIXES:
        indexes = [f for f in files if f.endswith(suffix)]
        if indexes:
            break
        if suffix == _INDEX_SUFFIXES[0] and any(f.endswith(".safetensors") for f in files):
            return  # unindexed safetensors: the weights; a pickle index beside them is unused
    for index in indexes:
        try:
            weight_map = json.loads((path / index).read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        # Unreadable, not JSON (a ValueError), or JSON without a weight map of file names.
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(
                f"rank {rank}: {path / index} is not a readable shard index "
                f"({type(exc).__name__}: {exc}); the file is corrupt or truncated. Re-download "
                "or re-save the model."
            ) from None
        missing = [shard for shard in shards if not (path / shard).is_file()]
        if missing:
            raise InputError(
                f"rank {rank}: {path} has {index}, which maps the weights to {len(shards)} shard "
                f"file(s), but {len(missing)} of them are not in the directory "
                f"({name_list(missing)}): the download or copy is incomplete, and fsdpcheck will "
                "not audit a model whose weights it cannot load. Download the missing shards "
                "(`hf download <repo id>`, or --download for a hub id) or copy the whole "
                f"directory again; to audit the config alone, remove {index}."
            )


def _check_config_values(config: Path, raw: object, *, rank: int) -> None:
    """A value of the wrong type in config.json (``"hidden_size": "big"``) is the user's to fix:
    named here, before the model's construction fails on it somewhere deep. Checked against the
    defaults of the model type's config class, as its ``__init__`` declares them (an instance
    may have turned a declared ``"auto"`` into a number), where transformers knows the type.
    Only what cannot be right: text where the default is a number (a whole number given as a
    fraction, or a list for a number, may be meant)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        return
    try:  # transformers only for a local config's values: a preset needs none
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[raw["model_type"]]
        declared = inspect.signature(config_class.__init__).parameters
    except Exception:  # remote code, an unknown model type
        log.debug("no defaults to check %s against", config, exc_info=True)
        return
    wrong = []
    for key, value in raw.items():
        default = declared[key].default if key in declared else None
        number = isinstance(default, int | float) and not isinstance(default, bool)
        if number and isinstance(value, str):
            owner = config_class.__name__
            wrong.append(f"{key!r} is {value!r}, not a number ({owner}'s default: {default!r})")
    if wrong:
        raise InputError(
            f"rank {rank}: {config} has a value of the wrong type: {'; '.join(wrong)}. Fix the "
            "value in config.json, or re-download or re-save the model."
        )
