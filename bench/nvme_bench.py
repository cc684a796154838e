#!/usr/bin/env python3
"""NVMe tier benchmark: the optimizer step with its state on disk against the disk's own limit.

In one run, on the same directory:

  disk write / read   sequential O_DIRECT writes then reads of a file the size of one
                      generation of the state, through the tier's own I/O pool
                      (offload_adam/nvme/direct_io.py: 4 MiB requests, several in flight):
                      the disk's bandwidth, and the limit a step can reach; the best of two
                      passes each, measured before and after the steps
  disk mixed          the same reads and writes at once (read one file while writing another),
                      as the pipeline does: what the disk gives when both share it
  cpu step            the fused kernel over every bucket held in the pipeline's ring buffers,
                      no I/O: what the CPU alone costs
  nvme step           offload_adam.nvme.StepPipeline.step with the state in files: read ahead,
                      kernel, write back, fsync, manifest commit; and the same without the
                      kernel (I/O alone: the pipeline's own overhead against the disk)

limit time = read bytes / read GB/s + write bytes / write GB/s (the disk doing the step's
reads and its writes, each at its own measured speed); ratio = step time / limit time.
Target (issue 17): step time <= 1.15 x max(limit time, cpu step time) at 2 threads.

Checksums (issue 25): every bucket slot is CRC32C'd as it is written and verified as it is
read, by the I/O threads. --checksums both (the default) steps four states of each format
side by side in rounds: two as the tier runs (checksums on) and two with the checksum
replaced by a constant (off), made in the order on, off, off, on and stepped in a rotating
order (where a state's files land, and a step's place in a round, move its time by ~20 %
on the VM's disk), so that the ratio of a round's on to off time is what checksumming
costs, paired. The disk's limit is measured without checksums (the disk's own speed).

    flock /tmp/offload_bench.lock python bench/nvme_bench.py            # ~2 GB of fp32 state
    python bench/nvme_bench.py --state-gb 0.2 --steps 2 --out /tmp/x      # smoke run

Writes results/nvme/nvme_bench_<tag>.json and .log; the load average is recorded at the
start and the end (the machine's cores may be shared).
"""
from __future__ import annotations

import argparse
import contextlib
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

from bench.machine import load_average, machine_info, one_line  # noqa: E402
from offload_adam.kernel_step import Hyper, adam_step  # noqa: E402
from offload_adam.nvme import NvmeState, StateSpec, StepPipeline  # noqa: E402
from offload_adam.param_state import adam_bucket  # noqa: E402
from offload_adam.nvme import direct_io  # noqa: E402
from offload_adam.nvme.direct_io import AlignedBuffer, IOPool, open_direct, wait  # noqa: E402

HYPER = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              decoupled_weight_decay=True, maximize=False, amsgrad=False)
FORMATS = {"fp32": "float32", "bf16": "bfloat16", "8bit": "8bit"}


CRC32 = direct_io.crc32


@contextlib.contextmanager
def checksums(on: bool):
    """The tier's checksum as it is (on), or a constant (off: nothing computed, and a
    state written so verifies as read so)."""
    direct_io.crc32 = CRC32 if on else (lambda data, value=0: 0)
    try:
        yield
    finally:
        direct_io.crc32 = CRC32


def log(out, line=""):
    print(line, flush=True)
    out.append(line)


# -- the disk's limit ---------------------------------------------------------------------

def disk_pass(pool, fds, buffers, size, write):
    """Seconds to write (or read) `size` bytes of each fd sequentially, one ring buffer per
    piece, all files at once, keeping len(buffers) - 1 pieces in flight."""
    piece = buffers[0].nbytes
    t = time.perf_counter()
    run_pieces(pool, [(fd, w, offset, min(piece, size - offset))
                      for offset in range(0, size, piece) for fd, w in zip(fds, write)], buffers)
    for fd, w in zip(fds, write):
        if w:
            os.fsync(fd)
    return time.perf_counter() - t


def run_pieces(pool, pieces, buffers) -> None:
    """Each (fd, write, offset, bytes) of `pieces` written from (or read into) the next of the
    ring `buffers`, in order, len(buffers) - 1 of them in flight."""
    pending = []
    for k, (fd, w, offset, n) in enumerate(pieces):
        op = pool.write if w else pool.read
        pending.append(op(fd, buffers[k % len(buffers)].view[:n], offset))
        if len(pending) >= len(buffers) - 1:
            e = wait(pending.pop(0))
            if e:
                raise e
    for f in pending:
        e = wait(f)
        if e:
            raise e


def read_through(fds, io_threads, piece=16 << 20, passes=2) -> list:
    """Files already there (a run's param files) read start to end, each on its own, as
    disk_pass reads: GB/s per file and pass. The disk's rate for bytes written a while ago
    and read since, where disk_limit's probe reads a file it has just written (a virtual
    disk's host may still cache it)."""
    runs = []
    for fd in fds:
        size = os.fstat(fd).st_size // piece * piece
        if size:
            runs.append([(fd, False, offset, piece) for offset in range(0, size, piece)])
    return read_rates(runs, io_threads, piece, passes)


def read_rates(runs, io_threads, piece=16 << 20, passes=1) -> list:
    """Each run of (fd, False, offset, bytes) pieces read in order through a ring of 4
    buffers of `piece` bytes (run_pieces), `passes` times over: bytes/s per pass and run."""
    pool = IOPool(io_threads)
    buffers = [AlignedBuffer(piece, pin=False) for _ in range(4)]
    rates = []
    try:
        for _ in range(passes):
            for pieces in runs:
                t = time.perf_counter()
                run_pieces(pool, pieces, buffers)
                rates.append(sum(n for *_, n in pieces) / (time.perf_counter() - t))
    finally:
        pool.close()
        for b in buffers:
            b.close()
    return rates


def disk_limit(folder, size, io_threads, piece, passes=2):
    paths = [os.path.join(folder, f"limit{k}.bin") for k in range(2)]
    fds = []
    for p in paths:
        fd, direct = open_direct(p, create=True, size=size)
        if not direct:
            raise SystemExit(f"nvme_bench: {folder} refuses O_DIRECT; measure on a real disk")
        fds.append(fd)
    pool = IOPool(io_threads)
    buffers = [AlignedBuffer(piece, pin=False) for _ in range(4)]
    for b in buffers:
        b.tensor.random_(0, 256)
    try:
        disk_pass(pool, fds[1:], buffers, size, [True])          # the second file, written
        # the best of `passes` of each (a virtual disk's speed varies from pass to pass)
        write = size / min(disk_pass(pool, fds[:1], buffers, size, [True])
                           for _ in range(passes))
        read = size / min(disk_pass(pool, fds[:1], buffers, size, [False])
                          for _ in range(passes))
        mixed_t = min(disk_pass(pool, fds, buffers, size, [False, True])
                      for _ in range(passes))
    finally:
        pool.close()
        for fd in fds:
            os.close(fd)
        for p in paths:
            os.unlink(p)
        for b in buffers:
            b.close()
    return {"write_Bps": write, "read_Bps": read, "mixed_seconds_per_byte_pair": mixed_t / size,
            "mixed_Bps": 2 * size / mixed_t, "bytes": size}


# -- the step -----------------------------------------------------------------------------

def make_spec(fmt, buckets, numel):
    return StateSpec(tuple(adam_bucket([(f"b{i}", (numel,))], FORMATS[fmt])
                           for i in range(buckets)), FORMATS[fmt])


def kernel_fn(grad, threads):
    def fn(i, t):
        name = f"b{i}"
        scales = {}
        if name + ".exp_avg_scale" in t:
            scales = dict(exp_avg_scales=[t[name + ".exp_avg_scale"]],
                          exp_avg_sq_scales=[t[name + ".exp_avg_sq_scale"]])
        adam_step([t[name + ".master"]], [grad], [t[name + ".exp_avg"]],
                  [t[name + ".exp_avg_sq"]], [], [], [t[name + ".step"]], HYPER, 1.0, threads,
                  **scales)
    return fn


def fill(i, t):
    gen = torch.Generator().manual_seed(i)
    for k, v in t.items():
        v.zero_()
        if k.endswith(".master"):
            v.copy_(torch.randn(v.shape, generator=gen) * 0.1)


def measured_limit(args, size, out, when):
    with checksums(False):   # the disk's own speed
        limit = disk_limit(args.dir, size, args.io_threads, 16 << 20)
    log(out, f"disk {when} the steps (O_DIRECT, {limit['bytes'] / 1e9:.2f} GB sequential): "
             f"write {limit['write_Bps'] / 1e9:.3f} GB/s, read {limit['read_Bps'] / 1e9:.3f} "
             f"GB/s, read+write at once {limit['mixed_Bps'] / 1e9:.3f} GB/s")
    return limit


def against(row, limit, out):
    """The step's ratios to the disk's limit `limit` and to the CPU step."""
    nbytes = row["bytes_per_generation"]
    limit_t = nbytes / limit["read_Bps"] + nbytes / limit["write_Bps"]
    mixed_t = nbytes * limit["mixed_seconds_per_byte_pair"]
    step_t, cpu_t = row["step_median"], row["cpu_median"]
    bound = max(limit_t, cpu_t)
    ratios = dict(limit_seconds=limit_t, mixed_limit_seconds=mixed_t,
                  ratio_to_limit=step_t / limit_t, ratio_to_bound=step_t / bound,
                  ratio_to_mixed=step_t / mixed_t, target_met=step_t <= 1.15 * bound)
    log(out, f"{row['format']:>5} crc {row['checksums']:>3} {row['buckets']:>4} x "
             f"{row['bucket_params'] / 1e6:.2f}M "
             f"params  {nbytes / 1e9:6.2f} GB  step {step_t:6.2f} s ({row['step_GBps']:.2f} "
             f"GB/s r+w)  limit {limit_t:6.2f} s  mixed {mixed_t:6.2f} s  cpu {cpu_t:6.2f} s  "
             f"step/max(limit,cpu) {ratios['ratio_to_bound']:.3f}  "
             f"{'met' if ratios['target_met'] else 'MISSED'} (<= 1.15)  "
             f"step/mixed {ratios['ratio_to_mixed']:.3f}  "
             f"(I/O alone {row['io_only_median']:.2f} s)")
    return ratios


def bench_format(fmt, args, folder, limit, out):
    """The rows of format `fmt`: one per checksum mode, the modes' steps alternating."""
    # a bucket of --bucket-mb of state in every format (8-bit: more params per bucket)
    bucket_numel = int(args.bucket_mb * 2**20 / (make_spec(fmt, 1, 1 << 20).nbytes / 2**20))
    bucket_numel -= bucket_numel % 32768
    buckets = max(3, int(args.state_gb * 1e9 / make_spec(fmt, 1, bucket_numel).nbytes))
    spec = make_spec(fmt, buckets, bucket_numel)
    grad = torch.randn(bucket_numel) * 1e-2
    fn = kernel_fn(grad, args.threads)
    # Both: two states of each mode, made in the order on, off, off, on and stepped in a
    # round's rotating order, so that where a state's files landed (the first made was
    # ~20 % slower on the VM's disk, checksums or not) and a step's place in the round
    # weigh on both modes alike.
    states = (["on", "off", "off", "on"] if args.checksums == "both" else [args.checksums])
    rows = {mode: {"format": fmt, "checksums": mode, "buckets": buckets,
                   "params": buckets * bucket_numel, "bytes_per_generation": spec.nbytes,
                   "bucket_params": bucket_numel, "step_seconds": [], "io_only_seconds": [],
                   "load_seconds": []} for mode in dict.fromkeys(states)}
    pipes = []
    with contextlib.ExitStack() as stack:
        for k, mode in enumerate(states):
            state_dir = os.path.join(folder, f"{fmt}_{k}_{mode}")
            os.makedirs(state_dir, exist_ok=True)
            stack.callback(shutil.rmtree, state_dir)
            state = stack.enter_context(NvmeState.open([state_dir], spec,
                                                       io_threads=args.io_threads))
            pipe = StepPipeline(state, args.ring * spec.buckets[0].nbytes)
            stack.callback(pipe.close)
            rows[mode].update(ring=len(pipe.buffers), depth=pipe.depth,
                              host_buffer_bytes=pipe.host_bytes)
            with checksums(mode == "on"):
                t = time.perf_counter()
                pipe.load(fill, step=0)
                rows[mode]["load_seconds"].append(time.perf_counter() - t)
                pipe.step(fn)   # warm-up: the second slots' extents written the first time
            pipes.append((mode, pipe))
        cpu = []
        pipe = pipes[0][1]
        for _ in range(args.steps):   # the kernel alone, over the same ring buffers
            t = time.perf_counter()
            for i in range(buckets):
                fn(i, pipe.state.tensors(i, pipe.buffers[i % len(pipe.buffers)]))
            cpu.append(time.perf_counter() - t)
        rounds = []
        for k in range(args.steps):
            took = {mode: 0.0 for mode in rows}
            for j in range(len(pipes)):
                mode, pipe = pipes[(j + k) % len(pipes)]   # the order rotates
                with checksums(mode == "on"):
                    t = time.perf_counter()
                    pipe.step(fn)
                    dt = time.perf_counter() - t
                    rows[mode]["step_seconds"].append(dt)
                    took[mode] += dt
                    t = time.perf_counter()
                    pipe.step(lambda i, tensors: None)   # the pipeline's I/O alone
                    rows[mode]["io_only_seconds"].append(time.perf_counter() - t)
            rounds.append(took)
    for row in rows.values():
        step_t = statistics.median(row["step_seconds"])
        row.update(cpu_seconds=cpu, io_only_median=statistics.median(row["io_only_seconds"]),
                   step_median=step_t, cpu_median=statistics.median(cpu),
                   step_GBps=2 * spec.nbytes / step_t / 1e9)
        row["against_before"] = against(row, limit, out)
    if len(rows) == 2:
        pairs = [r["on"] / r["off"] for r in rounds]
        rows["on"]["checksum_cost_ratios"] = pairs
        log(out, f"{fmt:>5} checksums on / off, round by round (two states each): "
                 f"{' '.join(f'{r:.3f}' for r in pairs)}  median {statistics.median(pairs):.3f}")
    return list(rows.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/offload_adam_nvme_bench",
                    help="scratch directory on the disk to measure (removed at the end)")
    ap.add_argument("--state-gb", type=float, default=2.0,
                    help="GB of one generation of the state in every format (8-bit: more params)")
    ap.add_argument("--bucket-mb", type=float, default=48, help="MiB of state per bucket")
    ap.add_argument("--ring", type=int, default=6, help="host buffers (buckets) in the ring")
    ap.add_argument("--formats", default="fp32,8bit")
    ap.add_argument("--steps", type=int, default=4, help="steps per state (even: ABBA)")
    ap.add_argument("--threads", type=int, default=2, help="kernel threads")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--checksums", choices=["both", "on", "off"], default="both",
                    help="both: a state with and one without, alternating (the paired cost)")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "nvme"))
    args = ap.parse_args()
    out = []
    info = machine_info()
    load_start = load_average()
    log(out, f"nvme_bench: {one_line(info)}")
    log(out, f"directory {args.dir}; kernel threads {args.threads}; I/O threads "
             f"{args.io_threads}; ring {args.ring} buckets of {args.bucket_mb} MiB")
    os.makedirs(args.dir, exist_ok=True)
    try:
        # measured on as many bytes as one generation of the fp32 state
        size = max(64 << 20, int(args.state_gb * 1e9) // (64 << 20) * (64 << 20))
        before = measured_limit(args, size, out, "before")
        rows = [row for f in args.formats.split(",")
                for row in bench_format(f, args, args.dir, before, out)]
        after = measured_limit(args, size, out, "after")
        limit = {"before": before, "after": after}
        log(out, "the same rows against the disk measured after the steps:")
        for row in rows:
            row["against_after"] = against(row, after, out)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    load_end = load_average()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    log(out, f"peak RSS {peak_rss / 2**20:.0f} MiB (the state on disk: the ring buffers, "
             "one bucket's grad, the disk passes' buffers, torch)")
    log(out, f"load average: start {load_start}, end {load_end}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"nvme_bench_{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "args": vars(args), "disk": limit, "rows": rows,
                   "load_average_start": load_start, "load_average_end": load_end,
                   "peak_rss_bytes": peak_rss}, f, indent=1)
    with open(stem + ".log", "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {stem}.json and .log")


if __name__ == "__main__":
    main()
