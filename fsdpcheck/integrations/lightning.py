"""Lightning: check every rank's model when ``fit`` starts.

    from fsdpcheck.integrations.lightning import FsdpcheckCallback
    trainer = Trainer(..., callbacks=[FsdpcheckCallback()])

``on_fit_start`` runs after the strategy has set up the model (DDP, or FSDP2 under
``ModelParallelStrategy``) on every rank, before the first step. Built on ``pytorch_lightning``
when it is installed, else on ``lightning.pytorch``. Needs ``pip install 'fsdpcheck[lightning]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpcheck.integrations.common import (
    FsdpcheckWarning,
    ModelCheckFailed,
    missing_extra,
    run_check,
    run_step_check,
    validate_on_failure,
)

try:
    from pytorch_lightning import Callback
except ImportError:
    try:
        from lightning.pytorch import Callback
    except ImportError as exc:  # the extra is optional
        raise missing_extra("pytorch_lightning (or lightning)", "lightning", exc) from exc

__all__ = ["FsdpcheckCallback", "FsdpcheckWarning", "ModelCheckFailed"]


class FsdpcheckCallback(Callback):
    """Run :func:`fsdpcheck.check_model` on the LightningModule at ``on_fit_start``.

    ``on_failure="raise"`` ends ``fit`` with :class:`ModelCheckFailed` (its message is the
    report's headline) on every rank; ``"warn"`` emits :class:`FsdpcheckWarning` and fits on.
    ``attribute``: check ``pl_module.<attribute>`` (e.g. ``"model"``) instead of the whole
    module. ``json_path``: rank 0 writes the full report there. ``result`` holds the last check.

    ``check_first_step=True``: also run the first training step (``optimizer_step``: the
    closure's forward and backward, then the optimizer) under :func:`fsdpcheck.check_step`;
    its result is ``step_result`` (``step_json_path``: rank 0's report of it).
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
    ):
        self.on_failure = validate_on_failure(on_failure)
        self.timeout = timeout
        self.json_path = json_path
        self.attribute = attribute
        self.check_first_step = check_first_step
        self.step_json_path = step_json_path
        self.result: Any = None
        self.step_result: Any = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = getattr(pl_module, self.attribute) if self.attribute else pl_module
        self.result = run_check(
            model,
            on_failure=self.on_failure,
            timeout=self.timeout,
            json_path=self.json_path,
            where="Lightning on_fit_start",
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

            self.step_result = run_step_check(
                model,
                step,
                on_failure=self.on_failure,
                timeout=self.timeout,
                json_path=self.step_json_path,
                where="Lightning first training step",
            )
            return returned[0] if returned else None

        pl_module.optimizer_step = first_step
