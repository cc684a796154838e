#!/usr/bin/env python3
"""A state larger than this machine's RAM: offload_adam.AdamW(state_dirs=...) at full size.

Issue 17's proof that the NVMe tier does what it is for: on a 24 GiB machine, bf16 CPU params
whose fp32 master and moments (12 B/param: 32.4 GB at 2.7 B params) cannot fit in RAM, stepped
by the optimizer with the state in files. In one run, on one directory:

  disk limit   the disk's O_DIRECT sequential write and read bandwidth (nvme_bench.disk_limit,
               the tier's own I/O pool), before the state's files are made and after they
               are removed (the disk holds two generations of the state: 2 x 32.4 GB)
  cpu step     the same optimizer with its state in RAM on a 1/--cpu-fraction slice of the
               params (what fits), scaled up: the step's CPU time without the disk
  nvme step    optimizer.step() with the state on disk: read ahead, kernel, write back,
               commit; --steps of them (the first reads slots never written)
  peak RSS     the process's during the disk run (VmHWM, reset after the RAM run) and
               VmRSS after each step: what the process held before the optimizer was built
               (torch, the params and grads: 4 B/param) plus what the tier added, against
               its ring (state_budget_mb), the bound it promises

limit time = state bytes / read GB/s + (state bytes + the redo log's) / write GB/s; ratio = step /
max(limit, cpu). --footprint compact: state_footprint="compact" (one copy + 4 spare buckets + the
redo log of the grads, 2 B/param written per step).

    flock /tmp/offload_bench.lock python bench/nvme_big_run.py          # 2.7 B params, ~6 min
    python bench/nvme_big_run.py --params-b 0.05 --limit-gb 0.25 --out /tmp/x   # smoke run

Writes results/nvme/nvme_big_run_<tag>.json and .log.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam.testing import ring_buffers, state_files  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit, log  # noqa: E402


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    """The peak RSS since the last reset_peak() (VmHWM), or the process's (getrusage)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Starts VmHWM again from the current RSS (Linux: "5" to clear_refs), so that the peak
    is the disk run's, not the RAM run's before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_params(count: int, numel: int):
    """bf16 params with a grad each (the same grads every step: a benchmark of the step)."""
    gen = torch.Generator().manual_seed(0)
    ps = []
    for _ in range(count):
        p = torch.empty(numel, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        p.requires_grad_()
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
        ps.append(p)
    return ps


def cpu_step_seconds(ps, args):
    """The step with its state in RAM on a slice of the params, scaled to all of them."""
    part = ps[:max(1, len(ps) // args.cpu_fraction)]
    opt = offload_adam.AdamW(part, lr=1e-4, num_threads=args.threads)
    opt.step()   # the first step allocates the state (page faults): not timed
    times = []
    for _ in range(3):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    del opt
    gc.collect()
    return statistics.median(times) * len(ps) / len(part), times, len(part)


def limit_of(args, out, when):
    lim = disk_limit(args.dir, int(args.limit_gb * 2**30) // (64 << 20) * (64 << 20),
                     args.io_threads, 16 << 20)
    log(out, f"disk {when} (O_DIRECT, {lim['bytes'] / 1e9:.2f} GB sequential): write "
             f"{lim['write_Bps'] / 1e9:.3f} GB/s, read {lim['read_Bps'] / 1e9:.3f} GB/s, "
             f"both at once {lim['mixed_Bps'] / 1e9:.3f} GB/s")
    return lim


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/offload_adam_nvme_big")
    ap.add_argument("--params-b", type=float, default=2.7, help="billions of bf16 params")
    ap.add_argument("--tensor-m", type=float, default=4.0, help="millions of elements a tensor")
    ap.add_argument("--bucket-mb", type=float, default=100.0, help="bucket_mb= (MiB of state)")
    ap.add_argument("--budget-mb", type=float, default=800.0, help="state_budget_mb=")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--footprint", default="two_generations",
                    choices=["two_generations", "compact"], help="state_footprint=")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--cpu-fraction", type=int, default=16)
    ap.add_argument("--limit-gb", type=float, default=8.0,
                    help="GiB per file of the disk passes (two files; large enough that a "
                         "virtual disk's cache does not flatter it)")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "nvme"))
    args = ap.parse_args()
    out, row = [], {"args": vars(args)}
    info = machine_info()
    row.update(machine=info, load_start=load_average())
    log(out, f"nvme_big_run: {one_line(info)}")
    os.makedirs(args.dir, exist_ok=True)
    try:
        row["limit_before"] = before = limit_of(args, out, "before the run")
        numel = int(args.tensor_m * 1e6) // 32768 * 32768
        count = max(1, round(args.params_b * 1e9 / numel))
        rss_torch = rss_now()
        t = time.perf_counter()
        ps = make_params(count, numel)
        n = count * numel
        log(out, f"{count} bf16 params of {numel} elements: {n / 1e9:.3f} B params, params + "
                 f"grads {4 * n / 2**30:.2f} GiB in RAM (made in {time.perf_counter() - t:.0f} s)")
        cpu_t, cpu_times, part = cpu_step_seconds(ps, args)
        log(out, f"cpu step (state in RAM, {part} of the {count} params, x{count / part:.1f}): "
                 f"{cpu_t:.2f} s  ({cpu_t / n * 1e9:.3f} ns/param, {args.threads} threads)")
        state_dir = os.path.join(args.dir, "state")
        os.makedirs(state_dir)
        reset_peak()
        rss_before = rss_now()   # torch, the params and grads: what the process held already
        t = time.perf_counter()
        opt = offload_adam.AdamW(ps, lr=1e-4, num_threads=args.threads, state_dirs=state_dir,
                                 bucket_mb=args.bucket_mb, state_budget_mb=args.budget_mb,
                                 state_footprint=args.footprint)
        files = state_files(opt)
        nbytes = files.spec.nbytes
        ring = sum(b.nbytes for b in ring_buffers(opt))
        disk = sum(os.path.getsize(os.path.join(state_dir, f)) for f in os.listdir(state_dir))
        # what a step writes beyond the state: compact's redo log (the grads, 2 B/param)
        log_bytes = 2 * n if args.footprint == "compact" else 0
        log(out, f"state on disk: {nbytes / 1e9:.2f} GB a generation ({nbytes / n:.2f} B/param), "
                 f"{len(files.spec.buckets)} buckets, {args.footprint}: the files take "
                 f"{disk / 1e9:.1f} GB ({disk / n:.2f} B/param); ring {ring / 2**20:.0f} MiB; "
                 f"files made in {time.perf_counter() - t:.1f} s")
        steps, rss = [], []
        for k in range(args.steps):
            t = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t)
            rss.append(rss_now())
            log(out, f"step {k + 1}: {steps[-1]:.1f} s  ({2 * nbytes / steps[-1] / 1e9:.2f} GB/s "
                     f"read + write)  VmRSS {rss[-1] / 2**30:.2f} GiB  peak {peak_rss() / 2**30:.2f} GiB")
        assert opt.step_count == args.steps
        opt.close()
        del opt
        gc.collect()
        shutil.rmtree(state_dir)
        row["limit_after"] = after = limit_of(args, out, "after the run")
        bound = 4 * n + ring + rss_torch
        added = row_peak = peak_rss()
        added -= rss_before
        med = statistics.median(steps[1:] or steps)
        for name, lim in (("before", before), ("after", after)):
            limit_t = nbytes / lim["read_Bps"] + (nbytes + log_bytes) / lim["write_Bps"]
            row[f"ratio_{name}"] = r = {
                "limit_seconds": limit_t, "ratio_to_limit": med / limit_t,
                "ratio_to_bound": med / max(limit_t, cpu_t),
                "target_met": med <= 1.15 * max(limit_t, cpu_t)}
            log(out, f"against the disk {name}: limit {limit_t:.1f} s, step (median of steps "
                     f"2..) {med:.1f} s, step/limit {r['ratio_to_limit']:.3f}, "
                     f"step/max(limit, cpu) {r['ratio_to_bound']:.3f} "
                     f"({'met' if r['target_met'] else 'MISSED'}: <= 1.15)")
        row.update(params=n, tensors=count, numel=numel, state_bytes=nbytes, ring_bytes=ring,
                   footprint=args.footprint, disk_bytes=disk, log_bytes_per_step=log_bytes,
                   step_seconds=steps, step_median=med, cpu_step_seconds=cpu_t,
                   cpu_step_samples=cpu_times, cpu_part=part, vmrss_after_steps=rss,
                   peak_rss=row_peak, rss_bound=bound, rss_torch_start=rss_torch,
                   rss_before_optimizer=rss_before, rss_added_by_tier=added,
                   ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        log(out, f"peak RSS of the disk run {row_peak / 2**30:.2f} GiB: the {rss_before / 2**30:.2f} "
                 f"GiB held before the optimizer was built (params + grads {4 * n / 2**30:.2f}, "
                 f"torch at start {rss_torch / 2**30:.2f}, the rest) + {added / 2**20:.0f} MiB "
                 f"added by the tier, whose ring is {ring / 2**20:.0f} MiB "
                 f"({'within' if added <= ring * 1.01 else 'ABOVE'} the ring + 1 %); the state is "
                 f"{nbytes / 2**30:.1f} GiB, RAM {row['ram_bytes'] / 2**30:.1f} GiB")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    save_run(args.out, f"nvme_big_run_{args.tag}", row, out)


def save_run(folder: str, name: str, row: dict, out: list) -> None:
    """The run's record `row` (the load average at its end added) as <name>.json and its
    log lines as <name>.log in `folder`."""
    row["load_end"] = load_average()
    log(out, f"load average: start {row['load_start']}, end {row['load_end']}")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, name)
    with open(stem + ".json", "w") as f:
        json.dump(row, f, indent=1, default=str)
    with open(stem + ".log", "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {stem}.json and .log")


if __name__ == "__main__":
    main()
