"""A script run in this process as ``python SCRIPT.py ARGS`` or ``python -m MODULE ARGS`` would
run it: as ``__main__``, with its own ``sys.argv`` and ``sys.path[0]``, in the working folder
it was started in; what it raises goes on up, with its traceback trimmed to its own frames."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from fsdpcheck.errors import InputError


@dataclass(frozen=True)
class Target:
    """What to run: a script file, or a module (``-m``), and the arguments it is given."""

    name: str
    args: tuple[str, ...] = ()
    module: bool = False

    @classmethod
    def parse(cls, words: list[str]) -> Target:
        """``SCRIPT.py ARGS...`` or ``-m MODULE ARGS...`` (as after ``python``)."""
        if not words:
            raise InputError(
                "fsdpcheck run needs the training script: fsdpcheck run [OPTIONS] SCRIPT.py "
                "[ARGS...] or fsdpcheck run [OPTIONS] -m MODULE [ARGS...]."
            )
        if words[0] == "-m" or (words[0].startswith("-m") and len(words[0]) > 2):
            name = words[0][2:] or (words[1] if len(words) > 1 else "")
            rest = words[1:] if words[0] != "-m" else words[2:]
            if not name:
                raise InputError("fsdpcheck run -m needs a module name: -m MODULE [ARGS...].")
            return cls(name, tuple(rest), module=True)
        if words[0].startswith("-"):
            raise InputError(
                f"fsdpcheck run: {words[0]!r} is not an option of run and not a script; give "
                "fsdpcheck's options before the script, the script's own after it (see "
                "fsdpcheck run --help)."
            )
        return cls(words[0], tuple(words[1:]))

    def problem(self) -> str:
        """Why this target cannot run ("" when it can), checked before any rank starts."""
        if self.module:
            import importlib.util

            try:
                found = importlib.util.find_spec(self.name)
            except (ImportError, ValueError):
                found = None
            if found is None:
                return (
                    f"no module named {self.name!r} (sys.path[0] is the working folder "
                    f"{os.getcwd()}, as under python -m): install it or run from its folder."
                )
            return ""
        path = Path(self.name)
        if not path.is_file():
            return f"the script {self.name!r} does not exist (working folder {os.getcwd()})."
        return ""


def run(target: Target) -> None:
    """Run ``target`` as Python would run it from the command line."""
    if target.module:
        sys.argv = [target.name, *target.args]  # argv[0] becomes the module's path, as -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        return
    path = os.path.abspath(target.name)
    sys.argv = [target.name, *target.args]
    sys.path[0] = os.path.dirname(path)
    runpy.run_path(path, run_name="__main__")


def print_script_error(error: BaseException) -> None:
    """The script's uncaught exception as Python prints it, from the script's first frame."""
    tb = error.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb if tb is not None else error.__traceback__)
    sys.stderr.flush()


def _ours(path: str) -> bool:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return path.startswith(here) or os.path.basename(path) in ("runpy.py", "<frozen runpy>")
