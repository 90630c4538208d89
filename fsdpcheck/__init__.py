"""fsdpcheck: find cross-rank buffer and parameter mismatches before FSDP2 training does."""

import os as _os

__version__ = "0.1.0"

# The library API, imported on first use so that `import fsdpcheck` stays torch-free.
_LAZY = {
    "run_audit": "fsdpcheck.audit",
    "check_model": "fsdpcheck.audit",
    "check_step": "fsdpcheck.step.api",
    "run_checked": "fsdpcheck.script.api",
    "AuditOptions": "fsdpcheck.options",
    "AuditResult": "fsdpcheck.audit",
    "load_full_state_dict": "fsdpcheck.loader.load",
    "broadcast_buffers": "fsdpcheck.loader.load",
    "BufferMismatchError": "fsdpcheck.loader.load",
    "verify_load": "fsdpcheck.loader.verify",
    "state_digests": "fsdpcheck.loader.sync",
    "compare_digests": "fsdpcheck.loader.sync",
    "save_fingerprint": "fsdpcheck.offline.standalone",
    "diff_fingerprints": "fsdpcheck.offline.diff",
    "configure_logging": "fsdpcheck.process",
    "probe": "fsdpcheck.children.probe:probe_builder",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpcheck' has no attribute {name!r}")
    import importlib

    module, _, attribute = module.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if _os.environ.get("FSDPCHECK_LOG"):  # the debug log, from the process's start
    from fsdpcheck.process import configure_logging

    configure_logging()
