#!/usr/bin/env python3
"""Where the engine puts a param's master and moments matters: one fused step over one large tensor
with its fp32 master, exp_avg and exp_avg_sq laid out three ways (bf16 grads in, bf16 copy out):

  separate tensors   three torch allocations (what the in-place path and the bare kernel use)
  engine arenas      engine/layout.py allocate_state: one allocation per role, each starting at its own
                     offset within a page (engine v2)
  end to end         the three buffers back to back in one allocation, `numel` elements apart (engine
                     v1's single state arena): for a power-of-two numel the streams sit exactly a power
                     of two apart, and collide in the caches

Rounds alternate the layouts (each round times one step of each) and the table shows medians and the
ratio to "separate tensors" paired within rounds.

    python bench/arena_layout_bench.py                 # 64M elements, 12 rounds
    python bench/arena_layout_bench.py --numel 16777216 --rounds 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from offload_adam._build import load_kernels  # noqa: E402
from bench.machine import machine_info, one_line  # noqa: E402
from offload_adam.engine.device import HostDevice  # noqa: E402
from offload_adam.engine.layout import ParamRec, allocate_state, state_roles  # noqa: E402
from offload_adam.state_format import FLOAT32  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    K, n = load_kernels(), args.numel
    grad = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    rec = ParamRec(torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)), 0, 0)
    allocate_state([rec], HostDevice(torch.device("cpu")), None,  # the views keep their memory
                   state_roles(FLOAT32, False))
    end_to_end = torch.empty(3 * n)
    layouts = {
        "separate tensors": [torch.empty(n) for _ in range(3)],
        "engine arenas": [rec.master, rec.exp_avg, rec.exp_avg_sq],
        "end to end": [end_to_end[i * n:(i + 1) * n] for i in range(3)],
    }
    for bufs in layouts.values():
        for t in bufs:
            t.copy_(torch.rand(n))
    times = {name: [] for name in layouts}
    steps = [torch.tensor(0.0)]
    for r in range(args.rounds + 2):
        for name, (p, m, v) in layouts.items():
            t0 = time.perf_counter()
            K.adam_step([p], [grad], [m], [v], [], [out], steps, 1e-3, 0.9, 0.999, 1e-8, 0.01,
                        True, False, 1.0, args.threads)
            if r >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - t0)
    machine = machine_info()
    print(f"arena_layout_bench: {n:,} elements, {args.rounds} rounds, {args.threads} threads, "
          f"isa {K.isa()}")
    print(f"machine: {one_line(machine)}")
    base = times["separate tensors"]
    rows = []
    print(f"{'layout':18} {'start mod 4096 (B)':>22} {'median ms':>10} {'ns/param':>9} {'t/separate':>11}")
    for name, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, base))
        starts = [t.data_ptr() % 4096 for t in layouts[name]]
        med = statistics.median(ts)
        rows.append({"layout": name, "starts_mod_4096": starts, "median_s": med, "samples": ts,
                     "ratio_to_separate_paired": paired})
        print(f"{name:18} {str(starts):>22} {med * 1e3:10.2f} {med / n * 1e9:9.3f} {paired:11.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"numel": n, "threads": args.threads, "isa": K.isa(), "machine": machine,
                       "rows": rows}, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
