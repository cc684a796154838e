"""step_in_backward with the state in files (state_dirs=): the files' pass starts in backward.

With the state in host RAM (early.py) a transfer bucket's kernel starts as soon as its
grads are copied. With the state in files its master and moments must be read first, so
the unit is the file bucket, and the NVMe tier's pipeline (nvme/pipeline.py) runs during
backward, on the engine's worker:

    a backward's first grad    the pass starts: the first file buckets are read ahead,
                               in the order their grads completed in the last backward
                               (the first backward guesses: the files' buckets last
                               first, as backward meets the params registered last
                               first; a wrong guess only stalls the pass to step();
                               none after state_resume=True, whose first step checks
                               the params restored before anything writes them)
    a file bucket completes    (every engine param in it, or its part of a param cut
                               in pieces, has its grad copied) it is
                               stepped when the pass reaches it: the kernels on the
                               ring buffer (core.step_lent), no param
                               written; then the pass writes it back and reads ahead
    step()                     EarlyStart.verify; the pass goes on over what is left
                               (buckets with params stepped in place, with a param
                               whose grad did not come), the files are committed, and
                               then the params stepped in backward are written

The worker never waits for a grad: the pass stops at the first bucket not complete, and
step() takes it from there. Unlike host RAM, nothing is committed before step(): an error verify
finds (clipping, GradScaler, a grad edited after its copy, accumulation, zero_grad() or
load_state_dict() before step()) abandons the pass, and the files and the params stay
at the last completed step: nothing was stepped. (A streamed param's kernel writes its
update straight into its host copy, in backward: abandoning puts back the committed
master's rounding, which is what the last step wrote, or the value kept before its step
where that is not so: never stepped, or changed since.) An error of the pass at step()
itself (a disk's) is not one of these: the buckets it lent there had their params written
as they were stepped, and the streamed params stepped in backward are not put back, so
those params are ahead of the files and the next step is refused, as without
step_in_backward (nvme_tier.py, NvmeState.params_ahead).

A new compact state's first pass runs here too (no redo log to write: disk_log.py takes
over from its commit on). It writes each bucket in place, not into another slot, so an
abandoned one sets the buckets it wrote back to step 0 (NvmeState.restart_first_pass).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..param_state import ParamState
from .grad_ring import ring_bytes, trainable_bytes
from .layout import Entry, ParamRec

# Per file bucket: its engine params (layout.Entry: a param, or a part of one larger than a
# bucket), or None when it holds a param stepped in place (its grad is final only at step():
# the bucket is never early).
FileBuckets = Sequence[Optional[Sequence[Entry]]]


class FileBucketsInBackward:
    """What the files' work in backward shares (DiskEarly here, disk_log.DiskLog): the
    file buckets of engine params, their grads in a bounded ring (grad_ring.py) until a
    job on the worker is done with them, and a bucket's start once its grads are all
    copied. `edited()`: whether the user edited optimizer.state since the last step
    (nvme_tier.FileStore.edited), asked at a backward's first grad: that backward does
    none of the files' work (step() loads the edits into the files first, then steps
    every bucket: its grads overflow the ring meanwhile, as after state_resume=True)."""

    def __init__(self, engine, early, pipeline, files: FileBuckets,
                 edited: Callable[[], bool] = lambda: False, ring: bool = True):
        self._engine = weakref.ref(engine)
        self._early = early
        self.pipeline = pipeline
        self.files = files
        self.edited = edited
        # called with each file bucket lent to be stepped here, before its params are read
        # (the file store's heads: nvme_heads.py)
        self.on_lend: Callable[[int], None] = lambda i: None
        self._files_of: Dict[int, List[int]] = {}   # id(rec) -> its file buckets
        self._entry_of: Dict[Tuple[int, int], Entry] = {}   # (file bucket, id(rec)) -> entry
        for i, entries in enumerate(files):
            for e in entries or ():
                self._files_of.setdefault(id(e.rec), []).append(i)
                self._entry_of[i, id(e.rec)] = e
        self._lock = threading.Lock()
        self._jobs = 0
        if not ring:   # the ring of the pass this one follows on (the same file buckets)
            engine.ring_busy(_weakly(self.busy_stepping))
            return
        largest = max((sum(p.numel * e.rec.dtype.itemsize for e in entries for p in e.pieces)
                       for entries in files if entries), default=0)
        bucket, asked = engine.bucket_bytes, engine.ring_asked   # (the size holds no engine)
        engine.use_ring(lambda params: ring_bytes(largest, bucket, asked=asked,
                                                  trainable=trainable_bytes(params)),
                        _weakly(self.busy_stepping))

    def busy_stepping(self) -> bool:
        """Whether a job is queued or running: it frees ring room without waiting for
        any grad (so a hook may wait for that room)."""
        engine = self._engine()
        with self._lock:
            jobs = self._jobs
        return jobs > 0 and engine is not None and engine.worker_busy()

    def _reset_counts(self) -> None:
        self._skipped = False   # this backward leaves the files' work to step() (edited)
        self._parts_in: set = set()   # (file bucket, id(rec)) counted in
        self._left = {i: len(e) for i, e in enumerate(self.files) if e}
        self._completed: List[int] = []   # file buckets in the order they completed

    def _count(self, rec: ParamRec, piece=None):
        """rec's grad copy has started (with `piece`: that piece was sent, the rest may
        not be yet): counted in its file buckets (several for a param in parts) whose
        part of it is all sent, each once. (engine, the file buckets it completed,
        whether it is the iteration's first grad), or None (not an engine param of a
        file bucket, counted already, or the engine gone)."""
        mine = self._files_of.get(id(rec))
        engine = self._engine()
        if mine is None or engine is None:
            return None
        complete = []
        with self._lock:
            todo = [i for i in mine if (i, id(rec)) not in self._parts_in]
            if not todo:
                return None   # accumulated before its bucket started: counted once
            first = not self._parts_in
            if first:   # (a group's step() refuses: nothing of this backward steps either)
                self._skipped = self.edited() or self._early.refusal(engine)
            for i in todo:
                if piece is not None and any(id(p) not in rec.copy.sent_ids
                                             for p in self._entry_of[i, id(rec)].pieces):
                    continue   # (a part not all sent yet)
                self._parts_in.add((i, id(rec)))
                self._left[i] -= 1
                if not self._left[i]:
                    complete.append(i)
            self._completed += complete
        return engine, complete, first

    def _begin_bucket(self, engine, i: int) -> bool:
        """File bucket i is complete: the packs holding its pieces are sent, and its
        params' steps begin (EarlyStart.begin: verify checks them at step()). False when
        the optimizer is gone."""
        recs = [e.rec for e in self.files[i]]
        for b in {p.bucket.index: p.bucket for e in self.files[i] for p in e.pieces}.values():
            engine.flush_pack(b)   # a pack waiting for pieces of other buckets: sent now
        return self._early.begin(recs)


class DiskEarly(FileBucketsInBackward):
    """The files' pass of one step, started during backward (see above)."""

    def __init__(self, engine, early, pipeline, files: FileBuckets,
                 edited: Callable[[], bool] = lambda: False, guess: bool = True):
        # learned from the last backwards; until then a guess: the last buckets first
        # (none after state_resume=True: its first step checks the params first)
        self.order: Optional[List[int]] = list(reversed(range(len(files)))) if guess else None
        self._before: Optional[set] = None       # the buckets completed in the last one
        self.unrestored = 0   # streamed params the last abandoned pass could not put back
        self.written: set = set()   # recs the user wrote since their step began (abandon)
        super().__init__(engine, early, pipeline, files, edited)
        self._reset()

    def _reset(self) -> None:
        self._close()   # (a pass never handed on: its I/O waited for)
        self._reset_counts()
        self._ready: set = set()          # ... those the pass may step
        self._gen: Optional[Iterator] = None
        self._pending = None              # (index, views) yielded, not stepped yet
        self._position = 0                # buckets of the pass stepped so far
        self._kicked = False              # the pass was queued on the worker
        self._jobs = 0   # its jobs queued on the worker and not ended (none, when reset)
        self._stepped_files: List[int] = []   # the file buckets stepped
        self._after: Dict[int, object] = {}   # file bucket -> an event after its grads
        # streamed values to restore (step_lent): a copy, or None for a param in its first
        # step (none kept: 2 B a param, for an error path)
        self._kept: Dict[int, Optional[torch.Tensor]] = {}

    @property
    def stepped(self) -> List[ParamRec]:
        """The params of the file buckets stepped so far, once each (a param in parts too)."""
        return list({id(e.rec): e.rec for i in self._stepped_files
                     for e in self.files[i]}.values())

    @property
    def started(self) -> bool:
        """Whether a pass is open (once the worker is idle: the caller drained it)."""
        return self._gen is not None

    @property
    def busy(self) -> bool:
        """Whether a pass was queued this iteration (it may not have started yet)."""
        return self._kicked or self._gen is not None

    @property
    def steps_in_backward(self) -> bool:
        """Whether its pass steps buckets in backward: not on a committed compact state
        (arrived: its steps log first, all at step())."""
        return not self.pipeline.state.logs_steps

    # ---- during backward (autograd's thread) ----------------------------------------

    def arrived(self, rec: ParamRec, piece=None) -> None:
        """rec's grad copy has started (or one piece of it, early.py: piece_sent): counts it in its
        file buckets, and starts the pass's step of each bucket it completes."""
        counted = self._count(rec, piece)
        if counted is None:
            return
        engine, complete, first = counted
        if self.order is None or self._skipped or self.pipeline.state.logs_steps:
            # no order to step in, the state edited, or a compact state committed (its
            # steps log first: disk_log.py, nvme_tier._files_early_for_now): all at step()
            return
        for i in complete:
            if not self._begin_bucket(engine, i):
                return   # the optimizer is gone
            # (a param the pass reads from the device, to start its master at its first
            # step, is read after this: the worker has no stream of the user's)
            self._after[i] = engine.device.fence()
            with self._lock:
                self._ready.add(i)
        if first and not self._kicked or complete:   # the first grad starts the reads ahead
            self._kicked = True
            with self._lock:
                self._jobs += 1
            blocks = [e.rec.home.block for i in complete for e in self.files[i]
                      if e.rec.home is not None]
            self._early.watch(blocks)
            # (this job steps the buckets complete, unless the pass stops before them
            # at one that is not: check_block then refuses a reader of a block left half)
            engine.defer_reads(engine.run(self._advance), blocks)

    # ---- on the worker -----------------------------------------------------------------

    def _advance(self) -> None:
        """Steps the pass's buckets in order while the next one is complete."""
        engine = self._engine()
        if engine is None:
            with self._lock:
                self._jobs -= 1
            return
        try:
            if self._gen is None:
                self._gen = self.pipeline.buckets(order=self.order)
                self._pending = next(self._gen)
            while self._pending is not None and self._pending[0] in self._ready:
                i, views = self._pending
                self.on_lend(i)
                engine.step_lent_early(self.files[i], views, self._early.hyper, self._kept,
                                       self._after.get(i))
                self._stepped_files.append(i)
                self._position += 1
                # the last bucket is not written here: that would commit the step
                self._pending = (next(self._gen) if self._position < len(self.order)
                                 else None)
        except BaseException:
            self._close()
            raise
        finally:
            with self._lock:
                self._jobs -= 1
            engine.ring.nudge()

    def half_written(self, block) -> bool:
        """Whether the pass stepped some of streamed `block`'s params (written their
        host copies) and left others whose grads came (EarlyStart.check_block)."""
        stepped = set(self._stepped_files)
        engine = self._engine()
        if not stepped or engine is None:
            return False
        done = left = False
        for rec in engine.recs_of(block.params):
            for i in self._files_of.get(id(rec), ()):
                if i in stepped:
                    done = True
                elif (i, id(rec)) in self._parts_in:
                    left = True
        return done and left

    # ---- at step() -----------------------------------------------------------------------

    def rest(self) -> "_Rest":
        """The pass from where backward left it: the buckets not stepped yet, then the
        commit (the caller runs it after verify, and closes it)."""
        rest = _Rest(self._gen, self._pending)
        self._gen = self._pending = None
        return rest

    def abandon(self, cause: Optional[str] = None) -> None:
        """Stops the pass, with nothing committed (the files stay at the last completed
        step), once the worker is idle; the next backward starts afresh (in the order
        learned before). `cause`: why (step_in_backward's refusal), else the error
        propagating, if any: what a refused step() says after (params_ahead)."""
        engine = self._engine()
        try:
            if engine is not None and self.busy:
                engine.drain()
        finally:
            stepped = list(self._stepped_files)
            kept = self._kept
            written, self.written = self.written, set()
            self._reset()   # (closes the pass)
            try:   # (compact: a new state's buckets written in place set back to step 0)
                self.pipeline.state.restart_first_pass()
            except OSError:
                pass   # (the files stay unsure: every later pass says why)
            self._restore(engine, stepped, kept, written)
            if self.unrestored:
                # their first values are not kept: a next step would start their masters
                # from the values stepped here (a script that skips a batch whose backward
                # raised goes on, silently off): refused until the model is loaded again
                self.pipeline.state.params_ahead(cause or sys.exc_info()[1])
            if engine is not None:
                engine.forget_grads()   # the next step copies its grads again
                # The pass made masters follow their params (a first step's: from the
                # param) and marked the params agreeing, in buckets never committed: the
                # next step checks each master again against its param (one in its
                # first step, whose file holds no master yet, read as zeros, starts
                # from it again)
                engine.marks.forget(rec.param for rec in engine.recs)

    def _restore(self, engine, stepped, kept: Dict[int, Optional[torch.Tensor]],
                 written: set = frozenset()) -> None:
        """The streamed params of the abandoned pass's buckets (their kernel wrote their
        host copies) go back to their last completed step: the committed master rounded,
        or the value kept before the step (whose master rule then applies again). A param
        in its first step has neither: it stays stepped (counted in `unrestored`). One
        the user wrote since its step began (`written`: rec ids) keeps what was written."""
        changed = []
        self.unrestored = 0
        with torch.no_grad():
            for i in stepped:
                views = None
                for rec, name, pieces in self.files[i]:
                    if rec.home is None:
                        continue   # its update waits in staging: nothing was written
                    if id(rec) in written:
                        changed.append(rec.param)   # (its master follows it next step)
                        continue
                    if id(rec) in kept and kept[id(rec)] is None:
                        self.unrestored += 1
                        continue
                    a, b = pieces[0].start, pieces[-1].stop   # (all of it, or its part)
                    old = kept.get(id(rec))
                    if old is None:
                        if views is None:
                            views = self.pipeline.state.views(i)
                        old = ParamState.in_bucket(views, name).rounded.reshape(-1)
                    else:
                        changed.append(rec.param)
                        old = old.reshape(-1)[a:b]
                    with rec.home.writing([(a, b)]):
                        rec.home.tensor.view(-1)[a:b].copy_(old)
        if engine is not None:
            engine.marks.forget(changed)

    def _close(self) -> None:
        gen = getattr(self, "_gen", None)
        self._gen, self._pending = None, None
        if gen is not None:
            gen.close()   # waits for the reads and writes in flight

    def new_iteration(self) -> None:
        """The next pass's order: the file buckets whose grads completed in this
        backward and in the one before, as they completed in this one; then the others
        in the files' order (a layer used every other step would stall the pass every
        other step if it came first). None completed: the order as it was."""
        if self._completed:
            steady = [i for i in self._completed
                      if self._before is None or i in self._before]
            first = set(steady)
            self.order = steady + [i for i in range(len(self.files)) if i not in first]
            self._before = set(self._completed)
        self._reset()


class _Rest:
    """What is left of a pass, as an iterator; close() stops it (the pipeline then waits
    for its I/O in flight and commits nothing), also when it was never iterated."""

    def __init__(self, gen: Iterator, pending):
        self._gen, self._pending = gen, pending

    def __iter__(self) -> "_Rest":
        return self

    def __next__(self) -> Tuple[int, Dict[str, torch.Tensor]]:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


def _weakly(method) -> Callable[[], bool]:
    """`method` called through a weak reference (False once its object is gone): the
    ring's `busy`, which the engine's worker reaches (its after_job) while the worker's
    thread runs and from the engine's finalizer. Held strongly, it kept this pass, and
    through its entries the streamed params' blocks, their streamer and model, alive
    through the collection that found the optimizer gone (found from outside)."""
    ref = weakref.WeakMethod(method)

    def call() -> bool:
        bound = ref()
        return bound is not None and bound()
    return call
