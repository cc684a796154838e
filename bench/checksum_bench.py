#!/usr/bin/env python3
"""The NVMe tier's checksum alone: CRC32C (K.crc32c, csrc/crc32c.h) in every ISA variant this CPU
runs, beside zlib's CRC32 (the tier's checksum before), in GB/s per thread.

Two buffers, as the I/O threads see them:
  warm   one 4 MiB request checksummed again and again (in L2/L3: the instruction's speed)
  cold   --cold-mb of memory walked in 4 MiB requests (from DRAM: what memory leaves of it)
with 1 and 2 threads at once (each its own buffers; the GIL is released), each pass timing every
contender once in a shuffled order; medians over the passes, and each variant's speed over
zlib's paired within a pass.

    flock /tmp/offload_bench.lock python bench/checksum_bench.py --tag dev-2core-epyc

Writes results/checksum_bench_<tag>.json and .log (every sample, the machine, the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import load_average, machine_info, one_line  # noqa: E402
from offload_adam._build import load_kernels  # noqa: E402
from offload_adam.nvme.direct_io import REQUEST_BYTES, AlignedBuffer  # noqa: E402


def requests(buf: AlignedBuffer, total: int):
    """`total` bytes of 4 MiB requests from `buf`, wrapping around it."""
    views = [buf.view[i:i + REQUEST_BYTES] for i in range(0, buf.nbytes, REQUEST_BYTES)]
    return [views[k % len(views)] for k in range(total // REQUEST_BYTES)]


def run_threads(fn, per_thread):
    """Seconds for len(per_thread) threads, started together, to checksum their requests."""
    barrier = threading.Barrier(len(per_thread) + 1)

    def work(views):
        barrier.wait()
        for v in views:
            fn(v)
    threads = [threading.Thread(target=work, args=(views,)) for views in per_thread]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=11)
    ap.add_argument("--bytes-mb", type=int, default=512, help="MiB each thread checksums per timing")
    ap.add_argument("--cold-mb", type=int, default=1024, help="MiB of memory per thread for 'cold'")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    K = load_kernels()
    active = K.isa()
    out = []

    def log(line=""):
        print(line, flush=True)
        out.append(line)
    info = machine_info()
    load_start = load_average()
    log(f"checksum_bench: {one_line(info)}")
    thread_counts = [int(t) for t in args.threads.split(",")]
    total = args.bytes_mb << 20
    contenders = {f"crc32c[{isa}]": isa for isa in K.supported_isas()}
    contenders["zlib.crc32"] = None
    buffers = {}
    for t in range(max(thread_counts)):
        warm = AlignedBuffer(REQUEST_BYTES, pin=False)
        cold = AlignedBuffer(args.cold_mb << 20, pin=False)
        for b in (warm, cold):
            b.tensor.random_(0, 256)
        buffers[t] = {"warm": warm, "cold": cold}
    rng = random.Random(0)
    samples = {}   # (buffer, threads, contender) -> seconds per pass
    try:
        for _ in range(args.passes):
            for where in ("warm", "cold"):
                for threads in thread_counts:
                    per_thread = [requests(buffers[t][where], total) for t in range(threads)]
                    order = list(contenders)
                    rng.shuffle(order)
                    for name in order:
                        isa = contenders[name]
                        if isa is not None:
                            K.set_isa(isa)
                        fn = zlib.crc32 if isa is None else K.crc32c
                        samples.setdefault((where, threads, name), []).append(
                            run_threads(fn, per_thread))
    finally:
        K.set_isa(active)
        for b in buffers.values():
            for x in b.values():
                x.close()
    rows = []
    log(f"{args.passes} passes of {args.bytes_mb} MiB per thread in 4 MiB requests; warm: one request "
        f"again and again; cold: {args.cold_mb} MiB per thread walked")
    log(f"{'buffer':6} {'threads':>7} {'contender':18} {'GB/s per thread':>16} {'min':>7} {'max':>7} "
        f"{'x zlib (paired)':>16}")
    for where, threads, name in ((w, t, n) for w in ("warm", "cold") for t in thread_counts
                                 for n in contenders):
        secs = samples[(where, threads, name)]
        speeds = [total / s / 1e9 for s in secs]
        zlib_secs = samples[(where, threads, "zlib.crc32")]
        paired = statistics.median(z / s for z, s in zip(zlib_secs, secs))
        row = {"buffer": where, "threads": threads, "contender": name, "seconds": secs,
               "GBps_per_thread_median": statistics.median(speeds), "x_zlib_paired": paired}
        rows.append(row)
        log(f"{where:6} {threads:>7} {name:18} {row['GBps_per_thread_median']:>16.2f} "
            f"{min(speeds):>7.2f} {max(speeds):>7.2f} {paired:>16.2f}")
    load_end = load_average()
    log(f"load average: start {load_start}, end {load_end}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"checksum_bench_{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "args": vars(args), "rows": rows, "bytes_per_timing": total,
                   "load_average": {"start": load_start, "end": load_end}}, f, indent=1)
    with open(stem + ".log", "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
