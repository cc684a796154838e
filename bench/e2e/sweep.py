"""The size sweep: the largest model of the benchmark's shape family each optimizer can train, found by
trying, and the iteration time at every size that trained.

Sizes are tried smallest first (model.SIZES, at the run's vocabulary and sequence length, batch 1). The
walk stops at the first size that fails, and says which bound stopped it:
  "GPU memory"   the try ran out of GPU memory (torch.cuda.OutOfMemoryError)
  "host RAM"     the optimizer's host buffers would not fit the available RAM (checked before trying,
                 from its bytes per param) or the optimizer refused for lack of host memory
  "time budget"  the sweep's time ran out first
  "error"        anything else (the message is kept)
  "all sizes fit" the largest size of the family trained
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from .contenders import Contender
from .model import SIZES, GPTConfig, config_for


def size_family(vocab_size: int, seq_len: int) -> list[tuple[str, GPTConfig]]:
    fam = [(name, config_for(layers, width, vocab_size, seq_len)) for name, (layers, width) in SIZES.items()]
    return sorted(fam, key=lambda nc: nc[1].num_params())


def _host_refusal(reason: str) -> bool:
    text = reason.lower()
    return any(k in text for k in ("host memory", "host ram", "pinned", "memoryerror", "cannot allocate memory"))


def largest_trainable(c: Contender, family: list[tuple[str, GPTConfig]],
                      try_size: Callable[[Contender, GPTConfig], dict],
                      host_available_bytes: Optional[int], deadline: float,
                      min_params: int = 0,
                      clock: Callable[[], float] = time.monotonic) -> dict:
    """Walks `family` upward with `try_size(contender, config)` (a run row: "status", "reason",
    "timing"). Returns {"largest", "largest_params", "bound", "detail", "points"}."""
    result = {"largest": None, "largest_params": 0, "bound": "all sizes fit", "detail": "", "points": []}
    for name, cfg in family:
        n = cfg.num_params()
        if n < min_params:
            continue
        if clock() > deadline:
            result.update(bound="time budget", detail=f"stopped before {name}")
            break
        need = c.host_bytes_per_param * n
        if need and host_available_bytes is not None and need > 0.9 * host_available_bytes:
            result.update(bound="host RAM", detail=f"{name} needs ~{need / 2**30:.0f} GiB of host RAM, "
                                                   f"{host_available_bytes / 2**30:.0f} GiB available")
            break
        row = try_size(c, cfg)
        point = {"size": name, "layers": cfg.layers, "width": cfg.width, "params": n, "status": row["status"]}
        if row["status"] == "ok":
            point["iteration_s"] = row["timing"]["iteration_s"]
            point["peak_gpu_bytes"] = row.get("peak_gpu_bytes")
            result["points"].append(point)
            result.update(largest=name, largest_params=n)
            continue
        point["reason"] = row.get("reason", "")
        result["points"].append(point)
        if row["status"] == "oom":
            result.update(bound="GPU memory", detail=f"{name}: {point['reason']}")
        elif _host_refusal(point["reason"]):
            result.update(bound="host RAM", detail=f"{name}: {point['reason']}")
        elif row["status"] == "skipped":
            result.update(bound="skipped", detail=point["reason"])
        else:
            result.update(bound="error", detail=f"{name}: {point['reason']}")
        break
    return result
