"""The framework hooks are optional extras: a missing framework names the extra to install."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("hf", ("transformers",), "hf"),
        ("lightning", ("pytorch_lightning", "lightning"), "lightning"),
    ],
)
def test_a_missing_framework_names_the_extra(monkeypatch, module, blocked, extra) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # import of it fails, as if not installed
    monkeypatch.delitem(sys.modules, f"fsdpcheck.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'fsdpcheck\[{extra}\]'"):
        importlib.import_module(f"fsdpcheck.integrations.{module}")


def test_accelerate_helper_names_the_extra_and_checks_options(monkeypatch) -> None:
    from fsdpcheck.integrations.accelerate import check_prepared

    with pytest.raises(ValueError, match="choose 'raise' or 'warn'"):
        check_prepared(object(), object(), on_failure="ignore")
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ImportError, match=r"pip install 'fsdpcheck\[accelerate\]'"):
        check_prepared(object(), object())


def test_importing_fsdpcheck_imports_no_framework() -> None:
    code = (
        "import sys, fsdpcheck; fsdpcheck.save_fingerprint; fsdpcheck.diff_fingerprints\n"
        "frameworks = {'transformers', 'pytorch_lightning', 'lightning', 'accelerate'}\n"
        "assert not frameworks & set(sys.modules), frameworks & set(sys.modules)"
    )
    _in_a_fresh_interpreter(code)


def test_the_audit_and_the_watch_import_no_pipelining_for_a_job_without_stages() -> None:
    # The watch tags pipeline stages' sends only where the job made stages, so it never imports
    # torch.distributed.pipelining itself (its import is part of every rank's start).
    code = (
        "import sys, fsdpcheck.audit, fsdpcheck.step.watch as w\n"
        "assert 'torch.distributed.pipelining' not in sys.modules\n"
        "assert w._pipeline_getters() == (None, {})\n"
        "from torch.distributed.pipelining.stage import _PipelineStageBase\n"
        "stage, getters = w._pipeline_getters()\n"
        "assert stage is _PipelineStageBase and set(getters) <= set(vars(stage)), getters"
    )
    _in_a_fresh_interpreter(code)


def _in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` where nothing is imported yet (what it asserts about sys.modules holds)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
