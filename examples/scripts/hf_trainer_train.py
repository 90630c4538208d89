"""An HF Trainer script with FSDP2 (accelerate's ``fsdp_version`` 2): a small Llama, next-token
loss on a toy dataset, AdamW. Launch it with ``accelerate launch`` (or torchrun).

It knows nothing of fsdpcheck:

    accelerate launch --num_processes 2 examples/scripts/hf_trainer_train.py
    accelerate launch --num_processes 2 -m fsdpcheck run examples/scripts/hf_trainer_train.py

``--out`` writes each rank's logged losses.
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = (torch.arange(i, i + 16) * 7) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=os.path.join(args.out or "hf-out", "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
    if args.out:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        rank = trainer.args.process_index
        with open(os.path.join(args.out, f"losses{rank}.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
