#!/usr/bin/env python3
"""Transfer benchmark: the engine's device<->host copies against the machine's pinned bandwidth.

Rows, each for D2H (grads to the host) and H2D (bf16 params back):

  pinned peak      one copy of the whole buffer between device memory and pinned host memory
                   (torch's own pinned allocation): the machine's measured pinned bandwidth
  pageable         the same copy with pageable host memory (what a failed pin falls back to)
  engine param=P   the engine's path (offload_adam.engine.device.CudaDevice.d2h / h2d: side
                   stream, timing events, host buffers from engine/host_memory.py's registered
                   arenas) over the buffer cut into params of P MiB, one copy per param (a
                   param larger than a bucket is cut into pieces: the same thing)
  small x N        N params of --small-kb each (norms, biases): one copy each, and "packed":
                   one copy per bucket of them, through a gather/scatter on the device, as
                   the engine sends the params below engine.layout.PACK_BELOW_BYTES

Bandwidth = bytes / (time from the first copy queued to the last copy's end event).
Target (issue 3): engine D2H and H2D >= 80% of "pinned peak".

    python bench/transfer_bench.py                    # 1 GiB of bf16, params of 1, 16, 128 MiB
    python bench/transfer_bench.py --mb 64 --repeats 3 --out /tmp/x   # smoke run

Writes results/transfer_bench_<host or --tag>.json. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.machine, offload_adam


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1024, help="total MiB moved each way")
    ap.add_argument("--param-mb", default="1,16,128", help="param sizes (MiB) to try")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--small-kb", type=float, default=8, help="size of each small param (KiB)")
    ap.add_argument("--small-count", type=int, default=2048, help="number of small params")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("transfer_bench: no CUDA device here; nothing to measure")
        return

    from bench.machine import machine_info, one_line
    from offload_adam.engine.device import CudaDevice
    from offload_adam.engine.host_memory import HostArenas

    dev = torch.device("cuda", torch.cuda.current_device())
    numel = int(args.mb * 2**20) // 2
    nbytes = numel * 2
    device_buf = torch.randn(numel, device=dev).to(torch.bfloat16)
    rows = []

    def add(name, direction, seconds, samples, moved=nbytes):
        rows.append({"name": name, "direction": direction, "seconds": seconds,
                     "bytes": moved, "gb_per_s": moved / seconds / 1e9, "samples": samples})

    pinned = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    pageable = torch.empty(numel, dtype=torch.bfloat16)
    for name, host in (("pinned peak", pinned), ("pageable", pageable)):
        add(name, "d2h", *timed(lambda: host.copy_(device_buf, non_blocking=True), args.repeats))
        add(name, "h2d", *timed(lambda: device_buf.copy_(host, non_blocking=True), args.repeats))

    cuda = CudaDevice(dev)
    all_pinned = True

    def engine_rows(name, sizes, packed):
        nonlocal all_pinned
        arenas = HostArenas(cuda)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        offsets = [arenas.reserve("grad", torch.bfloat16, n) for n in sizes]
        arenas.allocate()
        all_pinned &= arenas.pinned
        hosts = [arenas.view("grad", off, (n,)) for off, n in zip(offsets, sizes)]
        devs = [device_buf[s:s + n] for s, n in zip(starts, sizes)]
        moved = 2 * sum(sizes)
        pairs = [(hosts, devs)] if packed else [([h], [d]) for h, d in zip(hosts, devs)]

        def run(direction):
            last = None
            for h, d in pairs:
                last = cuda.d2h(h, d) if direction == "d2h" else cuda.h2d(d, h, cuda.fence())
            cuda.wait_host(last)

        for direction in ("d2h", "h2d"):
            seconds, samples = timed(lambda: run(direction), args.repeats)
            add(name, direction, seconds, samples, moved)
        arenas.release()

    for param_mb in (float(x) for x in args.param_mb.split(",")):
        per = max(1, int(param_mb * 2**20) // 2)
        engine_rows(f"engine param={param_mb:g}MiB",
                    [min(per, numel - s) for s in range(0, numel, per)], packed=False)
    small = [max(1, int(args.small_kb * 1024) // 2)] * args.small_count
    if sum(small) <= numel:
        engine_rows(f"small x {args.small_count}, one copy each", small, packed=False)
        engine_rows(f"small x {args.small_count}, packed", small, packed=True)

    peak = {r["direction"]: r["gb_per_s"] for r in rows if r["name"] == "pinned peak"}
    machine = machine_info(query_kernels=False)
    print(f"transfer_bench: {args.mb:g} MiB each way, pinned arenas: {all_pinned}")
    print(f"machine: {one_line(machine)}")
    print(f"{'row':36} {'dir':4} {'ms':>9} {'GB/s':>8} {'of peak':>8}")
    for r in rows:
        r["of_peak"] = r["gb_per_s"] / peak[r["direction"]]
        print(f"{r['name']:36} {r['direction']:4} {r['seconds'] * 1e3:9.2f} "
              f"{r['gb_per_s']:8.2f} {r['of_peak']:8.1%}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"transfer_bench_{args.tag}.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "machine": machine,
                   "mb": args.mb, "all_pinned": all_pinned, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
