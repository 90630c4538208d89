"""A rank's resolved model config, in a canonical form that ranks can compare by digest.

Volatile keys are dropped at every nesting level: they legitimately differ between ranks that
run the same model (where the files were read from, the library version that wrote them, the
attention kernel chosen for this host) or they mirror state compared elsewhere (``dtype``
follows the parameters, whose dtypes the layout check compares). Secret-looking values are
redacted: a config is the user's file, and reports travel into CI logs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from fsdpcheck.records import ConfigRecord, short_digest

VOLATILE_KEYS = frozenset(
    {
        "transformers_version",  # compared by the env check
        "_name_or_path",  # a per-node local path is expected
        "name_or_path",
        "_commit_hash",
        "_attn_implementation",  # chosen per host (sdpa, flash, eager)
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_experts_implementation",
        "_experts_implementation_internal",
        "_post_init_done",
        "dtype",  # set by model construction; the parameters' dtypes are compared
        "torch_dtype",
    }
)
_SECRET_KEY = re.compile(
    r"(^|_)(token|auth_token|access_token|hub_token|hf_token|api_key|apikey|password|passwd|"
    r"secret|secret_key|private_key|access_key)$",
    re.IGNORECASE,
)
_SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|gho_|github_pat_|xox[abp]-|AKIA)[A-Za-z0-9_\-]{12,}$")
REDACTED = "<redacted>"


def secret_value(text: str) -> bool:
    """Whether ``text`` looks like a token or key by its form (``hf_...``, ``sk-...``)."""
    return bool(_SECRET_VALUE.match(text))


def config_record(config: Any) -> ConfigRecord | None:
    """None when ``config`` is None or has no dict form."""
    raw = _as_dict(config)
    if raw is None:
        return None
    canonical = canonicalize(raw)
    text = json.dumps(_numbers_alike(canonical), sort_keys=True, separators=(",", ":"))
    return ConfigRecord(digest=short_digest(text), canonical=canonical)


def _as_dict(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    return None


def _numbers_alike(value: Any) -> Any:
    """For the digest only: ``10000.0`` and ``10000`` configure the same thing."""
    if isinstance(value, dict):
        return {k: _numbers_alike(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_alike(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonicalize(value: Any, key: str = "") -> Any:
    """JSON-ready, volatile keys dropped, secret-looking values redacted, keys sorted."""
    if isinstance(value, Mapping):
        return {
            str(k): canonicalize(v, str(k))
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            if str(k) not in VOLATILE_KEYS
        }
    if key and _SECRET_KEY.search(key) and value not in (None, "", False):
        return REDACTED
    if isinstance(value, (list, tuple)):
        return [canonicalize(v) for v in value]
    if isinstance(value, (set, frozenset)):  # iteration order follows the hash seed: sort
        return sorted((canonicalize(v) for v in value), key=repr)
    if isinstance(value, str):
        return REDACTED if _SECRET_VALUE.match(value) else value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # strict JSON has no NaN/Infinity
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)  # torch.dtype and friends
