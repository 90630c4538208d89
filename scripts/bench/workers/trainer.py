"""The trainer-start job the default audit is compared with: what a training script does before
its first step, and nothing else. Rank 0 ``from_pretrained`` (the checkpoint's dtype), other
ranks build on meta; ``fully_shard`` each decoder layer and the root; DCP's
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``; then the
non-persistent buffers broadcast one by one in sorted-name order (verl after PR #6405).

    python scripts/bench/workers/trainer.py --model DIR            # one rank (under a launcher)
    python scripts/bench/workers/trainer.py --make-checkpoint DIR  # write the bench's checkpoint
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]

# Llama-shaped, 267M parameters, bfloat16: 0.5 GiB of safetensors.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def make_checkpoint(path: Path) -> None:
    """Save a checkpoint with fsdpcheck's fill (seconds, not the minutes of a random init)."""
    sys.path.insert(0, str(REPO))
    import transformers

    from fsdpcheck.model.fill import build_filled

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    config = transformers.AutoConfig.from_pretrained(str(path))
    torch.set_default_dtype(torch.bfloat16)
    model = build_filled(lambda: transformers.AutoModelForCausalLM.from_config(config), seed=0)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--make-checkpoint", type=Path)
    args = parser.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint)
        return 0

    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = {}
    if rank == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
        full = dict(model.state_dict())
    else:
        config = transformers.AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kept = {}
    if rank == 0:  # to_empty() would lose rank 0's computed buffers: the broadcast's source
        kept = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in kept:
                buf.copy_(kept[name])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    with torch.no_grad():
        for _, buf in sorted(model.named_buffers()):
            dist.broadcast(buf, src=0)
    dist.destroy_process_group()
    # Ends as the audit it is compared with does: torch's teardown with DTensor's caches still
    # holding gloo groups now and then aborts the process (-6) after its work is done.
    from fsdpcheck.process import exit_skipping_teardown

    exit_skipping_teardown(0)


if __name__ == "__main__":
    sys.exit(main())
