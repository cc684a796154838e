#!/usr/bin/env python3
"""What following edits through `p.data` costs a CPU step (master_rule.bytes_sum).

A bf16 param stepped in place keeps an fp32 master; an edit through `p.data` (clamp_,
copy_, normal_) bumps no version counter of the param, so the param's mark also holds a
CRC32C of its bytes: taken when the step wrote the param, checked when the next step
starts. That reads the param's 2 B/param twice a step. An fp32 param is its own master:
not checksummed (its row is the control).

Contenders, each `--params` params of `--numel` elements, the same grads, timed in one
process, in a shuffled order per pass, median over passes of the median step:

  bf16 crc       the library as it is (CRC32C on the calling thread)
  bf16 crc-pool  the CRC of 2 MiB pieces over a pool of Python threads (as until
                 2026-12-02: slower on 2 cores; does it pay on many?)
  bf16 none      the checksum replaced by a constant (what the step costs without it)
  fp32           no checksum to take (control: should not move)

    flock /tmp/offload_bench.lock python bench/mark_cost.py --tag dev-2core

Prints ns/param per contender and the checksum's share; writes results/mark_cost_<tag>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam import master_rule  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402


PIECE = 1 << 21
_pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)))


def pooled_sum(t: torch.Tensor):
    """The CRC32C of each 2 MiB piece of t over a pool of Python threads (the GIL is
    released in the CRC): what bytes_sum did until 2026-12-02, kept here to ask a
    many-core host whether splitting pays there."""
    from offload_adam.nvme.direct_io import crc32
    if t.device.type != "cpu" or t.numel() == 0:
        return -1
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    if len(data) <= PIECE:
        return crc32(data)
    return tuple(_pool.map(crc32, [data[i:i + PIECE] for i in range(0, len(data), PIECE)]))


SUMS = {"crc": master_rule.bytes_sum, "crc-pool": pooled_sum, "none": lambda t: 0}


class Contender:
    def __init__(self, name: str, dtype: torch.dtype, total_sum, args):
        self.name, self.sum = name, total_sum
        gen = torch.Generator().manual_seed(0)
        self.params = [(torch.randn(args.numel, generator=gen) * 0.1).to(dtype).requires_grad_()
                       for _ in range(args.params)]
        self.grads = [torch.randn(args.numel, generator=gen).to(dtype) * 1e-2
                      for _ in range(args.params)]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.opt = offload_adam.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        self.times: list = []

    def step(self) -> float:
        master_rule.bytes_sum = self.sum   # (read at each step by the master's marks)
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=4)
    ap.add_argument("--numel", type=int, default=4 << 20)
    ap.add_argument("--steps", type=int, default=7, help="timed steps per contender per pass")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    original = master_rule.bytes_sum
    contenders = [Contender(f"bf16 {k}", torch.bfloat16, f, args) for k, f in SUMS.items()]
    contenders.append(Contender("fp32", torch.float32, original, args))
    n = args.params * args.numel
    info = machine_info()
    print(one_line(info), f"| threads {args.threads} | {n / 1e6:.1f} M params per contender")
    try:
        for c in contenders:   # warm-up: states made, marks taken
            c.step(), c.step()
        order = list(contenders)
        for _ in range(args.passes):
            random.shuffle(order)
            for c in order:
                c.times.append(statistics.median(c.step() for _ in range(args.steps)))
    finally:
        master_rule.bytes_sum = original
    rows = {c.name: statistics.median(c.times) / n * 1e9 for c in contenders}
    base = rows["bf16 none"]
    for name, ns in rows.items():
        extra = f"  (+{ns - base:.3f} over no checksum)" if name.startswith("bf16") else ""
        print(f"{name:12s} {ns:7.3f} ns/param{extra}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"mark_cost_{args.tag}.json")
    with open(path, "w") as f:
        json.dump({"machine": info, "threads": args.threads, "params": args.params,
                   "numel": args.numel, "passes": args.passes, "steps": args.steps,
                   "load_average": load_average(), "ns_per_param": rows,
                   "samples_s": {c.name: c.times for c in contenders}}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
