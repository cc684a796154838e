#!/usr/bin/env python3
"""The grads' fingerprint alone (verify_grads: engine/grads.py), per element of bf16 grads.

Contenders, each timed once per pass in a shuffled order, on the same grads:
  torch/rows=R   grad_fingerprint, the device's version (torch ops), R whole chunks reduced per
                 round of launches (a GPU's default 8; the CPU's 1)
  kernel/<isa>   host_fingerprint, the kernels' one pass (--device cpu only), per ISA variant
For each: the host's time to return (on a GPU: to queue the work, the cost autograd's thread
pays) and the time until the device is done; ns per element, medians over the passes. Every
contender's numbers are checked equal first.

    flock /tmp/offload_bench.lock python bench/fingerprint_bench.py --device cpu --tag dev-vm-xeon
    python bench/fingerprint_bench.py --device cuda --out bench/results/<gpu> --tag <gpu>

Writes <out>/fingerprint_bench_<tag>.json and .log (every sample, the machine, the load average).
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import load_average, machine_info, one_line  # noqa: E402
from offload_adam.engine import grads as engine_grads  # noqa: E402
from offload_adam.kernel_step import kernels  # noqa: E402


def contenders(device: torch.device, rows: list):
    """(name, function of a grad, the ISA to set or None)."""
    out = []
    for r in rows:
        def torch_version(g, r=r):
            engine_grads._rows = lambda d: r
            return engine_grads.grad_fingerprint(g)
        out.append((f"torch/rows={r}", torch_version, None))
    if device.type == "cpu":
        for isa in kernels().supported_isas():
            out.append((f"kernel/{isa}", engine_grads.host_fingerprint, isa))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grads", type=int, default=8, help="grads of --numel bf16 elements each")
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--rows", default="1,8", help="the torch version's whole chunks a round")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU)")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    info = machine_info()
    lines = [f"fingerprint_bench: {one_line(info)}; device {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if cuda else "")
             + f"; {args.grads} bf16 grads of {args.numel} elements; chunk {engine_grads._chunk(device)}"]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(args.numel, generator=gen).to(torch.bfloat16).to(device)
             for _ in range(args.grads)]
    elements = args.grads * args.numel
    original_rows, active = engine_grads._rows, kernels().isa()
    rows = [int(r) for r in args.rows.split(",")]
    who = contenders(device, rows)
    try:
        want = None
        for name, fn, isa in who:   # (warm: weights, factor tables, the allocator)
            if isa:
                kernels().set_isa(isa)
            got = [int(fn(g)) for g in grads]
            assert want is None or got == want, f"{name} gives other fingerprints"
            want = got
        samples = {name: {"host_ns": [], "done_ns": []} for name, _, _ in who}
        order = list(who)
        for _ in range(args.passes):
            random.shuffle(order)
            for name, fn, isa in order:
                if isa:
                    kernels().set_isa(isa)
                sync()
                t0 = time.perf_counter()
                for g in grads:
                    fn(g)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                samples[name]["host_ns"].append((t1 - t0) * 1e9 / elements)
                samples[name]["done_ns"].append((t2 - t0) * 1e9 / elements)
    finally:
        engine_grads._rows = original_rows
        kernels().set_isa(active)
    medians = {}
    for name, _, _ in who:
        host = statistics.median(samples[name]["host_ns"])
        done = statistics.median(samples[name]["done_ns"])
        medians[name] = {"host_ns": host, "done_ns": done, "grad_gbps": 2.0 / done}
        lines.append(f"{name:16s} host {host:7.3f} ns/element, done {done:7.3f} ns/element "
                     f"({2.0 / done:6.2f} GB/s of bf16 grad), median of {args.passes}")
    base = medians[f"torch/rows={rows[0]}"]["done_ns"]
    lines.append("done, against torch/rows=%d: " % rows[0]
                 + ", ".join(f"{n} {base / m['done_ns']:.2f} x" for n, m in medians.items()))
    lines.append(f"load average: {load_average()}")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"fingerprint_bench_{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(args), "machine": info, "medians": medians, "samples": samples}, f, indent=1)
    with open(stem + ".log", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .log")


if __name__ == "__main__":
    main()
