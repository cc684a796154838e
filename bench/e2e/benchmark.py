"""The whole comparison: every contender at every batch size on the same data, the no-optimizer baselines
for the exposed time, the loss check, then (on CUDA) the size sweep. Returns the report dict."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from . import contenders as C
from .data import MarkovTokens
from .model import GPTConfig
from .progress import Progress
from ..machine import load_average, machine_info
from .report import SCHEMA, add_exposed, check_losses
from .runner import RunSettings, run_contender
from .sweep import largest_trainable, size_family


@dataclasses.dataclass
class BenchSettings:
    device: torch.device
    size: str
    model: GPTConfig
    batches: list[int]
    micro_batch: int
    steps: int
    warmup: int
    optimizers: list[str]
    hparams: C.HParams
    compute_dtype: Optional[torch.dtype]
    sweep: bool
    sweep_budget_s: float
    seed: int = 0


def _with_baselines(selected: list[C.Contender]) -> list[C.Contender]:
    """The selected contenders, each (param dtype, autocast) preceded once by its no-optimizer run."""
    out, seen = [], set()
    for c in selected:
        key = (c.param_dtype, c.autocast)
        if key not in seen:
            seen.add(key)
            out.append(C.no_optimizer(*key))
        out.append(c)
    return out


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['optimizer']} batch {row['batch']}: {row['status']} ({row.get('reason', '')})"
    t = row["timing"]
    return (f"{row['optimizer']} batch {row['batch']}: iteration {t['iteration_s'] * 1e3:.1f} ms, "
            f"loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}")


def run(s: BenchSettings, progress_enabled: bool = True) -> dict:
    t0 = time.perf_counter()
    selected = C.resolve(s.optimizers)
    plan = _with_baselines(selected)
    runnable = [c for c in plan if c.unavailable(s.device) is None]
    progress = Progress(len(runnable) * len(s.batches) * s.steps, enabled=progress_enabled)
    uses_kernels = any(c.name.startswith("offload_adam") for c in runnable)
    if uses_kernels:
        # Load (on a cold cache: compile) the kernels before any timing, and say how long it took.
        progress.note("loading offload_adam's kernels (a cold cache compiles them first)")
    t_load = time.perf_counter()
    machine = machine_info(query_kernels=uses_kernels)  # asking for the ISA loads the kernels
    kernel_load_s = time.perf_counter() - t_load
    data = MarkovTokens(s.model.vocab_size, seed=s.seed)
    runs = []
    optimal = {}
    for batch in s.batches:
        host_batches = data.batches(s.steps, batch, s.model.seq_len)
        optimal[batch] = [data.optimal_loss(x, y) for x, y in host_batches]
        dev_batches = [(x.to(s.device), y.to(s.device)) for x, y in host_batches]
        rs = RunSettings(device=s.device, model=s.model, batch=batch, micro_batch=min(s.micro_batch, batch),
                         steps=s.steps, warmup=s.warmup, hparams=s.hparams, compute_dtype=s.compute_dtype,
                         seed=s.seed)
        rows = []
        for c in plan:
            label = f"{c.name} batch {batch}"
            row = run_contender(c, rs, dev_batches, on_step=lambda i, label=label: progress.advance(
                1, f"{label} step {i + 1}/{s.steps}"))
            if row["status"] != "skipped":
                # A run that stopped early leaves its remaining steps on the bar.
                progress.advance(s.steps - len(row.get("losses", [])))
            progress.note(_summary(row))
            rows.append(row)
        check_losses(rows, C.REFERENCE, C.TWIN, C.drifts(), C.relatives())
        add_exposed(rows)
        runs.extend(rows)
    report = {
        "schema": SCHEMA,
        "machine": machine,
        "kernel_load_s": kernel_load_s,
        "config": {
            "device": s.device.type, "size": s.size, "model": dataclasses.asdict(s.model),
            "num_params": s.model.num_params(), "batches": s.batches, "micro_batch": s.micro_batch,
            "steps": s.steps, "warmup": s.warmup, "timed_steps": s.steps - s.warmup,
            "optimizers": s.optimizers, "reference": C.REFERENCE, "twin": C.TWIN,
            "hparams": dataclasses.asdict(s.hparams),
            "compute_dtype": str(s.compute_dtype).replace("torch.", "") if s.compute_dtype else "param dtype",
            "seed": s.seed,
        },
        "optimal_loss": optimal,
        "runs": runs,
    }
    if s.sweep:
        report["sweep"] = _sweep(s, progress)
    progress.close()
    end = load_average()
    if end is not None:
        report["machine"]["load_average_end"] = end
    report["wall_s"] = time.perf_counter() - t0
    return report


def _sweep(s: BenchSettings, progress: Progress) -> dict:
    """Largest trainable size per sweep contender (batch 1, a few steps each)."""
    family = size_family(s.model.vocab_size, s.model.seq_len)
    deadline = time.monotonic() + s.sweep_budget_s
    steps = 3
    data = MarkovTokens(s.model.vocab_size, seed=s.seed)
    batches = [(x.to(s.device), y.to(s.device)) for x, y in data.batches(steps, 1, s.model.seq_len)]
    info = machine_info(query_kernels=False)

    def try_size(c: C.Contender, cfg: GPTConfig) -> dict:
        rs = RunSettings(device=s.device, model=cfg, batch=1, micro_batch=1, steps=steps, warmup=1,
                         hparams=s.hparams, compute_dtype=s.compute_dtype, seed=s.seed)
        row = run_contender(c, rs, batches)
        progress.note(f"sweep {c.name} {cfg.layers}x{cfg.width} ({cfg.num_params() / 1e9:.2f} B): "
                      f"{row['status']}")
        return row

    results = {}
    for name in C.SWEEP:
        c = C.CONTENDERS[name]
        reason = c.unavailable(s.device)
        if reason:
            results[name] = {"largest": None, "largest_params": 0, "bound": "skipped", "detail": reason,
                             "points": []}
            continue
        results[name] = largest_trainable(c, family, try_size, info["host_ram_available_bytes"], deadline)
    return {"family": [{"size": n, "layers": g.layers, "width": g.width, "params": g.num_params()}
                       for n, g in family],
            "batch": 1, "seq_len": s.model.seq_len, "results": results}
