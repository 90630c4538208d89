"""Bad model directories as a user meets them, one process, no launcher: each is exit 2 with one
paragraph naming the rank, the input and the fix, not a traceback (exit 3) and not a run that
quietly audits something else."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

from fsdpcheck.model.presets import PRESETS


def _config_dir(path: Path, **overrides: object) -> Path:
    """A directory holding the tiny Llama preset's config.json, with ``overrides`` written in."""
    path.mkdir(parents=True)
    config = PRESETS["tiny-llama"].make_config().to_dict()
    (path / "config.json").write_text(json.dumps({**config, **overrides}))
    return path


def _one_paragraph(result) -> str:
    """The error as printed; it must be a single paragraph, without a traceback."""
    text = (result.stdout + result.stderr).strip()
    assert "Traceback" not in text, text
    return text


def test_index_without_its_shards_is_bad_input(tmp_path: Path) -> None:
    model = _config_dir(tmp_path / "half-downloaded")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {"lm_head.weight": shards[0], "model.norm.weight": shards[1]}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    result = run_cli(["audit", "--model", str(model), "--json", str(tmp_path / "report.json")])
    text = _one_paragraph(result)
    assert result.returncode == 2, text
    assert str(model) in text and "model.safetensors.index.json" in text
    assert all(shard in text for shard in shards), text
    assert "download" in text  # the fix


def test_config_field_of_the_wrong_type_is_bad_input(tmp_path: Path) -> None:
    model = _config_dir(tmp_path / "typo", hidden_size="big")
    result = run_cli(["audit", "--model", str(model), "--json", str(tmp_path / "report.json")])
    text = _one_paragraph(result)
    assert result.returncode == 2, text
    assert "rank 0" in text and str(model / "config.json") in text
    assert "hidden_size" in text and "'big'" in text
