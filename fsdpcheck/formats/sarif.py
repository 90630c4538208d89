"""``scan --sarif``: SARIF 2.1.0 results pointing at the source line that iterates a set while
registering tensors.

Two kinds of result:

- the scan saw it: a row whose order followed the hash seed (``hang`` / ``silent-corruption``,
  level ``error``) is located at the set-iterating loops of its modeling files (see
  :mod:`fsdpcheck.checks.set_order`); if none is found statically, at the model class;
- latent: a loop over a set that registers tensors in a modeling file the scan covered (every
  ``transformers/models/<dir>`` whose name matches ``--filter``, all of them without one) that no
  row showed reordering, because the scan's small config did not trigger it or did not build
  that architecture at all (level ``warning``). transformers 5.24's ``cohere_compass`` is one:
  its rotary embedding needs two RoPE layer types to register buffers in set order.

Locations are absolute ``file://`` URIs: the files live in site-packages, not in a repository.
Reading sources only: nothing here imports or runs a modeling file.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import inspect
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpcheck.checks.set_order import SetOrderSite, find_sites_in_file
from fsdpcheck.distributed.environment import package_version
from fsdpcheck.output import write_text
from fsdpcheck.vocab import ExitCode, ScanFamily, ScanVerdict

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fsdpcheck.children.scan import ScanResult, ScanRow

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
INFO_URI = "https://github.com/huggingface/transformers/pull/48162"


def _rule(number: int, name: str, short: str, full: str, level: str) -> dict[str, Any]:
    return {
        "id": f"FSDPCHECK{number:03d}",
        "name": name,
        "shortDescription": {"text": short},
        "fullDescription": {"text": full},
        "defaultConfiguration": {"level": level},
        "helpUri": INFO_URI,
    }


RULES = (
    _rule(
        1,
        "SetOrderHang",
        "tensor order follows the hash seed; sizes differ (hang)",
        "Tensors are registered while iterating a set, so named_buffers() / "
        "named_parameters() order follows PYTHONHASHSEED and differs between ranks. The "
        "reordered tensors differ in size: a loader that broadcasts them in local order "
        "deadlocks (NCCL) or aborts (gloo). Iterate sorted(...) instead.",
        "error",
    ),
    _rule(
        2,
        "SetOrderSilentCorruption",
        "tensor order follows the hash seed; same sizes (corrupt)",
        "Tensors are registered while iterating a set, so their order follows "
        "PYTHONHASHSEED. The reordered tensors have equal sizes: a loader that broadcasts "
        "them in local order swaps their values without any error. Iterate sorted(...).",
        "error",
    ),
    _rule(
        3,
        "SetOrderLatent",
        "registers tensors while iterating a set (latent)",
        "This loop iterates a set and registers tensors in its body. The scan did "
        "not see the order change (its small config did not reach this code with two or "
        "more elements, or the architecture was not built); a config that does will give "
        "each rank its own tensor order. Iterate sorted(...) instead.",
        "warning",
    ),
)
_RULE_OF = {ScanVerdict.HANG: 0, ScanVerdict.SILENT_CORRUPTION: 1, "latent": 2}
SEEN = (ScanVerdict.HANG, ScanVerdict.SILENT_CORRUPTION)


def scan_to_sarif(
    result: ScanResult,
    *,
    transformers_dir: Path | None = None,
    version: str | None = None,
) -> dict[str, Any]:
    """The SARIF log (a JSON-ready dict) for a finished scan."""
    base = transformers_dir if transformers_dir is not None else _transformers_dir()
    results: list[dict[str, Any]] = []
    reported: set[tuple[str, int]] = set()
    per_file: dict[Path, tuple[SetOrderSite, ...]] = {}

    def sites(path: Path) -> tuple[SetOrderSite, ...]:
        if path not in per_file:
            per_file[path] = find_sites_in_file(path)
        return per_file[path]

    for row in result.rows:
        if row.verdict not in SEEN:
            continue
        files = row_sources(row, base)
        found = [s for f in files for s in sites(f)]
        for site in found:
            reported.add((site.path, site.line))
            results.append(_seen_result(row, site))
        if not found:
            results.append(_unlocated_result(row))

    rows_by_file: dict[Path, list[ScanRow]] = {}
    for row in result.rows:
        for f in row_sources(row, base):
            rows_by_file.setdefault(f, []).append(row)
    swept = set(covered_files(result.filters, base)) | set(rows_by_file)
    for path in sorted(swept):
        for site in sites(path):
            if (site.path, site.line) not in reported:
                reported.add((site.path, site.line))
                results.append(_latent_result(site, rows_by_file.get(path, [])))

    return {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "fsdpcheck",
                        "version": version or _own_version(),
                        "informationUri": INFO_URI,
                        "rules": [dict(rule) for rule in RULES],
                    }
                },
                "invocations": [
                    {
                        "executionSuccessful": result.exit_code
                        in (ExitCode.CONSISTENT, ExitCode.FINDINGS)
                    }
                ],
                "results": results,
                "properties": {
                    "transformers": result.transformers,
                    "torch": result.torch,
                    "seeds": list(result.seeds),
                    "filters": list(result.filters),
                    "rows": len(result.rows),
                    "filesSwept": len(swept),
                },
            }
        ],
    }


def _location(path: str, line: int, column: int = 1, snippet: str = "") -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": int(line), "startColumn": int(column)}
    if snippet:
        region["snippet"] = {"text": snippet}
    return {
        "physicalLocation": {
            "artifactLocation": {"uri": Path(path).resolve().as_uri()},
            "region": region,
        }
    }


def _site_locations(site: SetOrderSite) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if site.origin_line != site.line:
        related = _location(site.path, site.origin_line)
        related["id"] = 1
        related["message"] = {"text": f"the set is made here ({site.iterable})"}
        extra["relatedLocations"] = [related]
    return {"locations": [_location(site.path, site.line, site.column, site.snippet)], **extra}


def _seen_result(row: ScanRow, site: SetOrderSite) -> dict[str, Any]:
    index = _RULE_OF[row.verdict]
    outcome = "hang" if row.verdict == ScanVerdict.HANG else "corrupt them silently"
    shown = ", ".join(row.tensors[:6]) + (" …" if len(row.tensors) > 6 else "")
    text = (
        f"{row.architecture} ({row.id}): {site.function} iterates {site.iterable} (a set) while "
        f"registering tensors ({site.registers}); the scan saw {len(row.tensors)} tensor(s) "
        f"change order with PYTHONHASHSEED ({shown}), so a loader pairing them by local order "
        f"would {outcome}. Iterate sorted(...) instead."
    )
    return {
        "ruleId": RULES[index]["id"],
        "ruleIndex": index,
        "level": "error",
        "message": {"text": text},
        **_site_locations(site),
        "properties": _row_properties(row),
    }


def _unlocated_result(row: ScanRow) -> dict[str, Any]:
    index = _RULE_OF[row.verdict]
    path, line = class_location(row)
    text = (
        f"{row.architecture} ({row.id}): {len(row.tensors)} tensor(s) change order with "
        f"PYTHONHASHSEED ({', '.join(row.tensors[:6])}) → {row.verdict}; no loop over a set "
        "was found in its modeling source, so this points at the model class."
    )
    out: dict[str, Any] = {
        "ruleId": RULES[index]["id"],
        "ruleIndex": index,
        "level": "error",
        "message": {"text": text},
        "properties": _row_properties(row),
    }
    if path is not None:
        out["locations"] = [_location(path, line)]
    return out


def _latent_result(site: SetOrderSite, rows: Sequence[ScanRow]) -> dict[str, Any]:
    if rows:
        seen = ", ".join(f"{r.id}: {r.label}" for r in rows[:4])
        why = f"the scan built it without seeing a reorder ({seen})"
    else:
        why = "no architecture the scan built uses this file"
    text = (
        f"{site.function} iterates {site.iterable} (a set) while registering tensors "
        f"({site.registers}): latent, {why}. A config that reaches this loop with two or more "
        "elements gives each rank its own tensor order. Iterate sorted(...) instead."
    )
    return {
        "ruleId": RULES[2]["id"],
        "ruleIndex": 2,
        "level": "warning",
        "message": {"text": text},
        **_site_locations(site),
        "properties": {"rows": [r.id for r in rows]},
    }


def _row_properties(row: ScanRow) -> dict[str, Any]:
    return {
        "architecture": row.architecture,
        "modelType": row.model_type,
        "verdict": row.verdict,
        "tensors": list(row.tensors),
        "layerTypes": list(row.layer_types),
    }


# ---------------------------------------------------------------- finding the sources


def _transformers_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _own_version() -> str:
    return package_version("fsdpcheck") or "0"


_SIBLING = re.compile(r"^from \.\.(\w+)\.(modeling_\w+) import", re.MULTILINE)


def row_sources(row: ScanRow, base: Path | None) -> list[Path]:
    """The files that define ``row``'s model: its modeling files, and the sibling modeling
    modules they import from (a model may reuse another's rotary embedding)."""
    if row.family == ScanFamily.PRESET:  # fsdpcheck's own, or a tiny config of a transformers class
        path, _ = class_location(row)
        return [Path(path)] if path else []
    if base is None:
        return []
    folder = base / "models" / row.model_type.replace("-", "_")
    if not folder.is_dir():  # e.g. gemma3_text lives in gemma3: ask transformers (imports it)
        # transformers: only for such a scan row; the other reports never import it
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        folder = base / "models" / model_type_to_module_name(row.model_type)
    files = sorted(folder.glob("modeling_*.py"))
    out = list(files)
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except OSError:
            log.debug("%s unreadable: no sibling modules from it", f, exc_info=True)
            continue
        for package, module in _SIBLING.findall(text):
            sibling = base / "models" / package / f"{module}.py"
            if sibling.is_file() and sibling not in out:
                out.append(sibling)
    return out


def class_location(row: ScanRow) -> tuple[str | None, int]:
    """Where the row's model class is defined: fsdpcheck's fixture read as source, a
    transformers class by importing it (only for the few rows that need it)."""
    own = _class_in_source("fsdpcheck.model.hazard", row.architecture)
    if own is not None:
        return own
    try:  # transformers: only for a scan row's class; the other reports never import it
        import transformers

        cls = getattr(transformers, row.architecture, None)
    except Exception:  # a broken optional import inside transformers: no location
        log.debug("no class %s in transformers", row.architecture, exc_info=True)
        cls = None
    if cls is None:
        return None, 1
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):  # compiled, or defined where no source file is
        log.debug("no source for %s", row.architecture, exc_info=True)
        return None, 1
    return path, line


def _class_in_source(module: str, name: str) -> tuple[str, int] | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return spec.origin, node.lineno
    return None


def covered_files(filters: Iterable[str], base: Path | None) -> list[Path]:
    """The modeling files of every ``transformers/models/<dir>`` matching ``filters`` (case-
    insensitive substring, or glob with ``*?[``; all without filters)."""
    if base is None:
        return []
    patterns = [p.lower() for p in filters]
    out = []
    for folder in sorted((base / "models").iterdir()):
        if not folder.is_dir() or folder.name.startswith("_"):
            continue
        if patterns and not any(_match(folder.name.lower(), p) for p in patterns):
            continue
        out.extend(sorted(folder.glob("modeling_*.py")))
    return out


def _match(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def write_sarif(log: dict[str, Any], path: str | Path) -> None:
    write_text(json.dumps(log, indent=2) + "\n", path)
