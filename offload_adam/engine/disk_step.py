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
                    a master the files do not hold yet (first step, a loaded state
                    without one) comes from its param, and a resumed or loaded one
                    is kept only while it still rounds to its param; then the same
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

from ..kernel_state import master_from_param
from ..kernel_step import Hyper
from ..param_state import ROLES, ParamState
from ..params import rounds_to
from .core import OffloadEngine, _factor_of
from .layout import ParamRec
from .state import _masters_from_params

# How a param's master is made ready (nvme_tier.py's loaded-master marks): None (the
# files' master is current), "take" (from the param), "check" (kept if it rounds to it).
Ready = Optional[str]


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

    def bucket(self, entries: Sequence[Tuple[ParamRec, str, Ready]],
               views: Dict[str, torch.Tensor]) -> None:
        """Steps the recs of one file bucket that take part in this step: (rec, its name
        in the files, how its master is made ready) each; `views`: the bucket's tensors
        in the ring buffer. (A bucket stepped during backward is not passed again.)"""
        todo = [e for e in entries if self.takes_part(e[0])]
        if todo:
            step_file_bucket(self.engine, todo, views, self._hyper, self.grad_scale,
                             self.threads, self.fence)
            self.stepped.extend(rec for rec, _, _ in todo)

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


def step_file_bucket(engine: OffloadEngine, todo: Sequence[Tuple[ParamRec, str, Ready]],
                     views: Dict[str, torch.Tensor], hyper_of: Callable[[int], Hyper],
                     grad_scale: float, threads: int, fence=None, write: bool = True) -> None:
    """One file bucket's recs (each with a grad copy on its way): their state views
    pointed at the ring buffer, masters made ready, the bucket jobs' kernels grouped by
    transfer bucket, the files' "<name>.step" set to the count after the step. With
    `write` the params' H2D copies are queued too (after `fence`), and waited for where
    they read the ring buffer itself (an fp32 param's master, unstaged), since the
    pipeline reuses it for a read ahead; write=False (step_in_backward) leaves the
    params to step(): an fp32 master is then in its staging (layout.allocate_transfers)."""
    with torch.no_grad():
        for rec, name, _ in todo:
            _point_at(rec, name, views)
            for piece in rec.pieces:
                piece.step_t.fill_(float(ParamState.in_bucket(views, name).step))
        _ready_masters(engine, [(rec, how) for rec, _, how in todo])
        by_bucket: Dict[int, list] = {}
        for rec, _, _ in todo:
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
        for rec, name, _ in todo:
            ParamState.in_bucket(views, name).step.copy_(rec.step_t)
            _point_at(rec, None, views)


def _ready_masters(engine: OffloadEngine, recs: Sequence[Tuple[ParamRec, Ready]]) -> None:
    """Masters from their params where the files' are new ("take", or a step count
    of 0) or stale ("check" that does not round to the param; an fp32 param's
    master is the param, so it is simply taken)."""
    check = [rec for rec, how in recs if how == "check" and rec.low_precision
             and float(rec.step_t) != 0]
    if check:   # the params, for stale() below, in one batch of copies
        dev = engine.device
        pieces = [p for rec in check for p in rec.pieces]
        dev.wait_host(*[t for p in pieces for t in p.bucket.h2d])   # staging is free
        dev.wait_host(dev.d2h([p.staging for p in pieces],
                              [p.of(p.rec.live()) for p in pieces]))

    def stale(rec: ParamRec) -> bool:
        return not rec.low_precision or not all(
            rounds_to(p.state("master"), p.staging) for p in rec.pieces)

    take = [rec for rec, how in recs
            if master_from_param(how, float(rec.step_t), lambda rec=rec: stale(rec))]
    if take:
        _masters_from_params(engine.device, take)


def _point_at(rec: ParamRec, name: Optional[str], views: Dict[str, torch.Tensor]) -> None:
    """rec's state views (what its pieces' kernels read and write): the file bucket's
    tensors of param `name`, or None once its bucket is done with."""
    st = ParamState.in_bucket(views, name) if name is not None else None
    for role in ROLES:
        setattr(rec, role, getattr(st, role) if st is not None else None)
