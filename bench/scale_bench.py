#!/usr/bin/env python3
"""How the Python around the step grows with the number of params and of param groups.

A model of many small params (64 elements each), in one group or in one group per param
(per-layer learning rates taken to the end), built and trained a few iterations by:

  torch      torch.optim.AdamW (foreach), the peer, in the same process
  in-place   offload_adam.AdamW on fp32 CPU params (inplace.py)
  engine     offload_adam.AdamW(step_in_backward=True) on bf16 CPU params: the offload
             engine's path (engine/core.py, early.py), as CUDA params take it

For each size: construction, one backward (the grad hooks), one step(), medians of
`--repeats` iterations after a warm-up, in ms, and each one's growth over the size before
(2.0 for linear at doubling sizes; 4.0 is quadratic). What this measures is Python, not
bandwidth: the kernels' share is a few microseconds at these sizes.

    python bench/scale_bench.py                     # params 1000 2000 4000, groups 250 500 1000
    python bench/scale_bench.py --params 2000 4000 8000 --groups 500 1000 2000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402

KINDS = ("torch", "in-place", "engine")


def build(kind: str, n: int, grouped: bool):
    dtype = torch.bfloat16 if kind == "engine" else torch.float32
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(64, generator=gen).to(dtype).requires_grad_() for _ in range(n)]
    gs = [torch.randn(64, generator=gen).to(dtype) for _ in range(n)]
    groups = ([{"params": [p], "lr": 1e-3 * (1 + i % 7)} for i, p in enumerate(ps)]
              if grouped else [{"params": ps}])
    t0 = time.perf_counter()
    if kind == "torch":
        opt = torch.optim.AdamW(groups, lr=1e-3, foreach=True)
    else:
        opt = offload_adam.AdamW(groups, lr=1e-3, step_in_backward=kind == "engine")
    return opt, ps, gs, time.perf_counter() - t0


def iteration(opt, ps, gs):
    loss = sum((p * g).sum() for p, g in zip(ps, gs))
    t0 = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    opt.zero_grad()
    return t1 - t0, t2 - t1


def measure(kind: str, n: int, grouped: bool, repeats: int) -> dict:
    builds, backs, steps = [], [], []
    for _ in range(repeats):
        opt, ps, gs, built = build(kind, n, grouped)
        builds.append(built)
        iteration(opt, ps, gs)   # warm-up (the engine records the grads' order)
        for _ in range(2):
            b, s = iteration(opt, ps, gs)
            backs.append(b)
            steps.append(s)
        if hasattr(opt, "close"):
            opt.close()
    ms = lambda xs: 1e3 * statistics.median(xs)   # noqa: E731
    return {"build": ms(builds), "backward": ms(backs), "step": ms(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--groups", type=int, nargs="+", default=[250, 500, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"# scale_bench: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"ISA {offload_adam.kernel_isa()}; ms, medians of {args.repeats} (x: growth over "
          "the size before)")
    for grouped, sizes in ((False, args.params), (True, args.groups)):
        what = "groups of one param" if grouped else "params in one group"
        for kind in KINDS:
            before = None
            for n in sizes:
                r = measure(kind, n, grouped, args.repeats)
                grow = ("" if before is None else "  x " + " / ".join(
                    f"{r[k] / before[k]:.1f}" for k in ("build", "backward", "step")))
                print(f"{n:6d} {what:20s} {kind:9s} build {r['build']:8.1f}  backward "
                      f"{r['backward']:8.1f}  step {r['step']:8.1f}{grow}", flush=True)
                before = r


if __name__ == "__main__":
    main()
