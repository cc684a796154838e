#!/usr/bin/env python3
"""The NVMe tier's two crash-safe layouts side by side: disk bytes per param, bytes moved
per step, step time, against the disk's limit measured in the same run.

    python bench/nvme_footprint.py                       # ~100 M bf16 params, 8-bit moments
    python bench/nvme_footprint.py --params-m 10 --steps 2 --out /tmp/x   # smoke run

Two offload_adam.AdamW on the same CPU model (bf16 params, `--params-m` million, in
`--param-mb` params, 8-bit moments unless --state-dtype), each with its state in its own
directory under --dir: state_footprint="two_generations" (two copies of each bucket) and
"compact" (one copy in a ring with 4 spare buckets + a redo log of the step's grads).
Both get the same grads and are stepped in ABBA rounds (a state's place in the round and
where its files land move a step's time on a virtual disk; pairing cancels that). Per
step: the bytes the process read and wrote to storage (/proc/self/io read_bytes and
write_bytes deltas: O_DIRECT data, the log's buffered writes, manifests), the step time
(median). Disk bytes per param: the sizes of the files after the run.

limit = bytes read / read GB/s + bytes written / write GB/s, each speed the disk's own
(sequential O_DIRECT, bench/nvme_bench.py's probe: the best of 2 passes, before and after
the steps); ratio = step time / limit.

Writes results/nvme/nvme_footprint_<tag>.json and .log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import load_average, machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit  # noqa: E402
import offload_adam  # noqa: E402

LAYOUTS = ("two_generations", "compact")


def io_bytes():
    """(read_bytes, write_bytes) this process caused to go to storage so far."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out["read_bytes"], out["write_bytes"]


def folder_bytes(folder):
    return {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
            if not n.endswith(".lock")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/offload_adam_footprint_bench")
    ap.add_argument("--params-m", type=float, default=100.0, help="million params")
    ap.add_argument("--param-mb", type=float, default=8.0, help="MiB per param (bf16)")
    ap.add_argument("--state-dtype", default="8bit")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--steps", type=int, default=6, help="steps per layout (even: ABBA)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "nvme"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    lines = []

    def log(line=""):
        print(line, flush=True)
        lines.append(line)

    info = machine_info()
    log(f"# nvme_footprint: {one_line(info)}; load {load_average()}")
    per = int(args.param_mb * 2**20 / 2)
    count = max(1, int(args.params_m * 1e6 / per))
    numel = count * per
    gen = torch.Generator().manual_seed(0)
    models = {k: [torch.nn.Parameter((torch.randn(per, generator=gen) * 0.02).bfloat16())
                  for _ in range(count)] for k in LAYOUTS[:1]}
    models["compact"] = [torch.nn.Parameter(p.detach().clone()) for p in models[LAYOUTS[0]]]
    opts = {}
    for k in LAYOUTS:
        os.makedirs(os.path.join(args.dir, k))
        opts[k] = offload_adam.AdamW(models[k], lr=1e-4, state_dtype=args.state_dtype,
                                     state_dirs=os.path.join(args.dir, k), state_footprint=k,
                                     bucket_mb=args.bucket_mb, num_threads=args.threads)
    log(f"# {numel / 1e6:.1f} M bf16 params in {count} params, state_dtype={args.state_dtype}, "
        f"bucket_mb={args.bucket_mb:g}, {args.threads} threads")
    probe = 2 ** 30
    limits = [disk_limit(args.dir, probe, 4, 8 << 20)]
    log(f"disk (before): write {limits[0]['write_Bps'] / 1e9:.2f} GB/s, read "
        f"{limits[0]['read_Bps'] / 1e9:.2f} GB/s (sequential O_DIRECT, 1 GiB)")

    def step(k, s):
        for j, p in enumerate(models[k]):
            g = torch.Generator().manual_seed(1000 * s + j)
            p.grad = (torch.randn(per, generator=g) * 1e-3).bfloat16()
        r0, w0 = io_bytes()
        t = time.perf_counter()
        opts[k].step()
        dt = time.perf_counter() - t
        r1, w1 = io_bytes()
        return dt, r1 - r0, w1 - w0

    for k in LAYOUTS:   # the first step (fresh files, written in place) is not timed
        step(k, 0)
    rows = {k: [] for k in LAYOUTS}
    for s in range(1, args.steps + 1):
        order = LAYOUTS if s % 4 in (1, 0) else LAYOUTS[::-1]
        for k in order:
            rows[k].append(step(k, s))
    limits.append(disk_limit(args.dir, probe, 4, 8 << 20))
    log(f"disk (after):  write {limits[1]['write_Bps'] / 1e9:.2f} GB/s, read "
        f"{limits[1]['read_Bps'] / 1e9:.2f} GB/s")
    read_bps = statistics.median(x["read_Bps"] for x in limits)
    write_bps = statistics.median(x["write_Bps"] for x in limits)
    for k in LAYOUTS:   # the same params after the same steps: bitwise
        same = all(torch.equal(a, b) for a, b in zip(models[LAYOUTS[0]], models[k]))
        assert same, f"{k}: the params differ from {LAYOUTS[0]}'s"
    result = {"machine": info, "numel": numel, "state_dtype": args.state_dtype,
              "bucket_mb": args.bucket_mb, "threads": args.threads, "limits": limits,
              "layouts": {}}
    log()
    log("layout           disk B/param  read B/param/step  written B/param/step  "
        "step s (median)  limit s  ratio")
    for k in LAYOUTS:
        files = folder_bytes(os.path.join(args.dir, k))
        t = statistics.median(r[0] for r in rows[k])
        rd = statistics.median(r[1] for r in rows[k])
        wr = statistics.median(r[2] for r in rows[k])
        limit = rd / read_bps + wr / write_bps
        result["layouts"][k] = {"files": files, "step_s": [r[0] for r in rows[k]],
                                "read_bytes": [r[1] for r in rows[k]],
                                "written_bytes": [r[2] for r in rows[k]],
                                "median_step_s": t, "limit_s": limit}
        log(f"{k:16s} {sum(files.values()) / numel:12.2f}  {rd / numel:17.2f}  "
            f"{wr / numel:20.2f}  {t:15.2f}  {limit:7.2f}  {t / limit:5.2f}")
        log("    files: " + ", ".join(f"{n} {v / numel:.2f} B/param" for n, v in files.items()))
    a, b = (result["layouts"][k] for k in LAYOUTS)
    log()
    log(f"compact / two generations: disk {sum(b['files'].values()) / sum(a['files'].values()):.2f}"
        f" x, written per step {statistics.median(b['written_bytes']) / statistics.median(a['written_bytes']):.2f} x, "
        f"step time {b['median_step_s'] / a['median_step_s']:.2f} x (paired, same run)")
    log(f"# load {load_average()}")
    for o in opts.values():
        o.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"nvme_footprint_{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".log", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
