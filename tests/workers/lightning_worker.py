"""A real Lightning Trainer on 2 CPU ranks (gloo; ranks started by the test's launcher) with
FsdpcheckCallback: for the clean and the planted tiny Llama, one fit with ``on_failure="warn"``,
then one with "raise", first under ``strategy="ddp"``, then under ``ModelParallelStrategy``
(FSDP2: the module shards itself in ``configure_model`` on Lightning's mesh), there with
``check_first_step=True`` as well."""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from hooked import Tokens, tiny_llama, twins, write
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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


class Sharded(Module):
    """The ModelParallelStrategy recipe: each decoder layer, then the root, on the mesh's data
    dimension. A fresh module per fit, so ``configure_model`` shards it once."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fit(module, on_failure: str, json_path: Path, *, fsdp2: bool = False):
    callback = FsdpcheckCallback(
        on_failure=on_failure,
        timeout=30,
        json_path=json_path,
        attribute="model",
        check_first_step=fsdp2,
        step_json_path=json_path.with_suffix(".step.json") if fsdp2 else None,
    )
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else "ddp"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
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
        if not fsdp2:
            return trainer.global_step
        return {
            "global_step": trainer.global_step,
            "step_exit": callback.step_result.exit_code,
            # what the hook saw at on_fit_start: the model configure_model sharded
            "model_class": type(module.model).__name__,
            "dtensor_params": all(isinstance(p, DTensor) for p in module.model.parameters()),
        }

    return run


def hooked(planted: bool):
    module = Module(planted)
    return lambda mode, json_path: fit(module, mode, json_path)


def hooked_fsdp2(planted: bool):
    return lambda mode, json_path: fit(Sharded(planted), mode, json_path, fsdp2=True)


record = twins(out, hooked)
record["fsdp2"] = twins(out, hooked_fsdp2, prefix="fsdp2-")
write(out, record)
print("done")
