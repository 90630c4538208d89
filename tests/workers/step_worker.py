"""A training script's first step under check_step, on 2 real gloo ranks: a tiny Llama with
FSDP2 on every decoder layer, a vision-like tower and the root, AdamW, each rank its own batch.

Runs each case named on the command line (a fresh model each) and writes, per rank,
``rank<N>.json``: per case, the exit code, the headline, the seconds it took and (rank 0) the
report."""

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import fsdpcheck
from fsdpcheck.process import exit_skipping_teardown
from fsdpcheck.records import to_dict

VOCAB = 64
HIDDEN = 16


class WithTower(nn.Module):
    """A text model with an FSDP-wrapped tower that only a batch with an "image" runs."""

    def __init__(self):
        super().__init__()
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        self.llama = LlamaForCausalLM(config)
        self.tower = nn.Sequential(nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN))

    def forward(self, ids, labels, image=None):
        embeds = self.llama.model.embed_tokens(ids)
        if image is not None:
            embeds = embeds + self.tower(image).unsqueeze(1)
        return self.llama(inputs_embeds=embeds, labels=labels).loss


def build(mesh, lr: float = 1e-3) -> tuple[WithTower, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = WithTower()
    fully_shard(model.tower, mesh=mesh)
    for layer in model.llama.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def batch(rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * seed + rank)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    return ids, ids.clone()


def case_step(case: str, rank: int, model: WithTower, optimizer):
    """The zero-argument step each case hands check_step on this rank."""
    micro = 1
    if case == "extra-rank1" and rank == 1 or case == "extra-rank0" and rank == 0:
        micro = 2
    image = None
    if case == "tower-all" or case == "tower-rank1" and rank == 1:
        image = torch.ones(2, HIDDEN)
    ignored = case == "labels-ignored" and rank == 1

    def step():
        total = 0.0
        for m in range(micro):
            ids, labels = batch(rank, m)
            if ignored:
                labels = torch.full_like(labels, -100)
            loss = model(ids, labels, image) / micro
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        return total

    return step


def collective_step(case: str, rank: int, model: WithTower, optimizer, stages):
    """The cases of issue 31: a training step, then collectives whose descriptors must agree
    across their group's members beyond op, size and dtype."""
    plain = case_step("equal", rank, model, optimizer)

    def step():
        loss = plain()
        t = torch.ones(4)
        if case == "broadcast-self-root":  # each rank names itself the root
            dist.broadcast(t, src=rank)
        if case == "reduce-sum-max":
            dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        if case in ("collectives-agree", "a2a-unpaired", "a2a-self"):
            # Uneven MoE-like splits: rank 0 sends 3 to itself and 1 to rank 1, expects 2 back;
            # rank 1 sends 2 (unpaired: 4) to rank 0 and 2 to itself ("a2a-self": 1, its own
            # experts' tokens dropped after it announced 2).
            own = 1 if case == "a2a-self" else 2
            send = [[3, 1], [4 if case == "a2a-unpaired" else 2, own]][rank]
            recv = [[3, 2], [1, 2]][rank]
            out = torch.empty(sum(recv))
            dist.all_to_all_single(out, torch.ones(sum(send)), recv, send)
        if case == "collectives-agree":
            dist.broadcast(t, src=0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if case in ("p2p-ring", "p2p-size"):
            # Each rank sends its peer a message and receives one, both posted before either
            # waits (batch_isend_irecv); "p2p-size": rank 0 sends 4 elements, rank 1 expects 2.
            peer = 1 - rank
            size = 4 if case == "p2p-size" and rank == 0 else 2
            inbox = torch.empty(2)
            ops = [
                dist.P2POp(dist.isend, torch.ones(size), peer),
                dist.P2POp(dist.irecv, inbox, peer),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if case == "p2p-unreceived" and rank == 0:  # rank 1 never receives it
            dist.send(torch.ones(2), 1)
        if case == "pp-subgroups":
            # Pipeline stages: each rank all-reduces its own layers' gradients over its own
            # 1-rank data group, stage 1 holding more layers; then the loss over every rank.
            for _ in range(2 + rank):
                dist.all_reduce(torch.ones(3 + rank), group=stages[rank])
            dist.all_reduce(t)
        return loss

    return step


def ring_step(rank: int, world: int, cycle: bool):
    """Every rank sends its activation to the next rank and takes one from the previous, on a
    group of its own: posted together (a ring exchange), or each first waiting to receive
    before it sends (``cycle``: a cycle no rank can leave; unwatched, every rank waits in gloo)."""
    group = dist.new_group(list(range(world)), group_desc="ring")
    after, before = (rank + 1) % world, (rank - 1) % world

    def step():
        inbox, out = torch.empty(4), torch.full((4,), float(rank))
        if cycle:
            dist.recv(inbox, src=before, group=group)
            dist.send(out, dst=after, group=group)
        else:
            for work in (
                dist.isend(out, after, group=group),
                dist.irecv(inbox, before, group=group),
            ):
                work.wait()
        return inbox.sum()

    return step


def chain_step(rank: int, world: int, broken: bool):
    """Three batches in a chain: rank 0 sends to rank 1, which in one batch receives it and
    sends on to rank 2, which receives that and (``broken``) one more from rank 0 that rank 0
    never sends. Rank 1's batch is whole; rank 2's never is."""
    group = dist.new_group(list(range(world)), group_desc="chain")
    # Zeros: rank 0 only sends, and the step's loss is this box's sum on every rank (memory
    # torch.empty left unwritten held NaN once: a true non-finite finding on the clean twin).
    box = torch.zeros(4)
    ops = {
        0: [dist.P2POp(dist.isend, torch.ones(4), 1, group)],
        1: [dist.P2POp(dist.irecv, box, 0, group), dist.P2POp(dist.isend, torch.ones(4), 2, group)],
        2: [dist.P2POp(dist.irecv, box, 1, group)],
    }
    if broken:
        ops[2].append(dist.P2POp(dist.irecv, torch.empty(4), 0, group))

    def step():
        for work in dist.batch_isend_irecv(ops[rank]):
            work.wait()
        return box.sum()

    return step


def lone_against_batch_step(rank: int, world: int, pairs: bool):
    """Rank 0 receives and sends in one batch; rank 1 sends, then receives, each on its own
    (``isend``, ``irecv``), waiting for both after: it pairs, and unwatched it runs. Not
    ``pairs``: rank 1 never receives."""
    group = dist.new_group(list(range(world)), group_desc="lone-batch")
    box = torch.zeros(4)  # a rank that receives nothing returns its sum too (chain_step)

    def step():
        if rank == 0:
            ops = [
                dist.P2POp(dist.irecv, box, 1, group),
                dist.P2POp(dist.isend, torch.ones(4), 1, group),
            ]
            works = dist.batch_isend_irecv(ops)
        elif rank == 1:
            works = [dist.isend(torch.ones(4), 0, group=group)]
            if pairs:
                works.append(dist.irecv(box, 0, group=group))
        else:
            works = []
        for work in works:
            work.wait()
        return box.sum()

    return step


def clip_step(rank: int, model: WithTower, optimizer, everyone: bool):
    """Rank 0 (or every rank) takes the grad norm of FSDP2's DTensor gradients for its log."""

    def step():
        ids, labels = batch(rank)
        loss = model(ids, labels)
        loss.backward()
        if everyone or rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def unseen_step(rank: int, step, *, raise_on_1: bool = False):
    """Rank 0 all-reduces from a thread of its own (unseen by the thread-local watch), and
    re-raises what the thread raised; ``raise_on_1``: rank 1's step raises its own error."""

    def with_thread():
        loss = step()
        if rank == 1 and raise_on_1:
            raise ValueError("rank 1's own failure in its step")
        if rank == 0:
            raised = []

            def reduce():
                try:
                    dist.all_reduce(torch.ones(2))
                except Exception as exc:  # ends when rank 1's process is gone
                    raised.append(exc)

            worker = threading.Thread(target=reduce, daemon=True)
            worker.start()
            worker.join()
            if raised:
                raise raised[0]
        return loss

    return with_thread


def compiled_step(rank: int, model: WithTower, optimizer):
    """The model and an all-reduce both under torch.compile; the counter backend counts the
    frames dynamo compiles (what the watch's docs promise about a compiled step)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)

    @torch.compile(backend=counter)
    def reduce(t):
        dist.all_reduce(t)
        return t * 2

    def step():
        ids, labels = batch(rank)
        loss = compiled(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduce(torch.ones(4))
        return loss.detach()

    def after() -> dict:
        # The same compiled function once more, outside the watch.
        under = counter.frame_count
        out = reduce(torch.ones(4))
        return {
            "frames_under_watch": under,
            "frames_after": counter.frame_count,
            "after_values": out.tolist(),
        }

    return step, after


def pipeline_step(rank: int, world: int, fewer: bool):
    """torch.distributed.pipelining, one stage per rank (GPipe, 4 microbatches), each stage a
    Linear; ``fewer``: the last stage's schedule built for 2 microbatches (torchtitan#775)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(rank)
    stage_module = nn.Linear(8, 8)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    last = rank == world - 1
    micro = 2 if fewer and last else 4

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    schedule = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    # The last stage's batch is sized for its own schedule: 2 microbatches of 2 rows each.
    x, y = torch.ones(8, 8), torch.zeros(4 if fewer and last else 8, 8)

    def step():
        losses: list = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean() if losses else None

    return stage_module, step


# `schedule-<name>-<microbatches on rank 0>-<on rank 1>`: every schedule torch ships.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved": ("ScheduleInterleaved1F1B", "looped"),
    "loopedbfs": ("ScheduleLoopedBFS", "looped"),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", "looped"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def schedule_step(rank: int, world: int, case: str):
    """torch.distributed.pipelining's schedule ``name`` over 2 ranks, each stage a Linear:
    one stage per rank (``single``), two per rank looped (stages r, r + world) or in a V
    (stages r, 2 * world - 1 - r); each rank's schedule built for its own microbatch count, its
    batch sized for it (torchtitan#775 when they differ). Each case its own group: a send
    posted ahead of its pair stays posted after a finding, and must not meet the next case's."""
    from torch.distributed import pipelining

    group = dist.new_group(list(range(world)), group_desc="pipeline")
    _, name, *counts = case.split("-")
    class_name, layout = SCHEDULES[name]
    micro = int(counts[rank])
    torch.manual_seed(rank)
    if layout == "single":
        indices = [rank]
    elif layout == "looped":
        indices = [rank, rank + world]
    else:
        indices = [rank, 2 * world - 1 - rank]
    total = world * len(indices)
    modules = [nn.Linear(8, 8) for _ in indices]
    stages = [
        pipelining.PipelineStage(m, i, total, torch.device("cpu"), group=group)
        for m, i in zip(modules, indices, strict=True)
    ]

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    schedule_class = getattr(pipelining, class_name)
    schedule = schedule_class(
        stages[0] if layout == "single" else stages, n_microbatches=micro, loss_fn=loss_fn
    )
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    first, last = 0 in indices, total - 1 in indices
    x, y = torch.ones(2 * micro, 8), torch.zeros(2 * micro, 8)

    def step():
        losses: list = []
        kwargs = {"target": y, "losses": losses} if last else {}
        schedule.step(*([x] if first else []), **kwargs)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean() if losses else None

    return nn.ModuleList(modules), step


COLLECTIVE_CASES = (
    "broadcast-self-root",
    "reduce-sum-max",
    "collectives-agree",
    "a2a-unpaired",
    "a2a-self",
    "pp-subgroups",
    "p2p-ring",
    "p2p-size",
    "p2p-unreceived",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=20)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # HSDP: every rank a replica of the others (one shard each), as a 2-D job's replicate dim.
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    # Every rank creates every group, as new_group asks; each rank then uses only its own.
    stages = [dist.new_group([r]) for r in range(world)]
    stages.append(dist.new_group(list(range(world))))  # the point-to-point cases' own group
    record = {}
    for case in args.cases:
        if case == "submesh-timeout":  # the groups setup.init builds carry its timeout
            from fsdpcheck.distributed import setup

            ctx = setup.init(
                "auto", 7.0, mesh_shape=(world, 1), mesh_names=("dp_replicate", "dp_shard")
            )
            timeouts = {
                name: ctx.mesh.get_group(name)
                ._get_backend(torch.device("cpu"))
                .options._timeout.total_seconds()
                for name in ("dp_replicate", "dp_shard")
            }
            setup.shutdown(ctx)
            record[case] = {"timeouts": timeouts, "exit_code": 0}
            continue
        # "hsdp-lr-rank1": rank 1's optimizer was built with another learning rate.
        lr = 1e-2 if case == "hsdp-lr-rank1" and rank == 1 else 1e-3
        model, optimizer = build(hsdp if case.startswith("hsdp") else mesh, lr)
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        start = time.monotonic()
        if case.startswith("schedule-"):
            model, step = schedule_step(rank, world, case)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        elif case.startswith("pipeline-"):
            model, step = pipeline_step(rank, world, fewer=case == "pipeline-fewer-microbatches")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        elif case in COLLECTIVE_CASES:
            step = collective_step(case, rank, model, optimizer, stages)
        elif case in ("p2p-lone-batch", "p2p-lone-batch-unreceived"):
            step = lone_against_batch_step(rank, world, pairs=case == "p2p-lone-batch")
        elif case in ("p2p-chain-all", "p2p-chain-broken"):
            step = chain_step(rank, world, broken=case == "p2p-chain-broken")
        elif case in ("p2p-ring-all", "p2p-cycle-all"):
            step = ring_step(rank, world, cycle=case == "p2p-cycle-all")
        elif case.startswith("clip-"):
            step = clip_step(rank, model, optimizer, everyone=case == "clip-all")
        else:
            step = case_step(case, rank, model, optimizer)
        after = None
        if case == "compiled-step":
            step, after = compiled_step(rank, model, optimizer)
        timeout = args.timeout
        if case in ("unseen-rank0", "raise-rank1-unseen-rank0"):
            # Rank 0 issues an all-reduce from a thread of its own (the watch is thread-local):
            # it waits there; rank 1's check times out and must end every rank with exit 3.
            raising = case == "raise-rank1-unseen-rank0"
            step, timeout = unseen_step(rank, step, raise_on_1=raising), 5.0
        result = fsdpcheck.check_step(model, step, timeout=timeout)
        seconds = time.monotonic() - start
        # After a divergence FSDP2 may leave modules unsharded: plain parameters, not DTensors.
        changed = any(
            not hasattr(p, "to_local")
            and (n not in before or not torch.equal(before[n], p))
            or hasattr(p, "to_local")
            and not torch.equal(before[n], p.to_local())
            for n, p in model.named_parameters()
        )
        record[case] = {
            "exit_code": int(result.exit_code),
            "headline": result.headline,
            "seconds": seconds,
            "params_changed": changed,
            "report": to_dict(result.report) if result.report is not None else None,
        }
        if after is not None:
            record[case].update(after())
        # Keys in the job's store after the case: what each check leaves behind.
        record[case]["store_keys"] = dist.distributed_c10d._get_default_store().num_keys()
        # Written after every case: a rank the last case ends (exit 3) keeps the others.
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
        if result.exit_code == 3:  # a peer is gone: nothing more can run
            break
    print(f"rank {rank} done", flush=True)
    if any(r["exit_code"] == 3 for r in record.values()):
        os._exit(3)
    dist.destroy_process_group()


# torch's teardown aborts now and then after a DTensor job: skip it (see fsdpcheck.process)
exit_skipping_teardown(main())
