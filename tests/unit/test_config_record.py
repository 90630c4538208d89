"""Config records hold no memory address (issue 30): a mutation test over real configs, a
torchtitan-style dataclass config holding functions, partials, a class and lambdas
(tests/real_configs.py), and transformers' LlamaConfig and Gemma3 text config. Two builds, one
of them in another process (other addresses), digest equal; each single real change (an int, a
float, a string, a nested field, another function) is still found, and named by the config
check."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F
from real_configs import BUILDERS, titan
from synthetic import state_record, tensor
from torch import nn

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.model.config_record import config_record
from fsdpcheck.records import RankRecord
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import FindingKind, Verdict

TESTS = Path(__file__).resolve().parents[1]


def _nested(config, path: str, value: Any):
    """``config`` with the field at ``path`` (``attention.rope.theta``) set to ``value``."""
    *parents, last = path.split(".")
    target = config
    for name in parents:
        target = getattr(target, name) if not isinstance(target, dict) else target[name]
    if isinstance(target, dict):
        target[last] = value
    else:
        setattr(target, last, value)
    return config


def _other_lambda(layer_id: int) -> float:
    return 0.02 / (layer_id + 1)


MUTATIONS = {
    "titan": [
        ("int", "dim", 96),
        ("float", "norm_eps", 1e-6),
        ("string", "name", "llama3-8b"),
        ("nested float", "attention.rope.theta", 10000.0),
        ("nested tuple", "attention.rope.factors", (8.0, 1.0, 2.0)),
        ("another function", "activation", F.gelu),
        ("another class", "norm_cls", nn.LayerNorm),
        ("another partial", "param_init", functools.partial(nn.init.normal_, std=0.02)),
        ("a partial's keyword", "param_init", functools.partial(nn.init.trunc_normal_, std=0.01)),
        ("nested partial", "attention.param_init", functools.partial(nn.init.normal_, std=0.1)),
        ("a module function", "output_init", nn.init.zeros_),
        ("another lambda body", "depth_init", lambda layer_id: 0.02 / (layer_id + 1)),
        ("a named function for a lambda", "depth_init", _other_lambda),
        ("a function in a container", "layer_hooks.post", [F.relu]),
    ],
    "llama": [
        ("int", "hidden_size", 32),
        ("float", "rms_norm_eps", 1e-5),
        ("string", "hidden_act", "gelu"),
        ("nested", "rope_parameters.rope_theta", 500000.0),
    ],
    "gemma3": [
        ("int", "sliding_window", 512),
        ("float", "final_logit_softcapping", 25.0),
        ("list", "layer_types", ["sliding_attention", "full_attention"]),
        ("nested", "rope_parameters.sliding_attention.rope_theta", 20000.0),
    ],
}
CASES = [(name, *m) for name, ms in MUTATIONS.items() for m in ms]


def _report(a, b):
    records: dict[int, RankRecord] = {
        rank: replace(state_record(rank, pre=([], [tensor("w", (4,))])), config=config_record(c))
        for rank, c in enumerate((a, b))
    }
    return assemble(AuditOutcome(gathered_from(records)), None)


@pytest.mark.parametrize("name", BUILDERS)
def test_two_builds_digest_equal_and_hold_no_address(name: str) -> None:
    a, b = BUILDERS[name](), BUILDERS[name]()  # fresh lambdas and partials: other addresses
    ra, rb = config_record(a), config_record(b)
    assert ra == rb
    assert "0x" not in json.dumps(ra.canonical)
    report = _report(a, b)
    assert report.verdict == Verdict.CONSISTENT, [f.summary for f in report.findings]


def test_builds_in_another_process_digest_equal() -> None:
    """Every other process has other addresses (and another hash seed): the digests agree."""
    code = (
        "import json;"
        "from real_configs import BUILDERS;"
        "from fsdpcheck.model.config_record import config_record;"
        "print(json.dumps({n: config_record(b()).digest for n, b in BUILDERS.items()}))"
    )
    there = {}
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={
                "PYTHONPATH": str(TESTS),
                "PYTHONHASHSEED": seed,
                "TRANSFORMERS_VERBOSITY": "error",
            },
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        there[seed] = json.loads(done.stdout.strip().splitlines()[-1])
    here = {n: config_record(b()).digest for n, b in BUILDERS.items()}
    assert there["1"] == there["2"] == here


@pytest.mark.parametrize(
    ("name", "what", "path", "value"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_each_real_change_is_still_found(name: str, what: str, path: str, value: Any) -> None:
    base = BUILDERS[name]()
    changed = _nested(BUILDERS[name](), path, value)
    assert config_record(base).digest != config_record(changed).digest, what
    report = _report(base, changed)
    [finding] = [f for f in report.findings if f.kind == FindingKind.CONFIG]
    assert finding.ranks == (1,) and report.verdict == Verdict.INCONSISTENT
    top = path.split(".")[0]
    assert top in finding.summary, finding.summary


def test_callables_are_recorded_by_qualified_name() -> None:
    canonical = config_record(titan()).canonical
    assert canonical["activation"] == "torch.nn.functional.silu"
    assert canonical["norm_cls"] == "torch.nn.modules.normalization.RMSNorm"
    assert canonical["output_init"] == "real_configs.init_output"
    assert canonical["param_init"] == {
        "partial": "torch.nn.init.trunc_normal_",
        "args": [],
        "keywords": {"mean": 0.0, "std": 0.02},
    }
    assert canonical["depth_init"].startswith("real_configs.ModelArgs.<lambda>.<locals>.<lambda>#")
    assert canonical["attention"]["__class__"] == "real_configs.AttentionConfig"
    assert canonical["layer_hooks"]["cast"] == "torch.bfloat16"


def test_an_object_without_a_stable_value_is_recorded_by_its_type() -> None:
    class Opaque:
        pass

    record = config_record({"hook": Opaque(), "note": "made at <object at 0x7f3a1c2b4d60>"})
    assert record.canonical == {
        "hook": f"<{Opaque.__module__}.{Opaque.__qualname__}>",
        "note": "made at <object at 0x<address>>",
    }
    assert record == config_record({"hook": Opaque(), "note": "made at <object at 0x7f00aa00bb00>"})
