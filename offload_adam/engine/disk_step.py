"""The engine's step when its state lives in files (state_dirs=, nvme_tier.py).

With the state in host RAM (core.py) the engine drives: one job per transfer bucket,
each param's master and moments in host arenas. With state_dirs= they are in the NVMe
tier's files, laid out in registration order, and in RAM only while the tier's
pipeline (nvme/pipeline.py) holds their file bucket in a ring buffer. So the tier
drives, and the engine steps what each file bucket holds:

    DiskStep(...)   the step's start as in RAM (checks, end of backward, fence); every
                    grad copied (stale ones again, reused ones fingerprint-checked),
                    so the grads of all buckets are on their way to the host before
                    the first file bucket is read
    .bucket(...)    one file bucket: the recs' state views point at the ring buffer;
                    every master follows its param by the one rule (master_rule.py:
                    from the param at its first step, and after the param changed
                    unless it still is the master's rounding), also the masters of
                    the params without a grad this step; then the same
                    bucket jobs as in RAM (core.BucketJob: wait for the grads, the
                    kernel, the H2D copies of the update) over the recs' pieces,
                    grouped by transfer bucket; then a wait for the H2D copies
                    that read the ring buffer itself (fp32 params' masters), since
                    the pipeline reuses it for a read ahead
    .end()          as in RAM: the user's stream waits for the copies, versions bumped

The kernel runs on the caller's thread (the pipeline's reads and writes overlap it);
each piece keeps its own step count in RAM as in RAM mode, loaded from and stored
into its param's "step" in the files.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernel_step import Hyper
from ..param_state import ROLES, ParamState
from .core import OffloadEngine, _factor_of
from .layout import ParamRec
from .state import follow_masters

# A param of a file bucket: its record, and its name in the files.
Entry = Tuple[ParamRec, str]


class DiskStep:
    """One step of the engine's params over the files' buckets (see above)."""

    def __init__(self, engine: OffloadEngine, param_groups: List[dict], grad_scale: float):
        self.engine = engine
        self.param_groups = param_groups
        self.fence = engine.begin_step(param_groups, {}, grad_scale)
        with torch.no_grad():
            ready = engine.ready_grads()    # fingerprint checks done (and acted on) here
        self.grad_scale = grad_scale * _factor_of(ready)
        self.ready = {id(r): r for r in ready}
        self.threads = engine.threads()
        self.stepped: List[ParamRec] = []
        self._hypers: Dict[int, Hyper] = {}

    def takes_part(self, rec: ParamRec) -> bool:
        return id(rec) in self.ready

    def bucket(self, entries: Sequence[Entry], views: Dict[str, torch.Tensor]) -> None:
        """Steps the recs of one file bucket that take part in this step; the masters
        of the others follow their params (master_rule.py). `views`: the bucket's
        tensors in the ring buffer. (A bucket stepped during backward is not passed
        again.)"""
        todo = [e for e in entries if self.takes_part(e[0])]
        idle = [e for e in entries if not self.takes_part(e[0])]
        if idle:
            with torch.no_grad():
                _lend(idle, views)
                follow_masters(self.engine.device, [rec for rec, _ in idle],
                               self.engine.marks)
                _lend(idle, None)
        if todo:
            step_file_bucket(self.engine, todo, views, self._hyper, self.grad_scale,
                             self.threads, self.fence)
            self.stepped.extend(rec for rec, _ in todo)

    def write_early(self, recs: Sequence[ParamRec]) -> None:
        """Queues the H2D copies of the params stepped during backward (step_in_backward:
        their updates wait in staging), once the files hold their step."""
        pieces = {id(p) for rec in recs for p in rec.pieces}
        for job in self.engine.stepped_jobs(pieces, self.fence):
            job.write_back()
        self.stepped.extend(recs)

    def end(self, completed: bool) -> None:
        """Publishes the H2D copies and bumps the stepped params' versions, also
        after an error; the rest of the step's end only when it completed."""
        self.engine.publish_step(self.stepped)
        if completed:
            self.engine.end_step()

    def _hyper(self, group: int) -> Hyper:
        if group not in self._hypers:   # one per group per step, as in RAM
            self._hypers[group] = Hyper.of(self.param_groups[group])
        return self._hypers[group]


def step_file_bucket(engine: OffloadEngine, todo: Sequence[Entry],
                     views: Dict[str, torch.Tensor], hyper_of: Callable[[int], Hyper],
                     grad_scale: float, threads: int, fence=None, write: bool = True) -> None:
    """One file bucket's recs (each with a grad copy on its way): their state views
    pointed at the ring buffer, their masters following their params (master_rule.py),
    the bucket jobs' kernels grouped by
    transfer bucket, the files' "<name>.step" set to the count after the step. With
    `write` the params' H2D copies are queued too (after `fence`), and waited for where
    they read the ring buffer itself (an fp32 param's master, unstaged), since the
    pipeline reuses it for a read ahead; write=False (step_in_backward) leaves the
    params to step(): an fp32 master is then in its staging (layout.allocate_transfers)."""
    with torch.no_grad():
        _lend(todo, views)
        follow_masters(engine.device, [rec for rec, _ in todo], engine.marks)
        by_bucket: Dict[int, list] = {}
        for rec, _ in todo:
            for piece in rec.pieces:
                by_bucket.setdefault(piece.bucket.index, []).append(piece)
        ring_reads = []
        for index, pieces in sorted(by_bucket.items()):
            bucket = engine.buckets[index]
            job = engine.bucket_job(bucket, pieces, hyper_of(bucket.group), grad_scale,
                                    threads, fence)
            job.kernel()
            if write:
                before = len(bucket.h2d)
                job.write_back()
                if any(p.staging is None for p in pieces):   # the source is the master
                    ring_reads += bucket.h2d[before:]
        engine.device.wait_host(*ring_reads)
        for rec, name in todo:
            ParamState.in_bucket(views, name).step.copy_(rec.step_t)
        _lend(todo, None)


def _lend(entries: Sequence[Entry], views: Optional[Dict[str, torch.Tensor]]) -> None:
    """Points the recs' state views (what their pieces' kernels read and write) and
    step counts at their tensors in a file bucket's `views`; None: back to none, once
    the bucket is done with."""
    for rec, name in entries:
        st = ParamState.in_bucket(views, name) if views is not None else None
        for role in ROLES:
            setattr(rec, role, getattr(st, role) if st is not None else None)
        if st is not None:
            for piece in rec.pieces:
                piece.step_t.fill_(float(st.step))
