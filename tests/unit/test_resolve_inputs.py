"""``resolve`` on model directories: an incomplete sharded checkpoint and a config value of the
wrong type are input errors naming the file and the fix; their clean twins resolve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpcheck.errors import InputError
from fsdpcheck.model.presets import PRESETS
from fsdpcheck.model.resolve import resolve

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _model_dir(path: Path, *, files: tuple[str, ...] = (), **overrides: object) -> Path:
    """The tiny Llama preset's config.json with ``overrides``, and ``files`` (empty) beside it."""
    path.mkdir()
    config = {**PRESETS["tiny-llama"].make_config().to_dict(), **overrides}
    (path / "config.json").write_text(json.dumps(config))
    for name in files:
        (path / name).write_bytes(b"")
    return path


def _index(path: Path, name: str = "model.safetensors.index.json", shards=SHARDS) -> None:
    weight_map = {f"model.layers.{i}.weight": shard for i, shard in enumerate(shards)}
    (path / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_complete_sharded_checkpoint_resolves(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", files=SHARDS)
    _index(model)
    resolved = resolve(str(model))
    assert resolved.weight_files == SHARDS and resolved.has_checkpoint


def test_safetensors_beside_an_unused_pickle_index_resolve(tmp_path: Path) -> None:
    # What --download fetches from a repo with both formats: every *.json, the safetensors only.
    model = _model_dir(tmp_path / "m", files=("model.safetensors",))
    _index(model, "pytorch_model.bin.index.json", ("pytorch_model-00001-of-00001.bin",))
    assert resolve(str(model)).weight_files == ("model.safetensors",)


@pytest.mark.parametrize(
    ("present", "index", "missing"),
    [
        ((), "model.safetensors.index.json", SHARDS),
        (SHARDS[:1], "model.safetensors.index.json", SHARDS[1:]),
        ((), "pytorch_model.bin.index.json", ("pytorch_model-00001-of-00001.bin",)),
    ],
)
def test_index_with_missing_shards_is_bad_input(tmp_path: Path, present, index, missing) -> None:
    model = _model_dir(tmp_path / "m", files=present)
    _index(model, index, (*present, *missing))
    with pytest.raises(InputError) as raised:
        resolve(str(model), rank=3)
    message = str(raised.value)
    assert message.startswith(f"rank 3: {model} has {index}")
    assert all(shard in message for shard in missing)
    assert not any(shard in message for shard in present)
    assert "\n" not in message and f"remove {index}" in message


def test_unreadable_index_is_bad_input(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    (model / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(InputError, match="is not a readable shard index"):
        resolve(str(model))


def test_text_for_a_number_in_config_is_bad_input(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", hidden_size="big", rms_norm_eps="1e-6")
    with pytest.raises(InputError) as raised:
        resolve(str(model), rank=1)
    message = str(raised.value)
    assert message.startswith(f"rank 1: {model / 'config.json'} has a value of the wrong type")
    assert "'hidden_size' is 'big'" in message and "'rms_norm_eps' is '1e-6'" in message
    assert "LlamaConfig" in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"eos_token_id": [1, 2], "rope_theta": 500000, "hidden_size": 16.0},  # may be meant
        {"model_type": "not-a-transformers-type", "hidden_size": "big"},  # nothing to go by
        # Declared "auto", which MambaConfig turns into a number: the declaration decides.
        {"model_type": "mamba", "time_step_rank": "auto"},
    ],
)
def test_config_values_that_may_be_right_resolve(tmp_path: Path, overrides) -> None:
    assert resolve(str(_model_dir(tmp_path / "m", **overrides))).kind == "local"


def test_wrong_type_that_resolve_lets_pass_is_bad_input_at_build(tmp_path: Path) -> None:
    # A list for a number gets past resolve (a list may be meant elsewhere); transformers' own
    # validation names it, and build turns that into the same kind of error, in one paragraph.
    from fsdpcheck.model.build import build

    resolved = resolve(str(_model_dir(tmp_path / "m", hidden_size=[16])))
    with pytest.raises(InputError) as raised:
        build(resolved, rank=0, init="meta")
    message = str(raised.value)
    assert "config.json could not be used" in message and "hidden_size" in message
    assert "\n" not in message
