"""Training with FSDP2 (fully_shard) and offload_adam on 2 CPU ranks, with a checkpoint.

    python examples/fsdp2_cpu.py                          # starts 2 gloo ranks itself
    torchrun --nproc-per-node 2 examples/fsdp2_cpu.py     # or under torchrun

Each rank keeps a shard of every param (a DTensor) and offload_adam steps only
that shard: nothing is gathered. What the example shows, in order:
  * the model sharded per block, then the root; bf16 params (fp32 master and
    moments in the optimizer) or --dtype float32;
  * gradient accumulation without a reduce-scatter on the first micro-batches
    (set_requires_gradient_sync), clipping by the norm over all shards
    (max_grad_norm=; opt.clip_grad_norm_ would return it);
  * a distributed checkpoint (torch.distributed.checkpoint: each rank writes its
    shards, the optimizer state as DTensors) after half the steps, loaded into a
    fresh model and optimizer that then train the second half again: the two
    runs end bitwise equal.
On GPUs the same code runs with backend "nccl" and the model on "cuda": the
optimizer then keeps master and moments in pinned host memory (the engine).
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import offload_adam


def build(dtype, seed=0):
    torch.manual_seed(seed)   # the same initial weights on every rank
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
              for _ in range(3)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 10)).to(dtype)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())  # data per rank
    x = torch.randn(16, 64, generator=g)
    return x, (x[:, :10] > 0).long().argmax(dim=1)


def train(model, opt, steps, start=0, accumulate=2):
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)   # reduce once per step
            x, y = batch(step, micro)
            loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y) / accumulate
            loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {loss.item() * accumulate:.4f}", flush=True)


def main(args):
    dtype = getattr(torch, args.dtype)
    half = args.steps // 2
    model = build(dtype)
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0)
    w = next(model.parameters())
    print(f"rank {dist.get_rank()}: first weight {tuple(w.shape)}, local shard "
          f"{tuple(w.to_local().shape)}, optimizer state on the shard only", flush=True)
    train(model, opt, half)

    # Save: each rank writes its own shards (model and optimizer state).
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
    train(model, opt, args.steps - half, start=half)

    # Resume: a fresh model and optimizer load the checkpoint and train the second half again.
    fresh = build(dtype, seed=1)
    fresh_opt = offload_adam.AdamW(fresh.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if dist.get_rank() == 0:
        print("resumed from the checkpoint:", flush=True)
    train(fresh, fresh_opt, args.steps - half, start=half)
    same = all(torch.equal(p.to_local(), q.to_local())
               for p, q in zip(model.parameters(), fresh.parameters()))
    print(f"rank {dist.get_rank()}: resumed run bitwise equal to the uninterrupted one: {same}",
          flush=True)
    return same


def leave(code):
    """Ends this rank's process without the interpreter's teardown, where threads of
    torch.distributed's gloo backend can still abort it (once in CI, 2026-11-28: rank 0
    exited with SIGABRT, "terminate called without an active exception", after both
    ranks had finished and printed their results; see pytorch/pytorch#179291). All
    that this rank wrote (the checkpoint, its output) is complete by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_main(rank, world, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ok = main(args)
        dist.barrier()   # both ranks done before either tears down (gloo's exit race)
    finally:
        dist.destroy_process_group()
    leave(0 if ok else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--checkpoint", default=None, help="folder (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:   # under torchrun
        args.checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), "fsdp2_cpu_ckpt")
        dist.init_process_group("gloo")
        try:
            ok = main(args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        leave(0 if ok else 1)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = args.checkpoint or os.path.join(tmp, "checkpoint")
        torch.multiprocessing.spawn(rank_main, args=(2, port, args), nprocs=2)
