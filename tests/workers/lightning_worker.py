"""A real Lightning Trainer on 2 CPU ranks (gloo; ranks started by the test's launcher) with
FsdpcheckCallback: for the clean and the planted tiny Llama, one fit with ``on_failure="warn"``,
then one with "raise", first under ``strategy="ddp"``, then under ``ModelParallelStrategy``
(FSDP2: the module shards itself in ``configure_model`` on Lightning's mesh), there with
``check_first_step=True`` as well; then one sharded fit saves a distributed checkpoint and two
resume from it (``resumes``). Under DDP one fit saves a ``.ckpt`` file and one resumes from it
(``ddp_resume``)."""

import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from hooked import Tokens, outcome, rank, tiny_llama, twins, write
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


class Resumed(Sharded):
    """The clean model plus a one-value buffer ``model.scale``: ``skewed``, it holds the rank
    until a checkpoint restores it (0 on every rank), which only a persistent one is."""

    def __init__(self, skewed: bool, persistent: bool):
        super().__init__(planted=False)
        value = float(rank()) if skewed else 0.0
        self.model.model.register_buffer("scale", torch.tensor([value]), persistent=persistent)
        self.checked_before_validation: list[bool] = []

    def validation_step(self, batch, batch_idx):
        """The sanity check's forward: the deferred check must have run before it."""
        (callback,) = [c for c in self.trainer.callbacks if isinstance(c, FsdpcheckCallback)]
        self.checked_before_validation.append(callback.result is not None)
        return self.model(**batch).loss


def fit(
    module,
    on_failure: str,
    json_path: Path | None,
    *,
    fsdp2: bool = False,
    save_to: Path | None = None,
    **kwargs,
):
    callback = FsdpcheckCallback(
        on_failure=on_failure,
        timeout=30,
        json_path=json_path,
        attribute="model",
        check_first_step=fsdp2,
        step_json_path=json_path.with_suffix(".step.json") if fsdp2 and json_path else None,
    )
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else "ddp"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=kwargs.pop("max_steps", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)

    def run():
        trainer.fit(module, loader, **kwargs)
        if save_to is not None:
            trainer.save_checkpoint(save_to)  # a distributed checkpoint: one folder
        if not fsdp2:
            return trainer.global_step
        return {
            "global_step": trainer.global_step,
            "step_exit": callback.step_result.exit_code,
            "scale": module.model.model.scale.item() if isinstance(module, Resumed) else None,
            "validated": getattr(module, "checked_before_validation", None),
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


def resumes() -> dict:
    """A resume under ModelParallelStrategy, which loads ``ckpt_path`` after on_fit_start: the
    check must see the model as loaded. ``persistent``: the checkpoint restores the skewed
    buffer, the ranks agree (checked at on_fit_start, it would be a false alarm);
    ``non-persistent``: no checkpoint holds it, and the ranks still differ. The hook forwards
    ``trainer.ckpt_path``: ``persistent`` is its clean twin, and in ``node-local`` the path
    every rank loads (the strategy broadcasts rank 0's, ``ckpt``) is a node-local link, to
    step 1 on rank 0's "node" and to step 2 (which ``persistent`` saved) on rank 1's: the
    ranks really resume different saves, a ``checkpoint`` finding on rank 1 ("raise": before
    any step, which would wait on a rank that has one step less to go)."""
    checkpoint, later = out / "fsdp2-step=1", out / "fsdp2-step=2"
    saved = Resumed(skewed=False, persistent=True)
    # Not a resume, with a validation loader: the check runs at on_sanity_check_start.
    val = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    run = fit(saved, "raise", None, fsdp2=True, save_to=checkpoint, val_dataloaders=val)
    outcome_of = {"saved": outcome(run)}
    for name, persistent in (("persistent", True), ("non-persistent", False)):
        module = Resumed(skewed=True, persistent=persistent)
        json_path = out / f"resumed-{name}.json"
        save_to = later if persistent else None
        run = fit(
            module,
            "warn",
            json_path,
            fsdp2=True,
            max_steps=2,
            ckpt_path=checkpoint,
            save_to=save_to,
        )
        outcome_of[name] = outcome(run)
    node = out / f"node{rank()}"  # this rank's "node": its own directory, its own link
    node.mkdir()
    (node / "ckpt").symlink_to(later if rank() == 1 else checkpoint)
    here = Path.cwd()
    os.chdir(node)
    try:
        module = Resumed(skewed=False, persistent=True)
        json_path = out / "resumed-node-local.json"
        run = fit(module, "raise", json_path, fsdp2=True, max_steps=3, ckpt_path="ckpt")
        outcome_of["node-local"] = outcome(run)
    finally:
        os.chdir(here)
    return outcome_of


def ddp_resume() -> dict:
    """Under DDP every rank loads its own ``ckpt_path``, a ``.ckpt`` file (torch.save): the
    hook forwards it, and a single-file checkpoint every rank resumed is consistent."""
    saved = out / "ddp-step=1.ckpt"
    outcome(fit(Module(planted=False), "raise", None, save_to=saved))
    return outcome(
        fit(Module(planted=False), "warn", out / "resumed-ddp.json", ckpt_path=saved, max_steps=2)
    )


record = twins(out, hooked)
record["ddp-resumed"] = ddp_resume()
record["fsdp2"] = twins(out, hooked_fsdp2, prefix="fsdp2-")
record["resumed"] = resumes()
write(out, record)
print("done")
