"""Exceptions that carry an exit code."""

from __future__ import annotations

from typing import Any

from fsdpcheck.vocab import ErrorKind, ExitCode


class FsdpcheckError(Exception):
    """A failure fsdpcheck explains itself; ``exit_code`` is what the process should return."""

    exit_code = ExitCode.RUNTIME
    kind = ErrorKind.RUNTIME


class InputError(FsdpcheckError):
    """Bad usage or bad input: the message names the input and the fix."""

    exit_code = ExitCode.BAD_INPUT
    kind = ErrorKind.INPUT


class OptionError(InputError):
    """A combination of audit options that cannot run; ``option`` is the flag it is about
    (None: several together), which the CLI names as its usage error."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class PeersTimedOut(FsdpcheckError):
    """Ranks that were to join one of fsdpcheck's collectives did not come within its timeout
    (or the collective failed); ``ranks`` names the silent ones (empty where none could be
    told)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class ModelCheckFailed(FsdpcheckError):
    """The ranks' models differ (or the check could not finish); ``headline`` says how."""

    def __init__(self, headline: str, exit_code: int, result: Any = None):
        super().__init__(f"fsdpcheck: {headline} (exit {exit_code})")
        self.headline = headline
        self.exit_code = exit_code
        self.result = result  # the AuditResult; its report is on rank 0


class FsdpcheckWarning(UserWarning):
    """``on_failure="warn"``: the ranks' models differ, and training goes on anyway."""
