#!/usr/bin/env python3
"""The Python side of a step: many small params, so that what costs is the code around the
kernel (building its arguments, grouping, the stores' bookkeeping), not the kernel.

Three paths, each `--params` params of `--numel` elements (bf16 and fp32 alternating, two
groups), the median of `--steps` steps after a warm-up:

  in-place   CPU params, state in optimizer.state (inplace.py, cpu_step.py)
  engine     bf16 params through the offload engine on the host (free_grads_after_copy=True
             routes bf16 CPU params there)
  files      the state in files under --dir (state_dirs=, nvme_tier.py)

Prints us per step and per param. For an A/B of two trees (a refactor that must not cost),
run it from each alternately with PYTHONPATH set to the tree, e.g.

    for i in 1 2 3; do for t in /work/old /work/main; do
        PYTHONPATH=$t python $t/bench/python_overhead.py --tag $(basename $t); done; done
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402


def params(n, numel):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(numel, generator=gen) * 0.1)
            .to(torch.bfloat16 if i % 2 else torch.float32).requires_grad_() for i in range(n)]


def timed(opt, ps, steps):
    grads = [torch.randn_like(p) * 1e-2 for p in ps]
    out = []
    for k in range(steps + 2):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        t = time.perf_counter()
        opt.step()
        if k >= 2:   # two warm-up steps: states made, plans built
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--dir", default=None, help="for the files path (default: a temp dir)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    ps = params(args.params, args.numel)
    groups = [{"params": ps[::2]}, {"params": ps[1::2], "weight_decay": 0.0}]
    rows["in-place"] = timed(offload_adam.AdamW(groups, num_threads=1), ps, args.steps)
    # bf16 CPU params with free_grads_after_copy go through the engine (on the host)
    ps = [p.detach().to(torch.bfloat16).requires_grad_() for p in params(args.params, args.numel)]
    groups = [{"params": ps[::2]}, {"params": ps[1::2], "weight_decay": 0.0}]
    opt = offload_adam.AdamW(groups, num_threads=1, free_grads_after_copy=True)
    rows["engine"] = timed(opt, ps, args.steps)
    opt.close()
    folder = args.dir or tempfile.mkdtemp(prefix="offload_adam_overhead_")
    try:
        ps = params(args.params, args.numel)
        groups = [{"params": ps[::2]}, {"params": ps[1::2], "weight_decay": 0.0}]
        opt = offload_adam.AdamW(groups, num_threads=1, state_dirs=folder, bucket_mb=1)
        rows["files"] = timed(opt, ps, args.steps)
        opt.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"python_overhead {args.tag}: {args.params} params of {args.numel} "
          + "  ".join(f"{k} {v * 1e6:.0f} us ({v * 1e9 / args.params:.0f} ns/param)"
                      for k, v in rows.items() if v is not None), flush=True)


if __name__ == "__main__":
    main()
