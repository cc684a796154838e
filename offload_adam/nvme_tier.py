"""The optimizer's state in files: the state_dirs option.

The storage is nvme/ (files, slots, manifest, the read-ahead pipeline); this is the
optimizer's side of it. At construction every param of every group is dealt, in order,
into buckets of about bucket_mb of state (a bucket never spans two groups, so one kernel
call per param dtype has one set of hyperparameters; an engine param larger than a bucket
goes in parts, runs of its engine pieces, `_lay_out`), and the files are opened (or
created, or resumed). Each step() is one pass of the pipeline:

    for bucket i (read ahead by the pipeline):
        its CPU params stepped in place: the fused kernel on the live grad and param,
            the fp32 master and moments from the bucket's buffer
        its engine params (CUDA, or CPU through the pipeline): stepped by the engine
            over the same buffer (engine/core.py, EngineStep.lent)
    -> written back, then the step is committed

The same kernel calls on the same values as in RAM, so the params come out bitwise the
same as with the state in host RAM. Every param has a master in the files, so the files
hold the whole training state: an fp32 param stepped in place is its own master (as in
RAM), and its new value is copied there after its kernel. Every master follows its param
by the one rule (master_rule.py), as in RAM: taken from the param at the param's first
step (its step count is 0), and, once the param was changed by anything but the optimizer
(or a state dict was loaded), kept only while the param is still its rounding; also for a
param without a grad in a step.

A resumed state restores the params from the masters (`_restore_params`), after the ranks
of a sharded run agreed on one step (`_agree_on_step`). Until the next step nothing may
mix two steps: params changed since the restore must be the files' step, or the step
before (the state goes back to it: `_check_resumed`), and a state dict loaded over the
restored params must be theirs (`_refuse_a_mix`).

optimizer.state holds an empty entry for each of these params that has a state (`mark`);
state_dict() shows their state as file views (`add_state`) and load_state_dict() writes
into the files bucket by bucket (`load`). What the user does to those entries is what
torch's optimizers would make of it (`edited`): an entry removed (`opt.state.clear()`,
`del opt.state[p]`, a new `opt.state`) is a param without state, a tensor set in one
(`opt.state[p]["exp_avg"] = t`) is that param's state; state_dict() shows them, and the
next step() loads them into the files first (the optimizer: a load of its own state_dict).
A key of the user's own (not one of the state's: a library's count) is no edit: it stays
in the entry, in RAM, as torch's optimizers keep it, and state dicts carry it.

state_footprint="compact" (nvme/store.py: one copy, a redo log): each step first writes
every bucket's redo record (`_log_step`: its grads as the kernel reads them, the values of
params whose masters start again from them; the hyperparameters and grad scales in the
intent), so that a resume finishes a step cut short (`_redo_bucket`, at construction).
With step_in_backward the records of complete file buckets are written during backward
(engine/disk_log.py) and their grads read back from the log at step() (`_grads_from_log`).
Under several ranks every rank's log is durable before any rank moves a bucket
(`_all_ranks_logged`), so that resumed ranks agree on one step (`_agree_compact`).

The grads are checked before the first bucket is stepped. An I/O error mid-step raises with
the files at the last completed step (nvme/pipeline.py), but the params of the buckets
already stepped have moved: build the optimizer again with state_resume=True, which
restores them from the files, as after a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import weakref
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import distributed
from .distributed import is_dtensor, local, local_value
from .params import check_dense, groups_now, param_label, param_values, rounds_to, write_values
from .engine.disk_early import DiskEarly
from .engine.disk_log import DiskLog
from .engine.layout import Entry, state_slice
from .kernel_state import kernel_state
from .master_rule import MasterMarks, mark, take_from_param, written_since
from .cpu_step import calls_by_dtype, contiguous_grad
from .kernel_step import Hyper, KernelArgs
from .state_store import Lent, Loaded
from . import nvme_heads, split_master
from .param_state import FILE_ROLE, ParamState, adam_bucket, file_key
from .nvme import BucketSpec, NvmeError, NvmeState, StateSpec, StepPipeline, redo, ring_size
from .byte_view import byte_view
from .nvme.direct_io import crc32, written_pages
from .nvme.layout import shown
from .nvme.pipeline import AHEAD
from .nvme.store import OPEN_HELD, STATE_FILES, OtherState
from .engine.worker import interrupts_deferred
from .state_format import (MASTER_KEY, MOMENT_KEYS, Q8_FORMAT, Q8_FORMAT_KEY, SCALE_KEYS,
                           STATE_KEYS, float32_moment, state_format, stored_key, stored_state)
from .warn import warn

_MB = 2 ** 20
# (a shard's shape, so its state's layout, depends on the number of ranks)
_RANKS_HINT = ("; under FSDP2 a shard's shape depends on the number of ranks: resume with "
               "the number of ranks that made them")


class _Param:
    """One param of the tier, or a part of one: where it is in the groups, its name in
    the files, the dtype its files were laid out for, and its engine record when the
    engine steps it (EngineStep.lent; None: stepped in place here). Every param has a
    master in the files; the kernel steps it, except for an fp32 param stepped in place,
    which is its own master (as in RAM): the kernel steps the param and its value is
    copied into the files' master, so that the files hold the params too.

    A part: an engine param whose state is larger than a bucket is cut into runs of its
    engine pieces (`pieces`), each a flat state of its own in its own bucket, named
    "<name>#<first element>"; so a bucket, its spare room in a compact ring and the
    pipeline's buffers stay about bucket_mb whatever the largest param (a 70B model's
    embedding alone is 6 GB of 8-bit state)."""
    __slots__ = ("group", "index", "param", "base", "name", "dtype", "rec", "pieces", "split")

    def __init__(self, group: int, index: int, param: torch.Tensor, name: str, rec=None,
                 pieces=None, split: bool = False):
        self.group, self.index, self.param, self.base = group, index, param, name
        self.dtype = param.dtype
        self.rec = rec
        self.pieces = tuple(pieces) if pieces is not None else None
        self.name = name if pieces is None else f"{name}#{pieces[0].start}"
        self.split = split   # its master split, its value the bucket's head (HEADS)

    @property
    def part(self) -> bool:
        return self.pieces is not None

    @property
    def start(self) -> int:
        return self.pieces[0].start if self.pieces is not None else 0

    @property
    def shape(self) -> tuple:
        if self.pieces is not None:
            return (self.pieces[-1].stop - self.start,)
        return tuple(local(self.param).shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def entry(self) -> Entry:
        """What the engine steps (layout.Entry)."""
        return Entry(self.rec, self.name,
                     self.pieces if self.pieces is not None else tuple(self.rec.pieces))

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This entry's elements of a whole-param tensor `t` (flat, for a part)."""
        if self.pieces is None:
            return t
        return t.reshape(-1)[self.start:self.start + self.numel]

    @property
    def has_master(self) -> bool:
        """Whether the kernel steps the files' master (else the param, then copied)."""
        return self.dtype is not torch.float32 or self.rec is not None


def _bucket_spec(entries: List[_Param], fmt: str, amsgrad: bool) -> BucketSpec:
    return adam_bucket([(e.name, e.shape, e.part) for e in entries], fmt, amsgrad,
                       split=bool(entries) and entries[0].split)


# Design R2 of the smaller footprint (issue 28), the default (OFFLOAD_ADAM_HEADS=0 turns
# it off: whole masters, the blocks' values in their param files only): the params
# streamed from param files are laid out as the heads of their state's buckets, each
# master split (param_state.adam_bucket(split=True)), a bucket holding one block's params,
# and the blocks are loaded from the heads once a step committed them (nvme_heads.py);
# files laid out before resume in their layout.
HEADS = os.environ.get("OFFLOAD_ADAM_HEADS", "1") != "0"


def _head_block(p, rec):
    """The streamed block whose params a split bucket may hold with p's, or None where p's
    master stays whole: p is a bf16 param streamed from param files (its value is in
    files anyway: the head keeps it once), stepped by the engine, in one flat piece run."""
    home = rec.home if rec is not None else None
    if (home is None or rec.dtype is not torch.bfloat16 or not rec.flat
            or home.block.streamer.files is None):
        return None
    return home.block


def runs_within(items: Sequence, size: Callable[[list], float], limit: float) -> List[list]:
    """`items` cut into runs, in order, each of `size(run)` at most `limit` (one item at
    least): the parts of a param larger than a bucket, from its engine pieces."""
    runs, run = [], []
    for item in items:
        if run and size(run + [item]) > limit:
            runs.append(run)
            run = []
        run.append(item)
    return runs + [run] if run else runs


def deal(entries: Sequence, nbytes: Callable[[object], float], limit: float) -> List[list]:
    """`entries` dealt in order into buckets of at most `limit` bytes of state (one entry
    at least: a larger one is a bucket of its own); the planner deals its shapes with it."""
    buckets, bucket, size = [], [], 0
    for entry in entries:
        n = nbytes(entry)
        if bucket and size + n > limit:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(entry)
        size += n
    return buckets + [bucket] if bucket else buckets


def _spec_name(name: str, raw: bool) -> str:
    """A param's name in the files: torch.compile's wrapper (`_orig_mod.`) left out, so a
    state made through torch.compile(model).named_parameters() resumes on the model
    uncompiled and the other way round (`raw`: as given, the names of files made before)."""
    return name if raw else name.replace("_orig_mod.", "")


def _lay_out(param_groups, params, recs, limit: float, split: bool, raw: bool = False,
             heads: bool = False):
    """The file buckets (lists of _Param) and their specs: every param of every group, in
    order, dealt into buckets of about `limit` bytes of state (a bucket never spans two
    groups); with `split`, an engine param whose state is larger than `limit` is cut into
    parts (_Param), runs of its pieces of at most `limit` bytes each (one piece at least).
    (split=False: the layout of files made before parts existed, still resumed.) With
    `heads` (HEADS), the params streamed from param files (_head_block) have split
    masters, their values the heads of buckets that hold one block's params each."""
    buckets, specs = [], []
    for gi, (group, mine) in enumerate(zip(param_groups, params)):
        fmt = state_format(group["state_dtype"])
        amsgrad = bool(group["amsgrad"])
        names = group.get("param_names")
        keep = {id(p) for p in mine}

        def nbytes(e):
            return _bucket_spec([e], fmt.name, amsgrad).nbytes

        # runs of entries in order, each dealt on its own: (with `heads`) a run of one
        # block's split entries, or of unsplit ones
        runs: List[Tuple[object, list]] = []
        for i, p in enumerate(group["params"]):
            if id(p) not in keep:
                continue
            name = f"{gi}:{_spec_name(names[i], raw) if names else i}"
            rec = recs.get(id(p))
            block = _head_block(p, rec) if heads else None
            whole = _Param(gi, i, p, name, rec, split=block is not None)
            if (split and rec is not None and rec.flat and len(rec.pieces) > 1
                    and nbytes(whole) > limit):
                entries = [_Param(gi, i, p, name, rec, run, split=whole.split)
                           for run in runs_within(rec.pieces, lambda run: nbytes(
                               _Param(gi, i, p, name, rec, run, split=whole.split)), limit)]
            else:
                entries = [whole]
            if not runs or runs[-1][0] is not block:
                runs.append((block, []))
            runs[-1][1].extend(entries)
        for _, entries in runs:
            for bucket in deal(entries, nbytes, limit):
                specs.append(_bucket_spec(bucket, fmt.name, amsgrad))
                buckets.append(bucket)
    return buckets, specs


class FileStore:
    """The state of `params` (a list per group) in files under `dirs`: the file store of
    state_store.py. `engine`: the offload engine stepping some of them (its records name
    which), or None; `state`: optimizer.state, given an entry per param stepped."""

    # A pass commits the step only at its end: a bucket stepped before a second Ctrl-C
    # would leave its params ahead of their files. So every Ctrl-C is held until the
    # pass ends (a hard kill is what the files are crash-safe against).
    interrupt_note = ("offload_adam: Ctrl-C held until this step ends: the state files are "
                      "being written, and a bucket already stepped would be ahead of them. "
                      "To stop at once, kill the process (Ctrl-\\ or kill -9); "
                      "state_resume=True restores the last completed step.")

    def __init__(self, param_groups, params: List[List[torch.Tensor]], dirs, bucket_mb: float,
                 budget_mb: Optional[float], resume: bool = False, engine=None,
                 process_group=None, marks: Optional[MasterMarks] = None, state=None,
                 compact: bool = False, enroll=None, pickled_step: Optional[int] = None):
        recs = _recs_by_param(engine)
        self.engine = engine
        self.marks = marks if marks is not None else MasterMarks()
        self._formats = [state_format(g["state_dtype"]) for g in param_groups]
        self._amsgrad = [bool(g["amsgrad"]) for g in param_groups]
        # The groups as the user may edit them since (delete, reorder, pop: each step
        # follows them, `_follow`): the optimizer's list, each group number's dict when last
        # seen, the ids of the params here in no group now, and what that was read from.
        self._param_groups = param_groups
        self._by_group: List[dict] = list(param_groups)
        self._absent: set = set()
        self._groups_key = None
        self._built_with = {id(p) for ps in params for p in ps}   # (a param put in since)
        files_name = "+".join(sorted({f.files_name for f in self._formats}))
        self.pipeline = None
        self.compact = compact
        # The files hold the params that train (requires_grad, or a grad: a frozen one
        # would cost its state's bytes on disk and in every step's pass, as torch's
        # optimizers make no state for it); files made before that (every float param),
        # or before parts, are resumed as they are.
        trained = [[p for p in ps if p.is_floating_point() and (p.requires_grad
                                                               or p.grad is not None)]
                   for ps in params]
        floats = [[p for p in ps if p.is_floating_point()] for ps in params]
        if not any(trained):
            raise ValueError(
                "offload_adam: state_dirs= given, but none of the optimizer's params trains "
                "(requires_grad=False, or not a float): the files would hold no state, and "
                "a param unfrozen later cannot join them. Build the optimizer after "
                "unfreezing the params that train (or adding them: LoRA adapters)")
        # The layouts tried in turn, (buckets, specs) each: the one without parts only
        # where it differs (no file is touched before NvmeState.open). The engine took
        # the params that train (optimizer._engine_params): before the files of every
        # float param are laid out over its records, it takes the frozen ones too
        # (`enroll`), as it did when those files were made.
        def layouts():
            nonlocal engine, recs
            same = sum(map(len, trained)) == sum(map(len, floats))   # (a subsequence)
            for mine in ([trained] if same else [trained, floats]):
                if mine is floats and enroll is not None:
                    engine = self.engine = enroll(floats)
                    recs = _recs_by_param(engine)
                for raw in (False, True) if compiled_names else (False,):
                    if HEADS:   # (first: files made so; else those made before)
                        heads = _lay_out(param_groups, mine, recs, bucket_mb * _MB, True,
                                         raw=raw, heads=True)
                        if any(e.split for b in heads[0] for e in b):
                            yield heads
                    split = _lay_out(param_groups, mine, recs, bucket_mb * _MB, True, raw=raw)
                    yield split
                    if any(e.part for b in split[0] for e in b):
                        yield _lay_out(param_groups, mine, recs, bucket_mb * _MB, False, raw=raw)

        compiled_names = any("_orig_mod." in n for g in param_groups
                             for n in g.get("param_names") or ())

        flat = [p for group in params for p in group]
        try:
            budget, records = self._open_layout(layouts(), dirs, files_name, budget_mb,
                                                bucket_mb, compact, params, process_group)
        except Exception as e:   # (the other ranks raise too: distributed.refuse_together)
            distributed.refuse_together(str(distributed.told(e)), flat, process_group,
                                        replicas=resume)
            raise
        except BaseException:   # a Ctrl-C held while the files opened, raised once open
            if getattr(self, "state", None) is not None:
                self.state.close(discard=True)
            raise
        try:
            distributed.refuse_together(None, flat, process_group, replicas=resume)
        except BaseException as e:
            distributed.told(e)   # (said there, or the collective failed: nothing to add)
            self.state.close(discard=True)
            raise
        if compact:
            self._warn_whole_spares(param_groups, bucket_mb)
        self._largest_record = max(records, default=0)   # (a compact pass reads them)
        # where each param's state is: (its bucket, its _Param) per part, in order
        self._where: Dict[int, List[Tuple[int, _Param]]] = {}
        for i, b in enumerate(self.buckets):
            for e in b:
                self._where.setdefault(id(e.param), []).append((i, e))
        # each param's (local) shape, as its files were laid out for it
        self._shapes = {pid: tuple(local(where[0][1].param).shape)
                        for pid, where in self._where.items()}
        flat = [p for group in params for p in group]
        self._group = ((flat, process_group)   # several ranks: who steps (after_pass)
                       if distributed.sharded(flat, process_group) else None)
        try:
            self._agree_on_step(params, process_group, resume)
            # what refuses from here on (a damaged slot that the restore reads, a step cut
            # short on a rank that was not given state_resume=True) is refused on every
            # rank: the others would go on into their first step's collectives and wait
            # there for this one (found from outside: gloo's timeout, naming nothing)
            try:
                if pickled_step is not None:
                    self._refuse_moved_on(pickled_step, dirs)
                if (self.state.step or self.state.pending) and not resume:
                    cut = " and a step cut short" if self.state.pending else ""
                    raise ValueError(
                        f"state_dirs={list(dirs)} already hold this optimizer's state at "
                        f"step {self.state.step}{cut} (an earlier run, or one that crashed). To "
                        "continue from it, pass state_resume=True (the params are then set "
                        "from it too). To start afresh, or from a checkpoint of your own (a "
                        "model and an optimizer state_dict, e.g. Trainer's "
                        "resume_from_checkpoint), remove its files "
                        f"({', '.join(STATE_FILES)}) or give other directories: a state is "
                        "never overwritten unasked")
                self.pipeline = StepPipeline(self.state, budget,
                                             engine.device if engine is not None else None)
                if engine is not None:
                    engine.lend_pins(self.pipeline)
                if self.state.pending:   # compact: a step cut short, finished from its log
                    for i, t in self.pipeline.buckets(ahead=self.state.record_ahead):
                        self._redo_bucket(i, t)
                self._stepped: set = set()   # ids of the params whose files hold a stepped one
                # The params state_resume=True restored: id -> (entry, how the param was then,
                # the step it was restored from); checked at the next step (_check_resumed)
                self._resumed: Dict[int, Tuple[_Param, tuple, float]] = {}
                self._previous_gone = self._both_warned = False
                self._resumed_prints: Dict[int, List[Tuple[int, int]]] = {}
                # design R2: the streamed blocks whose values the split buckets' heads keep
                # (linked below), each as (its param files, block); a resume restores them
                # into the heads, their files not written (ParamFiles.restore_in_heads)
                found = nvme_heads.linkable(self.buckets, self.state.spec) if HEADS else []
                into_heads = {(id(f), b) for f, blocks in found for b in blocks}
                restored = bool(self.state.step)
                if restored:
                    if self._group is None:
                        self._found_before_restore()
                    self._restore_params(into_heads)   # (a damaged slot raises here)
                elif resume and not self.state.pending:
                    # Not an error (one script can pass state_resume=True from its first run
                    # on), but said: a mistyped directory would otherwise start afresh unseen.
                    warn(f"offload_adam: state_resume=True, but state_dirs={list(dirs)} "
                         "hold no completed step of this state: starting at step 0"
                         f"{_other_ranks_hint(dirs)}", RuntimeWarning)
            except Exception as e:
                distributed.tell_others(e, flat, process_group, resume)
                raise
            distributed.refuse_together(None, flat, process_group, replicas=resume)
        except BaseException:
            if self.pipeline is not None:
                self.pipeline.close()
            self.state.close(discard=True)
            raise
        # the tensors the last state_dict() mapped from the files, while alive (weakly),
        # the files' step and (two generations) slots then (`_warn_held`); at first those
        # of a closed optimizer's over these files, still held: this one's writes rewrite
        # their place too
        self._handed: Optional[_Handed] = _HELD_AFTER_CLOSE.pop(self.state.uuid, None)
        self._serial = next(_SERIALS)   # (whose state_dict() a load is given: _own_unchanged)
        self._held_warned = False   # (_warn_held: once, not at every step of a loop)
        self._early = None   # step_in_backward: the pass that starts in backward
        files = [[e.entry() for e in b] if all(e.rec is not None for e in b) else None
                 for b in self.buckets]
        # (asked through a weak reference: the engine holds the pass, and must not hold
        # this store, which holds the engine: a dropped optimizer is freed at once)
        me = weakref.ref(self)
        edited = lambda: me() is not None and me()._edited_now()   # noqa: E731
        if engine is not None and engine.early is not None and self.state.logs_steps:
            self._early = DiskLog(engine, engine.early, self.pipeline, files, edited)
            engine.early.use_files(self._early)
        elif engine is not None and engine.early is not None:
            # (compact too while nothing is committed: _files_early_for_now)
            self._early = DiskEarly(engine, engine.early, self.pipeline, files, edited,
                                    guess=not self._resumed)
            engine.early.use_files(self._early)
        if state is not None:
            self._mark(state)
        # design R2: the streamed blocks whose values the split buckets' heads keep are
        # loaded from them once a step committed them (nvme_heads.py); back in their
        # files when this store closes (the optimizer's close, or its finalizer)
        self._heads = nvme_heads.link(self.buckets, self.state, found) if HEADS else []
        if restored:
            for h in self._heads:
                h.files.restore_in_heads(sorted(h.blocks))
        if self._heads:
            links = list(self._heads)
            self.state.on_commit = lambda written: [h.committed(written) for h in links]
            me = weakref.ref(self)
            for h in links:
                h.pipeline = lambda: getattr(me(), "pipeline", None)
            if self._early is not None:   # (its buckets lent in backward)
                self._early.on_lend = lambda i: [h.lent(i) for h in links]

    def _open_layout(self, tries, dirs, files_name: str, budget_mb, bucket_mb: float,
                     compact: bool, params, process_group) -> Tuple[int, List[int]]:
        """Opens (or makes) the files in the first of the layouts `tries` (buckets, specs)
        they were made with: self.buckets and self.state; returns the ring's budget and
        each bucket's redo record reserve."""
        buckets, specs = next(tries)
        flat = [p for g in params for p in g]
        # (global, as the folders rank<R> are named: distributed.rank_dirs)
        rank = distributed.dist.get_rank() if distributed.sharded(flat, process_group) else None
        while True:
            self.buckets = buckets
            spec = StateSpec(tuple(specs), files_name, extra={"amsgrad": self._amsgrad})
            largest = max((b.nbytes for b in spec.buckets), default=0)
            budget = int(budget_mb * _MB) if budget_mb is not None else 4 * largest
            try:   # before any file is made: a refused construction leaves none behind
                ring_size(spec, budget)
            except ValueError as e:
                raise ValueError(f"state_budget_mb={budget_mb}: {e}") from None
            records = [redo.record_reserve([e.numel * e.dtype.itemsize for e in b])
                       for b in self.buckets]
            try:   # (compact: the redo log reserved for the grads, as the params' dtypes)
                with interrupts_deferred(hold_all=OPEN_HELD):   # (kept as it opens)
                    credit = (nvme_heads.given_back(nvme_heads.linkable(buckets, spec))
                              if HEADS else None)
                    self.state = NvmeState.open(list(dirs), spec, compact=compact,
                                                log_bytes=records, rank=rank, credit=credit)
                break
            except OtherState as e:
                following = next(tries, None)
                if following is not None:
                    buckets, specs = following
                    continue
                hint = _RANKS_HINT if rank is not None else ""
                raise ValueError(f"{e}. (What identifies them: the params' names, shapes "
                                 "and order in the groups, state_dtype, amsgrad, which "
                                 "params trained (a param frozen when they were made has "
                                 "no state there), and bucket_mb, which lays out the "
                                 f"buckets: bucket_mb={bucket_mb:g} here; resume with the "
                                 "one they were made with. A param larger than bucket_mb is "
                                 "kept in parts when the GPU's engine steps it and whole "
                                 "when the CPU does: resume on the same kind of device"
                                 f"{hint})") from None
        return budget, records

    def _warn_whole_spares(self, param_groups, bucket_mb: float) -> None:
        """The compact ring's spares are 4 extents the size of the largest bucket. A param
        the CPU steps in place is kept whole (parts follow the engine's pieces), so one
        whose state is many buckets made the spares 4x its state: an 8-bit 4M-param
        embedding with bucket_mb=1 took 31 B/param on disk where two generations take 12
        (found from outside). Said when the files open, with the way out."""
        sizes = [b.nbytes for b in self.state.spec.buckets]
        largest = max(range(len(sizes)), key=sizes.__getitem__, default=None)
        total = sum(sizes)
        if largest is None or 4 * sizes[largest] <= total or sizes[largest] <= bucket_mb * _MB:
            # (the footprint is still the smaller one; or no bucket is larger than
            # bucket_mb: a small state, under 4 buckets, whose spares are the design's,
            # was warned of, blaming a small param: found from outside)
            return
        e = max(self.buckets[largest], key=lambda e: e.numel)
        if e.rec is not None:
            return
        g = param_groups[e.group]
        warn(f"offload_adam: state_footprint='compact' keeps 4 spare extents the size of the "
             f"largest bucket, and param {param_label(g, e.group, e.index, e.param)} is "
             f"stepped whole in place on the CPU: its bucket holds "
             f"{sizes[largest] / _MB:.1f} MB of state (bucket_mb={bucket_mb:g}), so the "
             f"spares take {4 * sizes[largest] / _MB:.1f} MB beside the state's "
             f"{total / _MB:.1f} MB (two generations would take {2 * total / _MB:.1f} MB). "
             "The offload engine keeps such a param in parts of bucket_mb (bf16/fp16 params "
             "in host memory: step_in_backward=True; params on a GPU); else "
             "state_footprint='two_generations' takes less disk here", UserWarning)

    def _refuse_moved_on(self, pickled_step: int, dirs) -> None:
        """An optimizer unpickled (torch.load of a whole optimizer, copy.copy) reopens its
        files, which hold only their last step. Files moved on since the pickle (training
        went on after it was made) would step the pickled params with another step's
        moments: refused before anything is read or set."""
        if self.state.step == pickled_step and not self.state.pending:
            return
        now = (f"step {self.state.step}" if not self.state.pending
               else f"step {self.state.step} with the next step cut short")
        raise ValueError(
            f"offload_adam: this optimizer was pickled (e.g. torch.save of the optimizer "
            f"object) when its state files in state_dirs={list(dirs)} were at step "
            f"{pickled_step}; they are at {now}: training went on after the pickle was "
            "made, and the files keep only their last step. Unpickled, it would step the "
            "params saved with it with the moments of another step. To go on from the "
            "files, build the optimizer with state_resume=True (the params are set from "
            "them); for checkpoints to go back to, save opt.state_dict() (it holds the "
            "state's values) rather than the optimizer object. Nothing was changed")

    def _agree_on_step(self, params, process_group, resume: bool) -> None:
        """Under several ranks (FSDP2, process_group=, or DDP's replicas, whose first
        broadcast gives every rank rank 0's params): every rank resumes from the same
        step. A rank killed between the others' commit of a step and its own is one step
        behind; the others go back to its step, which their files still hold (the other
        slots, checked whole first). Ranks that cannot agree all raise the same error.
        (Replicas resumed from their own steps failed at the first step, the one behind
        refusing the broadcast params as changed: found from outside. Replicas agree
        when they resume, `resume`: a collective, which every rank's optimizer joins then;
        a replica's optimizer is otherwise built with no collective, as one a single rank
        builds for itself may be.)"""
        flat = [p for group in params for p in group]
        mine = (self.state.step, self.state.previous, self.state.run, self.state.uuid)
        if self.state.compact:
            self._agree_compact(flat, process_group, resume)
            return
        ranks = distributed.every_rank(mine, flat, process_group, replicas=resume)
        if ranks is None:
            return
        self._same_run([r[2:] for r in ranks])
        ranks = [r[:2] for r in ranks]
        target = min(step for step, _ in ranks)
        if any(step != target and previous != target for step, previous in ranks):
            raise ValueError(
                f"offload_adam: the ranks' state files are at steps {[s for s, _ in ranks]} "
                f"(rank order) and cannot be brought to one step (each keeps the step "
                f"before its last); they are not the files of one run. Give the directories "
                "of one run, or remove the state files to start afresh")
        problem = None
        if self.state.step != target:
            try:
                self.state.rollback()
            except NvmeError as e:
                problem = str(e)
        problems = distributed.every_rank(problem, flat, process_group, replicas=resume)
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            raise ValueError(
                f"offload_adam: the ranks' state files are at steps {[s for s, _ in ranks]} "
                f"(rank order); going back to step {target} failed on rank {bad[0][0]}: "
                f"{bad[0][1]}")
        if target != mine[0]:   # (mine: step, previous, run, uuid)
            warn(f"offload_adam: this rank's state files were at step {mine[0]}, "
                 f"another rank's at step {target} (killed before it committed step "
                 f"{mine[0]}): all ranks resume from step {target}", RuntimeWarning)

    def _same_run(self, ranks: List[tuple]) -> None:
        """Each rank's (run, uuid) of its files: files of two runs (a rank's folder put
        back from another run at the same step) are refused, not resumed together (found
        from outside: each rank trained on from its own run, silently); files that keep no
        run yet take the first rank's uuid as theirs (new files, or made before runs were
        kept). Every rank raises alike (they see the same list)."""
        runs = sorted({run for run, _ in ranks if run is not None})
        if len(runs) > 1:
            which = ", ".join(f"rank {r}: {run[:8] if run else '-'}"
                              for r, (run, _) in enumerate(ranks))
            raise ValueError(
                f"offload_adam: the ranks' state files are of different runs ({which}): a "
                "rank's directory was put back from another run. Give every rank the "
                "directories of one run, or remove the state files to start afresh")
        if self.state.run is None:
            self.state.join_run(runs[0] if runs else ranks[0][1])

    def _agree_compact(self, flat, process_group, resume: bool) -> None:
        """_agree_on_step for compact files, which keep no step before the last but may
        hold a step begun (its redo records durable): every rank's step begun is durable
        before any rank moves a bucket (`_all_ranks_logged`). So the ranks go forward to the
        latest step when each has it whole or begun; else back to the earliest when none
        moved a bucket of a later one (dropping what they began); anything else is not
        the files of one run."""
        st = self.state
        ranks = distributed.every_rank((st.step, st.intent_step, st.moved, st.run, st.uuid),
                                       flat, process_group, replicas=resume)
        if ranks is None:
            return
        self._same_run([r[3:] for r in ranks])
        ranks = [r[:3] for r in ranks]
        ahead = max(max(s, i or 0) for s, i, _ in ranks)
        behind = min(s for s, _, _ in ranks)
        began = st.intent_step
        if all(s == ahead or i == ahead for s, i, _ in ranks):
            target = ahead   # (the ranks with a step begun finish it: `pending`)
        elif all(s == behind and not moved for s, _, moved in ranks):
            target = behind
            st.drop_intent()
        else:
            raise ValueError(
                f"offload_adam: the ranks' compact state files are at steps "
                f"{[(s, i) for s, i, _ in ranks]} ((completed, begun) in rank order) and "
                "cannot be brought to one step: they are not the files of one run. Give "
                "the directories of one run, or remove the state files to start afresh")
        if began is not None and target != began:
            warn(f"offload_adam: this rank began step {began} in its state files, "
                 f"and another rank did not: all ranks resume from step {target}", RuntimeWarning)

    def _all_ranks_logged(self) -> None:
        """Compact, several ranks: no rank moves a bucket of a step before every rank's
        redo records of it are durable (a collective at each step, stepping or not), so
        that ranks killed at any instant can all go forward, or all back
        (`_agree_compact`)."""
        if self.compact and self._group is not None:
            bad = distributed.other_refusal(None, *self._group)
            if bad is not None:   # (a rank whose pass failed before its log: after_pass)
                raise distributed.told(RuntimeError(
                    f"offload_adam: rank {bad[0]}'s step() failed before it logged the "
                    f"step, so every rank's is, nothing stepped: {bad[1]}"))

    def after_pass(self, error: Optional[BaseException]) -> None:
        """Under several ranks (FSDP2, process_group=), after each step's pass, every rank
        says whether its pass failed (error: an I/O error, a state file truncated or its
        lock removed, on one rank alone): the others raise naming it instead of going on
        into the next forward's collectives, where they waited for that rank until the
        process group's timeout (found from outside). Their steps stay committed: the
        ranks resume from one step with state_resume=True (_agree_on_step)."""
        if self._group is None:
            return
        if error is not None:
            distributed.tell_others(error, *self._group)
            return
        bad = distributed.other_refusal(None, *self._group)
        if bad is not None:
            raise RuntimeError(
                f"offload_adam: rank {bad[0]}'s step() failed part way, so every rank's "
                f"raises: this rank's step completed (its files hold step "
                f"{self.step_count()}), rank {bad[0]}'s did not. Build every rank's "
                "optimizer again with state_resume=True: the ranks resume from one step. "
                f"Rank {bad[0]}'s error: {bad[1]}")

    def _restore_params(self, into_heads: frozenset = frozenset()) -> None:
        """A resumed state gives the params their values of its last completed step:
        each param takes its master from the files (rounded to a bf16/fp16 param), so
        that a crash loses nothing even between a step and the user's own checkpoint of
        the model. That holds for a param never stepped too (an MoE expert no token was
        routed to yet, a param without a grad so far): each step writes its master as
        the param is then, so the files hold its value of the last step (the model
        built again may hold another init, or NaN where it was built on the meta device
        and streamed). Files of no completed step set nothing. What each param is then
        is kept, to check at the next step that nothing loaded after mixes steps
        (_check_resumed). `into_heads`: the blocks (id of their param files, index) whose
        values the heads keep (design R2), not written here: restored into the heads once
        linked (ParamFiles.restore_in_heads)."""
        self._stepped, self._resumed = set(), {}
        # an fp32 param stepped in place is its own master: a state dict loaded over it
        # holds none to compare, so its first moment's values are (_refuse_a_mix)
        self._resumed_prints: Dict[int, List[Tuple[int, int]]] = {}
        # every slot checked before any param is set: a damaged one changes nothing
        every = [self.state.views(i) for i in range(len(self.buckets))]
        # masters a load_state_dict made from the params of the time (no step since):
        # the step's params if the model was loaded before the optimizer, not if after.
        # Set from them all the same, but a model loaded now is taken, not refused
        # (_check_resumed), each master following its param at the next step (master_rule:
        # never agreed), and it is said
        unknown = set(self.state.from_params)
        with torch.no_grad():
            for bucket, views in zip(self.buckets, every):
                for e in bucket:
                    st = ParamState.in_bucket(views, e.name)
                    step = float(st.step)
                    if step > 0 or self.state.step > 0:
                        if not (into_heads and _in_heads(e, into_heads)):
                            write_values(e.param, st.rounded, e.start if e.part else None)
                        if step > 0:
                            self._stepped.add(id(e.param))
                        if e.name not in unknown:
                            self._resumed[id(e.param)] = (e, mark(e.param), step)
                            if not e.has_master and step > 0:
                                self._resumed_prints.setdefault(id(e.param), []).append(
                                    (e.start if e.part else 0, _moment_print(float32_moment(
                                        st.exp_avg, st.exp_avg_scale, "exp_avg"))))
        self.marks.agree(e.param for e, _, _ in self._resumed.values())
        if unknown:
            names = sorted(unknown)
            warn(f"offload_adam: state_resume=True: the state files hold a state loaded with "
                 f"load_state_dict at step {self.state.step} and no step since, whose dict "
                 f"held no master for {len(names)} params (first: {shown(names[0])}; torch's state "
                 "dicts hold none): the files took them from the params as they were at that "
                 "load, and the params were set to them. If that run loaded the model's weights "
                 "after the optimizer's state dict, load them again now: each master follows "
                 "its param at the next step", RuntimeWarning)

    def _found_before_restore(self) -> None:
        """state_resume=True sets the params to the files' last step. A model checkpoint
        loaded before the optimizer was built, of the step before (a kill between step()
        and the checkpoint's save), would be dropped silently and its step trained twice:
        params that are the previous step's (and not the last's) set the state back to
        it, as a checkpoint loaded after (_check_resumed), with a warning. A fresh model
        is neither step's (the first param tells, reading one bucket)."""
        step, previous = self.state.step, self.state.previous
        entries = [e for bucket in self.buckets for e in bucket]
        if previous is None or not self._params_match(entries, previous=True):
            return
        if self._params_match(entries, previous=False):
            self._warn_both(step, previous)
            return
        self.state.rollback()
        warn(f"offload_adam: state_resume=True: the params were those of step {previous} "
             f"when the optimizer was built (a model checkpoint saved before the last step, "
             f"loaded first?), which the state files hold beside their last step {step}: "
             f"the optimizer state went back to step {previous} to match them "
             f"(opt.step_count). To continue from step {step} instead, build the optimizer "
             "on a freshly made model", RuntimeWarning)

    def _warn_both(self, step: int, previous: int) -> None:
        warn(f"offload_adam: state_resume=True: the params are those of step {step} and of "
             f"step {previous} alike (a step that moved no param: lr 0, a warmup's first?), "
             f"so they cannot say which step a checkpoint of yours is: the state is at step "
             f"{step} (opt.step_count); continue from there (a loop that goes on from step "
             f"{previous} would take step {step}'s batch twice in the moments)", RuntimeWarning)

    def _check_resumed(self, stepping: bool) -> None:
        """Before the first step after state_resume=True (and the state dict's views): the
        params changed since they were restored (a model checkpoint loaded after building
        the optimizer) must be the files' step, or training on would mix the params of
        one step with the moments and step count of another. Params of the step before,
        which the files hold too (a kill between step() and the model's save), set the
        state back to that step, with a warning; params of no step the files hold are
        refused, before anything is stepped."""
        if not self._resumed:
            return
        changed = [e for e, now, _ in self._resumed.values() if mark(e.param) != now]
        step, previous = self.state.step, self.state.previous
        older = [e for e, _, _ in self._resumed.values()]
        self._previous_gone = False
        if changed and self._params_match(changed, previous=False):
            if (previous is not None and not self._both_warned
                    and self._params_match(older, previous=True)):
                self._both_warned = True
                self._warn_both(step, previous)
        elif changed:
            if previous is not None and self._params_match(older, previous=True):
                self.state.rollback()
                self._restore_params()   # (the same values: they are the params)
                warn(f"offload_adam: the params were changed after state_resume=True set them "
                     f"to the state files' step {step}, and they are the params of step "
                     f"{previous}, which the files hold too (a model checkpoint saved before "
                     f"the last step?): the optimizer state went back to step {previous} to "
                     "match them. To continue from the files' last step instead, do not load "
                     "the model after building the optimizer with state_resume=True",
                     RuntimeWarning)
            else:
                held = f"step {step}" + (
                    f" or {previous}" if previous is not None and not self._previous_gone
                    else " only: " + ("a compact state keeps no step before its last"
                                      if self.compact else "the one before was being "
                                      "overwritten by a step cut short"))
                raise RuntimeError(
                    f"offload_adam: {len(changed)} params were changed after "
                    f"state_resume=True set them to the state files' step {step} (first: "
                    f"param {changed[0].name}), and they are not the params of any step the "
                    f"files hold ({held}): training on would step them with another step's "
                    "moments and step count. Nothing was stepped. Either resume from the "
                    "files alone (state_resume=True sets the params: do not load the model "
                    "after building the optimizer), or load the optimizer state saved with "
                    "these params (opt.load_state_dict) before stepping. (Under Hugging Face "
                    "Trainer's resume_from_checkpoint, Accelerate reads opt.state_dict() "
                    "before the checkpoint's optimizer state is loaded: there, build the "
                    "optimizer without state_resume, on directories without state, and the "
                    "checkpoint loads it)")
        if stepping:   # (until then, a model loaded later is checked again)
            self._resumed = {}

    def _params_match(self, entries: List[_Param], previous: bool) -> bool:
        """Whether each entry's param is its master in the files' current (or previous)
        generation, as a restore from it would have set it; entries not stepped in that
        generation match whatever they are (they start from their param)."""
        by_bucket: Dict[int, List[_Param]] = {}
        for e in {id(e.param): e for e in entries}.values():
            for i, part in self._where[id(e.param)]:   # (each part of a param in parts)
                by_bucket.setdefault(i, []).append(part)
        with torch.no_grad():
            for i, bucket in sorted(by_bucket.items()):
                try:
                    views = self.state.views(i, previous=previous)
                except NvmeError:
                    if previous:
                        self._previous_gone = True
                        return False   # not whole any more: no step to go back to
                    raise
                for e in bucket:
                    st = ParamState.in_bucket(views, e.name)
                    if float(st.step) == 0:
                        continue
                    if not rounds_to(st.rounded, e.of(param_values(e.param)).to("cpu")):
                        return False
        return True

    def step_count(self, state=None) -> int:
        """The completed steps the files hold (the last commit), or the one before when a
        model checkpoint of that step was loaded after state_resume=True (_check_resumed,
        which went back to it only at the next step() or state_dict(): a loop that read
        step_count between the load and those set its schedule and data a step ahead of
        the state, without a word; found from outside). Params of no step the files hold
        are refused by those, not here: the state is at the files' step meanwhile."""
        try:
            self._check_resumed(stepping=False)
        except RuntimeError:
            pass
        return self.state.step

    def _mark(self, state) -> None:
        """An empty entry in optimizer.state for each param whose state is in the files
        (stepped at least once), as torch's optimizers have one for each param with a
        state: code that asks whether an optimizer has state sees it (torch.distributed.
        checkpoint's get_state_dict otherwise "initialises" it with a step of zero grads,
        which would move the moments in the files)."""
        for bucket in self.buckets:
            for e in bucket:
                if id(e.param) not in self._stepped:
                    continue
                entry = state.get(e.param)
                if entry is None or (type(entry) is not InFiles and not _owns(entry)):
                    # (a plain entry of the user's own keys only: they stay, in RAM)
                    state[e.param] = InFiles(e.name, entry or {})

    def edited(self, state) -> List[str]:
        """The params (labels) whose entry in optimizer.state `state` the user removed
        or set a value in since the files' state was last shown there (`_mark`); the
        optimizer loads them into the files before its next step (see the module doc)."""
        out = []
        for pid, where in self._where.items():
            if pid in self._absent:
                continue
            e = where[0][1]
            entry = state.get(e.param)   # (a defaultdict's get makes no entry)
            # (a key of the user's own, not the state's, is no edit: it stays in RAM, as
            # torch's optimizers keep it, and state_dict() shows it)
            if pid in self._stepped:   # removed, replaced, cleared, or given a value
                if (entry is None or type(entry) is not InFiles or entry.cleared
                        or _owns(entry)):
                    out.append(e.name)
            elif entry and _owns(entry):   # a state given to a param without one
                out.append(e.name)
        return out

    def take_edits(self, state) -> bool:
        """Whether optimizer.state was edited (`edited`): then the caller loads its own
        state_dict(), which shows the edits, before the step. A files' pass that started in
        backward is stopped first (the step() that finds the edit raises, naming it: its
        grads were stepped from the state before; a backward's first grad asks too, so
        this is only an edit between backward and step())."""
        edited = self.edited(state)
        if edited:
            self._abandon_early(f"the optimizer state of {edited[0]} in optimizer.state was "
                                "changed after its step started during backward (the change "
                                "is in the files now: the next step uses it)")
        return bool(edited)

    def _edited_now(self) -> bool:
        """Whether the optimizer's state was edited (`edited`), asked at a backward's first
        grad: such a backward leaves the files' work to step(), which loads the edits
        first (engine/disk_early.py)."""
        early = self.engine.early if self.engine is not None else None
        owner = early.owner() if early is not None else None
        raw = getattr(owner, "raw_state", None)
        return raw is not None and bool(self.edited(raw()))

    def _check_in_files(self, param_groups) -> None:
        """A RuntimeError naming the first param whose shape is not the one its files were
        laid out for, or with a grad that the files hold no state for (frozen when the
        optimizer was built, unfrozen since), before anything moves."""
        for gi, g in enumerate(param_groups):
            for i, p in enumerate(g["params"]):
                laid = self._shapes.get(id(p))
                if laid is not None and tuple(local(p).shape) != laid:
                    raise RuntimeError(
                        f"offload_adam: param {param_label(g, gi, i, p)} has shape "
                        f"{tuple(local(p).shape)}; its state files were laid out for "
                        f"{laid} when the optimizer was built (p.data set to another "
                        "shape?); nothing was stepped. With state_dirs=, build the "
                        "optimizer after reshaping the model")
                if p.grad is not None and id(p) not in self._built_with:
                    raise RuntimeError(
                        f"offload_adam: param {param_label(g, gi, i, p)} was put into "
                        f"param_groups[{gi}]['params'] after the optimizer was built with "
                        "state_dirs=, whose files hold the state of the params it was built "
                        "with; nothing was stepped. Build a new optimizer over the params "
                        "(add_param_group cannot be used with state_dirs= either)")
                if p.grad is not None and id(p) not in self._where:
                    raise RuntimeError(
                        f"offload_adam: param {param_label(g, gi, i, p)} has a grad, but it "
                        "was frozen (requires_grad=False) when the optimizer was built with "
                        "state_dirs=, whose files hold the state of the params that trained "
                        "then, and none for it; nothing was stepped. Build the optimizer after "
                        "unfreezing it (with new state_dirs, or state_resume=False over "
                        "removed files)")

    def grads(self, param_groups=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(param, grad) of every param stepped in place here that has one (clipping's
        norm; the engine's params count theirs from their host copies)."""
        if param_groups is not None:
            self._check_in_files(param_groups)
            self._follow(param_groups)
        return [(e.param, local(e.param.grad)) for b in self.buckets for e in b
                if e.rec is None and e.param.grad is not None and id(e.param) not in self._absent]

    def _follow(self, param_groups) -> List[dict]:
        """`param_groups` (as they are now: the user may delete params from them, reorder
        or pop them, as torch.optim allows) by the index each param's group had when the
        files were laid out (_Param.group): the group its params are in now (the one last
        seen if none is); the params here in no group now (`_absent`) are not stepped,
        their state stays as it was. A group whose params are now in two groups cannot be
        followed (its buckets step with one group's hyperparameters): a RuntimeError."""
        self._param_groups = param_groups   # (torch's load_state_dict puts a new list)
        key = tuple((id(g), id(g["params"]), tuple(map(id, g["params"]))) for g in param_groups)
        if key == self._groups_key:
            return self._by_group
        def group_of(p):
            where = self._where.get(id(p))
            return where[0][1].group if where is not None else None

        def split(p, gi, other):
            g = param_groups[gi]
            at = next(k for k, q in enumerate(g["params"]) if q is p)   # (not ==: elementwise)
            return (f"offload_adam: param {param_label(g, gi, at, p)} "
                    f"is now in param group {gi}, but params that were in its group when "
                    f"the optimizer was built are in param group {other}: the state "
                    "files step a group's params with one group's hyperparameters. Move "
                    "params between groups by building a new optimizer")
        by_group = list(self._by_group)
        now, present = groups_now(param_groups, group_of, split)
        for group, (g, _) in now.items():
            by_group[group] = g
        self._by_group, self._groups_key = by_group, key
        self._absent = set(self._where) - present
        return by_group

    def add_group(self, index: int, group: dict) -> None:
        raise NotImplementedError(
            "add_param_group cannot be used with state_dirs=: the NVMe tier lays out "
            "its files for the params given at construction. Give every param group "
            "when building the optimizer; nothing was added")

    def reset(self) -> None:
        pass   # nothing cached between steps

    def host_bytes(self, param_groups=None, state=None) -> int:
        """The pipeline's ring buffers, the only state in RAM; compact, with the redo
        records the pass reads (the one stepped and AHEAD read ahead)."""
        if self.pipeline is None:
            return 0
        return self.pipeline.host_bytes + self._records_read

    @property
    def _records_read(self) -> int:
        return (AHEAD + 1) * self._largest_record if self.state.compact else 0

    @property
    def pinned(self) -> bool:
        return self.pipeline is None or self.pipeline.pinned

    def _check_open(self) -> None:
        if self.pipeline is None:
            raise RuntimeError("offload_adam: this optimizer was closed (its state files "
                               "too); build a new one, with state_resume=True to continue "
                               "from them")

    def close(self) -> None:
        if self.pipeline is not None:
            self._abandon_early("the optimizer was closed")
            self.pipeline.close()
            _heads_out(self._heads)   # (the blocks in the heads back in their files)
            if self._handed is not None and len(self._handed.held):
                _HELD_AFTER_CLOSE[self.state.uuid] = self._handed
            self.state.close()
            self.pipeline = None

    # ---- step -------------------------------------------------------------------------

    def pass_(self, param_groups, state, grad_scale: float) -> Iterator[Lent]:
        """One pass over the files (state_store.py): each file bucket lent in the
        pipeline's order, its in-place params to the CPU stepper and its engine params
        to the engine (EngineStep.lent); written back and committed once, when the
        pass ends; an error (or the pass closed early) commits nothing."""
        self._check_open()
        try:   # what the files refuse, before any bucket is stepped
            self._check_resumed(stepping=True)
            self._check_in_files(param_groups)
            # (the engine follows the groups itself: given them as they are)
            groups_now, param_groups = param_groups, self._follow(param_groups)
            with_grads = [e for b in self.buckets for e in b if e.rec is None
                          and e.param.grad is not None and id(e.param) not in self._absent]
            for e in with_grads:
                _check_grad(e, param_groups[e.group])
            if with_grads or (self._early is not None and self._early.started):
                # amsgrad switched on: refused here, the steps begun in backward abandoned
                # (streamed params put back); a changed state_dtype started none, and the
                # engine's check below says so
                for gi, g in enumerate(param_groups):
                    if state_format(g["state_dtype"]) == self._formats[gi]:
                        self._check_format(gi, param_groups)
        except BaseException:   # a pass started in backward ends with the refused step
            if self._early is not None and self._early.busy:   # (nothing stepped: the
                self.engine.early.commit()   # next zero_grad() and backward start afresh)
            raise
        # (step_in_backward: verify() here may abandon the pass, then raises)
        run = self.engine.stepping(groups_now, grad_scale) if self.engine else None
        early = self._early if self._early is not None and self._early.started else None
        stepped_early = list(early.stepped) if early is not None else []
        completed = lent = False
        current: list = []   # the kernel calls of the bucket lent now
        try:
            stepping = early is not None or with_grads or (run is not None and run.ready)
            if stepping:   # (refused before the redo log: nothing of the step is written)
                for gi in range(len(param_groups)):
                    self._check_format(gi, param_groups)
                self._warn_held("this step")
            if self.compact:   # before any bucket moves: the redo log, on every rank
                if stepping:
                    self._log_step(param_groups, grad_scale, run, early)
                self._all_ranks_logged()
            if stepping:
                passes = early.rest() if early is not None else self.pipeline.buckets()
                with contextlib.closing(passes):   # an error: the I/O in flight waited for
                    # every group, the buckets stepped in backward too (the pass does
                    # not hand those on): an error here commits nothing
                    for i, t in passes:
                        bucket = self.buckets[i]
                        for link in self._heads:   # (its blocks' edits, before it reads them)
                            link.lent(i)
                        if early is not None and i in getattr(early, "logged", ()):
                            self._grads_from_log(i)
                        calls, follow = self._lend_in_place(
                            [e for e in bucket if e.rec is None], t)
                        engine = [e.entry() for e in bucket if e.rec is not None]
                        steps = bool(calls) or bool(engine and run is not None)
                        # (an error raised here, between two of its kernel calls, a
                        # Ctrl-C, has moved the params of the calls that ran: `current`)
                        current = calls
                        yield Lent(Hyper.of(param_groups[bucket[0].group], bucket[0].group) if calls else None,
                                   calls, (lambda engine=engine, t=t: run.lent(engine, t))
                                   if run is not None and engine else None)
                        lent = lent or steps   # (stepped: its params moved)
                        current = []
                        for p, master in follow:   # an fp32 param is its own master
                            master.copy_(p)
                if stepped_early:   # committed: now their params
                    run.write_early(stepped_early)
                done = {id(e.param) for e in with_grads}
                done |= {id(r.param) for r in (run.stepped if run is not None else ())}
                self._stepped |= done
            # else, as torch: a step without grads changes nothing
            completed = True
        finally:
            try:
                if not completed:
                    # params moved: the files hold the step before. With step_in_backward
                    # too: the buckets the pass in backward left to step() are lent here
                    # and their params written as they are stepped, and a streamed param
                    # stepped in backward was written in its host copy then
                    # (a bucket cut short between two of its calls: those that ran moved
                    # their params, and a retry stepped them twice, silently)
                    lent = lent or any(call.ran for call, _ in current)
                    if lent or any(r.home is not None for r in stepped_early):
                        self.state.params_ahead(sys.exc_info()[1])
                    elif self.compact and early is None:   # a step begun whose pass
                        self.state.abandon_pass(lent=False)   # never ran is dropped
                if run is not None:
                    run.end(completed)
            finally:
                for link in self._heads:
                    link.end_pass()
                self._mark(state)
                self._files_early_for_now()

    # ---- compact: the redo log ----------------------------------------------------------

    def _files_early_for_now(self) -> None:
        """step_in_backward over compact files: a new state's first pass has no redo log
        (a crash makes the state anew), so it steps in backward as two generations do
        (DiskEarly: each bucket written in place, set back to step 0 if abandoned; no
        record written, the logs reserved only once it committed, into the room the heads'
        blocks gave back). From its commit (a step's or a load's) on, each step's grads go
        to the redo log in backward (DiskLog)."""
        early = self._early
        if not isinstance(early, DiskEarly) or not self.state.logs_steps or early.busy:
            return   # (a DiskEarly is made only with an engine)
        self._early = DiskLog(self.engine, self.engine.early, self.pipeline, early.files,
                              early.edited, ring=False)
        self._early.on_lend = early.on_lend
        self.engine.early.use_files(self._early)

    def _log_step(self, param_groups, grad_scale: float, run, early) -> None:
        """Compact: the redo records of the buckets not logged in backward (DiskLog),
        then the intent, with the hyperparameters and grad scales they are stepped with;
        none where the files' pass needs no intent (a new state's first step, which logs
        nothing in backward either: _files_early_for_now)."""
        if isinstance(early, DiskLog):
            early.settle()   # (its records written)
        if not self.state.logs_steps:
            return
        logged = early.logged if early is not None else {}
        records = {i: self._record(i, run) for i in range(len(self.buckets)) if i not in logged}
        groups = sorted({b[0].group for b in self.buckets})
        meta = {"hypers": {str(g): dataclasses.asdict(Hyper.of(param_groups[g], g))
                           for g in groups},
                "scale": grad_scale,
                "engine_scale": run.grad_scale if run is not None else grad_scale,
                "engine_grad_mul": run.grad_mul if run is not None else 1.0}
        self.state.begin(self.state.step + 1, records, meta)

    def _record(self, i: int, run) -> redo.Record:
        """Bucket i's redo record of the step about to run (nvme/redo.py): per param
        stepped, its grad as the kernel will read it (the engine's: piece by piece, once
        its copy landed); per param whose master follows it this step (master_rule.py:
        changed since it last agreed), its value; its group and which params are stepped
        in place (the grad scale differs)."""
        bucket = self.buckets[i]
        tensors, in_place = [], []
        for e in bucket:
            ready = e.rec is not None and run is not None and id(e.rec) in run.ready
            if e.rec is None and e.param.grad is not None and id(e.param) not in self._absent:
                tensors.append((f"g|{e.name}|0", contiguous_grad(e.param)))
                in_place.append(e.name)
            elif ready:
                tensors += [(f"g|{e.name}|{start}", g)
                            for start, g in run.host_grads(e.rec, e.entry().pieces)]
            if e.rec is None and not self.marks.current(e.param):
                tensors.append((f"p|{e.name}|0", param_values(e.param)))
            elif e.rec is not None and not self.engine.marks.current(e.param):
                tensors += [(f"p|{e.name}|{start}", v)
                            for start, v in run.host_params(e.rec, e.entry().pieces)]
        return {"group": bucket[0].group, "in_place": in_place}, tensors

    def _grads_from_log(self, i: int) -> None:
        """Bucket i's grads logged in backward (DiskLog: their ring room is reused) back
        into its pieces, from the redo log, for the step's kernels to read."""
        _, logged = self.state.record(i)
        for e in self.buckets[i]:
            for p in e.entry().pieces:
                p.grad = logged[f"g|{e.name}|{p.start}"]

    def _redo_bucket(self, i: int, t: Dict[str, torch.Tensor]) -> None:
        """Bucket i (at the step before the one cut short) stepped again from its redo
        record: the masters that followed their params, then the kernel on the logged
        grads with the logged hyperparameters, bitwise the step that ran (elementwise,
        its rounding drawn by element index: however the engine cut the params)."""
        meta, logged = self.state.record(i)
        step_meta = self.state.intent_meta
        hyper = Hyper(**step_meta["hypers"][str(meta["group"])])
        parts: Dict[Tuple[str, str], list] = {}
        for key, v in logged.items():
            name, start = key[2:key.rfind("|")], int(key[key.rfind("|") + 1:])
            parts.setdefault((key[0], name), []).append((start, v))

        def whole(kind, name, like):
            pieces = sorted(parts[(kind, name)], key=lambda x: x[0])
            flat = torch.cat([v.reshape(-1) for _, v in pieces]) if len(pieces) > 1 \
                else pieces[0][1].reshape(-1)
            return flat.view(like.shape)

        # (a log written before engine_grad_mul had the freed grads' factor in engine_scale)
        engine_scales = (step_meta["engine_scale"], step_meta.get("engine_grad_mul", 1.0))
        calls: Dict[Tuple[torch.dtype, float, float], Tuple[KernelArgs, list]] = {}
        for e in self.buckets[i]:
            st = ParamState.in_bucket(t, e.name)
            if ("p", e.name) in parts:
                _follow_param(st, whole("p", e.name, st.rounded))
            if ("g", e.name) in parts:
                g = whole("g", e.name, st.rounded)
                scale, mul = ((step_meta["scale"], 1.0) if e.name in meta["in_place"]
                              else engine_scales)
                args, grads = calls.setdefault((g.dtype, scale, mul), (KernelArgs(), []))
                args.add(st, st.head, e.start)   # (a part's rounding: its elements' indices)
                grads.append(g)
        for (_, scale, mul), (args, grads) in calls.items():
            args.run(grads, hyper, scale, max(1, torch.get_num_threads()), grad_mul=mul)

    def _abandon_early(self, reason: str) -> None:
        """A pass started in backward is stopped before the files or the ring change
        under it; if it had begun stepping, the next step() raises `reason` (nothing
        stepped), as step_in_backward does in RAM."""
        if self._early is not None and self._early.busy:
            self.engine.early.interrupted(reason)
            self._early.abandon()

    def _warn_held(self, writer: str) -> None:
        """A RuntimeWarning when this step (or load_state_dict: `writer`) rewrites the place
        in the files of tensors that the last state_dict() mapped and someone still holds (a
        checkpoint saved in the background, a state dict kept to save later): they would
        show other bytes. Two generations: a write goes to each bucket's slot that is not
        current, the held one once any bucket's current slot changed since the state_dict()
        (a step, a load, a rollback: told by the slots, not the step count, which a load
        sets back); compact: every write moves buckets within their ring."""
        if self._handed is None:
            return
        handed = self._handed
        if not len(handed.held):
            self._handed = None
        elif self.compact or handed.slots != list(self.state.slots):
            self._handed = None   # (once per state_dict())
            if self._held_warned:   # (a loop that keeps the last state dict: said once)
                return
            self._held_warned = True
            when = ("before the next step() or load_state_dict()" if self.compact
                    else "before the second step() or load_state_dict() after")
            warn(f"offload_adam: {len(handed.held)} tensors of a state_dict() taken at step "
                 f"{handed.step} are still held, and {writer} rewrites their place in the "
                 "state files (they are mapped from them, not copied): save or copy what "
                 f"state_dict() gives {when} (state_footprint="
                 f"{'compact' if self.compact else 'two_generations'}), and drop it after "
                 "(said once)", RuntimeWarning)

    def _check_format(self, gi: int, param_groups) -> None:
        group = param_groups[gi]
        fmt, amsgrad = self._formats[gi], self._amsgrad[gi]
        if (state_format(group["state_dtype"]), bool(group["amsgrad"])) != (fmt, amsgrad):
            raise ValueError(f"param group {gi}: state_dtype and amsgrad cannot change with "
                             f"state_dirs= (the files hold state_dtype={fmt.name!r}, "
                             f"amsgrad={amsgrad})")

    def _lend_in_place(self, bucket: List[_Param], t):
        """The kernel calls of a bucket's in-place params over their states in the ring
        buffer `t`, each with its grads, once every master follows its param
        (master_rule.py; the files hold the params too, so also those without a grad);
        and the (fp32 param, its master in the files) to copy after the calls: the kernel
        steps such a param itself (it is its own master, as in RAM)."""
        pairs, follow = [], []
        for e in bucket:
            st = ParamState.in_bucket(t, e.name)
            p = param_values(e.param)
            if not self.marks.current(e.param):
                _follow_param(st, p)
                self.marks.agree([e.param])
            if e.param.grad is None or id(e.param) in self._absent:   # not stepped
                continue
            if not e.has_master:
                follow.append((p, st.master))
                st.master = None
            pairs.append((e.param, st))
        calls = calls_by_dtype(pairs)
        return [(call, [contiguous_grad(p) for p in call.params]) for call in calls], follow

    # ---- state dict ----------------------------------------------------------------------

    def add_state(self, sd: dict) -> dict:
        """torch's state dict `sd` with the state of the params here, as file views, under
        the ids sd gives them, in the keys and order of the state in RAM."""
        self._check_resumed(stepping=False)
        state = dict(sd["state"])
        # each param's id in sd: torch's, by its place in param_groups as they are now
        saved_ids = {id(p): i for saved, g in zip(sd["param_groups"], self._param_groups)
                     for i, p in zip(saved["params"], g["params"])}
        parts: Dict[int, List[ParamState]] = {}   # a param in parts: those seen so far
        held: weakref.WeakSet = weakref.WeakSet()
        by_param: Dict[int, Dict[str, tuple]] = {}
        exact = True   # the dict is the files' state, no edit of the user's over it
        for i, bucket in enumerate(self.buckets):
            views = self.state.views(i)
            for e in bucket:
                rec = ParamState.in_bucket(views, e.name)
                if e.part:
                    got = parts.setdefault(id(e.param), [])
                    got.append(rec)
                    if len(got) < len(self._where[id(e.param)]):
                        continue
                    rec = self._joined(e.param, parts.pop(id(e.param)))
                if float(rec.step) == 0:
                    continue   # never stepped: no state, as in torch
                st = {"step": rec.step}
                for key in MOMENT_KEYS:
                    if getattr(rec, key) is not None:
                        st[key] = getattr(rec, key)
                    scale = SCALE_KEYS.get(key)
                    if scale is not None and getattr(rec, scale) is not None:
                        st[scale] = getattr(rec, scale)
                if e.has_master:   # (not an fp32 param stepped in place, as in RAM; a
                    st[MASTER_KEY] = rec.exported_master()   # split one: decoded, a copy)
                saved_id = saved_ids.get(id(e.param))
                if saved_id is None:   # taken out of param_groups since
                    exact = False
                    continue
                entry = sd["state"].get(saved_id)
                if id(e.param) in self._stepped and not (type(entry) is InFiles
                                                         and not entry.cleared):
                    # its entry removed, replaced or cleared: that is its state now, as
                    # in torch's optimizers (none, or what the user put there)
                    exact = False
                    if entry:
                        state[saved_id] = dict(entry)
                    else:
                        state.pop(saved_id, None)
                    continue
                state[saved_id] = _with_edits(st, entry or {})
                exact = exact and not any(stored_key(k) in STATE_KEYS for k in entry or {})
                held.update(v for v in st.values() if isinstance(v, torch.Tensor))
                handed = {k: _handed_as(v) for k, v in st.items()}
                exact = exact and None not in handed.values()
                by_param[id(e.param)] = handed
        # (a dict that shows the user's edits is not the files': _own_unchanged loads it)
        self._handed = _Handed(self.state.step,
                               None if self.compact else list(self.state.slots), held,
                               (self._serial, self.state.commits) if exact else (-1, -1),
                               by_param)
        return {**sd, "state": state}

    def _joined(self, param, parts: List[ParamState]) -> ParamState:
        """The state of a param in parts as one (for add_state, whose views() have just
        verified the parts' slots), the step count its first part's: its master and moments
        the parts' pages mapped side by side from the files (NvmeState.joined: no copy, as
        views() are), or, where they cannot be, the parts' tensors copied end to end; its
        8-bit scales copied (each part holds whole blocks)."""
        shape, where = local(param).shape, self._where[id(param)]

        def join(role, ts):
            if ts[0] is None:
                return None
            flat = None
            if role not in SCALE_KEYS.values():
                flat = self.state.joined([(i, file_key(e.name, FILE_ROLE.get(role, role)))
                                          for i, e in where],
                                         verified=True)   # (add_state's views() did)
            if flat is None:
                flat = torch.cat([t.reshape(-1) for t in ts])
            return flat if role in SCALE_KEYS.values() or role == "master_tie" \
                else flat.view(shape)
        return ParamState(parts[0].step, *[join(f.name, [getattr(st, f.name) for st in parts])
                                           for f in dataclasses.fields(ParamState)
                                           if f.name != "step"])

    def check_load(self, pairs) -> None:
        """Before anything is loaded: a ValueError for a saved state (stepped) of a param
        the files hold none for (frozen when the optimizer was built). `pairs`: (its saved
        state or None, param, its label) each. A closed optimizer's: refused first."""
        self._check_open()
        for saved, p, label in pairs:
            if (id(p) not in self._where and isinstance(saved, dict)
                    and float(stored_state(saved).get("step") or 0) > 0):
                raise ValueError(
                    f"offload_adam: the state dict holds a state for param {label()}, which "
                    "was frozen (requires_grad=False) when the optimizer was built with "
                    "state_dirs=: its files hold no state for it, and nothing was loaded. "
                    "Unfreeze it before building the optimizer")

    def load(self, loaded: Sequence[Loaded], saved_state: dict, state) -> None:
        """Writes a loaded state dict into the files, bucket by bucket: for each param its
        saved state converted to its group's format (state_format.py), or a fresh one.
        `loaded`: (its key in `saved_state`, param, group) each; optimizer `state` keeps
        an empty entry per param stepped (`_mark`). This store's own last state_dict(),
        untouched, is the files' already: nothing is written (_own_unchanged)."""
        saved_ids = {id(p): saved_id for saved_id, p, _ in loaded}
        # the loaded entries' keys of the user's own (torch loaded them into `state`): they
        # stay in RAM, beside the state in the files, as torch's optimizers keep them
        extras = {}
        for _, p, _ in loaded:
            entry = state.pop(p, None)
            own = {k: v for k, v in (entry or {}).items() if k not in STATE_KEYS}
            if own:
                extras[p] = own

        def saved_of(e: _Param) -> dict:
            return saved_state.get(saved_ids.get(id(e.param))) or {}

        unchanged = self._own_unchanged(saved_of)
        if not unchanged:
            self._refuse_a_mix(saved_of)
        self._abandon_early("the optimizer state was replaced (load_state_dict) after "
                            "its step started during backward (a load after an exception "
                            "between backward and step(), a Ctrl-C: opt.step() finishes "
                            "that step and opt.zero_grad() drops it, before the load)")
        if unchanged:   # the files hold it already: as if nothing was loaded
            for p, mine in extras.items():
                state[p] = mine
            self._mark(state)
            return
        stepped: set = set()

        # a param in parts: its state converted once for all its parts, kept until its last
        converted: Dict[int, object] = {}

        def fill(i, t):
            for e in self.buckets[i]:
                got = converted.get(id(e.param))
                if got is None:
                    got = self._converted(e, self._local_saved(e, saved_of(e)))
                    if e.part:
                        converted[id(e.param)] = got
                if e.part and self._where[id(e.param)][-1][1] is e:
                    del converted[id(e.param)]
                self._fill_param(e, t, got)
                if float(ParamState.in_bucket(t, e.name).step) > 0:
                    stepped.add(id(e.param))

        # the files' step count: the largest loaded one (known before the first bucket;
        # no step counts 0, as kernel_state reads it)
        step = max((int(float(saved_of(e).get("step") or 0)) for b in self.buckets for e in b),
                   default=0)
        if self.compact:   # its load cannot go back once a bucket is written: a saved state
            # refused (a param's, converted one at a time) is refused before that
            for e in {id(e.param): e for b in self.buckets for e in b}.values():
                self._converted(e, self._local_saved(e, saved_of(e)))
        # the masters made from the params as they are now (the dict held none): a model
        # loaded after this would not be them, and a resume before the next step must
        # not set the params from them (_restore_params)
        self.state.from_params_next = sorted(
            {e.name for b in self.buckets for e in b
             if float(saved_of(e).get("step") or 0) > 0
             and stored_state(saved_of(e)).get(MASTER_KEY) is None})
        self._warn_held("this load_state_dict()")
        for link in self._heads:   # (the heads take the loaded masters' high halves)
            link.out(unlink=False)
        self.pipeline.load(fill, step=step)
        self._files_early_for_now()
        self._stepped = stepped
        for p, own in extras.items():   # (_mark takes them into a stepped param's entry)
            state[p] = own
        self._mark(state)
        # every master loaded (or made from its param) is checked at its next step
        self.marks.forget(e.param for b in self.buckets for e in b)
        # the params still as state_resume=True set them were checked to be the loaded
        # state's (_refuse_a_mix): they stay to check at the next step
        self._resumed = {k: v for k, v in self._resumed.items() if mark(v[0].param) == v[1]}

    def _own_unchanged(self, saved_of) -> bool:
        """Whether the state dict being loaded is this store's last state_dict() as it
        handed it: each param's entry holds the very tensors it handed (and no other
        state), none written into since (a map of the files: its pages still the files',
        pagemap; a copy: its checksum, _handed_as), and the files have committed nothing
        since. Loading it would write the files'
        own bytes back: a whole pass over the state (minutes for a 70B one), which
        Accelerate asks at every start (its AcceleratedOptimizer loads the optimizer's
        own state_dict()), and a warning that those tensors are still held (the load
        holds them). Anything else (a copy, a torch.load, an edit) is loaded."""
        handed = self._handed
        if handed is None or handed.when != (self._serial, self.state.commits):
            return False
        tensors = []
        for e in {id(e.param): e for b in self.buckets for e in b}.values():
            saved = saved_of(e)
            mine = handed.by_param.get(id(e.param), {})
            if mine and int(saved.get(Q8_FORMAT_KEY, Q8_FORMAT)) != Q8_FORMAT:
                return False
            # (the dict's keys: 8-bit moments as codes, beside their format)
            ours = {stored_key(k): v for k, v in saved.items()
                    if k in STATE_KEYS and k != Q8_FORMAT_KEY}
            if ours.keys() != mine.keys():
                return False
            for k, (ref, crc) in mine.items():
                if ours[k] is not ref() or not isinstance(ours[k], torch.Tensor):
                    return False
                tensors.append((ours[k], crc))
        return all(written_pages(t.data_ptr(), t.numel() * t.element_size()) is False
                   if crc is None else crc32(byte_view(t.contiguous())) == crc
                   for t, crc in tensors)

    def _local_saved(self, e: _Param, saved: dict) -> dict:
        """Param e's state in a state dict, under the state's keys, as this rank's shard."""
        saved = stored_state(saved, f" of param {e.name}")
        if is_dtensor(e.param):   # its state is the local shard's (distributed.py)
            label = f"{e.name} (shape {tuple(local(e.param).shape)})"
            saved = {k: local_value(v, e.param, k, lambda: label)
                     if isinstance(v, torch.Tensor) and k in MOMENT_KEYS + (MASTER_KEY,) else v
                     for k, v in saved.items()}
        return saved

    def _refuse_a_mix(self, saved_of) -> None:
        """load_state_dict after state_resume=True set the params: a state saved with other
        params (another step's, whose model the restore overwrote) would step these with
        its moments. Refused before anything is written when a param still as the restore
        set it is not the loaded state's: its master does not round to it, or (no master:
        an fp32 param stepped in place) its step count is not the files'. Params loaded
        again since the restore are the user's to match, as in RAM: a master is compared
        with the param as it is all the same (a model and optimizer state of one
        checkpoint agree), only a step count is not. (Told by the param's mark, whose
        version counters DDP's first broadcast bumps, writing every rank's params with
        rank 0's same values: a CPU param's bytes tell, and the master compared. Under
        DDP every param counted as loaded again, and a checkpoint of another step was
        taken over the restored params: found from outside.)"""
        for e, now, step in self._resumed.values():
            saved = saved_of(e)
            if not saved:
                continue
            master = self._local_saved(e, saved).get(MASTER_KEY) if e.has_master else None
            if not isinstance(master, torch.Tensor) and written_since(mark(e.param), now):
                continue
            if isinstance(master, torch.Tensor):
                same = rounds_to(master.detach().to("cpu", torch.float32),
                                 param_values(e.param).to("cpu"))
            else:
                same = saved.get("step") is None or (
                    float(saved["step"]) == step and self._same_moment(e, saved))
            if same:
                continue
            theirs = float(saved.get("step", 0))
            which = (f"its step {theirs:g}, {step:g} in the files" if theirs != step else
                     f"step {step:g} as the files, but its "
                     f"{'master' if isinstance(master, torch.Tensor) else 'moments'} "
                     "are not the files'")
            raise ValueError(
                f"offload_adam: state_resume=True set the params to the state files' step "
                f"{self.state.step} when the optimizer was built, and the optimizer state "
                f"being loaded was saved with other params (param {e.base}: {which}): it "
                "would step these params with the moments of another step or run. To "
                "resume from a "
                "checkpoint (its model and optimizer state, e.g. Trainer's "
                "resume_from_checkpoint), build the optimizer without state_resume on "
                "directories without state (remove their files, "
                f"{', '.join(STATE_FILES)}, or give others); to continue from the files, "
                "do not load a state dict. Nothing was loaded")

    def _same_moment(self, e: _Param, saved: dict) -> bool:
        """Whether the first moment of a param without a master in the state dict `saved`
        is, value for value, the one the resume found in the files (_restore_params): a
        state saved at the same step by another run (other params) is not. Compared as
        fp32 values, whatever form (codes, bf16, fp32) the dict holds them in."""
        prints = self._resumed_prints.get(id(e.param))
        mine = self._local_saved(e, saved)
        value = mine.get("exp_avg")
        if not prints or not isinstance(value, torch.Tensor):
            return True
        try:
            flat = float32_moment(value, mine.get(SCALE_KEYS["exp_avg"]), "exp_avg").reshape(-1)
        except ValueError:
            return True   # (a malformed one: the load's own checks say what is wrong)
        numel = local(e.param).numel()
        if flat.numel() != numel:
            return True
        prints = sorted(prints)
        starts = [start for start, _ in prints] + [numel]
        return all(_moment_print(flat[a:b]) == crc
                   for (a, crc), b in zip(prints, starts[1:]))

    def _converted(self, e: _Param, saved: dict):
        """Param e's `saved` state (_local_saved) in the kernels' form (kernel_state.py)."""
        p = local(e.param)
        label = f"param {e.base} (shape {tuple(p.shape)})"
        return kernel_state(saved, p.shape, self._formats[e.group], self._amsgrad[e.group],
                            e.has_master, label)

    def _fill_param(self, e: _Param, t, got) -> None:
        """Writes param e's state `got` (_converted; a part: its elements) into its
        bucket's buffer `t`: a master the state lacks is the param as it is now (the files
        hold the params too), checked again at the next step, as a loaded one."""
        st = ParamState.in_bucket(t, e.name)
        st.step.fill_(got.step)
        for key, value in got.moments.items():
            getattr(st, key).copy_(_part_of(e, key, value))
        if got.master is not None and st.head is not None:   # a split master: encoded
            head, lo, tie = split_master.encode(e.of(got.master).reshape(st.head.shape))
            st.head.copy_(head)
            st.master_lo.copy_(lo.view(st.master_lo.shape))
            st.master_tie.copy_(tie)
        elif got.master is not None:
            st.master.copy_(e.of(got.master))
        else:
            st.restart(e.of(param_values(e.param)).to("cpu", torch.float32))


class _Handed(NamedTuple):
    """The tensors the last state_dict() mapped from the files, held weakly, and when."""
    step: int                     # the files' step count then
    slots: Optional[List[int]]    # two generations: each bucket's current slot then
    held: "weakref.WeakSet"
    # which store handed them, at which manifest (NvmeState.commits: the files' bytes
    # since unchanged while it is the same), and each param's (by id) {key: _handed_as}
    when: Tuple[int, int] = (-1, -1)
    by_param: Dict[int, Dict[str, tuple]] = {}


def _handed_as(t: torch.Tensor) -> Optional[tuple]:
    """A tensor state_dict() hands, to know it again untouched (FileStore._own_unchanged):
    (a weak reference, None) for a map of the files, whose pages tell a write; (a weak
    reference, its checksum) for a copy (a param in parts' 8-bit scales, joined end to end;
    parts that cannot be mapped side by side). None where the pages cannot be told (no
    pagemap: not Linux): the dict is then loaded as any, rather than each state_dict()
    reading the whole state to checksum it."""
    written = written_pages(t.data_ptr(), t.numel() * t.element_size())
    if written is None:
        return None
    return weakref.ref(t), crc32(byte_view(t.contiguous())) if written else None


# state uuid -> the last state_dict()'s tensors of a closed optimizer over those files:
# handed to the next optimizer that opens them
_HELD_AFTER_CLOSE: Dict[str, _Handed] = {}
_SERIALS = itertools.count()


class InFiles(dict):
    """optimizer.state's entry for a param whose state is in the files (FileStore._mark):
    empty, as the state is not in RAM; reading a key says where the state is, and a
    clear() is seen (FileStore.edited) as torch's optimizers would see it: no state."""

    def __init__(self, label: str, extras: Optional[dict] = None):
        super().__init__(extras or {})   # the user's own keys (not the state's): in RAM
        self.label, self.cleared = label, False

    def __missing__(self, key):
        raise KeyError(f"{key!r}: offload_adam keeps the optimizer state of param "
                       f"{self.label} in its state_dirs= files, not in optimizer.state: "
                       "read it from optimizer.state_dict()['state']. A value set here "
                       "(optimizer.state[p][key] = tensor), or the entry removed, is loaded "
                       "into the files at the next step()")

    def clear(self) -> None:
        self.cleared = True
        super().clear()


def _owns(entry: dict) -> bool:
    """Whether an optimizer.state entry sets any of the state's keys (not only keys of
    the user's own, which stay in RAM beside the files)."""
    return any(key in STATE_KEYS for key in entry)


def _with_edits(st: dict, entry: dict) -> dict:
    """A param's state from the files, with what the user set in its optimizer.state
    entry over it: a moment set as values (not 8-bit codes) leaves its file scales out."""
    if not entry:
        return st
    out = dict(st)
    for key, value in entry.items():
        key = stored_key(key)
        if key in SCALE_KEYS and not (isinstance(value, torch.Tensor)
                                      and value.dtype is torch.uint8):
            out.pop(SCALE_KEYS[key], None)
        out[key] = value
    return out


def _moment_print(fp32: torch.Tensor) -> int:
    """A moment's fp32 values (float32_moment of any stored form) as a CRC32C of their
    bytes."""
    return crc32(byte_view(fp32.contiguous()))


def _in_heads(e: _Param, blocks: set) -> bool:
    """Whether entry e is a param of one of `blocks` ((id of param files, block index))."""
    home = e.rec.home if e.split and e.rec is not None else None
    return home is not None and (id(home.block.streamer.files), home.block.index) in blocks


def _heads_out(links) -> None:
    """The blocks in the heads of a store closing (or dropped) back in their files."""
    for link in links:
        link.out(unlink=True)


def _part_of(e: _Param, key: str, value: torch.Tensor) -> torch.Tensor:
    """Param e's elements of its whole state tensor `value` under `key` (of an 8-bit
    scale array: its blocks' scales; a part starts on a block)."""
    return state_slice(value, key, e.start, e.start + e.numel) if e.part else value


def _follow_param(st: ParamState, p: torch.Tensor) -> None:
    """The master rule (master_rule.py) for a files' master `st.master` whose param
    changed, the param being `p` now (or as the redo log kept it): the master starts again
    from it unless it is still its rounding."""
    if take_from_param(float(st.step), False, lambda: not rounds_to(st.rounded, p)):
        st.restart(p)


def _check_grad(e: _Param, group: dict) -> None:
    p, g = local(e.param), local(e.param.grad)
    if p.dtype is not e.dtype:
        raise RuntimeError(f"param {param_label(group, e.group, e.index, p)} is {p.dtype}; its "
                           f"state files were laid out for {e.dtype} when the optimizer was "
                           "built: with state_dirs=, build the optimizer after casting the model")
    check_dense(g, f"param {param_label(group, e.group, e.index, p)}")
    if g.dtype is not p.dtype or tuple(g.shape) != tuple(p.shape):
        raise RuntimeError(f"param {param_label(group, e.group, e.index, p)}: its grad is "
                           f"{g.dtype} {tuple(g.shape)}, the param {p.dtype}")


def _other_ranks_hint(dirs) -> str:
    """Where a rank's folder (rank<R>) holds no state and its siblings do: the
    directories were likely given to other ranks than before (per-rank directories after
    a restart that mapped the ranks anew; found from outside)."""
    import os
    found = []
    for d in dirs:
        parent, name = os.path.split(os.path.normpath(d))
        if name.startswith("rank") and name[4:].isdigit():
            found += [os.path.join(parent, f"rank{r}")
                      for r in distributed.rank_folders_with_state(parent) if r != int(name[4:])]
    if not found:
        return ""
    return (f"; beside it, {found} hold the state of other ranks: if this run's directories "
            "were given to other ranks than before, give each rank the directories it had")


def _recs_by_param(engine) -> dict:
    """id(param) -> the engine's record of it (none without an engine)."""
    return {id(r.param): r for r in engine.recs} if engine is not None else {}
