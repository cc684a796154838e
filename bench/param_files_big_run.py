#!/usr/bin/env python3
"""Params and state on disk beyond this machine's RAM: stream_params(param_dirs=) + AdamW(state_dirs=).

Issue 28's acceptance run. A stack of wide MLP blocks (bf16), built on the meta device so that
no full copy ever sits in RAM, streams its blocks' params from param files through a cache of
`--cache-mb`, on the synchronous host stand-in of a GPU (engine/device.HostDevice: the "device"
copies are memcpy, its memory is RAM and counted); the optimizer keeps the fp32 master and moments
in compact state files (state_footprint="compact"; --footprint two_generations the other
layout) and steps each block during backward (step_in_backward), the grads through its bounded
ring. The disk's bytes (st_blocks) are taken before the first step and after the last: with
--heads the peak is the larger. In one run, on one directory:

  disk limit   O_DIRECT sequential write and read bandwidth before and after (nvme_bench.disk_limit);
               with --probe-each-gb also between iterations, each iteration then set against
               the mean of the limits probed on either side of it (the VM's disk drifts)
  compute      forward and backward of --compute-blocks blocks resident, nothing read or
               written (compute_floor), scaled to the model: each phase of an iteration is set
               against the larger of its compute and its disk bytes at the probed speeds, the
               iteration against their sum (on this stand-in the CPU computes what a GPU would)
  steps        forward + backward + step() per iteration, --steps of them (the first writes the
               state for the first time); per iteration the bytes read and written (/proc/self/io)
  expected     the bytes the design says (the planner's terms, offload_adam/plan.py): the state
               read and written, the grad log written and read back, the param files read where
               the cache misses in forward and backward (the compact pass at step() writes
               each block whole: none read), the new params written (none with --heads)
  peak RSS     VmHWM during the steps against the caches' budgets + the rings + the "device"
               memory (the blocks on the device at once and the activations) + 1 GiB; a thread
               watching VmRSS says in which phase the peak came and what glibc's heap held then

The stand-in's "device" memory is malloc'd host memory: glibc's dynamic mmap threshold rises to
the largest buffer freed (the 32 MiB grads) and then serves every smaller one from its heap, where
freed buffers stay (fragmented: with the grads' fingerprints in 8 MiB chunks, 0.33 GiB of a
24-block run's peak, and more the longer the run). On a GPU they are device memory. So by default
the run fixes the threshold at 4 MiB (mallopt M_MMAP_THRESHOLD, this process only): larger buffers
are mmap'd and returned when freed, the fingerprints' 1 MiB chunks on the CPU (engine/grads.py)
reused from the heap; --malloc glibc keeps glibc's default.

limit = bytes read / read GB/s + bytes written / write GB/s (each probe); ratio = iteration / limit.

    flock /tmp/offload_bench.lock python bench/param_files_big_run.py     # ~48 GB on disk, ~10 min
    python bench/param_files_big_run.py --blocks 3 --dim 512 --limit-gb 0.5 --out /tmp/x  # smoke

Writes results/nvme/param_files_big_run_<tag>.json and .log.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload_adam  # noqa: E402
from offload_adam import nvme_tier, param_files  # noqa: E402
from offload_adam.nvme.direct_io import allocated_bytes  # noqa: E402
from offload_adam.engine.device import HostDevice  # noqa: E402
from offload_adam.testing import ring_buffers, simulated, state_files  # noqa: E402
from bench.machine import load_average, machine_info, one_line  # noqa: E402
from bench.nvme_bench import disk_limit, log  # noqa: E402
from bench.nvme_big_run import limit_of, peak_rss, reset_peak, rss_now, save_run  # noqa: E402


def probe(args, out, when) -> dict:
    """The disk's sequential O_DIRECT speeds between iterations: --probe-each-gb per file,
    one pass each way (smaller and quicker than the probes before and after the run)."""
    lim = disk_limit(args.dir, int(args.probe_each_gb * 2**30) // (64 << 20) * (64 << 20),
                     args.io_threads, 16 << 20, passes=1)
    log(out, f"disk {when}: write {lim['write_Bps'] / 1e9:.3f} GB/s, read "
             f"{lim['read_Bps'] / 1e9:.3f} GB/s")
    return lim


class Block(torch.nn.Module):
    """x + down(silu(up(norm(x)))): 2 x dim x hidden params, the shape of a Llama MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=True, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def compute_floor(args, out) -> dict:
    """What forward and backward take with nothing read or written: --compute-blocks of the
    model's blocks resident in RAM (bf16, this process's threads, the run's tokens), median
    of 5 after a warm-up, scaled to --blocks. On the host stand-in the "device" is this CPU,
    so an iteration's forward can be no faster than max(this, its reads at the disk's read
    speed), backward likewise with its reads and writes; step() computes only the CPU step."""
    k = max(1, min(args.compute_blocks, args.blocks))
    gen = torch.Generator().manual_seed(2)
    blocks = torch.nn.ModuleList(Block(args.dim, args.hidden) for _ in range(k)).to(torch.bfloat16)
    with torch.no_grad():
        for p in blocks.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=gen)
    x = torch.randn(args.tokens, args.dim, generator=gen).to(torch.bfloat16)
    fwd, bwd = [], []
    for _ in range(6):
        t = time.perf_counter()
        y = x
        for b in blocks:
            y = b(y)
        loss = y.float().pow(2).mean()
        t_f = time.perf_counter()
        loss.backward()
        t_b = time.perf_counter()
        fwd.append(t_f - t)
        bwd.append(t_b - t_f)
        blocks.zero_grad(set_to_none=True)
    scale = args.blocks / k
    floor = {"blocks_timed": k, "forward_s": statistics.median(fwd[1:]) * scale,
             "backward_s": statistics.median(bwd[1:]) * scale}
    log(out, f"compute alone ({k} blocks resident, median of 5, scaled to {args.blocks}): forward "
             f"{floor['forward_s']:.1f} s, backward {floor['backward_s']:.1f} s")
    return floor


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, dim: int, hidden: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.out = torch.nn.Parameter(torch.ones(dim))   # resident

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x.float() * self.out.float()).pow(2).mean()


_M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None   # not glibc (or older than 2.33): the heap is not reported


def fix_mmap_threshold(nbytes: int) -> bool:
    """Allocations of `nbytes` or more mmap'd and returned when freed (see the docstring)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1)


class PeakWatch:
    """Samples VmRSS every ~2 ms on a thread of its own; at each new peak keeps the phase
    the model thread set (`phase`) and glibc's heap then: its size and its free bytes."""

    def __init__(self):
        self.phase, self.peak, self.at = "start", 0, {}
        self._libc, self._stop = _libc(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.002):
            r = rss_now()
            if r > self.peak:
                self.peak = r
                self.at = {"phase": self.phase}
                if self._libc is not None:
                    m = self._libc.mallinfo2()
                    self.at.update(heap_bytes=m.arena, heap_free_bytes=m.fordblks,
                                   mmapped_bytes=m.hblkhd)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return dict(self.at, rss=self.peak)


def io_bytes():
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/offload_adam_param_files_big")
    ap.add_argument("--blocks", type=int, default=84)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--cache-mb", type=float, default=2048.0, help="param_cache_mb=")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=100.0)
    ap.add_argument("--budget-mb", type=float, default=2600.0,
                    help="state_budget_mb= (the state ring: 12 of the largest bucket, one param)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16", "8bit"))
    ap.add_argument("--footprint", default="compact", choices=("compact", "two_generations"),
                    help="state_footprint= (two_generations: no redo log; the slots the "
                         "second step writes reserved after the first)")
    ap.add_argument("--heads", action=argparse.BooleanOptionalAction, default=True,
                    help="design R2 (nvme_tier.HEADS, the default; --no-heads: whole "
                         "masters): the blocks' params kept as the heads of their state's "
                         "buckets, masters split, their param file extents given back once "
                         "a step committed them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compute-blocks", type=int, default=4,
                    help="blocks timed resident for the compute floor (compute_floor)")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--probe-each-gb", type=float, default=0.0,
                    help="also probe the disk between iterations (GiB per file, one pass "
                         "each way): each iteration against the probes on either side of it")
    ap.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                    help="fixed: glibc's mmap threshold fixed at 4 MiB (see above); glibc: its default")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "nvme"))
    args = ap.parse_args()
    fixed = args.malloc == "fixed" and fix_mmap_threshold(4 << 20)
    torch.set_num_threads(args.threads)
    out, row = [], {"args": vars(args)}
    info = machine_info()
    row.update(machine=info, load_start=load_average())
    log(out, f"param_files_big_run: {one_line(info)}")
    row["malloc"] = "mmap threshold fixed at 4 MiB" if fixed else "glibc default"
    log(out, f"malloc: {row['malloc']}")
    os.makedirs(args.dir, exist_ok=True)
    try:
        row["limit_before"] = before = limit_of(args, out, "before the run")
        row["compute_floor"] = floor = compute_floor(args, out)
        rss_start = rss_now()
        with simulated(HostDevice(torch.device("cpu"))):
            with torch.device("meta"):
                model = Stack(args.blocks, args.dim, args.hidden).to(torch.bfloat16)
            param_dir = os.path.join(args.dir, "params")
            t = time.perf_counter()
            _, w_setup = io_bytes()
            streamer = offload_adam.stream_params(model, Block, prefetch=args.prefetch,
                                                  param_dirs=param_dir,
                                                  param_cache_mb=args.cache_mb)
            gen = torch.Generator().manual_seed(0)
            # the weights, block by block (as a checkpoint's shards; the keys and shapes from
            # the params: a state_dict() of a block not loaded yet would write its NaNs first)
            for layer in model.layers:
                layer.load_state_dict({k: torch.empty(v.shape, dtype=v.dtype).normal_(
                    0, 0.02, generator=gen) if k != "norm.weight" else torch.ones(v.shape, dtype=v.dtype)
                    for k, v in layer.named_parameters()})
            with torch.no_grad():
                model.out.fill_(1.0)
            streamer.files.flush()
            n_streamed = sum(p.numel() for layer in model.layers for p in layer.parameters())
            n = n_streamed + model.out.numel()
            block_bytes = streamer.largest_block_bytes
            # (the meta model's NaNs are not written: the load is the blocks' one write)
            row["setup_written_bytes"] = io_bytes()[1] - w_setup
            log(out, f"{args.blocks} blocks of {block_bytes / 1e6:.0f} MB (dim {args.dim}, hidden "
                     f"{args.hidden}): {n / 1e9:.3f} B params, {2 * n_streamed / 1e9:.2f} GB of "
                     f"bf16 blocks; streamed and loaded in {time.perf_counter() - t:.0f} s, "
                     f"{row['setup_written_bytes'] / 1e9:.2f} GB written; cache "
                     f"{streamer.files.cache_bytes / 2**20:.0f} MiB = {len(streamer.files.slots)} blocks")
            state_dir = os.path.join(args.dir, "state")
            os.makedirs(state_dir)
            nvme_tier.HEADS = args.heads
            opt = offload_adam.AdamW(model.parameters(), lr=1e-4, num_threads=args.threads,
                                     state_dirs=state_dir, state_footprint=args.footprint,
                                     step_in_backward=True, free_grads_after_copy=True,
                                     bucket_mb=args.bucket_mb, state_budget_mb=args.budget_mb,
                                     state_dtype=args.state_dtype)
            # the disk's bytes before the first step (the peak is this or after it)
            opened = {name: sum(allocated_bytes(os.path.join(d, f)) for f in os.listdir(d))
                      for name, d in (("state", state_dir), ("params", param_dir))}
            log(out, f"allocated on disk before the first step (st_blocks): state "
                     f"{opened['state'] / 1e9:.2f} GB + params {opened['params'] / 1e9:.2f} GB "
                     f"= {(opened['state'] + opened['params']) / n:.2f} B/param")
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(args.tokens, args.dim, generator=gen).to(torch.bfloat16)
            reset_peak()
            watch = PeakWatch()
            rss_before = rss_now()
            steps, phases, traffic, step_traffic, rss = [], [], [], [], []
            fwd_traffic = []   # forward's (read, written); backward's = the rest before step()
            probes = []   # --probe-each-gb: before iteration k, probes[k]; after the last
            for k in range(args.steps):
                if args.probe_each_gb:
                    watch.phase = f"probe {k + 1}"
                    probes.append(probe(args, out, f"before iteration {k + 1}"))
                r0, w0 = io_bytes()
                t = time.perf_counter()
                watch.phase = f"forward {k + 1}"
                loss = model(x)
                t_fwd = time.perf_counter()
                rf, wf = io_bytes()
                fwd_traffic.append((rf - r0, wf - w0))
                watch.phase = f"backward {k + 1}"
                loss.backward()
                t_bwd = time.perf_counter()
                rb, wb = io_bytes()
                watch.phase = f"step() {k + 1}"
                opt.step()
                opt.zero_grad()
                t_end = time.perf_counter()
                steps.append(t_end - t)
                phases.append((t_fwd - t, t_bwd - t_fwd, t_end - t_bwd))
                r1, w1 = io_bytes()
                traffic.append((r1 - r0, w1 - w0))
                step_traffic.append((r1 - rb, w1 - wb))
                rss.append(rss_now())
                log(out, f"iteration {k + 1}: {steps[-1]:.1f} s (forward {phases[-1][0]:.1f}, "
                         f"backward {phases[-1][1]:.1f}, step() {phases[-1][2]:.1f}), read "
                         f"{traffic[-1][0] / 1e9:.2f} GB, written {traffic[-1][1] / 1e9:.2f} GB  "
                         f"VmRSS {rss[-1] / 2**30:.2f} GiB  peak {peak_rss() / 2**30:.2f} GiB")
            if args.probe_each_gb:
                probes.append(probe(args, out, f"after iteration {args.steps}"))
            files = state_files(opt)
            gen_bytes = files.spec.nbytes
            ring = sum(b.nbytes for b in ring_buffers(opt))
            grad_ring = opt._engine.ring.nbytes if getattr(opt._engine, "ring", None) else 0
            disk = {name: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
                    for name, d in (("state", state_dir), ("params", param_dir))}
            # (what the files take: a hole, a block's extent given back, takes nothing)
            allocated = {name: sum(allocated_bytes(os.path.join(d, f)) for f in os.listdir(d))
                         for name, d in (("state", state_dir), ("params", param_dir))}
            row["state_files"] = {f: os.path.getsize(os.path.join(state_dir, f))
                                  for f in sorted(os.listdir(state_dir))}
            row["largest_bucket_bytes"] = max(b.nbytes for b in files.spec.buckets)
            row_peak = peak_rss()
            at_peak = watch.stop()
            cache = streamer.files.cache_bytes
            head_buffers = streamer.files.head_buffers_peak
            opt.close()
            streamer.close()
        shutil.rmtree(state_dir)
        row["limit_after"] = after = limit_of(args, out, "after the run")
        # what the design says a step moves (plan.py's terms)
        compact = args.footprint == "compact"
        log_bytes = 2 * n if compact else 0
        miss = max(0, 2 * n_streamed - cache)
        # (the compact pass at step() writes each block whole: it reads none)
        expect_read = gen_bytes + log_bytes + 2 * miss
        # (--heads: the new params are the state's heads, written with it; the compact
        # pass commits before the cache gives a block away: no param file written; two
        # generations commit at the end, so a block given away before goes to its file)
        params_written = 0 if args.heads and compact else 2 * n_streamed
        expect_write = gen_bytes + log_bytes + params_written
        med = statistics.median(steps[1:] or steps)
        med_read = statistics.median(r for r, _ in traffic[1:] or traffic)
        med_write = statistics.median(w for _, w in traffic[1:] or traffic)
        log(out, f"on disk: state {disk['state'] / 1e9:.1f} GB + params {disk['params'] / 1e9:.1f} GB "
                 f"= {(disk['state'] + disk['params']) / 1e9:.1f} GB "
                 f"({(disk['state'] + disk['params']) / n:.2f} B/param: "
                 + ", ".join(f"{f} {b / n:.3f}" for f, b in row["state_files"].items()
                             if b) + f", params {disk['params'] / n:.3f}; largest bucket "
                 f"{row['largest_bucket_bytes'] / 2**20:.1f} MiB); RAM "
                 f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB")
        log(out, f"allocated on disk after the last step (st_blocks; holes not counted): state "
                 f"{allocated['state'] / 1e9:.2f} GB + params {allocated['params'] / 1e9:.2f} GB = "
                 f"{(allocated['state'] + allocated['params']) / n:.2f} B/param"
                 + (" (--heads: the blocks in the heads have their param file extents given "
                    "back)" if args.heads else ""))
        log(out, f"bytes per iteration (median of 2..): read {med_read / 1e9:.2f} GB (expected at "
                 f"most {expect_read / 1e9:.2f}: state {gen_bytes / 1e9:.2f} + log {log_bytes / 1e9:.2f} "
                 f"+ param misses in forward and backward {2 * miss / 1e9:.2f}), written {med_write / 1e9:.2f} GB (expected "
                 f"{expect_write / 1e9:.2f}: state + log + params {params_written / 1e9:.2f}"
                 + (", at most" if args.heads and not compact else "") + ")")
        later = range(1, len(steps)) if len(steps) > 1 else range(len(steps))
        med_step = statistics.median(phases[k][2] for k in later)
        med_fb = statistics.median(phases[k][0] + phases[k][1] for k in later)
        step_read = statistics.median(step_traffic[k][0] for k in later)
        step_write = statistics.median(step_traffic[k][1] for k in later)
        for name, lim in (("before", before), ("after", after)):
            limit_t = med_read / lim["read_Bps"] + med_write / lim["write_Bps"]
            step_limit = step_read / lim["read_Bps"] + step_write / lim["write_Bps"]
            row[f"ratio_{name}"] = {"limit_seconds": limit_t, "ratio": med / limit_t,
                                    "target_met": med <= 1.15 * limit_t,
                                    "step_limit_seconds": step_limit,
                                    "step_ratio": med_step / step_limit}
            log(out, f"against the disk {name}: limit {limit_t:.1f} s for the bytes moved, "
                     f"iteration (median of 2..) {med:.1f} s, ratio {med / limit_t:.3f} "
                     f"({'met' if med <= 1.15 * limit_t else 'MISSED'}: <= 1.15); step() alone "
                     f"{med_step:.1f} s for {step_read / 1e9:.2f} GB read + {step_write / 1e9:.2f} GB "
                     f"written: limit {step_limit:.1f} s, ratio {med_step / step_limit:.3f}; forward + "
                     f"backward {med_fb:.1f} s (computed by the CPU here: set per phase against the larger of "
                     f"compute and disk below)")
        # each phase against the larger of its compute (compute_floor) and its disk bytes:
        # what this stand-in could do at best, the compute being the CPU's here
        for name, lim in (("before", before), ("after", after)):
            per = []
            for k in later:
                fr, fw = fwd_traffic[k]
                br = traffic[k][0] - step_traffic[k][0] - fr
                bw = traffic[k][1] - step_traffic[k][1] - fw
                # (not `disk`: the files' sizes, saved as disk_bytes below)
                phase_disk = [fr / lim["read_Bps"] + fw / lim["write_Bps"],
                              br / lim["read_Bps"] + bw / lim["write_Bps"],
                              step_traffic[k][0] / lim["read_Bps"]
                              + step_traffic[k][1] / lim["write_Bps"]]
                bounds = [max(floor["forward_s"], phase_disk[0]),
                          max(floor["backward_s"], phase_disk[1]), phase_disk[2]]
                per.append({"iteration": k + 1, "phase_seconds": phases[k],
                            "phase_disk_seconds": phase_disk, "phase_bound_seconds": bounds,
                            "ratio": steps[k] / sum(bounds)})
            ratio = statistics.median(p["ratio"] for p in per)
            row[f"phase_ratio_{name}"] = {"per_iteration": per, "ratio": ratio}
            mid = per[len(per) // 2]
            log(out, f"per phase against max(compute, disk {name}), iteration {mid['iteration']}: "
                     + ", ".join(f"{what} {t:.1f} s / {b:.1f}" for what, t, b in zip(
                         ("forward", "backward", "step()"), mid["phase_seconds"],
                         mid["phase_bound_seconds"]))
                     + f" (disk alone {' / '.join(f'{d:.1f}' for d in mid['phase_disk_seconds'])}"
                     f"); iteration / the sum, median of 2..: {ratio:.3f}")
        if probes:   # each iteration against the disk just before and just after it
            per = []
            for k in later:
                around = (probes[k], probes[k + 1])
                limit_t = sum(traffic[k][0] / p["read_Bps"] + traffic[k][1] / p["write_Bps"]
                              for p in around) / 2
                per.append({"iteration": k + 1, "limit_seconds": limit_t,
                            "ratio": steps[k] / limit_t})
            ratio = statistics.median(p["ratio"] for p in per)
            row["ratio_around"] = {"per_iteration": per, "probes": probes, "ratio": ratio,
                                   "target_met": ratio <= 1.15}
            log(out, "against the disk probed on either side of each iteration (the mean of the "
                     "two limits): " + ", ".join(f"iteration {p['iteration']} {p['ratio']:.3f}"
                                                 for p in per)
                + f"; median {ratio:.3f} ({'met' if ratio <= 1.15 else 'MISSED'}: <= 1.15)")
        device_peak = (args.prefetch + 2) * block_bytes
        # --heads: a block over several buckets is read from its heads through buffers
        # beside the cache's slots, HEAD_READS blocks' worth in flight (ParamFiles.read_ahead;
        # this model's blocks are all one size)
        head_bound = param_files.HEAD_READS * block_bytes if args.heads else 0
        bound = cache + ring + grad_ring + device_peak + head_bound + 2**30
        log(out, f"peak RSS {row_peak / 2**30:.2f} GiB ({(row_peak - rss_start) / 2**30:.2f} above "
                 f"the start's {rss_start / 2**30:.2f}); bound: param cache {cache / 2**20:.0f} MiB + "
                 f"state ring {ring / 2**20:.0f} MiB + grad ring {grad_ring / 2**20:.0f} MiB + device "
                 f"blocks {device_peak / 2**20:.0f} MiB"
                 + (f" + head reads {head_bound / 2**20:.0f} MiB" if args.heads else "")
                 + f" + 1 GiB = {bound / 2**30:.2f} GiB above the "
                 f"start: {'within' if row_peak - rss_start <= bound else 'ABOVE'}")
        if args.heads:
            log(out, f"head reads' buffers beside the cache: at most {head_buffers / 2**20:.0f} MiB "
                     "at once")
        if "heap_bytes" in at_peak:
            log(out, f"at the peak (sampled {at_peak['rss'] / 2**30:.2f} GiB, in {at_peak['phase']}): "
                     f"glibc heap {at_peak['heap_bytes'] / 2**20:.0f} MiB, of it free "
                     f"{at_peak['heap_free_bytes'] / 2**20:.0f} MiB; malloc's mmaps "
                     f"{at_peak['mmapped_bytes'] / 2**20:.0f} MiB")
        row.update(params=n, streamed=n_streamed, block_bytes=block_bytes, cache_bytes=cache,
                   state_ring_bytes=ring, grad_ring_bytes=grad_ring, disk_bytes=disk,
                   disk_allocated_bytes=allocated, disk_allocated_before_first=opened,
                   heads=args.heads, footprint=args.footprint,
                   head_buffers_peak=head_buffers,
                   generation_bytes=gen_bytes, log_bytes=log_bytes, expected_read=expect_read,
                   expected_write=expect_write, traffic=traffic, step_seconds=steps,
                   phase_seconds=phases, step_traffic=step_traffic, forward_traffic=fwd_traffic,
                   step_median=med, read_median=med_read, write_median=med_write,
                   rss_start=rss_start, rss_before_steps=rss_before, vmrss_after_steps=rss,
                   peak_rss=row_peak, rss_bound_above_start=bound,
                   within_rss_bound=row_peak - rss_start <= bound, at_peak=at_peak)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    save_run(args.out, f"param_files_big_run_{args.tag}", row, out)

if __name__ == "__main__":
    main()
