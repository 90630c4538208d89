"""A torchtitan-style trainer: the model of ``examples/builders/torchtitan_style.py`` (a dataclass
config holding functions, a fused ``wqkv`` that its state-dict hooks split and fuse), built on
``meta``, ``fully_shard`` per block and on the root, ``to_empty`` and ``init_weights``; the
pretrained weights broadcast from rank 0 with DCP's ``set_model_state_dict``; then gradient
accumulation over every micro-batch of this rank's share of the data, AdamW.

It knows nothing of fsdpcheck:

    torchrun --nproc-per-node 2 examples/scripts/titan_train.py --samples 8
    torchrun --nproc-per-node 2 -m fsdpcheck run examples/scripts/titan_train.py --samples 8

``--samples`` is split over the ranks as ``range(rank, samples, world)``: with a count the
world does not divide, rank 0 gets one micro-batch more than the others in its step.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# The trainer's own model package (torchtitan's is installed; this one sits beside it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "builders"))
from torchtitan_style import ModelArgs, Transformer, checkpoint  # noqa: E402


def fused(state_dict: dict) -> dict:
    """Checkpoint names (``wq``/``wk``/``wv``) to the model's fused ``wqkv``, as torchtitan's
    state-dict adapter does before a load."""
    out = {}
    for name, value in state_dict.items():
        if name.endswith(".wq.weight"):
            stem = name.removesuffix("wq.weight")
            parts = [state_dict[f"{stem}{p}.weight"] for p in ("wq", "wk", "wv")]
            out[f"{stem}wqkv.weight"] = torch.cat(parts, dim=0)
        elif not name.endswith((".wk.weight", ".wv.weight")):
            out[name] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="sequences in the dataset")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model_args = ModelArgs()
    pretrained = fused(checkpoint(model_args)) if rank == 0 else {}
    with torch.device("meta"):
        model = Transformer(model_args)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    set_model_state_dict(
        model,
        pretrained,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    data = torch.randint(
        0, model_args.vocab_size, (args.samples, 17), generator=torch.Generator().manual_seed(7)
    )
    mine = data[rank : args.samples : world]
    micro_batches = mine.split(args.micro_batch)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for tokens in micro_batches:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if rank == 0:
            print(f"step {step + 1} loss {total:.6f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        from safetensors.torch import save_file

        local = {n: p.to_local().detach().contiguous() for n, p in model.named_parameters()}
        save_file(local, os.path.join(args.out, f"rank{rank}.safetensors"))
        with open(os.path.join(args.out, f"losses{rank}.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
