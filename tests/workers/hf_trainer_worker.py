"""A real HF Trainer on 2 CPU ranks (DDP over gloo) with FsdpcheckCallback: one step with
``on_failure="warn"``, then a second Trainer with ``"raise"``."""

import sys
from pathlib import Path

import torch.distributed as dist
from hooked import Tokens, outcome, rank, tiny_llama, write
from transformers import Trainer, TrainingArguments

from fsdpcheck.integrations.hf import FsdpcheckCallback

out = Path(sys.argv[1])
model = tiny_llama()


def train(on_failure: str, json_name: str):
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = FsdpcheckCallback(on_failure=on_failure, timeout=30, json_path=out / json_name)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    return lambda: trainer.train().global_step


record = {
    "warn": outcome(train("warn", "warn.json")),
    "raise": outcome(train("raise", "raise.json")),
}
record["world_size"] = dist.get_world_size()
write(out, record)
print(f"rank {rank()} done")
