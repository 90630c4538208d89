"""Survey the installed transformers: which architectures build with a hash-seed-dependent order?

For every causal-LM architecture (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; masked-LM encoders on
request) that matches the filter, a child interpreter makes a small config from the architecture's
config class (fewer, narrower layers; the attention/layer types mixed where the config has
``layer_types``), builds the model on ``meta`` and prints its fingerprint as one JSON line. There
is one child per hash seed (``PYTHONHASHSEED`` = 0 .. seeds-1), each building *all* selected
architectures in turn: string hashes depend only on the seed, not on what the process did before,
so this gives the same orders as one interpreter per (architecture, seed) at a fraction of the
cost. Children run in parallel (at most ``jobs``), each with an overall deadline, and each
architecture has its own time limit inside the child.

Row verdicts: ``ok`` (same orders under every seed), ``hang`` (tensors that reorder differ in
size: a loader pairing them by local order deadlocks or aborts), ``silent-corruption`` (same
sizes: values are swapped without an error) or ``skipped`` with the reason. Library code: returns
frozen records, never prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import logging
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fsdpcheck.checks.hash_seed import ModuleReorder, SeedError
from fsdpcheck.children.launch import emit
from fsdpcheck.children.probe import DEFAULT_SEEDS
from fsdpcheck.children.seeds import check_seeds, compare_builds, over_seeds
from fsdpcheck.distributed.environment import package_version
from fsdpcheck.errors import InputError
from fsdpcheck.model.fingerprint import fingerprint
from fsdpcheck.model.presets import PRESETS
from fsdpcheck.options import BuildSpec
from fsdpcheck.pipeline import build_or_raise
from fsdpcheck.records import ScanTarget, SeedBuild, from_dict, to_dict
from fsdpcheck.text import int_ranges
from fsdpcheck.vocab import Init, ScanFamily, ScanVerdict, SeedFailure, Snapshot, Verdict

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1800.0  # per child (one hash seed, every selected architecture)
DEFAULT_ARCH_TIMEOUT = 60.0  # per architecture, inside a child
FAMILIES = (ScanFamily.CAUSAL_LM, ScanFamily.MASKED_LM)
LAYERS = 4  # layers in a small config (more when the config has more distinct layer types)

# Integer config fields and the small value they are lowered to (never raised).
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 16,
}
_MIXED = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class ScanRow:
    id: str
    model_type: str
    architecture: str  # model class
    family: ScanFamily
    verdict: ScanVerdict
    reason: str | None = None  # why it was skipped
    tensors: tuple[str, ...] = ()  # tensors whose order follows the hash seed
    reorders: tuple[ModuleReorder, ...] = ()
    seeds_built: tuple[int, ...] = ()
    config: str | None = None  # which small-config attempt built: see ``_ATTEMPTS``
    layer_types: tuple[str, ...] = ()  # distinct layer types in the built config
    seconds: float = 0.0  # slowest build over the seeds

    @property
    def label(self) -> str:
        return (
            f"skipped: {self.reason}" if self.verdict == ScanVerdict.SKIPPED else str(self.verdict)
        )


@dataclass(frozen=True)
class ScanResult:
    rows: tuple[ScanRow, ...]
    seeds: tuple[int, ...]
    filters: tuple[str, ...]
    families: tuple[str, ...]
    exit_code: int
    counts: Mapping[str, int] = field(default_factory=dict)
    errors: tuple[SeedError, ...] = ()  # children that failed or timed out
    transformers: str | None = None
    torch: str | None = None
    python: str = ""
    started: str = ""  # UTC, ISO 8601
    elapsed: float = 0.0


# ---------------------------------------------------------------- selecting architectures


def available_targets(
    families: Sequence[str] = ("causal-lm",), presets: Sequence[str] = ()
) -> list[ScanTarget]:
    """Every architecture of the installed transformers in ``families``, then the presets."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise InputError(f"unknown family {unknown[0]!r}: choose from {', '.join(FAMILIES)}.")
    out: list[ScanTarget] = []
    if families:
        mappings = {
            ScanFamily.CAUSAL_LM: modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            ScanFamily.MASKED_LM: modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        }
        for family in map(ScanFamily, families):
            for model_type, names in mappings[family].items():
                name = names if isinstance(names, str) else names[0]
                suffix = "" if family == ScanFamily.CAUSAL_LM else f" ({family})"
                out.append(ScanTarget(model_type + suffix, model_type, name, family))
    if presets:
        for name in presets:
            preset = PRESETS.get(name)
            if preset is None:
                raise InputError(
                    f"--preset {name!r} is not a preset; choose from {', '.join(PRESETS)}."
                )
            out.append(ScanTarget(f"preset:{name}", name, preset.architecture, ScanFamily.PRESET))
    return out


def matches(target: ScanTarget, patterns: Sequence[str]) -> bool:
    """Case-insensitive: a pattern with ``*?[`` is a glob on model_type / class name / row id,
    anything else a substring of one of them. No patterns: everything matches."""
    if not patterns:
        return True
    names = [target.model_type.lower(), target.class_name.lower(), target.id.lower()]
    for pattern in patterns:
        p = pattern.lower()
        if any(c in p for c in "*?["):
            if any(fnmatch.fnmatchcase(n, p) for n in names):
                return True
        elif any(p in n for n in names):
            return True
    return False


def select(
    filters: Sequence[str],
    families: Sequence[str] = ("causal-lm",),
    presets: Sequence[str] = (),
) -> list[ScanTarget]:
    targets = available_targets(families, ())
    chosen = [t for t in targets if matches(t, filters)]
    chosen += available_targets((), presets)  # presets are asked for by name: always included
    if not chosen:
        raise InputError(
            f"--filter {' '.join(filters)!r} matches none of the {len(targets)} architectures "
            f"({', '.join(families)}) of this transformers; try a shorter pattern or a glob."
        )
    return chosen


# ---------------------------------------------------------------- the scan


def scan(
    filters: Sequence[str] = (),
    *,
    seeds: int = DEFAULT_SEEDS,
    families: Sequence[str] = ("causal-lm",),
    presets: Sequence[str] = (),
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    arch_timeout: float = DEFAULT_ARCH_TIMEOUT,
    progress: Callable[[int, int, str], None] | None = None,
) -> ScanResult:
    """Build every selected architecture on meta under PYTHONHASHSEED = 0 .. seeds-1 and compare.

    ``progress(done, total, label)`` is called (from worker threads, one call at a time) after
    each (architecture, seed) build; ``total`` = architectures x seeds. ``presets`` adds
    fsdpcheck presets (e.g. ``hazard``) as extra rows. Exit code: 1 when any row would hang or
    corrupt, 3 when no child produced anything, else 0; a filter matching nothing raises
    :class:`InputError` (exit 2). With the default 8 seeds a two-way set order goes unnoticed
    with probability 1/128.
    """
    check_seeds(seeds)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    targets = select(filters, families, presets)
    argv = [
        "-m", "fsdpcheck.children.scan", "--child",
        "--arch-timeout", str(arch_timeout),
        "--targets", json.dumps([to_dict(t) for t in targets]),
    ]  # fmt: skip
    runs = over_seeds(
        argv,
        seeds,
        jobs=jobs,
        timeout=timeout,
        total=len(targets) * seeds,
        progress=progress,
        label=lambda seed, build: f"{build.target} (seed {seed})",
    )
    seed_list = runs.seeds
    per_arch = {t.id: runs.built(t.id) for t in targets}
    errors = list(runs.lost.values())
    rows = tuple(scan_row(t, per_arch[t.id], seed_list, errors) for t in targets)
    counts = {v: sum(r.verdict == v for r in rows) for v in ScanVerdict}
    # Seeds that failed are only an error when no architecture has a result left.
    if counts[ScanVerdict.HANG] or counts[ScanVerdict.SILENT_CORRUPTION]:
        overall = Verdict.INCONSISTENT
    else:
        overall = Verdict.ERROR if errors and not any(per_arch.values()) else Verdict.CONSISTENT
    code = overall.exit_code()
    return ScanResult(
        rows=rows,
        seeds=seed_list,
        filters=tuple(filters),
        families=tuple(families),
        exit_code=code,
        counts=counts,
        errors=tuple(errors),
        transformers=package_version("transformers"),
        torch=package_version("torch"),
        python=sys.version.split()[0],
        started=started,
        elapsed=round(time.monotonic() - start, 2),
    )


def scan_row(
    target: ScanTarget,
    by_seed: Mapping[int, SeedBuild],
    seeds: Sequence[int],
    errors: Sequence[SeedError],
) -> ScanRow:
    base = dict(
        id=target.id,
        model_type=target.model_type,
        architecture=target.class_name,
        family=target.family,
    )
    built = {s: b for s, b in sorted(by_seed.items()) if b.built}
    failed = {s: b for s, b in sorted(by_seed.items()) if not b.built}
    missing = [s for s in seeds if s not in by_seed]
    seconds = max((b.seconds for b in by_seed.values()), default=0.0)
    first = next(iter(built.values()), None)
    extra = dict(
        seeds_built=tuple(built),
        seconds=round(seconds, 3),
        config=first.config if first else None,
        layer_types=first.layer_types if first else (),
    )
    reorders = compare_builds(built)
    if reorders:
        worst = ScanVerdict(max((r.outcome for r in reorders), key=lambda v: v.severity))
        tensors = tuple(t.name for r in reorders for t in r.tensors)
        return ScanRow(**base, verdict=worst, tensors=tensors, reorders=reorders, **extra)
    if len(built) == len(seeds):
        return ScanRow(**base, verdict=ScanVerdict.OK, **extra)
    if failed and not built:
        reasons = list(dict.fromkeys(b.message for b in failed.values()))
        reason = reasons[0] if len(reasons) == 1 else "; ".join(reasons[:2])
    elif failed:
        seed, build = next(iter(failed.items()))
        reason = f"built under seeds {int_ranges(built)} only; seed {seed}: {build.message}"
    else:
        why = {e.seed: e.message for e in errors}
        reason = (
            f"no result from seed(s) {int_ranges(missing)}: {why.get(missing[0], 'child lost')}"
        )
    return ScanRow(**base, verdict=ScanVerdict.SKIPPED, reason=reason, **extra)


# ---------------------------------------------------------------- small configs (child side)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``getattr`` that also survives properties that raise (per-layer configs do)."""
    try:
        return getattr(obj, key, default)
    except Exception:
        log.debug("%s.%s raised; using %r", type(obj).__name__, key, default)  # hot: no traceback
        return default


def _config_fields(obj: Any) -> set[str]:
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    return set(vars(obj))


def _small_kwargs(defaults: Any) -> dict[str, Any]:
    """Lowered sizes for the integer fields in :data:`SMALL` this config has, recursively into
    its sub-configs; token ids that would fall outside the small vocabulary are clamped."""
    fields = _config_fields(defaults)
    kwargs: dict[str, Any] = {}
    for key, small in SMALL.items():
        value = _get(defaults, key, None)
        if key in fields and type(value) is int and value > small:
            kwargs[key] = small
    # Unset sizes some models still read directly (``x // config.num_key_value_heads``).
    for key in ("head_dim", "num_key_value_heads"):
        if key in fields and _get(defaults, key, 0) is None:
            kwargs[key] = SMALL[key]
    vocab = kwargs.get("vocab_size", _get(defaults, "vocab_size", None))
    if type(vocab) is int:
        for key in fields:
            value = _get(defaults, key, None)
            if key.endswith("_token_id") or key.endswith("_token_index"):
                if type(value) is int and value >= vocab:
                    kwargs[key] = vocab - 1
                elif isinstance(value, list) and any(type(v) is int and v >= vocab for v in value):
                    kwargs[key] = [min(v, vocab - 1) for v in value]
    for key in getattr(type(defaults), "sub_configs", None) or {}:
        sub = _get(defaults, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            try:
                kwargs[key] = type(sub)(**_sub_kwargs(sub))
            except Exception:  # keep the shipped sub-config
                log.debug("%s: kept the shipped %s", type(defaults).__name__, key, exc_info=True)
                continue
    return kwargs


def _sub_kwargs(sub: Any) -> dict[str, Any]:
    small = _small_kwargs(sub)
    layers = _get(sub, "num_hidden_layers", None)
    if type(layers) is int and layers > LAYERS:
        small["num_hidden_layers"] = LAYERS
        small.update(_layer_types_kwarg(sub, LAYERS, mix=True))
    return small


def layer_plan(defaults: Any, *, mix: bool) -> list[str] | None:
    """The distinct layer types to cycle through, or None to leave ``layer_types`` alone.

    The config's own distinct types when it has several; with ``mix``, sliding + full attention
    for a config that has ``layer_types`` and a ``sliding_window`` but ships one type only."""
    if "layer_types" not in _config_fields(defaults):
        return None
    types = _get(defaults, "layer_types", None)
    distinct = list(dict.fromkeys(types)) if types else []
    if len(distinct) >= 2:
        return distinct
    if mix and "sliding_window" in _config_fields(defaults):
        return list(_MIXED)
    return distinct or None


def _layer_types_kwarg(defaults: Any, layers: int, *, mix: bool) -> dict[str, Any]:
    plan = layer_plan(defaults, mix=mix)
    if not plan:
        return {}
    return {"layer_types": [plan[i % len(plan)] for i in range(layers)]}


# (name, lower sizes, mix layer types, lower the layer count): tried in order, first that builds.
# Each is followed by a "+rope-per-type" variant where the config has several layer types and
# flat ``rope_parameters`` (some models read ``rope_parameters[layer_type]``).
_ATTEMPTS = (
    ("small", True, True, True),
    ("small-own-types", True, False, True),
    ("layers-only", False, True, True),
    ("default", False, False, False),
)


def _rope_per_type(defaults: Any, layer_types: Iterable[str]) -> dict[str, Any] | None:
    """``rope_parameters`` keyed by layer type (bases 1e4 sliding, 1e6 otherwise, as Gemma)."""
    if "rope_parameters" not in _config_fields(defaults):
        return None
    types = list(dict.fromkeys(layer_types))
    flat = _get(defaults, "rope_parameters", None) or {}
    if not isinstance(flat, dict) or not types or set(types) <= set(flat):
        return None
    common = {k: v for k, v in flat.items() if not isinstance(v, dict)}
    return {
        t: {**common, "rope_type": "default", "rope_theta": 1e4 if "sliding" in t else 1e6}
        for t in types
    }


def small_configs(
    model_type: str, *, decoder: bool = True
) -> Iterable[tuple[str, Callable[[], Any]]]:
    """Candidate configs for ``model_type`` as (attempt name, factory), smallest and most mixed
    first; a factory may raise (the config class validates its arguments). ``decoder`` sets
    ``is_decoder`` where the config has it (causal-LM heads of encoder models require it)."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    seen: list[dict[str, Any]] = []
    for name, small, mix, fewer in _ATTEMPTS:
        kwargs: dict[str, Any] = _small_kwargs(defaults) if small else {}
        if decoder and _get(defaults, "is_decoder") is False:
            kwargs["is_decoder"] = True
        if fewer:
            plan = layer_plan(defaults, mix=mix)
            layers = max(LAYERS, len(plan or ()))
            if _get(defaults, "num_hidden_layers", None) is not None:
                kwargs["num_hidden_layers"] = min(layers, defaults.num_hidden_layers)
                layers = kwargs["num_hidden_layers"]
            kwargs.update(_layer_types_kwarg(defaults, layers, mix=mix))
        types = kwargs.get("layer_types") or _get(defaults, "layer_types", None) or ()
        rope = _rope_per_type(defaults, types)
        candidates = [(name, kwargs)]
        if rope is not None:
            candidates.append((f"{name}+rope-per-type", {**kwargs, "rope_parameters": rope}))
        for label, kw in candidates:
            if kw in seen:
                continue
            seen.append(kw)
            yield label, (lambda kw=kw: config_class(**kw) if kw else defaults)


def _for_model(config: Any, model_class: Any) -> Any:
    """The sub-config the class is built from, where a composite config maps to a text-only
    causal LM (e.g. ``qwen3_5`` -> ``Qwen3_5ForCausalLM`` takes ``Qwen3_5TextConfig``)."""
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    for key in getattr(type(config), "sub_configs", None) or {}:
        sub = _get(config, key)
        if isinstance(sub, wanted):
            return sub
    return config


class ArchTimeout(BaseException):
    """Raised inside a child when one architecture exceeds its time limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise ArchTimeout


def build_target(target: ScanTarget) -> SeedBuild:
    """Build one target on meta and fingerprint it (child side); raises on failure."""
    if target.family == ScanFamily.PRESET:
        built = build_or_raise(BuildSpec(target.model_type, init=Init.META), 0)
        config = getattr(built.model, "config", None)
        types = getattr(config, "layer_types", None) or ()
        fp = fingerprint(built.model, Snapshot.PRE_WRAP, with_values=False)
        return SeedBuild(target.id, fp, config="preset", layer_types=tuple(dict.fromkeys(types)))

    model_class = getattr(transformers, target.class_name, None)
    if model_class is None:
        raise RuntimeError(f"transformers has no {target.class_name}")
    first_error: Exception | None = None
    attempts = 0
    decoder = target.family == ScanFamily.CAUSAL_LM
    for name, make_config in small_configs(target.model_type, decoder=decoder):
        try:
            config = _for_model(make_config(), model_class)
            with torch.device("meta"):
                model = model_class._from_config(config)
        except Exception as exc:
            log.debug("%s: small config %s did not build", target.id, name, exc_info=True)
            first_error = first_error or exc
            attempts += 1
            continue
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None) or ()
        fp = fingerprint(model, Snapshot.PRE_WRAP, with_values=False)
        return SeedBuild(target.id, fp, config=name, layer_types=tuple(dict.fromkeys(types)))
    assert first_error is not None
    raise BuildFailed(f"{_describe(first_error)} ({attempts} config attempts; the first's error)")


class BuildFailed(Exception):
    """Every candidate config failed to build; the message names the first error."""


def _describe(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:240]}" if text else type(exc).__name__


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdpcheck.children.scan")
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--targets", required=True, help="JSON list of ScanTarget records")
    parser.add_argument("--arch-timeout", type=float, default=DEFAULT_ARCH_TIMEOUT)
    args = parser.parse_args(argv)
    targets = [from_dict(ScanTarget, t) for t in json.loads(args.targets)]

    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    for target in targets:
        start = time.monotonic()
        try:
            signal.setitimer(signal.ITIMER_REAL, args.arch_timeout)
            try:
                build = build_target(target)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except ArchTimeout:
            why = f"build exceeded {args.arch_timeout:g} s"
            build = SeedBuild(target.id, failure=SeedFailure.TIMEOUT, message=why)
        except Exception as exc:
            log.debug("%s: build failed", target.id, exc_info=True)
            what = str(exc) if isinstance(exc, BuildFailed) else _describe(exc)
            build = SeedBuild(
                target.id, failure=SeedFailure.RUNTIME, message=f"build failed: {what}"
            )
        emit(dataclasses.replace(build, seconds=round(time.monotonic() - start, 3)))
    return 0


# ---------------------------------------------------------------- rendering (no printing)

if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
