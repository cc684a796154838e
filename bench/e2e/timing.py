"""Timing one training iteration, split into its parts.

An iteration is cut at marks: start -> forward+backward -> optimizer (step + zero_grad) -> end.
  iteration_s = wall time from start to end (the host clock after the device has finished)
  fwd_bwd_s, optimizer_s = the time between consecutive marks
  other_s = iteration_s - fwd_bwd_s - optimizer_s   (so the parts sum exactly; on CUDA it is the
            launch/sync slack outside the marked regions, on CPU almost zero)

On CPU the marks are host clock reads (the work is synchronous). On CUDA they are CUDA events recorded on
the current stream, read after one synchronize at the end of the iteration: the split follows the GPU's
timeline without a device sync between the parts (a sync there would serialize what the offload engine
overlaps). `exposed_s` of a run, what the optimizer adds to an iteration, is computed elsewhere against an
iteration without optimizer (see run.py's baselines), because an overlapping optimizer also works inside
forward+backward.
"""

from __future__ import annotations

import statistics
import time

import torch


class IterationClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._names: list[str] = []
        self._marks: list = []
        self._t0 = 0.0
        self.host_start = 0.0  # perf_counter at start(), to place the iteration on the host timeline

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the previous iteration is over, on the host and on the device
        self._names.clear()
        self._marks.clear()
        self._t0 = self.host_start = time.perf_counter()
        self._marks.append(self._mark())

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def lap(self, name: str) -> None:
        """Ends the part called `name` here."""
        self._names.append(name)
        self._marks.append(self._mark())

    def stop(self) -> dict[str, float]:
        """Ends the iteration; returns seconds per part, "iteration_s" and "other_s"."""
        if self.cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        parts: dict[str, float] = {}
        for name, a, b in zip(self._names, self._marks, self._marks[1:]):
            parts[name + "_s"] = a.elapsed_time(b) / 1e3 if self.cuda else b - a
        parts["iteration_s"] = end - self._t0
        parts["other_s"] = parts["iteration_s"] - sum(v for k, v in parts.items() if k != "iteration_s")
        return parts

    def mark_offsets(self) -> dict[str, float]:
        """Seconds from start() to each lap of the last iteration (after stop()): where forward+backward
        and the optimizer lie on the host's perf_counter timeline, offset by `host_start`."""
        out = {}
        for name, a, b in zip(self._names, self._marks[:1] * len(self._names), self._marks[1:]):
            out[name] = a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def median_split(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median of each part over the timed iterations. The medians of the parts need not sum to the median
    iteration; `other_s` is recomputed so that the reported split still sums to `iteration_s`."""
    if not samples:
        return {}
    keys = samples[0].keys()
    med = {k: statistics.median(s[k] for s in samples) for k in keys}
    med["other_s"] = med["iteration_s"] - sum(v for k, v in med.items() if k not in ("iteration_s", "other_s"))
    return med
