"""A real Lightning Trainer on 2 CPU ranks (strategy="ddp", gloo; ranks started by the test's
launcher) with FsdpcheckCallback: for the clean and the planted tiny Llama, one fit with
``on_failure="warn"``, then one with "raise"."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from hooked import Tokens, run_twins, tiny_llama

from fsdpcheck.integrations.lightning import FsdpcheckCallback

out = Path(sys.argv[1])


class Module(pl.LightningModule):
    def __init__(self, planted: bool):
        super().__init__()
        self.model = tiny_llama(planted)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(module, on_failure: str, json_path: Path):
    callback = FsdpcheckCallback(
        on_failure=on_failure, timeout=30, json_path=json_path, attribute="model"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)

    def run():
        trainer.fit(module, loader)
        return trainer.global_step

    return run


def hooked(planted: bool):
    module = Module(planted)
    return lambda mode, json_path: fit(module, mode, json_path)


run_twins(out, hooked)
