"""Hugging Face Trainer: check every rank's model as training begins.

    from fsdpcheck.integrations.hf import FsdpcheckCallback
    trainer = Trainer(..., callbacks=[FsdpcheckCallback()])

``on_train_begin`` runs after the Trainer has wrapped the model and loaded any checkpoint it
resumes from, and before the first step. Needs ``pip install 'fsdpcheck[hf]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpcheck.integrations.common import (
    FsdpcheckWarning,
    ModelCheckFailed,
    missing_extra,
    run_check,
    validate_on_failure,
)

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the extra is optional
    raise missing_extra("transformers", "hf", exc) from exc

__all__ = ["FsdpcheckCallback", "FsdpcheckWarning", "ModelCheckFailed"]


class FsdpcheckCallback(TrainerCallback):
    """Run :func:`fsdpcheck.check_model` on the Trainer's model at ``on_train_begin``.

    ``on_failure="raise"`` stops training with :class:`ModelCheckFailed` (its message is the
    report's headline) on every rank; ``"warn"`` emits :class:`FsdpcheckWarning` and trains on.
    ``json_path``: rank 0 writes the full report there. ``result`` holds the last check.
    """

    def __init__(
        self,
        *,
        on_failure: str = "raise",
        timeout: float = 60.0,
        json_path: str | Path | None = None,
    ):
        self.on_failure = validate_on_failure(on_failure)
        self.timeout = timeout
        self.json_path = json_path
        self.result: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs):
        if model is None:
            raise ModelCheckFailed("Trainer passed no model to on_train_begin", 2)
        self.result = run_check(
            model,
            on_failure=self.on_failure,
            timeout=self.timeout,
            json_path=self.json_path,
            where="Trainer on_train_begin",
        )
        return control
