"""The command layer as a user meets it: help, presets, torchrun, bare single-process runs."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import read_report, torchrun_fsdpcheck
from conftest import run_plain as _run


def test_presets_lists_required_models_without_importing_torch() -> None:
    code = (
        "import sys; from fsdpcheck.cli import app; "
        "sys.argv=['fsdpcheck','presets']\n"
        "try: app()\nexcept SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'presets imported torch'"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    for name in ("tiny-gemma4", "tiny-gemma3", "tiny-llama", "tiny-qwen3", "hazard"):
        assert name in result.stdout


def test_unknown_preset_is_bad_input_on_one_rank() -> None:
    result = _run([sys.executable, "-m", "fsdpcheck", "audit", "--model", "tiny-nonesuch"])
    assert result.returncode == 2
    assert "tiny-nonesuch" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_single_rank_without_any_launcher_variables(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = _run(
        [sys.executable, "-m", "fsdpcheck", "audit", "--model", "tiny-gemma4", "--json", str(out)]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(out)
    assert report["world_size"] == 1 and report["verdict"] == "consistent"


def test_torchrun_as_the_readme_says_with_the_step(tmp_path: Path) -> None:
    """The README's command, plus ``audit --step`` as a user runs it: the synthetic step ran
    under the watch on both ranks (torchrun exits 0 only when every rank does), the report
    times it, the console says so."""
    out = tmp_path / "report.json"
    args = ("audit", "--model", "tiny-gemma4", "--step", "--json", str(out))
    result = _run(torchrun_fsdpcheck(2, *args), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(out)
    assert report["world_size"] == 2
    assert report["verdict"] == "consistent" and report["exit_code"] == 0
    assert report["findings"] == [] and report["errors"] == []
    assert report["timings"]["step"] > 0 and "step-watch" in report["timings"]
    assert "step: consistent · finished; every collective the same on every rank" in result.stdout
    # Which step ran (issue 37: the report did not say).
    assert report["step"]["source"] == "synthetic" and report["step"]["seed"] == 0
    assert "2x16 random tokens" in report["step"]["description"]
    assert "ran fsdpcheck's synthetic step" in result.stdout
    assert report["model"]["architecture"] == "Gemma4ForCausalLM"
    # The multimodal layer classes in _no_split_modules are absent from the text model.
    assert "Gemma4TextDecoderLayer" in report["wrap"]["found"]
    assert "Gemma4VisionEncoderLayer" in report["wrap"]["missing"]
    assert result.stdout.count("verdict:") == 1  # rendered once, by rank 0


def test_make_demo_shows_the_divergence() -> None:
    result = _run(["make", "demo"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buffer-order" in result.stdout
    assert "model.rotary_emb.full_attention_inv_freq" in result.stdout
    assert "exit code 1" in result.stdout
