"""Lightning: check every rank's model when ``fit`` starts.

    from fsdpcheck.integrations.lightning import FsdpcheckCallback
    trainer = Trainer(..., callbacks=[FsdpcheckCallback()])

``on_fit_start`` runs after the strategy has set up the model on every rank, before the first
step. Under DDP Lightning has also loaded ``fit(ckpt_path=...)`` by then, so the check runs there.
Strategies that shard (``ModelParallelStrategy``: FSDP2 applied in ``configure_model``;
``FSDPStrategy``, DeepSpeed) load the checkpoint after ``on_fit_start``
(``strategy.restore_checkpoint_after_setup``), and which checkpoint, if any, is not known yet
then: under them the check waits for the first hook after that load and before any forward
(``on_sanity_check_start``, else ``on_train_start``), so a resumed job is checked as it will
train, not as it was built. The checkpoint the check sees loaded, ``trainer.ckpt_path`` (what
``fit(ckpt_path=...)`` resolved to: a ``.ckpt`` file, or a distributed checkpoint directory),
is compared across ranks too (``check_model(checkpoint=)``); the callback's ``checkpoint=``
overrides it. The sharding strategies load rank 0's ``ckpt_path`` on every rank (they
broadcast it): under them each rank records what it finds at rank 0's path, so a node whose
copy differs is named, and a path only another rank was given, which nothing loaded, is not.
The optimizer and lr scheduler (``trainer.optimizers``, ``trainer.lr_scheduler_configs``, where
there is one of each) are checked too; Lightning restores their state after ``on_fit_start``, so
under DDP the check sees them as built, and under the sharding strategies as loaded (held to
``ckpt_path`` where it is a DCP directory).
Built on ``pytorch_lightning`` when it is installed, else on
``lightning.pytorch``. Needs ``pip install 'fsdpcheck[lightning]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdpcheck.errors import FsdpcheckWarning, ModelCheckFailed
from fsdpcheck.integrations.common import CheckSettings, missing_extra

try:
    from pytorch_lightning import Callback
except ImportError:
    try:
        from lightning.pytorch import Callback
    except ImportError as exc:  # the extra is optional
        raise missing_extra("pytorch_lightning (or lightning)", "lightning", exc) from exc

__all__ = ["FsdpcheckCallback", "FsdpcheckWarning", "ModelCheckFailed"]


class FsdpcheckCallback(Callback, CheckSettings):
    """Run :func:`fsdpcheck.check_model` on the LightningModule at ``on_fit_start`` (under a
    strategy that loads the checkpoint after it, such as ``ModelParallelStrategy``: at
    ``on_sanity_check_start``, else ``on_train_start``, after that load).

    ``on_failure="raise"`` ends ``fit`` with :class:`ModelCheckFailed` (its message is the
    report's headline) on every rank; ``"warn"`` emits :class:`FsdpcheckWarning` and fits on.
    ``attribute``: check ``pl_module.<attribute>`` (e.g. ``"model"``) instead of the whole
    module. ``json_path``: rank 0 writes the full report there. ``result`` holds the last check.

    ``check_first_step=True``: also run the first training step (``optimizer_step``: the
    closure's forward and backward, then the optimizer) under :func:`fsdpcheck.check_step`;
    its result is ``step_result`` (``step_json_path``: rank 0's report of it).

    ``checkpoint``: the checkpoint this rank resumed from, when not ``trainer.ckpt_path``
    (a script that loads its own weights).
    """

    def __init__(
        self,
        *,
        on_failure: str = "raise",
        timeout: float = 60.0,
        json_path: str | Path | None = None,
        attribute: str | None = None,
        check_first_step: bool = False,
        step_json_path: str | Path | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
    ):
        CheckSettings.__init__(
            self, on_failure=on_failure, timeout=timeout, json_path=json_path, checkpoint=checkpoint
        )
        self.attribute = attribute
        self.check_first_step = check_first_step
        self.step_json_path = step_json_path
        self.step_result: Any = None
        self._pending = False  # the check waits for the strategy's checkpoint load (module doc)
        self._after_setup = False  # the strategy restores after setup, from rank 0's path

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._after_setup = bool(getattr(trainer.strategy, "restore_checkpoint_after_setup", False))
        self._pending = self._after_setup
        if not self._pending:
            self._check(trainer, pl_module, "on_fit_start")

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pending:
            self._check(trainer, pl_module, "on_sanity_check_start")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pending:
            self._check(trainer, pl_module, "on_train_start")

    def _check(self, trainer: Any, pl_module: Any, hook: str) -> None:
        self._pending = False
        model = getattr(pl_module, self.attribute) if self.attribute else pl_module
        # Loaded by now under every strategy (the module docstring): the resolved path.
        found = getattr(trainer, "ckpt_path", None)
        if self._after_setup and not getattr(trainer, "is_global_zero", True):
            # The strategies that restore after setup (ModelParallel, FSDP, DeepSpeed in
            # pytorch_lightning 2.6) load rank 0's ckpt_path on every rank: they broadcast it,
            # so this rank's own ckpt_path is not what it loaded; rank 0's arrives instead.
            found = None
        self.result = self.check(
            model,
            where=f"Lightning {hook}",
            checkpoint=self.checkpoint or found,
            # The same on every rank (the strategy), whatever checkpoint= each rank was given:
            # the broadcast is a collective.
            rank0_checkpoint=self._after_setup,
            optimizer=_only(getattr(trainer, "optimizers", None) or ()),
            scheduler=_only([c.scheduler for c in getattr(trainer, "lr_scheduler_configs", ())]),
        )
        if self.check_first_step:
            self._watch_first_step(pl_module, model)

    def _watch_first_step(self, pl_module: Any, model: Any) -> None:
        """Wrap ``pl_module.optimizer_step`` once: its first call runs under check_step."""
        original = pl_module.optimizer_step

        def first_step(*args: Any, **kwargs: Any) -> Any:
            pl_module.optimizer_step = original  # later steps run plain
            returned: list[Any] = []
            losses: list[Any] = []  # what the closure (training_step + backward) returned
            args, kwargs = list(args), dict(kwargs)
            closure = kwargs.get("optimizer_closure", args[3] if len(args) > 3 else None)
            if callable(closure):

                def watched_closure() -> Any:
                    losses.append(closure())
                    return losses[-1]

                if "optimizer_closure" in kwargs:
                    kwargs["optimizer_closure"] = watched_closure
                else:
                    args[3] = watched_closure

            def step() -> Any:
                returned.append(original(*args, **kwargs))
                return losses[-1] if losses else returned[-1]

            self.step_result = self.check_step(
                model, step, where="Lightning first training step", json_path=self.step_json_path
            )
            return returned[0] if returned else None

        pl_module.optimizer_step = first_step


def _only(items: Any) -> Any:
    """The one item of ``items``; None where there are none or several (check_model takes one
    optimizer)."""
    items = list(items)
    return items[0] if len(items) == 1 else None
