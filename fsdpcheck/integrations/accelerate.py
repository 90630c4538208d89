"""accelerate: check every rank's model right after ``accelerator.prepare``.

    model = accelerator.prepare(model)      # FSDP2 (fsdp_version=2): prepare(model, optimizer)
    accelerator.load_state(resume_dir)       # a resume: check after it, and say from where
    check_prepared(accelerator, model, checkpoint=resume_dir, optimizer=optimizer)

The Accelerator keeps no record of the directory ``load_state`` read, so the checkpoint a
resume came from is compared across ranks only when it is passed as ``checkpoint=``.

Needs ``pip install 'fsdpcheck[accelerate]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdpcheck.errors import FsdpcheckWarning, ModelCheckFailed
from fsdpcheck.integrations.common import CheckSettings, missing_extra

__all__ = ["FsdpcheckWarning", "ModelCheckFailed", "check_first_step", "check_prepared"]


def check_prepared(
    accelerator: Any,
    model: Any,
    *,
    on_failure: str = "raise",
    timeout: float = 60.0,
    json_path: str | Path | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
) -> Any:
    """Collective (every process calls it): :func:`fsdpcheck.check_model` on the model that
    ``accelerator.prepare`` returned, unwrapped from DDP (FSDP2 shards in place, so its
    parameters stay DTensors and the check sees the wrapped layout). Returns the AuditResult;
    a failure raises :class:`ModelCheckFailed` or, with ``on_failure="warn"``, warns.
    ``checkpoint``: the directory this rank's ``accelerator.load_state`` read (call it after
    that load): ranks that resumed different saves are a ``checkpoint`` finding. ``optimizer``,
    ``scheduler``: what ``prepare`` returned for them (checked as ``check_model(optimizer=)``;
    after ``load_state``, held to ``checkpoint``'s DCP ``optimizer_0`` directory, if any)."""
    try:
        import accelerate  # noqa: F401  (the extra; the accelerator itself is the caller's)
    except ImportError as exc:
        raise missing_extra("accelerate", "accelerate", exc) from exc
    settings = CheckSettings(on_failure=on_failure, timeout=timeout, json_path=json_path)
    return settings.check(
        accelerator.unwrap_model(model),
        where="after accelerator.prepare",
        checkpoint=checkpoint,
        optimizer=optimizer,
        scheduler=scheduler,
    )


def check_first_step(
    accelerator: Any,
    model: Any,
    step: Any,
    *,
    on_failure: str = "raise",
    timeout: float = 60.0,
    json_path: str | Path | None = None,
) -> Any:
    """Collective: the first training step, run once by calling ``step()`` (forward,
    ``accelerator.backward``, ``optimizer.step()``), under :func:`fsdpcheck.check_step`.
    Returns the AuditResult; a failure raises :class:`ModelCheckFailed` or warns."""
    settings = CheckSettings(on_failure=on_failure, timeout=timeout, json_path=json_path)
    unwrapped = accelerator.unwrap_model(model)
    return settings.check_step(unwrapped, step, where="first training step", json_path=json_path)
