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
