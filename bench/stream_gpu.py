#!/usr/bin/env python3
"""Params streamed per block on a GPU (offload_adam.stream_params) against the same model
with every param resident, in one process, on one GPU.

Per mode (resident, streamed with prefetch k for each --prefetch): the median of --steps
timed steps (after --warmup) of: forward + backward (CUDA events), opt.step() (wall), the
whole iteration (wall, synchronized); the peak device memory (max_memory_allocated); the
param bytes sent host-to-device per step (the streamer's count). The bound a streamed
step is measured against: max(resident forward + backward, 2 x streamed bytes / the pinned
host-to-device bandwidth measured here, resident opt.step()).

    python bench/stream_gpu.py                      # ~0.9B-param GPT, batch 4 x 2048
    python bench/stream_gpu.py --layers 4 --width 1024 --steps 3 --out /tmp/s   # smoke
    # ~6.9B GPT (32 x 4096) streamed under a 24 GB cap, activation checkpointing, 8-bit
    # moments, the CPU step during backward; resident measured without optimizer, uncapped:
    python bench/stream_gpu.py --layers 32 --width 4096 --checkpoint --cap-gb 24 \
        --state-dtype 8bit --step-in-backward --free-grads --resident compute --prefetch 2 \
        --steps 3

Writes <out>/stream_gpu_<tag>.json. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pinned_h2d_gbps(nbytes=1 << 30, repeats=5):
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


class Checkpointed(torch.nn.Module):
    """A block run under non-reentrant activation checkpointing: the block is called
    inside the checkpointed function, so its streaming hooks run in the recompute too."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


class NoStep:
    """Forward + backward only (the resident compute the bound is measured against)."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def step(self):
        pass

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def kept_blocks(n: int, keep: int) -> List[int]:
    """Which of n blocks stay resident when `keep` of them do (--keep-resident): spread
    evenly, so that each streamed block's copy has the compute of the resident ones
    around it to hide behind (a forward bound by its copies, as the 13B's at batch 4 on
    an H200: 0.46 s of copies against 0.34 s of compute, has slack every few blocks)."""
    if not 0 <= keep <= n:
        raise ValueError(f"--keep-resident {keep}: the model has {n} blocks")
    return [int((i + 0.5) * n / keep) for i in range(keep)]


def streamed_blocks(model, keep: int):
    """stream_params' `blocks=` for the e2e model with `keep` of its blocks resident
    (kept_blocks): a predicate over its _Blocks (inside Checkpointed wrappers or not)."""
    from bench.e2e.model import _Block
    kept = [model.blocks[i] for i in kept_blocks(len(model.blocks), keep)]
    kept = {id(getattr(b, "inner", b)) for b in kept}   # (a wrapper's block streams, or stays)
    return lambda name, m: isinstance(m, _Block) and id(m) not in kept


def run_mode(cfg, args, prefetch):
    import offload_adam
    from bench.e2e.model import build_model
    mode = "resident" if prefetch is None else f"streamed k={prefetch}"
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    # Built on the device (fast init), then, streamed, moved to host memory before the cap
    # applies: a model over the cap never has to fit it whole.
    torch.cuda.set_per_process_memory_fraction(1.0)
    model = build_model(cfg, "cuda", torch.bfloat16)
    if prefetch is not None:
        model.cpu()
        torch.cuda.empty_cache()
    _cap(args, prefetch is not None)
    setup = {"model": _progress(mode, "model built", t0)}
    if args.checkpoint:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    streamer = None
    if prefetch is not None:
        files = ({} if not args.param_dir else
                 dict(param_dirs=args.param_dir, param_cache_mb=args.param_cache_mb))
        streamer = offload_adam.stream_params(model, streamed_blocks(model, args.keep_resident),
                                              prefetch=prefetch, **files)
        setup["streamer"] = _progress(mode, "streamer set up", t0) - setup["model"]
    if prefetch is None and args.resident == "compute":
        opt = NoStep(model)
    else:
        opt = offload_adam.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                 state_dtype=args.state_dtype,
                                 step_in_backward=args.step_in_backward,
                                 free_grads_after_copy=args.free_grads,
                                 grad_ring_mb=(args.grad_ring_mb or None)
                                 if args.step_in_backward else None,
                                 defer_blocks=args.defer_blocks if prefetch is not None else 0,
                                 num_threads=args.num_threads or None)
    setup["optimizer"] = _progress(mode, "optimizer built", t0) - sum(setup.values())
    name = "resident" + (" (no step)" if isinstance(opt, NoStep) else "")
    out = _train(cfg, args, model, opt, streamer, mode, t0)
    if getattr(streamer, "files", None) is not None:
        # the disk's rate for the param files themselves (written at setup, read since),
        # next to the probe's for a file it wrote just before reading (see main)
        from bench.nvme_bench import read_through
        streamer.files.flush()
        out["files_read_Bps"] = statistics.median(read_through(streamer.files.fds, 4))
        _progress(mode, f"the param files read through: {out['files_read_Bps'] / 1e9:.2f} GB/s", t0)
    out.update(mode=name if prefetch is None else mode, prefetch=prefetch,
               streamed_gb=(streamer.streamed_bytes / 1e9) if streamer else 0.0,
               largest_block_gb=(streamer.largest_block_bytes / 1e9) if streamer else 0.0,
               grad_ring_mb=_ring_mb(opt), setup_s=setup)
    del model, opt, streamer
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_fsdp2(cfg, args):
    """The peer: FSDP2 (fully_shard per block, then the root) on a one-GPU mesh with
    CPUOffloadPolicy and bf16 compute (MixedPrecisionPolicy), fp32 params, grads and
    torch.optim.AdamW's state on the host: the recipe torch documents for offloading."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from bench.e2e.model import build_model
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    model = build_model(cfg, "cuda", torch.float32)
    if args.checkpoint:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    policy = dict(offload_policy=CPUOffloadPolicy(),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    torch.cuda.empty_cache()
    _cap(args, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    out = _train(cfg, args, model, opt, None, "fsdp2", time.perf_counter())
    out.update(mode="fsdp2 cpu offload", prefetch=None, streamed_gb=0.0, largest_block_gb=0.0)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _cap(args, capped):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, args.cap_gb * 1e9 / total) if capped and args.cap_gb else 1.0)
    torch.cuda.reset_peak_memory_stats()


def _progress(mode, what, t0) -> float:
    """A line as each phase ends (a run stopped by a time limit still says how far it got);
    returns the seconds since t0."""
    at = time.perf_counter() - t0
    print(f"  [{mode}] {what} at {at:.1f} s", flush=True)
    return at


def io_bytes():
    """(read, written) bytes this process moved to and from storage so far (param files)."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def _ring_mb(opt) -> float:
    """The grad ring's size in MiB (0: none, the grads in a buffer per param)."""
    ring = getattr(getattr(opt, "_engine", None), "ring", None)
    return ring.nbytes / 2**20 if ring is not None else 0.0


def _clip(spans, lo, hi) -> float:
    """Seconds of the union of `spans` ((start, end) pairs) inside [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _overlap(spans, others) -> float:
    """Seconds of `spans` during which one of `others` ran too (both unions)."""
    return sum(_clip(others, a, b) for a, b in _union(spans))


def _union(spans):
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [tuple(m) for m in merged]


def _waits_in_backward(profile, bwd_start, bwd_end) -> dict:
    """Where the threads waited inside backward's host span (the engine's profile,
    "waits"): the kernels' jobs waiting for their grads' D2H copies to land and for the
    streamed params' host copies (fetches still reading them), and the hooks' waits for
    grad ring room, split by what the worker did meanwhile: a kernel, a wait for grads,
    or neither (no job: the grads it would step were not sent, or a job's other waits)."""
    waits = (profile or {}).get("waits", ())
    of = lambda what: [(w["start_s"], w["end_s"]) for w in waits if w["what"] == what]
    grads, home, ring = of("grads"), of("home"), of("ring")
    kernels = [(r["start_s"], r["end_s"]) for r in (profile or {}).get("timeline", ())
               if r["phase"] == "cpu_step"]
    ring_in = [(max(a, bwd_start), min(b, bwd_end)) for a, b in ring
               if min(b, bwd_end) > max(a, bwd_start)]
    ring_s = _clip(ring_in, bwd_start, bwd_end)
    with_kernel = _overlap(ring_in, kernels)
    with_grads = _overlap(ring_in, grads)   # (a worker's waits and kernels do not overlap)
    return dict(grads_wait_in_bwd_s=_clip(grads, bwd_start, bwd_end),
                home_wait_in_bwd_s=_clip(home, bwd_start, bwd_end),
                ring_wait_in_bwd_s=ring_s, ring_wait_kernel_s=with_kernel,
                ring_wait_grads_s=with_grads,
                ring_wait_neither_s=max(0.0, ring_s - with_kernel - with_grads))


def _cpu_in_backward(profile, bwd_start, bwd_end) -> dict:
    """Where the CPU step's kernels ran against backward's host span (the engine's
    timeline): the seconds from backward's start to the first kernel (the CPU waiting for
    the first grads), the kernels' seconds inside the span, the span's idle seconds after
    the first kernel (the CPU waiting for grads: backward not CPU-bound there), and the
    kernels' seconds after backward returned (inside step())."""
    spans = sorted((r["start_s"], r["end_s"]) for r in (profile or {}).get("timeline", ())
                   if r["phase"] == "cpu_step")
    out = dict(cpu_first_s=0.0, cpu_in_bwd_s=0.0, cpu_idle_in_bwd_s=0.0, cpu_after_bwd_s=0.0)
    if not spans:
        return out
    busy, merged = 0.0, _union(spans)   # (intervals of several workers may overlap)
    first = max(merged[0][0], bwd_start)
    for a, b in merged:
        busy += max(0.0, min(b, bwd_end) - max(a, bwd_start))
        out["cpu_after_bwd_s"] += max(0.0, b - max(a, bwd_end))
    out["cpu_first_s"] = max(0.0, merged[0][0] - bwd_start)
    out["cpu_in_bwd_s"] = busy
    out["cpu_idle_in_bwd_s"] = max(0.0, (bwd_end - first) - busy) if first < bwd_end else 0.0
    return out


def _train(cfg, args, model, opt, streamer, mode, t0):
    """--warmup + --steps iterations; per iteration: forward and forward + backward (CUDA
    events), opt.step() (wall), the whole (wall, synchronized), the engine's CPU step time
    (its profile: the kernels' time summed over buckets, in backward and at step())."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for it in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), device="cuda",
                               generator=gen)
        if it == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        fetched0 = streamer.fetched_bytes if streamer else 0
        files = getattr(streamer, "files", None)
        held = lambda: dict(files.hold_s) if files is not None else {"fetch": 0.0, "step": 0.0}
        h0 = held()
        io0 = io_bytes()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        e1.record()
        tb = time.perf_counter()
        io_f, h_f = io_bytes(), held()
        loss.backward()
        e2.record()
        t1 = time.perf_counter()
        io_b, h_b = io_bytes(), held()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        io1 = io_bytes()
        profile = getattr(opt, "last_step_profile", None)
        rows.append(dict(fwd_s=e0.elapsed_time(e1) / 1e3, fwd_bwd_s=e0.elapsed_time(e2) / 1e3,
                         queue_s=t1 - t0, step_s=t2 - t1, iter_s=t3 - t0,
                         cpu_step_s=profile["cpu_step_s"] if profile else 0.0,
                         ring_wait_s=profile.get("ring_wait_s", 0.0) if profile else 0.0,
                         loss=float(loss.detach()),
                         disk_read_bytes=io1[0] - io0[0], disk_write_bytes=io1[1] - io0[1],
                         # (per phase: the forward's host span, backward's, step() + the
                         # rest; the forward's reads and writes end when its host span does)
                         disk_fwd_read_bytes=io_f[0] - io0[0], disk_fwd_write_bytes=io_f[1] - io0[1],
                         disk_bwd_read_bytes=io_b[0] - io_f[0], disk_bwd_write_bytes=io_b[1] - io_f[1],
                         fwd_host_s=tb - t0,
                         # the param files' holds: the fetches' (forward, backward) and the
                         # CPU step's (the whole iteration): where compute waited for the disk
                         fetch_hold_fwd_s=h_f["fetch"] - h0["fetch"],
                         fetch_hold_bwd_s=h_b["fetch"] - h_f["fetch"],
                         step_hold_s=held()["step"] - h0["step"],
                         h2d_param_bytes=(streamer.fetched_bytes - fetched0) if streamer else 0,
                         bwd_host_s=t1 - tb, **_cpu_in_backward(profile, tb, t1),
                         **_waits_in_backward(profile, tb, t1)))
        r = rows[-1]
        _progress(mode, f"iteration {it}: {r['iter_s']:.3f} s (fwd {r['fwd_s']:.3f}, fwd+bwd "
                  f"{r['fwd_bwd_s']:.3f}, step() {r['step_s']:.3f}, CPU step "
                  f"{r['cpu_step_s']:.3f}, hooks waited for the grad ring "
                  f"{r['ring_wait_s']:.3f}; backward's host span {r['bwd_host_s']:.3f}: first "
                  f"kernel after {r['cpu_first_s']:.3f}, kernels {r['cpu_in_bwd_s']:.3f}, CPU "
                  f"idle after the first {r['cpu_idle_in_bwd_s']:.3f}; kernels after backward "
                  f"{r['cpu_after_bwd_s']:.3f}; in backward the kernels' jobs waited for grads "
                  f"{r['grads_wait_in_bwd_s']:.3f} and for host copies {r['home_wait_in_bwd_s']:.3f}, "
                  f"hooks for the ring {r['ring_wait_in_bwd_s']:.3f} (a kernel running "
                  f"{r['ring_wait_kernel_s']:.3f}, a job waiting for grads "
                  f"{r['ring_wait_grads_s']:.3f}, neither {r['ring_wait_neither_s']:.3f})"
                  + (f"; disk read/written GB: forward {r['disk_fwd_read_bytes'] / 1e9:.2f}/"
                     f"{r['disk_fwd_write_bytes'] / 1e9:.2f} in {r['fwd_host_s']:.3f} s, backward "
                     f"{r['disk_bwd_read_bytes'] / 1e9:.2f}/{r['disk_bwd_write_bytes'] / 1e9:.2f}; "
                     f"fetches held the param files {r['fetch_hold_fwd_s']:.3f} s in forward, "
                     f"{r['fetch_hold_bwd_s']:.3f} in backward, the CPU step {r['step_hold_s']:.3f}"
                     if r["disk_read_bytes"] or r["disk_write_bytes"] else "") + ")", t0)
    timed = rows[args.warmup:]
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    return dict(median=med, rows=rows, peak_gb=torch.cuda.max_memory_allocated() / 1e9)


def planned_step(cfg, args, h2d_gbps, disk):
    """offload_adam.plan's step for the streamed runs' layout: the model as a Llama of the
    same width and params per block (MLP width 8/3 of it), prefetch the largest asked, the
    lent GPU machine's defaults but for the host-to-device and disk speeds measured here."""
    from offload_adam import plan as planner
    model = planner.ModelShape("gpt", cfg.vocab_size, cfg.width, round(8 * cfg.width / 3),
                               cfg.layers, cfg.heads, cfg.heads)
    machine = planner.replace(planner.MACHINES["lent-h100"], pcie_gbps=h2d_gbps)
    if disk is not None:
        machine = planner.replace(machine, ssd_read_gbps=disk["read_Bps"] / 1e9,
                                  ssd_write_gbps=disk["write_Bps"] / 1e9)
    run = planner.Run(args.batch, args.seq, 1, args.checkpoint,
                      max(int(k) for k in args.prefetch.split(",")),
                      param_cache_mb=args.param_cache_mb if args.param_dir else None)
    state = args.state_dtype if args.state_dtype in planner.STATE_DTYPES else "float32"
    layout = planner.Layout("files" if args.param_dir else "ram", "ram", state)
    p = planner.plan(model, machine, run, layout)
    return dict(layout=f"params {layout.params}, state ram {state}", params=model.params,
                step_s=p.step_s, bound=p.bound, seconds=p.seconds, expected_s=p.expected_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", default="1,2")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--cap-gb", type=float, default=0.0,
                    help="cap the streamed runs' device memory (set_per_process_memory_fraction)")
    ap.add_argument("--state-dtype", default="float32", help="offload_adam.AdamW state_dtype")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="the CPU step during backward (offload_adam.AdamW step_in_backward)")
    ap.add_argument("--free-grads", action="store_true",
                    help="free each grad on the device once on the host (free_grads_after_copy)")
    ap.add_argument("--resident", choices=["full", "compute"], default="full",
                    help="the resident run with the optimizer, or forward + backward only")
    ap.add_argument("--param-dir", default="",
                    help="the streamed blocks' host copies in files there (param_dirs=)")
    ap.add_argument("--param-cache-mb", type=float, default=4096.0,
                    help="with --param-dir: param_cache_mb=")
    ap.add_argument("--grad-ring-mb", type=float, default=0.0,
                    help="grad_ring_mb= (with step_in_backward; default: the engine's rule, "
                         "with the state in RAM twice the largest block's grads)")
    ap.add_argument("--defer-blocks", type=int, default=0,
                    help="defer_blocks= for the streamed runs (with --step-in-backward): the "
                         "last blocks' CPU steps overlap the next forward")
    ap.add_argument("--keep-resident", type=int, default=0,
                    help="streamed runs: keep this many blocks on the device, spread evenly "
                         "(fewer bytes over PCIe a step, for the device memory under the cap)")
    ap.add_argument("--num-threads", type=int, default=0,
                    help="the CPU step's kernel threads (0: the optimizer's default, the "
                         "cores less one): fewer leave cores to autograd and the copies")
    ap.add_argument("--fsdp2", action="store_true",
                    help="also the peer: FSDP2 with CPUOffloadPolicy on a one-GPU mesh")
    ap.add_argument("--tag", default=socket.gethostname())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("stream_gpu: no CUDA device here; nothing to measure")
        return 0
    from bench.e2e.model import config_for
    from bench.machine import machine_info, one_line
    cfg = config_for(args.layers, args.width, args.vocab, args.seq)
    print(one_line(machine_info()))
    print(f"model: {cfg.num_params() / 1e9:.2f}B params ({cfg}), batch {args.batch} x {args.seq}, "
          f"checkpointing {args.checkpoint}, cap {args.cap_gb or 'none'} GB (streamed runs), "
          f"state_dtype {args.state_dtype}, step_in_backward {args.step_in_backward}, "
          f"free_grads_after_copy {args.free_grads}, defer_blocks {args.defer_blocks}, "
          f"blocks kept resident {kept_blocks(args.layers, args.keep_resident)}")
    h2d = pinned_h2d_gbps()
    print(f"pinned host-to-device: {h2d:.1f} GB/s")
    disk = None
    if args.param_dir:   # the param files' disk, in the same run (O_DIRECT, sequential)
        from bench.nvme_bench import disk_limit
        os.makedirs(args.param_dir, exist_ok=True)
        disk = disk_limit(args.param_dir, 2 << 30, 4, 8 << 20)
        print(f"param files' disk: read {disk['read_Bps'] / 1e9:.2f} GB/s, write "
              f"{disk['write_Bps'] / 1e9:.2f} GB/s")
    modes = [run_mode(cfg, args, None)]
    for k in (int(x) for x in args.prefetch.split(",")):
        modes.append(run_mode(cfg, args, k))
    peer_error = None
    if args.fsdp2:
        try:
            modes.append(run_fsdp2(cfg, args))
        except Exception as e:   # the peer failing must not lose the rows measured above
            peer_error = f"{type(e).__name__}: {e}"
            print("fsdp2 peer failed:", peer_error)
            args.fsdp2 = False
    resident = modes[0]["median"]
    print(f"{'mode':<18}{'iter s':>8}{'fwd s':>8}{'fwd+bwd':>9}{'step s':>8}{'cpu step':>9}"
          f"{'peak GB':>9}{'H2D GB':>8}{'bound s':>9}{'it/bound':>9}{'fwd +%':>8}")
    for m in modes:
        med = m["median"]
        # the CPU step: the resident run's whole step() when it ran one, else this run's
        # kernels (the engine's profile; 0 for the peer, whose step is not ours to split)
        cpu_step = max(resident["step_s"] if args.resident == "full" else 0.0, med["cpu_step_s"])
        disk_s = (med["disk_read_bytes"] / disk["read_Bps"] + med["disk_write_bytes"]
                  / disk["write_Bps"]) if disk is not None and m["prefetch"] else 0.0
        bound = max(resident["fwd_bwd_s"], med["h2d_param_bytes"] / 1e9 / h2d, cpu_step, disk_s)
        m["bound_s"], m["disk_s"] = bound, disk_s
        # what streaming added to the forward (waits on param copies included): an upper
        # bound on the waits, relative to the streamed forward
        m["fwd_extra"] = 1.0 - resident["fwd_s"] / med["fwd_s"]
        print(f"{m['mode']:<18}{med['iter_s']:>8.3f}{med['fwd_s']:>8.3f}{med['fwd_bwd_s']:>9.3f}"
              f"{med['step_s']:>8.3f}{med['cpu_step_s']:>9.3f}{m['peak_gb']:>9.2f}"
              f"{med['h2d_param_bytes'] / 1e9:>8.2f}{bound:>9.3f}{med['iter_s'] / bound:>9.2f}"
              f"{100 * m['fwd_extra']:>7.1f}%")
    for m in modes:
        if m.get("disk_s"):
            med = m["median"]
            print(f"{m['mode']}: param files read {med['disk_read_bytes'] / 1e9:.2f} GB, written "
                  f"{med['disk_write_bytes'] / 1e9:.2f} GB an iteration: disk limit "
                  f"{m['disk_s']:.2f} s, iteration {med['iter_s'] / m['disk_s']:.2f} x it")
            if m.get("files_read_Bps"):   # the reads at the files' own rate, not the probe's
                files_s = (med["disk_read_bytes"] / m["files_read_Bps"]
                           + med["disk_write_bytes"] / disk["write_Bps"])
                m["disk_files_s"] = files_s
                fwd_gbps = med["disk_fwd_read_bytes"] / med["fwd_host_s"] / 1e9
                print(f"{m['mode']}: the param files read through at "
                      f"{m['files_read_Bps'] / 1e9:.2f} GB/s (the probe: "
                      f"{disk['read_Bps'] / 1e9:.2f}); forward read {fwd_gbps:.2f} GB/s; disk "
                      f"limit at the files' rate {files_s:.2f} s, iteration "
                      f"{med['iter_s'] / files_s:.2f} x it")
    planned = planned_step(cfg, args, h2d, disk)
    print(f"planner ({planned['layout']}, a Llama of this width and params per block, at the "
          f"host-to-device and disk speeds measured here): {planned['step_s']:.2f} s, bound by "
          f"{planned['bound']} ({', '.join(f'{k} {v:.2f}' for k, v in planned['seconds'].items())}); "
          f"as the code schedules it: {planned['expected_s']:.2f} s")
    for m in modes:
        if m["prefetch"] is not None:
            m["planned_ratio"] = m["median"]["iter_s"] / planned["step_s"]
            m["expected_ratio"] = m["median"]["iter_s"] / planned["expected_s"]
            print(f"{m['mode']}: iteration {m['planned_ratio']:.2f} x the planner's step, "
                  f"{m['expected_ratio']:.2f} x its estimate of the schedule")
    if args.fsdp2:
        peer = modes[-1]["median"]["iter_s"]
        for m in modes[:-1]:
            print(f"{m['mode']}: {peer / m['median']['iter_s']:.2f}x the FSDP2 CPU-offload iteration")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"stream_gpu_{args.tag}.json"
    path.write_text(json.dumps(dict(machine=machine_info(), args=vars(args), num_params=cfg.num_params(),
                                    pinned_h2d_gbps=h2d, disk=disk, modes=modes,
                                    planned=planned,
                                    peer_error=peer_error), indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
