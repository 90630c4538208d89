"""A real HF Trainer on 2 CPU ranks (DDP over gloo) with FsdpcheckCallback: for the clean and
the planted tiny Llama, one step with ``on_failure="warn"``, then a Trainer with "raise"."""

import sys
from pathlib import Path

from hooked import Tokens, run_twins, tiny_llama
from transformers import Trainer, TrainingArguments

from fsdpcheck.integrations.hf import FsdpcheckCallback

out = Path(sys.argv[1])


def train(model, on_failure: str, json_path: Path):
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
    callback = FsdpcheckCallback(on_failure=on_failure, timeout=30, json_path=json_path)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    return lambda: trainer.train().global_step


def hooked(planted: bool):
    model = tiny_llama(planted)
    return lambda mode, json_path: train(model, mode, json_path)


run_twins(out, hooked)
