"""A real HF Trainer on 2 CPU ranks (DDP over gloo). ``FsdpcheckCallback``: for the clean and
the planted tiny Llama, one step with ``on_failure="warn"``, then a Trainer with "raise".
``watch_first_step``: two steps of the clean Llama ("warn": the first watched, the second
plain; it saves ``checkpoint-1`` and ``checkpoint-2``), then one where rank 1's first
``compute_loss`` issues an extra ``all_reduce`` ("raise"). Resumes from those saves, the hook
forwarding ``args.resume_from_checkpoint``: ``resumed`` (every rank from checkpoint-1) and
``resumed-stale`` (rank 1 from checkpoint-2: "raise", before any step, which would wait on a
rank that has one step less to go)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hooked import Tokens, outcome, rank, run_twins, tiny_llama
from transformers import Trainer, TrainingArguments

from fsdpcheck.integrations.hf import FsdpcheckCallback, watch_first_step

out = Path(sys.argv[1])


def arguments(max_steps: int = 1, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy=kwargs.pop("save_strategy", "no"),
        **kwargs,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train(model, on_failure: str, json_path: Path):
    callback = FsdpcheckCallback(on_failure=on_failure, timeout=30, json_path=json_path)
    trainer = Trainer(model=model, args=arguments(), train_dataset=Tokens(), callbacks=[callback])
    return lambda: trainer.train().global_step


def hooked(planted: bool):
    model = tiny_llama(planted)
    return lambda mode, json_path: train(model, mode, json_path)


class ExtraCollective(Trainer):
    """Rank 1's first loss is all-reduced (a metric only one rank syncs): a collective rank 0
    never issues."""

    extra = True

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.extra and rank() == 1:
            self.extra = False
            dist.all_reduce(torch.ones(1))
        return super().compute_loss(model, inputs, *args, **kwargs)


def first_step(variant: str) -> dict:
    trainer_class, max_steps, mode = {
        "step-clean": (Trainer, 2, "warn"),
        "step-extra": (ExtraCollective, 1, "raise"),
    }[variant]
    # The clean run saves every step: the checkpoints the resumes below start from.
    saving = {"save_strategy": "steps", "save_steps": 1} if variant == "step-clean" else {}
    trainer = trainer_class(
        model=tiny_llama(planted=False), args=arguments(max_steps, **saving), train_dataset=Tokens()
    )
    watch = watch_first_step(
        trainer, on_failure=mode, timeout=30, json_path=out / f"{variant}.json"
    )

    def run():
        steps = trainer.train().global_step
        plain = "training_step" not in vars(trainer)  # the watch took itself off
        return {"global_step": steps, "step_exit": watch.result.exit_code, "plain_after": plain}

    return outcome(run)


def resumed(variant: str) -> dict:
    """A resume from the step-clean run's saves, as scripts pass it on:
    ``trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)``."""
    step = 2 if variant == "resumed-stale" and rank() == 1 else 1
    mode, max_steps = ("raise", 3) if variant == "resumed-stale" else ("warn", 2)
    args = arguments(max_steps, resume_from_checkpoint=str(out / "trainer" / f"checkpoint-{step}"))
    callback = FsdpcheckCallback(on_failure=mode, timeout=30, json_path=out / f"{variant}.json")
    trainer = Trainer(
        model=tiny_llama(planted=False), args=args, train_dataset=Tokens(), callbacks=[callback]
    )
    return outcome(
        lambda: trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).global_step
    )


record = {variant: first_step(variant) for variant in ("step-clean", "step-extra")}
record.update({variant: resumed(variant) for variant in ("resumed", "resumed-stale")})
run_twins(out, hooked, record)
