"""Hugging Face Trainer: check every rank's model as training begins.

    from fsdpcheck.integrations.hf import FsdpcheckCallback
    trainer = Trainer(..., callbacks=[FsdpcheckCallback()])

``on_train_begin`` runs after the Trainer has wrapped the model and loaded any checkpoint it
resumes from, and before the first step. The checkpoint it resumed from is compared across
ranks too (``check_model(checkpoint=)``): the callback's ``checkpoint=``, else
``args.resume_from_checkpoint`` (the ``TrainingArguments`` field scripts pass on to
``trainer.train(resume_from_checkpoint=...)``) once the Trainer has restored a step from it.
The Trainer keeps the path it resolved itself (``train(resume_from_checkpoint=True)``) to
itself, out of a callback's reach: pass that one as ``checkpoint=``. The Trainer's optimizer
and lr scheduler (the callback's ``optimizer`` and ``lr_scheduler``) are checked too: the
Trainer creates them, and loads them from a checkpoint it resumes from, before
``on_train_begin``; their state is held to the checkpoint's where it holds a DCP
``optimizer_0`` directory (FSDP's sharded state dict), never to a pickled ``optimizer.pt``. The
first training step
itself (opt-in)::

    trainer = Trainer(...)
    first = watch_first_step(trainer)      # its first training_step runs under check_step
    trainer.train()                        # first.result: that step's AuditResult

Needs ``pip install 'fsdpcheck[hf]'``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.errors import FsdpcheckWarning, ModelCheckFailed
from fsdpcheck.integrations.common import CheckSettings, missing_extra

log = logging.getLogger(__name__)

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the extra is optional
    raise missing_extra("transformers", "hf", exc) from exc

__all__ = [
    "FirstStepWatch",
    "FsdpcheckCallback",
    "FsdpcheckWarning",
    "ModelCheckFailed",
    "watch_first_step",
]


class FsdpcheckCallback(TrainerCallback, CheckSettings):
    """Run :func:`fsdpcheck.check_model` on the Trainer's model at ``on_train_begin``.

    ``on_failure="raise"`` stops training with :class:`ModelCheckFailed` (its message is the
    report's headline) on every rank; ``"warn"`` emits :class:`FsdpcheckWarning` and trains on.
    ``json_path``: rank 0 writes the full report there. ``result`` holds the last check.
    ``checkpoint``: the directory this rank's ``trainer.train(resume_from_checkpoint=...)``
    resumed from (default: ``args.resume_from_checkpoint``; see the module's docstring).
    """

    def __init__(
        self,
        *,
        on_failure: str = "raise",
        timeout: float = 60.0,
        json_path: str | Path | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
    ):
        CheckSettings.__init__(
            self, on_failure=on_failure, timeout=timeout, json_path=json_path, checkpoint=checkpoint
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs):
        if model is None:
            raise ModelCheckFailed("Trainer passed no model to on_train_begin", 2)
        self.result = self.check(
            model,
            where="Trainer on_train_begin",
            checkpoint=self.checkpoint or _resumed_from(args, state),
            optimizer=kwargs.get("optimizer"),
            scheduler=kwargs.get("lr_scheduler"),
        )
        return control


def _resumed_from(args: Any, state: Any) -> Any:
    """``args.resume_from_checkpoint`` where the Trainer did resume from it: it restored its
    state (a ``global_step`` above 0) and that directory's ``trainer_state.json`` holds the same
    step. The Trainer itself reads ``train(resume_from_checkpoint=...)``, not the argument, so a
    path there that the script resumed from elsewhere is no resume of this one."""

    step = getattr(state, "global_step", 0)
    path = getattr(args, "resume_from_checkpoint", None)
    if not step or not isinstance(path, str | os.PathLike):
        return None
    try:
        saved = json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        log.debug("no trainer_state.json to match at %s", path, exc_info=True)
        return None
    return path if isinstance(saved, dict) and saved.get("global_step") == step else None


class FirstStepWatch(CheckSettings):
    """Stands in for ``trainer.training_step`` until its first call, which it runs under
    :func:`fsdpcheck.check_step` (see :func:`watch_first_step`); ``result`` holds that check."""

    def __init__(self, trainer: Any, *, on_failure: str, timeout: float, json_path: Any):
        super().__init__(on_failure=on_failure, timeout=timeout, json_path=json_path)
        self.trainer = trainer
        # An instance attribute of the user's own (a wrapper of theirs) is put back as it was.
        self._own = trainer.__dict__.get("training_step")

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """``training_step(model, inputs, num_items_in_batch=None)``, passed on as called (a
        Trainer without ``num_items_in_batch`` gets none)."""
        trainer = self.trainer
        if self._own is None:
            del trainer.training_step  # later steps: the class's training_step, plain
        else:
            trainer.training_step = self._own
        losses: list[Any] = []

        def step() -> Any:
            losses.append(trainer.training_step(model, *args, **kwargs))
            return losses[-1]

        self.result = self.check_step(
            trainer.accelerator.unwrap_model(model),
            step,
            where="Trainer first training_step",
            json_path=self.json_path,
        )
        if losses:
            return losses[0]
        # "warn" after a step that did not finish: the Trainer wants a loss tensor; a NaN one is
        # what its nan filter (``logging_nan_inf_filter``) already leaves out of the logged loss.

        return torch.tensor(float("nan"), device=trainer.args.device)


def watch_first_step(
    trainer: Any,
    *,
    on_failure: str = "raise",
    timeout: float = 60.0,
    json_path: str | Path | None = None,
) -> FirstStepWatch:
    """Run the Trainer's first ``training_step`` (the first micro-batch's forward and backward;
    the optimizer step is the Trainer's own, after it) under :func:`fsdpcheck.check_step`, on
    every rank; later steps run plain. Call it on every rank before ``trainer.train()``.

    ``on_failure``, ``timeout`` and ``json_path`` work as for :class:`FsdpcheckCallback`: a
    step whose ranks issued different collectives, or that left a NaN on some rank, raises
    :class:`ModelCheckFailed` out of ``trainer.train()`` on every rank, or warns. With "warn"
    after a divergence the step did not complete (the returned loss is NaN): training on from
    it is at your risk. Returns the watch; its ``result`` is the step's AuditResult once run.

    It sets ``trainer.training_step`` on the instance (so a Trainer subclass's own
    ``training_step`` is the one watched) and removes itself on the first call."""
    watch = FirstStepWatch(trainer, on_failure=on_failure, timeout=timeout, json_path=json_path)
    trainer.training_step = watch
    return watch
