"""What a ``--builder`` may return: the model, ``(model, state_dict)``, or a mapping / object
with ``model``, ``state_dict``, ``step`` and ``batch`` (the step ``--step`` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdpcheck.errors import InputError
from fsdpcheck.model.builder import BuildContext, call_builder

SOURCE = """
import types
import torch

def _step():
    return torch.tensor(1.0)

def plain(ctx):
    return torch.nn.Linear(2, 2)

def pair(ctx):
    model = torch.nn.Linear(2, 2)
    return model, model.state_dict()

def mapping(ctx):
    return {"model": torch.nn.Linear(2, 2), "step": _step, "batch": [1], "optimizer": None}

def namespace(ctx):
    return types.SimpleNamespace(model=torch.nn.Linear(2, 2), step=_step)

def bad_step(ctx):
    return {"model": torch.nn.Linear(2, 2), "step": 3}
"""


@pytest.fixture
def builders(tmp_path: Path) -> Path:
    path = tmp_path / "answers.py"
    path.write_text(SOURCE)
    return path


def _call(path: Path, name: str):
    return call_builder(f"{path}:{name}", BuildContext(0, 1, 0, torch.device("cpu")))


def test_the_earlier_forms_still_work(builders: Path) -> None:
    built = _call(builders, "plain")
    assert isinstance(built.model, torch.nn.Linear) and built.step is None
    built = _call(builders, "pair")
    assert set(built.state_dict) == {"weight", "bias"} and built.step is None


def test_a_mapping_or_object_carries_the_step_and_its_batch(builders: Path) -> None:
    built = _call(builders, "mapping")  # a key fsdpcheck does not read is left alone
    assert built.step() == 1.0 and built.batch == [1] and built.state_dict is None
    built = _call(builders, "namespace")
    assert isinstance(built.model, torch.nn.Linear) and built.step() == 1.0


def test_a_step_that_is_not_callable_is_bad_input_naming_rank_and_fix(builders: Path) -> None:
    with pytest.raises(InputError) as raised:
        _call(builders, "bad_step")
    message = str(raised.value)
    assert message.startswith("rank 0: --builder ")
    assert "its step is a int, not callable" in message
    assert "leave 'step' out for the synthetic transformers step" in message
