#!/usr/bin/env python3
"""Iteration time (forward + backward + step) with step_in_backward False vs True.

A small bf16 decoder-like MLP stack on the CPU, stepped by offload_adam.AdamW
through the offload engine (on CPU the transfers are plain copies). With
step_in_backward=True each bucket's Adam step runs in the engine's worker thread
during the rest of backward; with False (the default) it runs at step(). The
gain is bounded by how much backward is left after each bucket's grads are
ready, and by the cores the step and backward share (on 2 cores, little).

With --state-dirs DIR both modes keep the state in files under DIR (the NVMe
tier, a fresh folder per run): at step() the files' pass reads, steps and
writes every bucket; with step_in_backward it starts at backward's first grad
(engine/disk_early.py), so the disk time hides behind backward.

Rounds alternate the two modes (each its own model and optimizer, same seed);
the first iterations are warm-up (the first step learns the buckets).

    python bench/early_start_bench.py                        # defaults
    python bench/early_start_bench.py --threads 2 --dim 1024 --layers 8 --iters 20
    python bench/early_start_bench.py --dim 1024 --layers 8 --state-dirs /tmp/state
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import offload_adam  # noqa: E402
from bench.machine import machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit  # noqa: E402


def make_model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def iteration_times(step_in_backward: bool, args) -> list:
    model = make_model(args.dim, args.layers)
    files = {}
    if args.state_dirs:
        files = dict(state_dirs=tempfile.mkdtemp(dir=args.state_dirs),
                     state_budget_mb=args.budget_mb)
    opt = offload_adam.AdamW(model.parameters(), lr=1e-4, bucket_mb=args.bucket_mb,
                             step_in_backward=step_in_backward, **files)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    times = []
    for it in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
    if files:
        opt.close()
        shutil.rmtree(files["state_dirs"])
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--state-dirs", default=None,
                    help="keep the state in files under this directory (the NVMe tier)")
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="with --state-dirs: the tier's host memory budget")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.state_dirs:   # (made if missing, as the command in bench/README gives it)
        os.makedirs(args.state_dirs, exist_ok=True)
    nparams = sum(p.numel() for p in make_model(args.dim, args.layers).parameters())
    times = {False: [], True: []}
    limits = []
    state_bytes = 12 * nparams   # fp32 master and moments: read and written each step

    def measure_disk():
        if args.state_dirs:   # the disk's own speed, in the same run (it drifts)
            limits.append(disk_limit(args.state_dirs, state_bytes, 4, 16 << 20, passes=1))

    measure_disk()
    for _ in range(args.rounds):
        for mode in (False, True):
            times[mode] += iteration_times(mode, args)
    measure_disk()
    print(f"machine: {one_line(machine_info())}")
    print(f"model: {args.layers} x (Linear {args.dim}->{4 * args.dim}, GELU, Linear), bf16, "
          f"{nparams / 1e6:.1f}M params, batch {args.batch}, bucket_mb {args.bucket_mb}, "
          f"torch threads {args.threads}, {args.rounds} rounds x {args.iters} iterations "
          f"(+{args.warmup} warm-up)"
          + (f"; state in files under {args.state_dirs} (fp32 master and moments, "
             f"{12 * nparams / 1e9:.2f} GB read and as much written per step)" if args.state_dirs else
             "; state in host RAM"))
    print(f"{'step_in_backward':>18} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for mode in (False, True):
        t = times[mode]
        print(f"{str(mode):>18} {1e3 * statistics.median(t):10.1f} {1e3 * min(t):8.1f} "
              f"{1e3 * max(t):8.1f}")
    gain = 1 - statistics.median(times[True]) / statistics.median(times[False])
    print(f"median iteration time change with step_in_backward=True: {-100 * gain:+.1f}%")
    for when, limit in zip(("before", "after"), limits):
        t = limit["mixed_seconds_per_byte_pair"] * state_bytes
        print(f"disk {when} (O_DIRECT, {state_bytes / 1e9:.2f} GB read and written at once, "
              f"{limit['mixed_Bps'] / 1e9:.2f} GB/s): {1e3 * t:.0f} ms a step, the limit; "
              f"median iteration / limit: step_in_backward False "
              f"{statistics.median(times[False]) / t:.2f}, True "
              f"{statistics.median(times[True]) / t:.2f}")


if __name__ == "__main__":
    main()
