"""Exceptions that carry an exit code and the stage they came from."""

from __future__ import annotations

EXIT_CONSISTENT = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 3


class FsdpcheckError(Exception):
    """A failure fsdpcheck explains itself; ``exit_code`` is what the process should return."""

    exit_code = EXIT_RUNTIME
    kind = "runtime"


class InputError(FsdpcheckError):
    """Bad usage or bad input: the message names the input and the fix."""

    exit_code = EXIT_BAD_INPUT
    kind = "input"


class CollectiveTimeout(FsdpcheckError):
    """A peer did not answer within ``--timeout``."""
