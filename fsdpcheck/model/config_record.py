"""A rank's resolved model config, in a canonical form that ranks can compare by digest.

Volatile keys are dropped at every nesting level: they legitimately differ between ranks that
run the same model (where the files were read from, the library version that wrote them, the
attention kernel chosen for this host) or they mirror state compared elsewhere (``dtype``
follows the parameters, whose dtypes the layout check compares). Secret-looking values are
redacted: a config is the user's file, and reports travel into CI logs. Nothing recorded holds
a memory address: a config that holds functions (torchtitan's dataclasses hold ``param_init``)
records each by its qualified name, and an object with no stable value by its type's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
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
# A memory address as Python and C extensions print them (``<function f at 0x7f3a...>``): it
# differs per process, so it never reaches a record.
_ADDRESS = re.compile(r"\b0x[0-9a-f]{8,16}\b")
ADDRESS = "0x<address>"
_MAX_DEPTH = 32  # deeper than any config: an object graph, recorded by its type from there


def secret_value(text: str) -> bool:
    """Whether ``text`` looks like a token or key by its form (``hf_...``, ``sk-...``)."""
    return bool(_SECRET_VALUE.match(text))


def without_addresses(text: str) -> str:
    """``text`` with every memory address replaced by ``0x<address>``."""
    return _ADDRESS.sub(ADDRESS, text)


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
        return _fields(config)  # not asdict: it deep-copies, and a config may hold anything
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


def canonicalize(value: Any, key: str = "", depth: int = 0) -> Any:
    """JSON-ready, volatile keys dropped, secret-looking values redacted, keys sorted; callables
    by qualified name, dataclasses by their fields, other objects by ``str()`` where it holds
    no memory address and else by their type's qualified name."""
    if depth > _MAX_DEPTH:
        return f"<{qualified_name(type(value))}>"
    deeper = depth + 1
    if isinstance(value, Mapping):
        return {
            str(k): canonicalize(v, str(k), deeper)
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            if str(k) not in VOLATILE_KEYS
        }
    if key and _SECRET_KEY.search(key) and value not in (None, "", False):
        return REDACTED
    if isinstance(value, (list, tuple)):
        return [canonicalize(v, "", deeper) for v in value]
    if isinstance(value, (set, frozenset)):  # iteration order follows the hash seed: sort
        return sorted((canonicalize(v, "", deeper) for v in value), key=repr)
    if isinstance(value, str):
        return REDACTED if _SECRET_VALUE.match(value) else without_addresses(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # strict JSON has no NaN/Infinity
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A nested config: its class too (two option classes with the same fields differ).
        fields = {"__class__": qualified_name(type(value)), **_fields(value)}
        return canonicalize(fields, "", deeper)
    if isinstance(value, functools.partial):
        return canonicalize(
            {"partial": callable_name(value.func), "args": value.args, "keywords": value.keywords},
            "",
            deeper,
        )
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return callable_name(value)
    text = str(value)  # torch.dtype and friends
    if _ADDRESS.search(text):  # a default object repr: nothing stable but the type
        return f"<{qualified_name(type(value))}>"
    return text


def _fields(instance: Any) -> dict[str, Any]:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (``torch.nn.init.trunc_normal_``)."""
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}" if module else name


def callable_name(fn: Any) -> str:
    """A callable as it is the same in every process: its qualified name; a bound method's
    function's (``Class.method``); a lambda or a local function also by a digest of its code,
    since two of them can share one qualified name."""
    if isinstance(fn, functools.partial):
        return json.dumps(canonicalize(fn), sort_keys=True)
    target = getattr(fn, "__func__", fn)
    name = qualified_name(target)
    code = getattr(target, "__code__", None)
    if code is not None and ("<lambda>" in name or "<locals>" in name):
        name += f"#{short_digest(_code_text(code), size=6)}"
    return without_addresses(name)


def _code_text(code: types.CodeType) -> str:
    """What a code object computes, without addresses: bytecode, names, plain constants."""
    consts = [
        _code_text(c) if isinstance(c, types.CodeType) else repr(c)
        for c in code.co_consts
        if c is None or isinstance(c, (bool, int, float, str, bytes, tuple, types.CodeType))
    ]
    return repr((code.co_code, code.co_names, code.co_varnames, consts))
