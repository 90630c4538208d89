"""Building blocks for synthetic fingerprints: the hazard model's tensor names and a factory."""

from __future__ import annotations

from fsdpcheck.records import TensorRecord

FULL = "model.rotary_emb.full_attention_inv_freq"
SLIDING = "model.rotary_emb.sliding_attention_inv_freq"
SCALE = "model.layers.0.attn.scale"
EMBED = "model.embed_tokens.weight"
Q_PROJ = "model.layers.0.attn.q_proj.weight"
K_PROJ = "model.layers.0.attn.k_proj.weight"


def tensor(name, shape, dtype="float32", persistent=None, placements=None, device="cpu"):
    return TensorRecord(
        name=name,
        shape=tuple(shape),
        dtype=dtype,
        device=device,
        persistent=persistent,
        placements=placements,
    )


def env(rank, world_size=2):
    from fsdpcheck.records import EnvRecord

    return EnvRecord(rank, rank, world_size, "host", "gloo", "3.11", "2.13", "5.24", "0")


def valued(name, digest, head=(), *, placements=None, shape=(4,), persistent=None):
    """A materialised tensor: its value digest and first values."""
    from dataclasses import replace

    t = tensor(name, shape, persistent=persistent, placements=placements)
    return replace(t, digest=digest, head=tuple(head))


def state_record(rank, *, pre=None, post=None, ties=(), uninitialized=(), shard_key=None):
    """A rank's record: ``pre``/``post`` are (buffers, params) of TensorRecords, or None."""
    from fsdpcheck.records import Fingerprint, RankRecord

    def fp(stage, tensors):
        return None if tensors is None else Fingerprint(stage, tuple(tensors[0]), tuple(tensors[1]))

    return RankRecord(
        env=env(rank),
        pre_wrap=fp("pre-wrap", pre),
        post_wrap=fp("post-wrap", post),
        ties=tuple(ties),
        uninitialized=tuple(uninitialized),
        shard_key=shard_key,
    )


def analyse(groups, records):
    """Every check the report runs over one gather of these groups' representatives."""
    from fsdpcheck.checks.catalogue import Evidence, run_checks
    from fsdpcheck.records import Gathered

    digests = {r: g.digest for g in groups for r in g.ranks}
    return run_checks(Evidence(Gathered(digests, {}, dict(records), bytes_sent=0)))
