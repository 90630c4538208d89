"""A real Lightning Trainer on 2 CPU ranks (strategy="ddp", gloo) with
``FsdpcheckCallback(check_first_step=True, on_failure="warn")``: a fit whose batches carry
labels, then one where rank 1's labels are all -100 (a NaN loss on rank 1 only)."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from hooked import Tokens, outcome, tiny_llama, write

from fsdpcheck.integrations.lightning import FsdpcheckCallback

out = Path(sys.argv[1])


class Module(pl.LightningModule):
    def __init__(self, ignored: bool):
        super().__init__()
        self.model = tiny_llama(planted=False)
        self.ignored = ignored

    def training_step(self, batch, batch_idx):
        if self.ignored and self.global_rank == 1:
            batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit(variant: str):
    callback = FsdpcheckCallback(
        on_failure="warn",
        timeout=30,
        attribute="model",
        check_first_step=True,
        step_json_path=out / f"{variant}-step.json",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = Module(ignored=variant == "ignored")
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)

    def run():
        trainer.fit(module, loader)
        step = callback.step_result
        return {"global_step": trainer.global_step, "step_exit": step.exit_code}

    return outcome(run)


write(out, {variant: fit(variant) for variant in ("labels", "ignored")})
print("done")
