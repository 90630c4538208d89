"""Records and their vocabulary: every field typed with an Enum holds the member after a JSON
round trip, and the JSON text is the plain values, as it was before the fields were typed."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, Literal

import pytest

from fsdpcheck import records
from fsdpcheck.records import from_dict, to_dict

RECORDS = [
    cls
    for cls in vars(records).values()
    if isinstance(cls, type)
    and dataclasses.is_dataclass(cls)
    and cls.__module__ == records.__name__
]


def _words(hint: Any) -> list[type[Enum]]:
    """The Enums a field's type names, at any depth (``X | None``, ``tuple[X, ...]``)."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return [hint]
    return [word for arg in typing.get_args(hint) for word in _words(arg)]


def _word_fields(cls: type) -> dict[str, type[Enum]]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: _words(hints[f.name])[0] for f in dataclasses.fields(cls) if _words(hints[f.name])
    }


WORDED = [cls for cls in RECORDS if _word_fields(cls)]


def _sample(hint: Any, *, plain: bool) -> Any:
    """A value of type ``hint``; a word as its member, or (``plain``) as its bare string."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        member = list(hint)[-1]  # not the first: a default must not hide a lost conversion
        return member.value if plain else member
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(
            **{f.name: _sample(hints[f.name], plain=plain) for f in dataclasses.fields(hint)}
        )
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), plain=plain)
    if origin is Literal:
        return args[0]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (_sample(args[0], plain=plain),)
        return tuple(_sample(a, plain=plain) for a in args)
    if origin in (dict, Mapping):
        key, value = args
        return {_sample(key, plain=True): _sample(value, plain=plain)}
    return {bool: True, int: 3, float: 1.5, str: "x", typing.Any: "any"}[hint]


def test_the_records_with_words_are_found() -> None:
    names = {cls.__name__ for cls in WORDED}
    assert {"Report", "Finding", "RankError", "Fingerprint", "LoaderPrediction"} <= names


@pytest.mark.parametrize("cls", WORDED, ids=lambda cls: cls.__name__)
def test_a_json_round_trip_gives_back_the_members_and_the_same_text(cls: type) -> None:
    record = _sample(cls, plain=False)
    text = json.dumps(to_dict(record), sort_keys=True)
    back = from_dict(cls, json.loads(text))
    assert back == record
    for name, word in _word_fields(cls).items():
        assert type(getattr(back, name)) is word, name
    # The JSON is the plain strings, exactly as when the fields held them.
    assert text == json.dumps(to_dict(_sample(cls, plain=True)), sort_keys=True)


def test_a_word_this_version_does_not_know_is_refused() -> None:
    error = to_dict(_sample(records.RankError, plain=True))
    with pytest.raises(ValueError):
        from_dict(records.RankError, {**error, "stage": "warp-drive"})


def test_a_load_that_did_not_run_keeps_its_empty_method() -> None:
    outcome = records.LoadOutcome(False, "skipped")
    back = from_dict(records.LoadOutcome, json.loads(json.dumps(to_dict(outcome))))
    assert back.method == "" and back.outcome is records.LoadStatus.SKIPPED


def test_a_finding_about_a_kind_with_a_usual_context_takes_it_and_its_json_is_the_records() -> None:
    found = records.Finding.about(records.FindingKind.CONFIG, [2, 1], 0, "config differs")
    assert (found.snapshot, found.cause) == (
        records.Snapshot.PRE_WRAP,
        records.Cause.CONSTRUCTION_TIME,
    )
    assert found.ranks == (2, 1) and found.details == {} and found.tensors == ()
    told = records.Finding.about(
        records.FindingKind.OPTIMIZER, (1,), 0, "x", snapshot=records.Snapshot.POST_WRAP
    )
    assert (told.snapshot, told.cause) == (records.Snapshot.POST_WRAP, records.Cause.LOADING)
    back = from_dict(records.Finding, json.loads(json.dumps(to_dict(found))))
    assert back == found


def test_a_finding_of_a_kind_without_a_usual_context_must_say_it() -> None:
    with pytest.raises(ValueError, match="device"):
        records.Finding.about(records.FindingKind.DEVICE, (1,), 0, "on meta")
    with pytest.raises(ValueError, match="uninitialized"):
        records.Finding.about(records.FindingKind.UNINITIALIZED, (1,), 0, "garbage")
