"""Per-step profile of the offload engine (read by the end-to-end benchmark).

`opt.last_step_profile` is a dict:
    d2h_s, cpu_step_s, h2d_s  seconds summed over buckets
    exposed_s                 how long step() blocked its caller
    ring_waits, ring_wait_s   with step_in_backward: how many times, and how long in all,
                              a grad's hook waited for room in the grad ring since the
                              last step (autograd's thread blocked: no kernel launched)
    waits                     where the threads waited, for telling a CPU-bound backward
                              from one whose CPU waits: [{"what", "bucket", "start_s",
                              "end_s"}], what = "grads" (a bucket's kernel waiting for its
                              grads' D2H copies to land), "home" (... for the fetches
                              that read its streamed params' host copies, or for their
                              param file slots), "ring" (a hook waiting for grad ring
                              room, bucket -1)
    wait_s                    {what: seconds} summed over `waits`
    timeline                  [{"bucket", "phase": "d2h"|"cpu_step"|"h2d", "start_s", "end_s"}]
                              in time.perf_counter() seconds

What the timestamps mean on CUDA: a copy's start_s is the host time at which it
was queued, and its end_s is start_s plus the copy's duration measured by CUDA
timing events around it (the GPU may run it later than it was queued, so the
interval is placed at the earliest time it could have started). cpu_step
intervals are host times. On CPU the copies are synchronous and every
timestamp is a host time. A bucket's d2h interval spans all its copies since
the previous step, including grads copied during backward.

The dict is built when first read: resolving CUDA event times waits for the
copies, which the step itself never does.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple


class StepProfile:
    def __init__(self) -> None:
        self.exposed_s = 0.0
        self.ring_waits, self.ring_wait_s = 0, 0.0
        self._d2h: Dict[int, list] = {}
        self._h2d: Dict[int, list] = {}
        self._cpu: List[Tuple[int, float, float]] = []
        self._waits: List[Tuple[str, int, float, float]] = []
        self._dict: Optional[dict] = None

    def add_d2h(self, bucket: int, transfer) -> None:
        self._d2h.setdefault(bucket, []).append(transfer)

    def add_h2d(self, bucket: int, transfer) -> None:
        self._h2d.setdefault(bucket, []).append(transfer)

    def add_cpu(self, bucket: int, start: float, end: float) -> None:
        self._cpu.append((bucket, start, end))

    def add_wait(self, what: str, bucket: int, start: float, end: float) -> None:
        self._waits.append((what, bucket, start, end))

    def as_dict(self) -> dict:
        if self._dict is None:
            timeline = []
            totals = {"d2h": 0.0, "h2d": 0.0}
            for phase, per_bucket in (("d2h", self._d2h), ("h2d", self._h2d)):
                for b, transfers in per_bucket.items():
                    secs = [t.seconds() for t in transfers]
                    totals[phase] += sum(secs)
                    start = min(t.host_start for t in transfers)
                    end = max(t.host_start + s for t, s in zip(transfers, secs))
                    timeline.append({"bucket": b, "phase": phase,
                                     "start_s": start, "end_s": end})
            for b, s, e in self._cpu:
                timeline.append({"bucket": b, "phase": "cpu_step",
                                 "start_s": s, "end_s": e})
            timeline.sort(key=lambda r: (r["start_s"], r["bucket"]))
            self._dict = {
                "d2h_s": totals["d2h"],
                "cpu_step_s": sum(e - s for _, s, e in self._cpu),
                "h2d_s": totals["h2d"],
                "exposed_s": self.exposed_s,
                "ring_waits": self.ring_waits,
                "ring_wait_s": self.ring_wait_s,
                "timeline": timeline,
                "waits": [{"what": w, "bucket": b, "start_s": s, "end_s": e}
                          for w, b, s, e in sorted(self._waits, key=lambda r: r[2])],
                "wait_s": {w: sum(e - s for what, _, s, e in self._waits if what == w)
                           for w in ("grads", "home", "ring")},
            }
        return self._dict
