"""What rank 0's gather would hold had these records' ranks run together (pure): for
``fsdpcheck diff`` over saved records, and for tests over synthetic ones.

The same selection as :func:`fsdpcheck.distributed.gather.gather_records`: every rank's group
digest, host and value digests; full records only from each group's representative and from the
ranks whose values differ.
"""

from __future__ import annotations

from collections.abc import Mapping

from fsdpcheck.distributed.environment import seed_tag
from fsdpcheck.model.keys import expert_key, value_keys, value_senders
from fsdpcheck.records import Gathered, RankRecord


def built_on_meta(record: RankRecord) -> bool:
    """As the gather flags it: some tensor was on ``meta`` before wrapping."""
    fp = record.pre_wrap
    return fp is not None and any(t.device == "meta" for t in (*fp.buffers, *fp.params))


def gathered_from(records: Mapping[int, RankRecord]) -> Gathered:
    """The :class:`Gathered` of ``records`` (rank → its record), as the gather builds it."""
    digests = {rank: records[rank].group_digest() for rank in sorted(records)}
    reps: dict[str, int] = {}
    for rank, digest in digests.items():
        reps.setdefault(digest, rank)
    keys = value_keys(records)
    extra_senders = value_senders(keys) - set(reps.values())
    return Gathered(
        digests=digests,
        hosts={rank: records[rank].env.host for rank in digests},
        records={rank: records[rank] for rank in reps.values()},
        bytes_sent=0,
        meta_ranks=tuple(rank for rank in digests if built_on_meta(records[rank])),
        value_keys=keys,
        extra={rank: records[rank] for rank in sorted(extra_senders)},
        expert_keys={rank: expert_key(records[rank]) for rank in digests},
        seed_tags={rank: seed_tag(records[rank].env.hash_seed) for rank in digests},
    )
