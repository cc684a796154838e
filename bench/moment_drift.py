#!/usr/bin/env python3
"""Does a stored exp_avg_sq decay like beta2**t once the grads stop? (issue 16, part 1)

A param whose grads stop (a rare token's embedding row, a seldom-routed expert) must see its second moment
decay exactly as beta2**t: a format that loses v there later takes updates too large. Each moment format
runs the kernel (`K.adam_step`) on N elements: grad 1 for 20 steps, then 0; betas (0.9, 0.999). Reported
at several step counts after the grads stop: the mean of the decoded exp_avg_sq over the exact value, and
the mean of its square root over the exact root. Two cases:

  uniform: every element alike (the issue's measurement);
  mixed:   in each block of 256, 4 elements keep a grad 30x larger (they set the block's scale), the others
           decay beside them (their ratios are over the decaying elements only).

    python bench/moment_drift.py            # ~30 s; writes bench/results/moment_drift.txt
    python bench/moment_drift.py --isa avx2 --numel 65536 --steps 480,2000,4000
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]   # the test's measurement; bench.machine
from test_moment_decay import HOT, decayed_mean_ratios, mixed_blocks  # noqa: E402  (the test's measurement)

from offload_adam._build import load_kernels  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "moment_drift.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=65536)
    ap.add_argument("--steps", default="480,2000,4000", help="steps after the grads stop at which to report")
    ap.add_argument("--isa", default=None, help="scalar, avx2, avx512, neon (default: the best this CPU has)")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    K = load_kernels()
    if args.isa:
        K.set_isa(args.isa)
    marks = [int(x) for x in args.steps.split(",")]
    lines = [f"machine: {one_line(machine_info())}",
             f"moment_drift: {args.numel} elements, isa {K.isa()}, betas (0.9, 0.999), grad 1 for {HOT} steps "
             f"then 0; mean decoded exp_avg_sq / exact (mean sqrt / exact sqrt)",
             f"{'case':8} {'format':6} " + " ".join(f"{m:>15}" for m in marks)]
    for mixed in (False, True):
        for fmt in ("f32", "bf16", "q8"):
            big = mixed_blocks(args.numel) if mixed else torch.zeros(args.numel, dtype=torch.bool)
            r = decayed_mean_ratios(K, fmt, big, args.numel, marks)
            lines.append(f"{'mixed' if mixed else 'uniform':8} {fmt:6} " +
                         " ".join(f"{r[m][0]:>7.3f} ({r[m][1]:.3f})" for m in marks))
            print(lines[-1], flush=True)
    lines.append(f"load average after: {load_average()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3] + lines[-1:]))


if __name__ == "__main__":
    main()
