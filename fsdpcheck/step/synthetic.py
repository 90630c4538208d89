"""``audit --step``: one synthetic training step on the audited model, under the same watch.

A seeded token batch from the config's vocabulary (the same shape on every rank, its own
tokens on each data-parallel rank: the TP ranks of one data shard split one batch, so they see
the same tokens), the causal-LM loss and AdamW. Rank-dependent code in the model's forward (a
module a config enables on one node only, a stale config's extra layer) shows here even when
the static checks pass."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.options import TP_DIMS
from fsdpcheck.records import EnvRecord, LoadOutcome, Report
from fsdpcheck.step.session import conclude_step, merged, watched_step
from fsdpcheck.step.watch import ChannelLost
from fsdpcheck.vocab import LoadStatus

log = logging.getLogger(__name__)

BATCH, SEQUENCE = 2, 16


def batch_index(mesh: Any, rank: int) -> int:
    """Which batch ``rank`` draws: its index along the mesh's data dims, leaving out the dims
    whose ranks split one batch (tensor parallel); ``rank`` where the mesh has none of them.
    Drawing by global rank fed each TP rank other tokens, so what tensor parallelism keeps
    whole (norms, embeddings) drifted apart across TP ranks in the step itself."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    coordinate = mesh.get_coordinate() if mesh is not None else None
    if not any(n in TP_DIMS for n in names) or coordinate is None:
        return rank
    index = 0
    for size, place, name in zip(mesh.mesh.shape, coordinate, names, strict=True):
        if name not in TP_DIMS:
            index = index * int(size) + int(place)
    return index


def token_step(model: Any, vocab_size: int, *, rank: int, device: Any, seed: int = 0):
    """A zero-argument step: forward with ``labels=input_ids``, backward, one AdamW step.
    ``rank``: the batch to draw (:func:`batch_index`)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    ids = torch.randint(0, vocab_size, (BATCH, SEQUENCE), generator=generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> Any:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def audit_step(
    ctx: DistContext,
    env: EnvRecord,
    built: Any,
    load: LoadOutcome | None,
    report: Report | None,
    *,
    seed: int = 0,
) -> Report | None:
    """Collective: the synthetic step, when the load ran (weights on every rank: every rank
    knows ``load``); its findings merged into rank 0's ``report``. Otherwise a note on rank 0.
    A peer that stops answering raises, as any failed collective of the audit does."""
    loaded = load is not None and load.outcome == LoadStatus.LOADED and built is not None
    if not loaded:
        why = load.message or str(load.outcome) if load is not None else "the load did not run"
        note = f"--step: no step without weights on every rank ({why})"
        return replace(report, warnings=(*report.warnings, note)) if report is not None else None
    vocab = getattr(built.config, "vocab_size", None) or 2
    batch = batch_index(ctx.mesh, ctx.rank)
    step = token_step(built.model, int(vocab), rank=batch, device=ctx.device, seed=seed)
    try:
        record, seconds = watched_step(ctx, built.model, step)
        outcome = conclude_step(ctx, built.model, env, record, seconds)
    except ChannelLost as exc:  # the audit's own handler names the peer
        raise exc.cause from None
    if report is None or outcome is None:
        return report
    return merged(report, outcome)
