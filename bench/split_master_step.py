#!/usr/bin/env python3
"""What a split master costs the step: adam_step of fp32 masters against the same step of
split masters (offload_adam/split_master.py: bf16 value + low half + tie bit, decoded per
chunk into a cache-resident scratch and encoded back), in one process, alternating, on
buckets far larger than the caches (DRAM-bound, as the step is on any host).

    python bench/split_master_step.py [--numel 33554432] [--rounds 7] [--threads 2]

DRAM bytes per param the step must move (bf16 grads in, bf16 param copy out), per moment
format: fp32 master: grad 2 + master 4 + 4 + param 2 + moments; split: grad 2 + param 2 + 2
+ low half 2 + 2 + tie 1/4 + moments (8-bit moments: 16.06 vs 14.31 B; fp32: 36 vs 34.25).
Prints the medians (ns/param, GB/s of those bytes) and the machine, per ISA variant.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine_info, one_line  # noqa: E402
from offload_adam import split_master  # noqa: E402
from offload_adam.kernel_step import kernels  # noqa: E402

MOMENT_BYTES = {"fp32": 24.0, "8bit": 4.0 + 16 / 256}   # m and v, read and written


def make(n: int, fmt: str, split: bool):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g) * 0.02
    t = {"grad": (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16),
         "lp": torch.empty(n, dtype=torch.bfloat16), "step": torch.tensor(0.0)}
    if fmt == "8bit":
        t.update(m=torch.zeros(n, dtype=torch.uint8), v=torch.zeros(n, dtype=torch.uint8),
                 ms=torch.zeros((n + 255) // 256), vs=torch.zeros((n + 255) // 256))
    else:
        t.update(m=torch.zeros(n), v=torch.zeros(n))
    if split:
        t["lp"], t["lo"], t["tie"] = split_master.encode(master, num_threads=4)
    else:
        t["master"] = master
    return t


def step(t, fmt: str, threads: int) -> float:
    kw = {}
    if fmt == "8bit":
        kw.update(exp_avg_scales=[t["ms"]], exp_avg_sq_scales=[t["vs"]])
    if "lo" in t:
        kw.update(master_los=[t["lo"]], master_ties=[t["tie"]])
    t0 = time.perf_counter()
    kernels().adam_step([t["master"]] if "master" in t else [], [t["grad"]], [t["m"]], [t["v"]],
                        [], [t["lp"]], [t["step"]], 1e-4, 0.9, 0.999, 1e-8, 0.1, True, False,
                        1.0, threads, **kw)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 25)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    K = kernels()
    print(one_line(machine_info()))
    print(f"numel {args.numel}, {args.threads} threads, {args.rounds} rounds alternating; "
          f"medians; bf16 grads, bf16 param copy, weight decay 0.1")
    print(f"{'isa':8} {'moments':8} {'master':7} {'ns/param':>9} {'B/param':>8} {'GB/s':>7} "
          f"{'split/fp32':>10}")
    active = K.isa()
    try:
        for isa in K.supported_isas():
            K.set_isa(isa)
            for fmt in ("8bit", "fp32"):
                bufs = {s: make(args.numel, fmt, s) for s in (False, True)}
                for s in bufs:
                    step(bufs[s], fmt, args.threads)   # warm: pages touched, scratch made
                times = {False: [], True: []}
                for _ in range(args.rounds):
                    for s in (False, True):
                        times[s].append(step(bufs[s], fmt, args.threads))
                med = {s: statistics.median(v) / args.numel * 1e9 for s, v in times.items()}
                for s in (False, True):
                    nbytes = (2 + 2 + (2 + 2 + 2 + 0.25) if s else 2 + 8 + 2) + MOMENT_BYTES[fmt]
                    ratio = f"{med[True] / med[False]:10.2f}" if s else ""
                    print(f"{isa:8} {fmt:8} {'split' if s else 'fp32':7} {med[s]:9.3f} "
                          f"{nbytes:8.2f} {nbytes / med[s]:7.1f} {ratio}")
                del bufs
    finally:
        K.set_isa(active)


if __name__ == "__main__":
    main()
