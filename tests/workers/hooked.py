"""What the framework-hook workers share: a tiny Llama with the upstream bug planted in it, a
token dataset, and how a rank reports what the hook did (``rank<N>.json``)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def tiny_llama(planted: bool = True) -> LlamaForCausalLM:
    """A 1-layer Llama. ``planted``: its rotary module also registers one buffer per attention
    type while iterating a set of type names, as transformers 5.0-5.15 did, so the order follows
    PYTHONHASHSEED. Sizes differ per type (16 vs 8) but the total does not, so DDP's coalesced
    start-up broadcast goes through and scrambles them without an error. Not planted: the clean
    twin, the same on every rank whatever the hash seed."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    if not planted:
        return model
    dims = {"sliding_attention": 16, "full_attention": 8}
    for layer_type in set(dims):
        inv_freq = 1.0 / (1e4 ** (torch.arange(dims[layer_type]) / dims[layer_type]))
        model.model.rotary_emb.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)
    return model


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 8) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


VARIANTS = {"clean": False, "planted": True}  # each launch runs both twins, clean first


def rank() -> int:
    return int(os.environ["RANK"])


def outcome(run) -> dict:
    """Run ``run()``; say what it returned, what it raised (message, exit code), what it warned."""
    from fsdpcheck.integrations.common import FsdpcheckWarning, ModelCheckFailed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FsdpcheckWarning)
        try:
            returned = run()
            raised = None
        except ModelCheckFailed as exc:
            returned, raised = None, {"message": str(exc), "exit_code": exc.exit_code}
    warned = [str(w.message) for w in caught if issubclass(w.category, FsdpcheckWarning)]
    return {"returned": returned, "raised": raised, "warned": warned}


def write(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank()}.json").write_text(json.dumps(record))


def run_twins(
    out: Path,
    hooked: Callable[[bool], Callable[[str, Path], Callable[[], Any]]],
    record: dict | None = None,
) -> None:
    """For each twin (clean first): ``hooked(planted)`` sets it up once and returns how to run
    it with the hook in a given ``on_failure`` mode; both modes run, and this rank's record is
    written."""
    record = {} if record is None else record
    record.update(twins(out, hooked))
    write(out, record)
    print(f"rank {rank()} done")


def twins(
    out: Path,
    hooked: Callable[[bool], Callable[[str, Path], Callable[[], Any]]],
    prefix: str = "",
) -> dict:
    """What :func:`run_twins` records, without writing it: ``{variant: {mode: outcome}}``; rank
    0's reports go to ``<prefix><variant>-<mode>.json``."""
    record = {}
    for variant, planted in VARIANTS.items():
        run_with = hooked(planted)
        record[variant] = {
            mode: outcome(run_with(mode, out / f"{prefix}{variant}-{mode}.json"))
            for mode in ("warn", "raise")
        }
    return record
