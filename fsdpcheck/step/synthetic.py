"""``audit --step``: one training step on the audited model, under the same watch: the step a
``--builder`` returned with the model (its own forward, loss and optimizer), else a synthetic one.

The synthetic step: a seeded token batch from the config's vocabulary (the same shape on every
rank, its own tokens on each data-parallel rank: the TP ranks of one data shard split one
batch, so they see the same tokens), the causal-LM loss and AdamW. Rank-dependent code in the
model's forward (a module a config enables on one node only, a stale config's extra layer)
shows here even when the static checks pass."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fsdpcheck.distributed import liveness
from fsdpcheck.distributed.gather import gather_slots
from fsdpcheck.distributed.setup import DistContext
from fsdpcheck.distributed.wire import span
from fsdpcheck.options import TP_DIMS
from fsdpcheck.records import EnvRecord, LoadOutcome, Report, StepRun
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


# Why a rank cannot take the step: the greatest code over the ranks, so every rank takes the same
# branch; each rank's only when one cannot.
_READY, _FAILED, _NO_MODEL, _NOT_LOADED, _NO_WEIGHTS, _NO_STEP = range(6)


def audit_step(
    ctx: DistContext,
    env: EnvRecord,
    built: Any,
    load: LoadOutcome | None,
    report: Report | None,
    *,
    seed: int = 0,
    forget: list[Callable[[], Any]] | None = None,
    abort: liveness.AbortWatch | None = None,
) -> Report | None:
    """Collective: one watched step, its findings merged into rank 0's ``report``, when every
    rank holds weights (the load ran, or nothing was to be loaded and each rank holds its own:
    a builder without a state dict, ``--init all --no-load``) and has a step (the builder's
    own, or a transformers forward for the synthetic one). Otherwise a note on rank 0 naming
    the ranks and why. A peer that stops answering raises, as any failed collective does.
    ``forget``, ``abort``: as :func:`~fsdpcheck.step.session.watched_step`'s."""
    mine = _readiness(built, load, report, rank=ctx.rank)
    if span([mine], ctx.side_channel, size=ctx.world_size).high[0] != _READY:
        # Someone cannot step: rank 0 learns who and why (the others' report is None).
        channel, rank, world = ctx.side_channel, ctx.rank, ctx.world_size
        codes = [s[0] for s in gather_slots(bytes([mine]), channel, rank=rank, world_size=world)]
        if report is None:
            return None
        return replace(report, warnings=(*report.warnings, _why_not(codes, load)))
    step, ran = _step_for(ctx, built, seed=seed)
    try:
        record, seconds = watched_step(ctx, built.model, step, forget=forget, abort=abort)
        outcome = conclude_step(ctx, built.model, env, record, seconds, abort=abort)
    except ChannelLost as exc:  # the audit's own handler names the peer
        raise exc.cause from None
    if report is None or outcome is None:
        return report
    return replace(merged(report, outcome), step=ran)


def _readiness(built: Any, load: LoadOutcome | None, report: Report | None, *, rank: int) -> int:
    if rank == 0 and (report is None or report.errors):  # only rank 0 knows another failed
        return _FAILED
    if built is None:
        return _NO_MODEL
    loaded = load is not None and load.outcome == LoadStatus.LOADED
    if load is not None and load.ran and not loaded:  # refused or partly loaded: every rank knows
        return _NOT_LOADED
    if not loaded and not built.materialised:  # built on meta, or on rank 0 only
        return _NO_WEIGHTS
    if getattr(built, "step", None) is None and not _takes_tokens(built.model):
        return _NO_STEP
    return _READY


def _takes_tokens(model: Any) -> bool:
    """Whether the synthetic step can call ``model(input_ids=, labels=)``."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a C forward: let the step itself say
        return True
    names = {p.name for p in parameters}
    keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return keywords or {"input_ids", "labels"} <= names


def _why_not(codes: list[int], load: LoadOutcome | None) -> str:
    """Rank 0's note: why no rank stepped."""
    loaded = f"the load {load.outcome}: {load.message}" if load is not None else "the load failed"
    reasons = {
        _FAILED: "a rank failed before the step",
        _NO_MODEL: "no model built",
        _NOT_LOADED: loaded,
        _NO_WEIGHTS: "no weights (built on meta or on rank 0 only, and nothing loaded)",
        _NO_STEP: (
            "the model is not called as model(input_ids=, labels=) (not a transformers causal "
            "LM); return its own step from the --builder (docs/cli.md#the-builders-own-step)"
        ),
    }
    parts = []
    for code, reason in reasons.items():
        ranks = [r for r, c in enumerate(codes) if c == code]
        if not ranks:
            continue
        if code in (_FAILED, _NOT_LOADED):
            parts.append(reason)
        else:
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {_listed(ranks)}: {reason}")
    return f"--step: no step ({'; '.join(parts)})"


def _listed(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _step_for(ctx: DistContext, built: Any, *, seed: int) -> tuple[Callable[[], Any], StepRun]:
    """The builder's own step (on its batch, where it gave one), else the synthetic step; and
    which of them, for the report."""
    own = getattr(built, "step", None)
    if own is not None:
        batch = built.batch
        if batch is None:
            return own, StepRun("builder", "the builder's own step, called with no argument")
        ran = StepRun("builder", "the builder's own step, on the batch it returned")
        return (lambda: own(batch)), ran
    vocab = getattr(built.config, "vocab_size", None) or 2
    batch_at = batch_index(ctx.mesh, ctx.rank)
    step = token_step(built.model, int(vocab), rank=batch_at, device=ctx.device, seed=seed)
    said = (
        f"fsdpcheck's synthetic step: {BATCH}x{SEQUENCE} random tokens per data-parallel rank "
        f"(vocabulary {int(vocab)}), labels = inputs (causal-LM loss), backward, one AdamW step "
        "(lr 1e-5)"
    )
    return step, StepRun("synthetic", said, seed=seed)
