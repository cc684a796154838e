#!/usr/bin/env python3
"""Does the param files' reader keep up with the disk? Forward and backward read rates against a probe.

Issue 28's GPU run (bench/stream_gpu.py, stage stream_7b_files) read its forward's cache misses at
~1.47 GB/s on a disk whose probe read 2.41 GB/s (2026-12-04b), and at 1.29 against 1.52 on another
machine (2026-11-28). Either the disk serves the run's 13 GB of files slower than the probe's 2 GiB,
or the reader (ParamFiles: `io_threads` threads of 4 MiB requests, read ahead in the recorded order
only into slots the cache gives away) leaves the disk idle. This run takes the compute out: blocks
of frozen bf16 weights that forward only touches (one row), each with a small trainable scale so that
backward fetches the block again as in training, on a host stand-in of a GPU whose copies to the
"device" copy only each tensor's first 64 Ki elements (`--copies first`; on a GPU the copies are
DMA, no CPU time, where a memcpy of every block, `--copies whole`, keeps a 2-core VM busy: then
forward and backward are the CPU's memcpy, not the disk). So forward and backward are the param
files' reads and little else, and their rates are set against the disk probed with the same
thread count just before and just after (nvme_bench.disk_limit: 4 MiB requests, O_DIRECT).

    per phase   seconds, bytes read from the param files (ParamFiles.read_bytes), GB/s, and the
                ratio to the mean of the two probes' read rates (1.0: the disk's speed)
    hold_s      the seconds forward's fetches spent in ParamFiles.hold(): waiting for the disk
    read through  after the iterations, the param files read start to end (nvme_bench.read_through):
                the disk's rate for these bytes, which the probe's file, read just after it was
                written, may overstate (a virtual disk's host cache)
    block by block  the same files read block by block in ascending and in descending order
                (read_blocks): forward's misses come in the first order, backward's in the
                second, each phase set against the rate of its own

    flock /tmp/offload_bench.lock python bench/param_files_read.py     # 3 GiB of files, ~1 min
    python bench/param_files_read.py --blocks 6 --rows 1024 --probe-gb 0.25 --out /tmp/x   # smoke

Writes results/nvme/param_files_read_<tag>.json and .log.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam.engine.device import HostDevice, Transfer, as_list  # noqa: E402
from offload_adam.testing import simulated  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit, log, read_rates, read_through  # noqa: E402
from bench.nvme_big_run import save_run  # noqa: E402
from bench.param_files_big_run import io_bytes  # noqa: E402


class Block(torch.nn.Module):
    """x * scale + weight[0]: forward reads one row of its weight, yet the streamer copies the
    whole block to the "device" before each use, as it would before a real layer's."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, dim), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.scale + self.weight[0]


class FirstDevice(HostDevice):
    """HostDevice whose copies move only each tensor's first 64 Ki elements: what forward
    reads of a Block (its scale, one row of its weight) arrives, the rest of the "device"
    copy is whatever its memory held. A bench's stand-in, for timing the files alone."""

    def _copy(self, dsts, srcs):
        t0 = time.perf_counter()
        for d, s in zip(as_list(dsts), as_list(srcs)):
            n = min(d.numel(), 1 << 16)
            d.view(-1)[:n].copy_(s.reshape(-1)[:n])
        return Transfer(t0, time.perf_counter())


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, rows: int, dim: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(rows, dim) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def read_blocks(files, order, io_threads, piece=16 << 20, passes=2) -> list:
    """The param files' blocks read whole in `order` (each block start to end, in pieces of
    `piece` with 3 in flight, as read_through reads): GB/s per pass. Backward reads its misses
    in the blocks' descending order, forward in ascending: each phase is set against the rate
    of its own order, in case the disk (or a virtual disk's host, reading ahead of an
    ascending stream) serves the two differently."""
    ranges = []
    for i in order:
        fd, offset, size = files._extent(i)
        ranges += [(fd, False, offset + at, min(piece, size - at)) for at in range(0, size, piece)]
    return read_rates([ranges], io_threads, piece, passes)


def probe(args, out, when) -> dict:
    size = int(args.probe_gb * 2**30) // (64 << 20) * (64 << 20)
    lim = disk_limit(args.dir, size, args.io_threads, 16 << 20, passes=2)
    log(out, f"disk {when} ({size / 2**30:.2f} GiB, {args.io_threads} threads, best of 2): "
             f"read {lim['read_Bps'] / 1e9:.3f} GB/s, write {lim['write_Bps'] / 1e9:.3f} GB/s")
    return lim


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/offload_adam_param_files_read")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--cache-blocks", type=int, default=8,
                    help="param_cache_mb= as this many of the largest block")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--probe-gb", type=float, default=2.0)
    ap.add_argument("--copies", choices=("first", "whole"), default="first",
                    help="the stand-in's copies to the device: each tensor's first 64 Ki "
                         "elements (the files timed alone) or all of it (a memcpy)")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "nvme"))
    args = ap.parse_args()
    out: list = []
    info = machine_info()
    log(out, f"param_files_read: {one_line(info)}")
    os.makedirs(args.dir, exist_ok=True)
    row = {"args": vars(args), "machine": info, "load_start": load_average()}
    try:
        before = probe(args, out, "before")
        device = (FirstDevice if args.copies == "first" else HostDevice)(torch.device("cpu"))
        with simulated(device):
            with torch.device("meta"):
                model = Stack(args.blocks, args.rows, args.dim).to(torch.bfloat16)
            block_mb = 2 * (args.rows + 1) * args.dim / 2**20
            streamer = offload_adam.stream_params(
                model, Block, prefetch=args.prefetch, param_dirs=os.path.join(args.dir, "params"),
                param_cache_mb=args.cache_blocks * (block_mb + 1))
            for layer in model.layers:
                layer.load_state_dict({"weight": torch.full((args.rows, args.dim), 0.01,
                                                            dtype=torch.bfloat16),
                                       "scale": torch.ones(args.dim, dtype=torch.bfloat16)})
            streamer.files.flush()
            files = streamer.files
            log(out, f"{args.blocks} blocks of {block_mb:.1f} MiB ({args.blocks * block_mb / 1024:.2f} "
                     f"GiB of param files), cache {len(files.slots)} blocks, prefetch "
                     f"{args.prefetch}, {args.io_threads} I/O threads, copies to the device: {args.copies}")
            opt = offload_adam.AdamW(model.parameters(), lr=1e-4)
            x = torch.randn(8, args.dim).to(torch.bfloat16)
            phases = []
            t_all, io_all = time.perf_counter(), io_bytes()
            for k in range(args.steps):
                r0, h0 = files.read_bytes, files.hold_s["fetch"]
                t0 = time.perf_counter()
                loss = model(x)
                t1 = time.perf_counter()
                r1, h1 = files.read_bytes, files.hold_s["fetch"]
                loss.backward()
                t2 = time.perf_counter()
                r2, h2 = files.read_bytes, files.hold_s["fetch"]
                opt.step()
                opt.zero_grad()
                t3 = time.perf_counter()
                phases.append({"forward": (t1 - t0, r1 - r0, h1 - h0),
                               "backward": (t2 - t1, r2 - r1, h2 - h1),
                               "step()": (t3 - t2, files.read_bytes - r2,
                                          files.hold_s["fetch"] - h2)})
                log(out, f"iteration {k + 1}: " + ", ".join(
                    f"{name} {s:.2f} s, {b / 1e9:.2f} GB read ({b / s / 1e9:.2f} GB/s), "
                    f"held {h:.2f} s" for name, (s, b, h) in phases[-1].items()))
            # (the whole: reads started in one phase may end in the next; /proc's count is
            # what reached the disk)
            t_all, io_all = time.perf_counter() - t_all, io_bytes()[0] - io_all[0]
            row["iterations"] = {"seconds": t_all, "disk_read_bytes": io_all}
            log(out, f"{args.steps} iterations: {t_all:.2f} s, {io_all / 1e9:.2f} GB read from the "
                     f"disk (/proc/self/io): {io_all / t_all / 1e9:.2f} GB/s")
            files.flush()
            # (the files' rate: written minutes ago, read since; the probe's was just written)
            row["files_read"] = read_through(files.fds, args.io_threads)
            log(out, "the param files read through, start to end: " + ", ".join(
                f"{r / 1e9:.3f}" for r in row["files_read"]) + " GB/s")
            # (in turn, ABBA: the disk's rate drifts within a minute, and a pass just after
            # another over the same bytes may find some in the host's cache)
            blocks = list(range(args.blocks))
            orders = {"ascending": blocks, "descending": blocks[::-1]}
            for name in ("ascending", "descending", "descending", "ascending"):
                row.setdefault(f"files_read_{name}", []).extend(
                    read_blocks(files, orders[name], args.io_threads, passes=1))
            for name in orders:
                log(out, f"the param files read block by block, {name} (ABBA): " + ", ".join(
                    f"{r / 1e9:.3f}" for r in row[f"files_read_{name}"]) + " GB/s")
            opt.close()
            streamer.close()
        after = probe(args, out, "after")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    disk = (before["read_Bps"] + after["read_Bps"]) / 2
    files_rate = statistics.median(row["files_read"])
    later = phases[1:] or phases   # (the first forward reads every block: its cache is empty)
    row.update(before=before, after=after, phases=phases)
    for name, order in (("forward", "ascending"), ("backward", "descending")):
        rate = statistics.median(b / s for s, b, _ in (p[name] for p in later))
        ordered = statistics.median(row[f"files_read_{order}"])
        row[name] = {"median_Bps": rate, "ratio_to_probe": rate / disk,
                     "ratio_to_files": rate / files_rate, "ratio_to_order": rate / ordered}
        log(out, f"{name}: median {rate / 1e9:.2f} GB/s over iterations 2..: {rate / disk:.2f} x "
                 f"the probes' read rate (their mean, {disk / 1e9:.2f} GB/s), {rate / files_rate:.2f} "
                 f"x the param files read through ({files_rate / 1e9:.2f} GB/s), "
                 f"{rate / ordered:.2f} x them read block by block in its order, {order} "
                 f"({ordered / 1e9:.2f} GB/s)")
    save_run(args.out, f"param_files_read_{args.tag}", row, out)


if __name__ == "__main__":
    main()
