"""Turn ``--model`` into something buildable (preset, local directory or cached hub id)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fsdpcheck.errors import InputError
from fsdpcheck.model.presets import PRESETS, Preset

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ResolvedModel:
    spec: str
    kind: str  # "preset" | "local" | "hub"
    name: str
    path: Path | None = None
    preset: Preset | None = None
    weight_files: tuple[str, ...] = ()
    pickle_weights: bool = False  # weights are pickle files (refused unless --allow-pickle)

    @property
    def has_checkpoint(self) -> bool:
        return bool(self.weight_files)


def resolve(spec: str, *, rank: int = 0, allow_pickle: bool = False) -> ResolvedModel:
    """Resolve ``spec``; raise :class:`InputError` naming the rank, the input and the fix."""
    preset = PRESETS.get(spec)
    if preset is not None:
        return ResolvedModel(spec=spec, kind="preset", name=spec, preset=preset)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _local(spec, path, "local", spec, rank=rank, allow_pickle=allow_pickle)
    if _HUB_ID.match(spec) and not path.exists():
        snapshot = _from_hub_cache(spec, rank=rank)
        return _local(spec, snapshot, "hub", spec, rank=rank, allow_pickle=allow_pickle)
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
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
    if allow_pickle:
        patterns += [f"*{suffix}" for suffix in _PICKLE_SUFFIXES]
    try:
        return Path(snapshot_download(spec, allow_patterns=patterns))
    except Exception as exc:  # network, auth, offline mode: all the user's to fix
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
    spec: str, path: Path, kind: str, name: str, *, rank: int, allow_pickle: bool
) -> ResolvedModel:
    config = path / "config.json"
    if not config.is_file():
        raise InputError(
            f"rank {rank}: {path} has no config.json; pass a Hugging Face model directory "
            "(config.json plus optional *.safetensors weights)."
        )
    try:
        json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"rank {rank}: {config} is not readable JSON ({exc}); the file is corrupt or "
            "truncated. Re-download or re-save the model."
        ) from None
    files = sorted(os.listdir(path))
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
