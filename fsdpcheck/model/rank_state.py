"""A rank's state beyond its tensors, added to its record: the live FSDP2 plan, the canonical
config and the tensors it holds on a device its job cannot use. Used by the audit,
``check_model`` and ``save_fingerprint``, on the rank itself."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fsdpcheck.checks.flags import misplaced
from fsdpcheck.model.config_record import config_record
from fsdpcheck.model.fsdp_plan import fsdp_plan
from fsdpcheck.records import RankRecord


def with_state(record: RankRecord, model: Any, config: Any) -> RankRecord:
    """``record`` with ``fsdp_plan``, ``config`` and ``misplaced`` filled in.

    None of them may fail a rank: each reads only what is there (a plan that torch does not
    expose says so inside the record) and is left out when it cannot be read. A record that
    already carries an error is returned as it is: its digest is the error's."""
    if record.error is not None:
        return record
    try:
        record = replace(record, fsdp_plan=fsdp_plan(model))
    except Exception:  # fsdp_plan catches its own; this is the last line of defence
        pass
    try:
        record = replace(record, config=config_record(config))
    except Exception:  # a config without a usable dict form: nothing to compare
        pass
    return replace(record, misplaced=misplaced(record))
