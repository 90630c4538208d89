"""The checkpoint as the reference, in one process: each format read by slice, a plain module's
tensors against it (no process group needed for one rank's own check), and the findings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fsdpcheck.checks.source import source_findings
from fsdpcheck.loader.source import check_rank, open_source
from fsdpcheck.records import VerifyResult
from fsdpcheck.vocab import FindingKind


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4))
    model.register_buffer("scale", torch.arange(3.0))
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _looks(checked) -> dict[str, str]:
    return {m["name"]: m["looks_like"] for m in checked.mismatches}


def test_each_format_reads_the_same_entries(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state(_model())
    save_file(state, str(tmp_path / "one.safetensors"))
    (tmp_path / "index").mkdir()
    weight_map = {k: ("a" if i % 2 else "b") + ".safetensors" for i, k in enumerate(state)}
    for file in set(weight_map.values()):
        part = {k: v for k, v in state.items() if weight_map[k] == file}
        save_file(part, str(tmp_path / "index" / file))
    (tmp_path / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "LATEST").write_text("dcp\n")  # a checkpoint root naming its newest
    for path in (tmp_path / "one.safetensors", tmp_path / "index", tmp_path / "dcp", tmp_path):
        reader = open_source(path)
        assert {k: v[0] for k, v in reader.entries.items()} == {
            k: tuple(v.shape) for k, v in state.items()
        }, path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="2 .safetensors files"):
        open_source(_two_files(tmp_path))


def _two_files(tmp_path: Path) -> Path:
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a", "b"):
        save_file({"x": torch.zeros(2)}, str(folder / f"{name}.safetensors"))
    return folder


def test_a_clean_module_passes_and_each_wrong_load_is_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = _model()
    state = _state(model)
    save_file(state, str(tmp_path / "m.safetensors"))
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for path in (tmp_path / "m.safetensors", tmp_path / "dcp"):
        clean = check_rank(model, path, 0)
        assert clean.mismatches == () and clean.checked == 5
    with torch.no_grad():
        model[0].weight.copy_(state["0.weight"].T)  # square: a transpose fits
        model[1].weight.copy_(state["1.weight"].flip(0))  # the same rows, another order
        model.scale.add_(1)
    for path in (tmp_path / "m.safetensors", tmp_path / "dcp"):
        checked = check_rank(model, path, 0)
        assert _looks(checked) == {
            "0.weight": "transposed",
            "1.weight": "permuted-rows",
            "scale": "values",
        }, path
    first = next(m for m in checked.mismatches if m["name"] == "scale")["first"]
    assert (first["index"], first["model"], first["checkpoint"]) == ([0], 1.0, 0.0)


def test_a_cast_and_another_entrys_bytes(tmp_path: Path) -> None:
    model = _model()
    state = _state(model)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp_path / "bf16.safetensors")
    )
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(state[name].to(torch.bfloat16))
    checked = check_rank(model, tmp_path / "bf16.safetensors", 0)
    assert set(_looks(checked).values()) == {"cast"}
    assert {(m["checkpoint_dtype"], m["model_dtype"]) for m in checked.mismatches} == {
        ("bfloat16", "float32")
    }
    twin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    save_file(_state(twin), str(tmp_path / "twin.safetensors"))
    with torch.no_grad():
        twin[1].weight.copy_(twin[0].weight)
    checked = check_rank(twin, tmp_path / "twin.safetensors", 0)
    (mismatch,) = checked.mismatches
    assert (mismatch["name"], mismatch["looks_like"]) == ("1.weight", "other-tensor")
    assert "0.weight" in mismatch["reason"]


def test_findings_name_tensor_ranks_slice_and_first_difference() -> None:
    per_rank = {
        "rank": 1,
        "looks_like": "permuted-rows",
        "reason": "values differ from the checkpoint: the same rows in another order",
        "slice": "[4:8, 0:8]",
        "first": {"index": [1, 0], "full_index": [5, 0], "model": 0.5, "checkpoint": 0.25},
    }
    mismatch = {
        "name": "q.weight",
        "kind": "param",
        "looks_like": "permuted-rows",
        "reason": per_rank["reason"],
        "ranks": [1],
        "per_rank": [per_rank],
    }
    (finding,) = source_findings(VerifyResult(True, False, 3, (mismatch,)))
    assert finding.kind == FindingKind.SOURCE and finding.ranks == (1,)
    assert finding.tensors == ("q.weight",)
    assert "[4:8, 0:8]" in finding.summary and "[5, 0]: 0.5 here, 0.25" in finding.summary
    assert source_findings(VerifyResult(True, True, 3)) == []
