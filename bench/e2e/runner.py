"""Trains the model with one contender for a fixed number of steps and measures it.

One run: build the model (same init for everyone), build the optimizer, then per step
    clock.start(); [forward; backward] x accumulation; clock.lap("fwd_bwd");
    opt.step(); opt.zero_grad(); clock.lap("optimizer"); clock.stop()
The first `warmup` steps are trained and their losses kept, but not timed (allocator warm-up, kernel JIT,
the offload engine's first step which learns the order grads arrive in). Memory: peak GPU bytes
(torch.cuda.max_memory_allocated) over the run, host RSS growth over the run, and the optimizer's own
count of host bytes when it keeps one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from typing import Callable, Optional

import torch

from .contenders import Contender, HParams, host_bytes, state_bytes
from .model import GPTConfig, build_model
from .timing import IterationClock, median_split


@dataclasses.dataclass
class RunSettings:
    device: torch.device
    model: GPTConfig
    batch: int                 # sequences per optimizer step
    micro_batch: int           # sequences per forward (batch / micro_batch micro-batches accumulate)
    steps: int
    warmup: int
    hparams: HParams
    compute_dtype: Optional[torch.dtype]   # None: the param dtype
    seed: int = 0

    @property
    def accumulation(self) -> int:
        return -(-self.batch // self.micro_batch)  # ceil: the last micro-batch may be smaller


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return 0


def _page_size() -> int:
    import os
    return os.sysconf("SC_PAGE_SIZE")


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _profile_of(opt) -> Optional[dict]:
    try:
        prof = getattr(opt, "last_step_profile", None)
    except Exception:
        return None
    return prof if isinstance(prof, dict) else None


def run_contender(c: Contender, rs: RunSettings, batches: list[tuple[torch.Tensor, torch.Tensor]],
                  on_step: Callable[[int], None] = lambda i: None) -> dict:
    """Returns the run's row for the report. `batches[i]` are step i's micro-batches, already on the
    device, concatenated: [batch, seq] inputs and targets."""
    row: dict = {"optimizer": c.name, "label": c.label, "batch": rs.batch,
                 "accumulation": rs.accumulation, "param_dtype": str(c.param_dtype).replace("torch.", ""),
                 "autocast": str(c.autocast).replace("torch.", "") if c.autocast else None,
                 "precision": c.precision, "baseline": c.baseline}
    reason = c.unavailable(rs.device)
    if not reason and c.no_accumulation and rs.accumulation > 1:
        reason = f"batch {rs.batch} needs {rs.accumulation} micro-batches: {c.no_accumulation}"
    if reason:
        row.update(status="skipped", reason=reason)
        return row
    cuda = rs.device.type == "cuda"
    _cleanup(rs.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss0 = rss_bytes()
    t_setup = time.perf_counter()
    model = opt = gpu_model_bytes = None
    losses: list[float] = []
    splits: list[dict] = []
    profiles: list[dict] = []
    timeline = None
    try:
        model = build_model(rs.model, rs.device, c.param_dtype, rs.compute_dtype, rs.seed)
        gpu_model_bytes = torch.cuda.memory_allocated() if cuda else None
        opt = c.build(model, rs.hparams)
        row["setup_s"] = time.perf_counter() - t_setup
        autocast = (torch.autocast(rs.device.type, dtype=c.autocast) if c.autocast
                    else contextlib.nullcontext())
        clock = IterationClock(rs.device)
        for step in range(rs.steps):
            inputs, targets = batches[step]
            clock.start()
            loss_sum = torch.zeros((), device=rs.device)
            for x, y in zip(inputs.split(rs.micro_batch), targets.split(rs.micro_batch)):
                with autocast:
                    loss = model(x, y)
                # Weighted by its share of the batch: the accumulated grad is the full batch's mean.
                loss = loss * (x.shape[0] / rs.batch)
                loss.backward()
                loss_sum += loss.detach()
            clock.lap("fwd_bwd")
            opt.step()
            opt.zero_grad(set_to_none=True)
            clock.lap("optimizer")
            split = clock.stop()
            losses.append(loss_sum.item())
            if step >= rs.warmup:
                splits.append(split)
                prof = _profile_of(opt)
                if prof is not None:
                    profiles.append(prof)
                    if step == rs.steps - 1 and prof.get("timeline"):
                        timeline = {"iteration_start_s": clock.host_start, "marks": clock.mark_offsets(),
                                    "buckets": prof["timeline"]}
            on_step(step)
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", reason=str(e).splitlines()[0])
    except Exception as e:  # a contender's failure is a result, not the benchmark's end
        row.update(status="failed", reason=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=6))
    row["losses"] = losses
    row["num_params"] = rs.model.num_params()
    if splits:
        row["timing"] = median_split(splits)
        row["timed_steps"] = len(splits)
    if profiles:
        keys = ("d2h_s", "cpu_step_s", "h2d_s", "exposed_s")
        row["offload_profile"] = {k: sorted(p[k] for p in profiles)[len(profiles) // 2]
                                  for k in keys if all(k in p for p in profiles)}
    if timeline:
        row["timeline"] = timeline
    if cuda:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        row["gpu_model_bytes"] = gpu_model_bytes
    row["host_rss_growth_bytes"] = max(0, rss_bytes() - rss0)
    if opt is not None:
        row["optimizer_state_bytes"] = state_bytes(opt)
        row["host_offload_bytes"] = host_bytes(opt)
        pinned = getattr(opt, "pinned", None)
        if callable(pinned):
            with contextlib.suppress(Exception):
                row["pinned"] = bool(pinned())
        close = getattr(opt, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
    del model, opt
    _cleanup(rs.device)
    row["wall_s"] = time.perf_counter() - t_setup
    return row
