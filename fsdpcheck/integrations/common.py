"""What every framework hook does: run :func:`fsdpcheck.check_model` (or ``check_step`` on the
first training step), then raise or warn."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from fsdpcheck.audit import check_model
from fsdpcheck.errors import FsdpcheckWarning, ModelCheckFailed
from fsdpcheck.output import write_json
from fsdpcheck.step.api import check_step
from fsdpcheck.vocab import ExitCode

ON_FAILURE = ("raise", "warn")


def validate_on_failure(on_failure: str) -> str:
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure={on_failure!r}: choose 'raise' or 'warn'")
    return on_failure


class CheckSettings:
    """What every hook is told (how a failure ends, the collectives' timeout, where rank 0
    writes its report, the checkpoint resumed from) and its last ``result``."""

    def __init__(
        self,
        *,
        on_failure: str,
        timeout: float,
        json_path: str | Path | None,
        checkpoint: str | os.PathLike[str] | None = None,
    ):
        self.on_failure = validate_on_failure(on_failure)
        self.timeout = timeout
        self.json_path = json_path
        self.checkpoint = checkpoint
        self.result: Any = None

    def check(
        self,
        model: Any,
        *,
        where: str,
        checkpoint: str | os.PathLike[str] | None = None,
        rank0_checkpoint: bool = False,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> Any:
        """Collective: every rank must call it. Returns the AuditResult when the ranks agree;
        otherwise raises :class:`ModelCheckFailed` or warns, the same on every rank.

        ``json_path`` is checked on every rank before the check begins, so a path the report
        cannot be written to fails every rank alike (exit 2, in either mode) instead of rank 0
        alone after the check while the others train on. No rank is ended by the check when its
        peers give up on it (a rank slower than ``timeout``): it returns exit 3, and raises or
        warns, like them.

        ``checkpoint``: what this rank resumed from (the settings' own, else what the framework
        says; see :func:`local_checkpoint`), forwarded to ``check_model(checkpoint=)``: ranks
        that resumed different saves are a ``checkpoint`` finding. ``rank0_checkpoint``: the
        framework loaded rank 0's path on every rank (see ``check_model``). ``optimizer``,
        ``scheduler``: what the framework steps with, forwarded to ``check_model`` (an
        ``optimizer`` finding)."""
        _check_json_path(self.json_path, where)
        result = check_model(
            model,
            checkpoint=local_checkpoint(checkpoint),
            timeout=self.timeout,
            rank0_checkpoint=rank0_checkpoint,
            optimizer=optimizer,
            scheduler=scheduler,
        )
        return self.act_on(result, where=where, json_path=self.json_path)

    def check_step(
        self, model: Any, step: Any, *, where: str, json_path: str | Path | None = None
    ) -> Any:
        """Collective: :func:`fsdpcheck.check_step` on the first real training step (``step``, a
        zero-argument callable that runs it), rank 0's report written to ``json_path``, then
        raise or warn as :meth:`check` does. After a divergence the step did not complete:
        training on from it ("warn") is at the user's risk."""
        _check_json_path(json_path, where)
        result = check_step(model, step, timeout=self.timeout)
        return self.act_on(result, where=where, json_path=json_path)

    def act_on(self, result: Any, *, where: str, json_path: str | Path | None) -> Any:
        """Write rank 0's report, then return the result, raise or warn, the same on every
        rank."""
        if json_path is not None and result.report is not None:  # rank 0 holds the report
            write_json(result.report, Path(json_path))
        if result.exit_code == 0:
            return result
        headline = result.headline or "the check failed; see rank 0's report"
        if self.on_failure == "raise":
            raise ModelCheckFailed(f"{where}: {headline}", result.exit_code, result)
        warnings.warn(
            f"fsdpcheck ({where}): {headline} (exit {result.exit_code})",
            FsdpcheckWarning,
            stacklevel=4,
        )
        return result


def missing_extra(framework: str, extra: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"fsdpcheck.integrations.{extra} needs {framework}, which is not importable here "
        f"({exc}); install it with: pip install 'fsdpcheck[{extra}]'"
    )


def local_checkpoint(checkpoint: Any) -> str | os.PathLike[str] | None:
    """A resume checkpoint this rank can read as a path, or None: a framework may hold a URL
    (``s3://...``, read through fsspec) or a non-path marker (``True``), which no rank could
    find on its filesystem, the same on every rank: recorded, it would read as every rank
    unable to read its checkpoint."""
    if isinstance(checkpoint, os.PathLike):
        return checkpoint
    if not isinstance(checkpoint, str) or not checkpoint or "://" in checkpoint:
        return None
    return checkpoint


def _check_json_path(json_path: str | Path | None, where: str) -> None:
    if json_path is not None:
        problem = _json_path_problem(Path(json_path))
        if problem:
            raise ModelCheckFailed(f"{where}: {problem}", ExitCode.BAD_INPUT)


def _json_path_problem(path: Path) -> str | None:
    """Why rank 0 could not write the report to ``path``, asked of each rank's own filesystem
    without touching it: every rank asks at once, and a probe file or folder one rank made and
    removed would trip another (the write itself makes the missing folders)."""
    problem = None
    existing = path.parent
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if path.is_dir():
        problem = f"json_path {path} is a directory; pass a file path, e.g. {path / 'report.json'}"
    elif not existing.is_dir():
        problem = f"json_path {path} cannot be written: {existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"json_path {path} cannot be written: this user cannot write in {existing}"
    if problem is None:
        return None
    return (
        f"{problem}. Nothing was checked. Pass a json_path in a folder this user can write "
        "(every rank checks it before the check begins, so on a multi-node job it must be "
        "writable on every host)."
    )
