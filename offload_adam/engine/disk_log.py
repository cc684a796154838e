"""step_in_backward with compact state files: the grads go to the redo log in backward.

(From the state's first commit on. A new state's first pass has no log, a crash in it
making the state anew, so it steps in backward in place as disk_early.py does:
nvme_tier.FileStore._files_early_for_now.)

A compact state (nvme/store.py, state_footprint="compact") keeps one copy of each bucket:
no bucket may move before every bucket's redo record is on disk, so the files' pass cannot
step buckets in backward as disk_early.py does (the grads of the buckets after them do not
exist yet). What it can do in backward is what would otherwise hold the grads in host RAM
until step(): write them to the redo log. So, on the engine's worker:

    a file bucket completes    (every engine param in it has its grad copied) its record
                               is appended to the log (its pieces' grads as they landed),
                               and its room in the grad ring is free again
    step()                     EarlyStart.verify (an edit, a clip, accumulation or a
                               changed hyperparameter since backward raises, nothing
                               stepped); the records of the buckets not logged yet, the
                               intent; then the pass, reading the logged grads back

Host RAM for grads stays the grad ring's (twice the largest file bucket's grads, 4 x
bucket_mb at least); the disk pays the grads' bytes once more, read at step() (2 B per bf16
param). The pass itself runs at step(), not in backward: where the disk bounds the step
(what the compact files are for) backward's share of it is small.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .disk_early import FileBuckets, FileBucketsInBackward
from .layout import ParamRec


class DiskLog(FileBucketsInBackward):
    """The grads of one step logged during backward (see above); `pipeline`: a
    nvme.StepPipeline over a compact state."""

    def __init__(self, engine, early, pipeline, files: FileBuckets,
                 edited: Callable[[], bool] = lambda: False, ring: bool = True):
        self.state = pipeline.state
        self.unrestored = 0   # (nothing is stepped in backward: nothing to put back)
        self.stepped: List[ParamRec] = []
        self.written: set = set()   # (nothing stepped in backward is written over either)
        super().__init__(engine, early, pipeline, files, edited, ring)
        self._reset()

    def _reset(self) -> None:
        self._reset_counts()
        self._queue: List[int] = []        # complete buckets not logged yet
        self.logged: Dict[int, bool] = {}  # file buckets whose grads are in the log
        self._jobs = 0
        self._kicked = False
        self._error: Optional[BaseException] = None

    @property
    def started(self) -> bool:
        return self._kicked

    @property
    def busy(self) -> bool:
        return self._kicked

    # ---- during backward (autograd's thread) ----------------------------------------

    def arrived(self, rec: ParamRec, piece=None) -> None:
        """rec's grad copy has started (or one piece of it, early.py: piece_sent): counts it in its
        file buckets, and logs each bucket it completes on the worker."""
        counted = self._count(rec, piece)
        if counted is None or not counted[1] or self._skipped:
            return   # (edited: every record written at step())
        engine, complete, _ = counted
        for i in complete:
            if not self._begin_bucket(engine, i):
                return   # the optimizer is gone
            with self._lock:
                self._queue.append(i)
                self._jobs += 1
                self._kicked = True
            engine.run(self._log_ready)

    # nothing is stepped in backward: the pass runs at step() (EarlyStart.steps_in_backward)
    steps_in_backward = False

    def half_written(self, block) -> bool:
        """Nothing is stepped in backward here: no block is ever half written."""
        return False

    # ---- on the worker -----------------------------------------------------------------

    def _log_ready(self) -> None:
        engine = self._engine()
        try:
            while engine is not None and self._error is None:
                with self._lock:
                    if not self._queue:
                        break
                    i = self._queue.pop(0)
                pieces = [p for e in self.files[i] for p in e.pieces]
                engine.device.wait_host(*{id(t): t for e in self.files[i]
                                          for t in e.rec.copy.transfers}.values())
                tensors = [(f"g|{e.name}|{p.start}", p.grad)
                           for e in self.files[i] for p in e.pieces]
                self.state.log_record(i, ({"group": self.files[i][0].rec.group,
                                           "in_place": []}, tensors))
                self.logged[i] = True
                for p in pieces:   # logged: their room in the ring is free
                    engine.ring.done(p)
        except BaseException as e:
            self._error = e   # raised at step() (the worker's own error path too)
            raise
        finally:
            with self._lock:
                self._jobs -= 1
            if engine is not None:
                engine.ring.nudge()

    # ---- at step() -----------------------------------------------------------------------

    def settle(self) -> None:
        """Waits for the records being written; an error writing one raises here."""
        engine = self._engine()
        if engine is not None and self._kicked:
            engine.drain()
        if self._error is not None:
            raise self._error

    def rest(self):
        """The pass over every bucket, at step() (the grads of those logged read back,
        each started a few buckets ahead of its kernel: NvmeState.record_ahead)."""
        logged = self.logged
        return self.pipeline.buckets(ahead=lambda i: self.state.record_ahead(i)
                                     if i in logged else None)

    def abandon(self, cause: Optional[str] = None) -> None:
        """The step will not run (verify refused it, zero_grad, a load: `cause`, unused,
        as DiskEarly.abandon takes it): the records are forgotten, nothing was stepped."""
        engine = self._engine()
        try:
            if engine is not None and self._kicked:
                engine.drain()
        finally:
            self.state.forget_log()
            self._reset()
            if engine is not None:
                engine.forget_grads()

    def new_iteration(self) -> None:
        self.state.forget_log()   # (a step that ran forgot them at its commit)
        self._reset()
