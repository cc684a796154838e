#!/usr/bin/env python3
"""defer_blocks= on the CPU: how much of the CPU step the next forward hides.

On a GPU the main thread queues each block's kernels and then waits for the GPU, while
the engine's worker steps the blocks whose grads are on the host. Here the GPU's time
is stood in for by sleeps on the main thread (a custom autograd function per block that
sleeps in forward and in backward, as the H200 run's 13B spent ~13 and ~30 ms of GPU
time per block), and the "device" is host memory (engine/device.HostDevice). The CPU
step is real: the
fused kernels on `--threads` threads, every block's params streamed (stream_params),
stepped in backward (step_in_backward=True), without the grads' fingerprints
(verify_grads=False: on a GPU a device reduction, here CPU time on the main thread that
the sleeps do not stand for). The sleeps bring forward and backward to 0.24 and 0.56
of the CPU step (the H200 run's proportions; `--fwd-ms`/`--bwd-ms` set them per block
instead), so that the CPU step is the bound, as it was there.

One optimizer per defer_blocks value (`--defer`, and 0), each over its own copy of the
model, iterations alternating between them (paired: the VM's memory bandwidth moves).
The sleeps are calibrated first with an optimizer whose grad ring holds every grad, so
that the main thread's own time (the streamer's and the engine's Python, which a GPU run
has too) is measured without the hooks' waits for room, and counted in the stand-in's
time. The fetches and the grads' copies move no bytes by default (`--copies free`: on a
GPU they are DMA, which costs the CPU nothing; the values computed are then garbage,
only the schedule is timed). Per iteration: wall time of forward, backward and step()
(the deferred steps of the iteration before overlap this one's forward, and its wait
for them is counted in it), the CPU step's kernel time (the engine's profile). Reported:
medians, and each iteration against its bound max(CPU step, stand-in GPU time).

    python bench/defer_schedule.py                  # 16 blocks x 16 M params, defer 0/2/4/6
    python bench/defer_schedule.py --numel 4000000 --defer 3 --iters 4     # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam.engine.device import HostDevice  # noqa: E402
from offload_adam.engine.device import Transfer  # noqa: E402
from offload_adam.testing import simulated  # noqa: E402
from bench.machine import machine_info, one_line  # noqa: E402


class GpuTime(torch.autograd.Function):
    """A block's GPU time as a sleep (the main thread waits, as for a GPU); its param's
    grad is a fixed tensor (autograd copies it into .grad: a memcpy, as the grad's D2H)."""

    @staticmethod
    def forward(ctx, x, w, grad_w, fwd_s, bwd_s):
        ctx.grad_w, ctx.bwd_s, ctx.numel = grad_w, bwd_s, w.numel()
        time.sleep(fwd_s)
        return x + w[:1].float() * 0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        # free copies: a grad autograd takes as it is (its values are never read: the
        # copies to the host are free too); else the fixed grad, copied into .grad
        grad = ctx.grad_w if ctx.grad_w is not None else torch.empty(ctx.numel, dtype=torch.bfloat16)
        return g, grad, None, None, None


class DmaHost(HostDevice):
    """The host stand-in whose copies cost the CPU nothing, as a GPU's DMA does not: a
    fetch or a grad's copy moves no byte (the values computed are garbage; the timing
    is the schedule's: the CPU step's real kernels against the stand-in's sleeps)."""

    def _copy(self, dsts, srcs):
        t = time.perf_counter()
        return Transfer(t, t)


class SleepBlock(torch.nn.Module):
    def __init__(self, numel: int, times: dict, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter((torch.randn(numel, generator=gen) * 0.02).bfloat16())
        self.grad_w = (None if times["free_copies"] else
                       (torch.randn(numel, generator=gen) * 1e-3).bfloat16())
        self.times = times   # shared: set after calibration

    def forward(self, x):
        return GpuTime.apply(x, self.w, self.grad_w, self.times["fwd_s"], self.times["bwd_s"])


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, numel: int, times: dict):
        super().__init__()
        self.x0 = torch.nn.Parameter(torch.zeros(1, 8))   # resident: backward reaches block 0
        self.blocks = torch.nn.ModuleList(SleepBlock(numel, times, i) for i in range(blocks))

    def forward(self):
        x = self.x0 * 1
        for b in self.blocks:
            x = b(x)
        return x.sum()


def build(args, times, defer, ring_mb=None):
    model = Stack(args.blocks, args.numel, times)
    offload_adam.stream_params(model, SleepBlock, prefetch=2)
    opt = offload_adam.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                             state_dtype=args.state_dtype, step_in_backward=True,
                             num_threads=args.threads, defer_blocks=defer,
                             grad_ring_mb=ring_mb,
                             bucket_mb=args.bucket_mb,
                             # (the grads' fingerprints: a reduction on the GPU, which
                             # here would be the main thread's, in the stand-in's time)
                             verify_grads=False)
    return model, opt


def iteration(model, opt, times) -> dict:
    t0 = time.perf_counter()
    loss = model()
    tf = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    opt.zero_grad()
    profile = opt.last_step_profile or {}
    return dict(iter_s=t2 - t0, fwd_s=tf - t0, bwd_s=t1 - tf, step_s=t2 - t1,
                cpu_step_s=profile.get("cpu_step_s", 0.0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--numel", type=int, default=16_000_000, help="params per block")
    ap.add_argument("--defer", default="2,4,6",
                    help="defer_blocks= of the contenders, comma-separated (0 always runs)")
    ap.add_argument("--iters", type=int, default=8, help="timed iterations of each, paired")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (the main thread "
                    "keeps a core, as the thread driving a GPU)")
    ap.add_argument("--state-dtype", default="float32")
    ap.add_argument("--bucket-mb", type=float, default=8.0)
    ap.add_argument("--fwd-ms", type=float, default=0.0, help="per block (0: 0.24 x its CPU step)")
    ap.add_argument("--bwd-ms", type=float, default=0.0, help="per block (0: 0.56 x its CPU step)")
    ap.add_argument("--copies", choices=["free", "memcpy"], default="free",
                    help="free: the fetches and grad copies move nothing, as DMA costs the CPU "
                         "nothing (default); memcpy: plain copies on the main thread")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "defer"))
    args = ap.parse_args(argv)
    info = machine_info()
    print(one_line(info))
    times = {"fwd_s": 0.0, "bwd_s": 0.0, "free_copies": args.copies == "free"}
    device = (DmaHost if args.copies == "free" else HostDevice)(torch.device("cpu"))
    with simulated(device):
        # calibration: the CPU step, and the main thread's own time in forward and
        # backward without sleeps, the ring large enough for every grad (no hook waits
        # for room: that wait is the CPU step's, not the main thread's)
        all_grads_mb = 2 * args.blocks * args.numel / 2**20 + 64
        model, opt = build(args, times, 0, ring_mb=all_grads_mb)
        for _ in range(3):
            cal = iteration(model, opt, times)
        opt.close()
        del model, opt
        defers = [0] + sorted({int(d) for d in args.defer.split(",")} - {0})
        runs = {m: build(args, times, m) for m in defers}
        per_block = cal["cpu_step_s"] / args.blocks
        # the sleeps bring forward and backward to 0.24 and 0.56 of the CPU step, as on
        # the H200, counting the main thread's own time in them (the streamer's and the
        # engine's Python, which a GPU run has too)
        fwd = max(0.0, 0.24 * cal["cpu_step_s"] - cal["fwd_s"]) / args.blocks
        bwd = max(0.0, 0.56 * cal["cpu_step_s"] - cal["bwd_s"]) / args.blocks
        times["fwd_s"] = args.fwd_ms / 1e3 if args.fwd_ms else fwd
        times["bwd_s"] = args.bwd_ms / 1e3 if args.bwd_ms else bwd
        gpu_s = args.blocks * (times["fwd_s"] + times["bwd_s"]) + cal["fwd_s"] + cal["bwd_s"]
        print(f"{args.blocks} blocks x {args.numel / 1e6:.1f} M params, state {args.state_dtype}, "
              f"{args.threads} kernel thread(s); CPU step {cal['cpu_step_s'] * 1e3:.0f} ms "
              f"({per_block * 1e3:.1f} ms a block); stand-in GPU time a block: forward "
              f"{times['fwd_s'] * 1e3:.1f} ms, backward {times['bwd_s'] * 1e3:.1f} ms, besides "
              f"the main thread's own {cal['fwd_s'] * 1e3:.0f} + {cal['bwd_s'] * 1e3:.0f} ms "
              f"an iteration ({gpu_s * 1e3:.0f} ms in all)")
        rows = {m: [] for m in runs}
        for it in range(args.warmup + args.iters):
            for m in (defers if it % 2 == 0 else defers[::-1]):
                r = iteration(*runs[m], times)
                if it >= args.warmup:
                    r["bound_s"] = max(r["cpu_step_s"], gpu_s)
                    rows[m].append(r)
        for m in runs:
            runs[m][1].close()
    result = {}
    for m, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["ratio"] = statistics.median(r["iter_s"] / r["bound_s"] for r in rs)
        result[m] = med
        print(f"defer_blocks={m}: iteration {med['iter_s'] * 1e3:.0f} ms (median of {len(rs)}; "
              f"forward {med['fwd_s'] * 1e3:.0f}, backward {med['bwd_s'] * 1e3:.0f}, "
              f"step() {med['step_s'] * 1e3:.0f}), CPU step {med['cpu_step_s'] * 1e3:.0f} ms, "
              f"{med['ratio']:.2f} x the bound max(CPU step, stand-in GPU time)")
    speedup = {m: result[0]["iter_s"] / result[m]["iter_s"] for m in result if m}
    print("vs defer_blocks=0: " + ", ".join(f"defer_blocks={m} {x:.2f} x the iteration rate"
                                            for m, x in speedup.items()))
    print("expected gain (schedule model): min(N x (CPU step - backward) a block, forward's "
          "share before the deferred blocks); the deferred steps must fit in the forward")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"defer_schedule_{args.tag}.json")
    with open(path, "w") as f:
        json.dump(dict(machine=info, args=vars(args), times=times, gpu_s=gpu_s,
                       result={str(k): v for k, v in result.items()},
                       rows={str(k): v for k, v in rows.items()},
                       speedup={str(k): v for k, v in speedup.items()}), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
