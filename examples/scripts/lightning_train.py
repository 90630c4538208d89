"""A Lightning FSDP2 script: ``ModelParallelStrategy``, the module built on ``meta`` and sharded
in ``configure_model``; Lightning materialises it (``to_empty``, then every submodule's
``reset_parameters``) and trains.

It knows nothing of fsdpcheck:

    torchrun --nproc-per-node 2 examples/scripts/lightning_train.py
    torchrun --nproc-per-node 2 -m fsdpcheck run examples/scripts/lightning_train.py

The model's ``RMSNorm`` keeps its own weight: Lightning can only initialise it after
``to_empty`` because it defines ``reset_parameters``.
"""

import argparse
import json
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LanguageModel(pl.LightningModule):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        self.vocab, self.dim, self.n_layers = vocab, dim, layers
        self.losses = []

    def configure_model(self):
        with torch.device("meta"):  # Lightning materialises it after sharding
            self.embed = nn.Embedding(self.vocab, self.dim)
            self.blocks = nn.ModuleList(Block(self.dim) for _ in range(self.n_layers))
            self.norm = RMSNorm(self.dim)
            self.head = nn.Linear(self.dim, self.vocab, bias=False)
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    data = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(3))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LanguageModel()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"losses{trainer.global_rank}.json"), "w") as f:
            json.dump(model.losses, f)


if __name__ == "__main__":
    main()
