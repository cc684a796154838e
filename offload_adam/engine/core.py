"""The offload engine: fp32 master weights and Adam moments in host memory.

The data path, in the order this file follows it:

  1. backward, a hook per param  the grad's host copy starts on the D2H side
                                 stream (small grads wait for the rest of their
                                 bucket's pack; a grad whose param has a hook
                                 registered after ours, which may edit it,
                                 waits until autograd is past that hook); one
                                 GradCopy record per grad
  2. end of backward             the packs still waiting are copied, and the
                                 user's stream is made to wait for the copies:
                                 whatever runs next (clip, edit, another
                                 micro-batch) is ordered after them
  3. step()                      a fence (the params may still be read by queued
                                 backward work); grads whose copy is stale are
                                 copied again, reused copies get their
                                 fingerprint compared on the device; one job per
                                 bucket on the worker thread (the one entry point,
                                 `stepping`, also steps state a store lends: the
                                 files' buckets, `EngineStep.lent`)
  4. bucket job (worker)         wait: its fingerprint check (copy again what
                                 changed), its grads landed, its last H2D done
                                 with its buffers; kernel: the fused Adam step
                                 writes master, moments and the bf16/fp16 update;
                                 write back: H2D copies after the fence
  5. end of step()               the user's stream waits for the H2D copies (no
                                 host wait: the next forward is queued behind them)

By default the CPU step starts at step(): only then are the grads final, so the
default is exact in every case. step_in_backward=True starts a bucket's kernel
in step 1 as soon as its grads are on the host (early.py). Which copy is
current and how edits invisible to version counters are seen: grads.py.
Where every element lives (pieces, buckets, host buffers): layout.py.
The device interface and its rules: device.py.

CPU params run here only with step_in_backward or free_grads_after_copy (on
HostDevice, copies done on the spot), or when built inside
offload_adam.testing.simulated() (AsyncSimDevice: the GPU's path, checked); otherwise the optimizer steps them in
place (inplace.py).

State: optimizer.state[p] holds "step", "exp_avg", "exp_avg_sq"
(+ "max_exp_avg_sq") and "master_param": fp32 CPU tensors shaped like the
param, views into the engine's host memory. Whatever load_state_dict puts there
is copied in at the next step. Nothing assumes whole tensors or one process: a
param is whatever tensor the optimizer was given (a DTensor's local shard), and
the only cross-param reduction is the clipping norm (`grad_sq_sums`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version
from torch.utils.weak import WeakIdKeyDictionary

from ..freed_grad import Stepped, freed_grad, is_freed
from ..kernel_step import Hyper, KernelArgs
from ..master_rule import MasterMarks
from ..param_state import ROLES, SPLIT_ROLES, ParamState
from ..options import Options
from ..params import check_dense, groups_now, home_of, one_device
from ..state_format import state_format
from ..warn import warn
from .device import HostDevice, current_host_stand_in, make_device
from .host_memory import HostArenas, put_off
from .early import EarlyStart, format_changed, steps_kept
from .grad_ring import GradRing, block_grad_bytes, ring_bytes, trainable_bytes
from .grads import GradCopy, sq_sum, start_check
from .param_check import ParamCheck
from .layout import (Bucket, Entry, ParamRec, Piece, allocate_state, allocate_transfers, cut,
                     local, make_buckets, state_roles)
from .profile import StepProfile
from .state import bind_state, follow_masters, is_bound, read_params
from .worker import ForkedChildError, Worker, forked_child_error, interrupts_deferred

_ACC_SLOTS = 4   # the accumulation ring: pieces in flight to the host before one is added


class OffloadEngine:
    """Steps the offloaded params of one optimizer. Built and driven by it.

    managed[i] lists the params of param_groups[i] the engine owns (all on one
    device); amsgrad[i] says whether that group keeps max_exp_avg_sq; `options`
    (options.py) are the optimizer's, checked; `routing` (the optimizer's) gives
    the device interface (device.py); names[i]: how errors name managed[i]'s
    params (params.param_label); `marks`: when each param last agreed with its
    master (master_rule.py; the optimizer's, shared with its other stores)."""

    def __init__(self, managed: Sequence[Sequence[torch.Tensor]], amsgrad: Sequence[bool], *,
                 state_dtypes: Optional[Sequence[str]] = None, options: Optional[Options] = None,
                 owner=None, routing=None,
                 available_host_bytes: Optional[int] = None,
                 names: Optional[Sequence[Sequence[str]]] = None,
                 marks: Optional[MasterMarks] = None, claim: bool = True):
        options = options or Options()
        all_params = [p for ps in managed for p in ps]
        locals_ = [local(p) for p in all_params]
        self.device = (routing.device(locals_) if routing is not None   # (None: a bare engine)
                       else make_device(one_device(locals_), current_host_stand_in()))
        self.overlap = options.overlap
        self.bucket_bytes = int(options.bucket_mb * 2**20)
        self.free_grads_after_copy = options.free_grads_after_copy
        self.verify_grads = options.verify_grads
        self.marks = marks if marks is not None else MasterMarks()
        # edits of device params through p.data, which no mark shows (param_check.py)
        self.param_check = None if isinstance(self.device, HostDevice) else ParamCheck(self.device)
        if self.param_check is not None:
            self.marks.hidden_edit = self.param_check.edited
        self._num_threads = options.num_threads
        self._last_threads = self._num_threads or self.device.default_num_threads()
        self._available = available_host_bytes
        # grad_ring_mb=, in bytes (None: the ring's own rule, grad_ring.ring_bytes)
        self.ring_asked = (int(options.grad_ring_mb * 2**20)
                           if options.grad_ring_mb is not None else None)
        # state_dirs=: master and moments live in the NVMe tier's files, in RAM only
        # while its pipeline holds their bucket (EngineStep.lent): no host arenas for them.
        self.state_on_disk = options.state_dirs is not None
        self.process_group = options.process_group   # (early.verify: the ranks agree)
        self.recs: List[ParamRec] = []
        # the optimizer (a weakref; None for a bare engine): its _join_to_engine() adds the
        # params that got a grad since they were added frozen (optimizer._join_trained)
        self._owner = owner
        self._ids: set = set()                    # id() of each rec's param (has)
        # the owner's param_groups as they are now (follow_groups): the group dict each
        # rec's group index stands for, the recs whose param is in no group, and what the
        # reading was made of (its groups' and their lists' identities and lengths)
        self._rec_of: Dict[int, ParamRec] = {}   # id(param) -> its rec
        self._by_group: List[Optional[dict]] = []
        self._absent: set = set()                # ids of the recs in no group now
        self._groups_key = None
        self._groups_task = None                 # the backward that last read them
        self.early_groups = None   # (backward, groups, follow_groups of them): _EarlyOwner's
        self.buckets: List[Bucket] = []           # replaced in place (the finalizer holds it)
        self._state_arenas: list = []
        self._transfer_arenas: list = []
        self._packs: Dict[int, list] = {}         # bucket index -> [(piece, grad piece)] waiting
        self._pack_arrived: set = set()           # ids of the packed pieces hooked so far
        self._pack_expected: set = set()          # ... and in the last backward
        # bucket index -> its expected packed pieces not hooked yet (None: count again)
        self._pack_missing: Optional[Dict[int, int]] = None
        self._backward: list = []                 # D2H copies of the running backward
        self._deferred: List[ParamRec] = []       # grads whose copy waits for hooks after ours
        self._backward_task = None
        # backwards left by a grad of another (_at_end_of_backward's task then), whose end
        # has not come: one that raised, or one a backward runs inside (the recompute of
        # reentrant checkpointing), which ends later; told apart by that end
        self._unended: set = set()
        self._hook_order: Optional[List[ParamRec]] = []   # the first backward's order
        self._want_norms = False
        # Micro-batches accumulated into freed grads: each piece's D2H copy into a slot of
        # a small pinned ring, added to the host copy when its slot is needed again or
        # before anything reads the host copies (_flush_adds).
        self._acc_arenas: list = []
        self._acc_slots: List[torch.Tensor] = []
        self._acc_free: List[int] = []
        self._acc_pending: list = []              # (rec, copy, piece, slot index, slot view)
        # step_in_backward: the grads land in a bounded ring instead of a buffer per piece
        # (grad_ring.py; below, or with the state in files by the files' pass, use_ring)
        self.ring: Optional[GradRing] = None
        self._ring_arenas: list = []
        self._lent_pins: list = []   # others' buffers pinned through our device (lend_pins)
        self._profile = StepProfile()
        self._last_profile: Optional[StepProfile] = None
        self._worker = Worker(context=self.device.on_thread) if self.overlap else None
        # Held by each hook's and backward-end callback's work, and by close(): a close()
        # from another thread (a watchdog) during a backward lets the hook running finish,
        # then the hooks are gone; it tore the records down under a hook (AttributeError
        # in the training thread: found from outside)
        self._hooks_lock = threading.RLock()
        self._taken_over: Optional[str] = None   # why a newer engine took the params (_claim)
        # A step that raised after some kernels ran (a param file's write failed: ENOSPC,
        # EIO) leaves each param in RAM stepped or not, state and value together, and
        # training may go on; but a param in parts (pieces in several buckets) some of
        # whose pieces stepped is of no step: `torn` says so, and no step or state dict
        # is taken from it until a state is loaded (RamStore). The pieces whose kernel
        # ran since the last step ended (in backward too: step_in_backward):
        self.torn: Optional[str] = None
        self._ran: set = set()
        self.early = None
        # defer_blocks=: the deferred steps left running when step() returned (the last
        # one's worker job number), and the pieces they read
        self._tail = 0
        self._tail_pieces: List[Piece] = []
        if options.step_in_backward:
            self.early = EarlyStart(self, _early_owner(weakref.ref(self), owner),
                                    options.defer_blocks)
            if not self.state_on_disk:   # before any transfer buffer is laid out
                bucket, asked, deferred = self.bucket_bytes, self.ring_asked, options.defer_blocks
                size = lambda params: ring_bytes(   # (holds no engine: no cycle)
                    bucket, bucket, block_grad_bytes(params), asked, deferred,
                    trainable_bytes(params))
                self._make_ring(size, _worker_busy(weakref.ref(self)), size(all_params))
        # Waits for the copies in flight, removes the hooks, ends the worker and
        # unpins when the optimizer goes (or this constructor fails), holding
        # nothing that keeps the engine alive.
        self._pid = os.getpid()   # (a forked child has none of its threads: _check_pid)
        self._finalizer = weakref.finalize(
            self, _shutdown, self.device, self._worker, self.recs, self.buckets,
            self._state_arenas, self._transfer_arenas, self._acc_arenas, self._ring_arenas,
            self._lent_pins, self._pid)
        # every group's recs first, then one layout of the buckets (laid out again at
        # each group, building was O(groups x params))
        added = []
        for i, (params, ams) in enumerate(zip(managed, amsgrad)):
            added += self._add_recs(i, params, ams,
                                    state_dtypes[i] if state_dtypes else "float32",
                                    names[i] if names else None)
        # claim=False (an optimizer's constructor): an older engine over these params
        # keeps them until claim(), once the rest of the construction (the state files)
        # is done: a constructor refused takes nothing over
        self._unclaimed: Optional[List[ParamRec]] = None if claim else []
        if added:
            self._rebucket(added)
            self._take_over(added)

    @property
    def step_in_backward(self) -> bool:
        return self.early is not None

    def threads(self) -> int:
        """Kernel threads: the option, or torch.get_num_threads() as the caller
        sees it (per thread: read in step(), remembered for hook-time jobs)."""
        if self._num_threads is None:
            self._last_threads = self.device.default_num_threads()
        return self._num_threads or self._last_threads

    def hook_threads(self) -> int:
        """Kernel threads for jobs started from autograd's hooks: the option, or the
        count step() last read (torch.get_num_threads() is per thread, and autograd's
        thread may not see the caller's setting)."""
        return self._num_threads or self._last_threads

    # ---- construction -------------------------------------------------------------

    def add_group(self, group: int, params: Sequence[torch.Tensor], amsgrad: bool,
                  state_dtype: str = "float32", names: Optional[Sequence[str]] = None) -> None:
        """`names`: how errors name each param (params.param_label), or None."""
        known = [p.rec for b in self.buckets for p in b.pieces]
        new = self._add_recs(group, params, amsgrad, state_dtype, names)
        if new:
            self._rebucket(list(dict.fromkeys(known)) + new)
            # last: a group that fails to be added takes nothing over
            self._take_over(new)

    def _take_over(self, recs: List[ParamRec]) -> None:
        if self._unclaimed is not None:
            self._unclaimed += recs
        else:
            _claim(self, recs)

    def claim(self) -> None:
        """Takes over, from an older live engine, the params added since the engine was
        made with claim=False (and those added from now on, as they are)."""
        recs, self._unclaimed = self._unclaimed or [], None
        _claim(self, recs)

    def _add_recs(self, group: int, params: Sequence[torch.Tensor], amsgrad: bool,
                  state_dtype: str, names: Optional[Sequence[str]]) -> List[ParamRec]:
        """add_group's recs (state allocated, grads hooked), in the order they join the
        buckets (the order grads arrive: last param first), not laid out yet."""
        if not params:
            return []
        if self.recs:
            one_device([local(self.recs[0].param)] + [local(p) for p in params])
        fmt = state_format(state_dtype)
        new = [ParamRec(p, group, len(self.recs) + i, fmt) for i, p in enumerate(params)]
        for rec, name in zip(new, names or ()):
            rec.name = name
        self._allocate_state(new, state_roles(fmt, amsgrad))
        for rec in new:
            rec.pieces = cut(rec, self.bucket_bytes)
            for piece in rec.pieces:
                piece.step_t = torch.zeros((), dtype=torch.float32)
            rec.step_t = rec.pieces[0].step_t
            self._hook_grad(rec)
        self.recs.extend(new)
        self._ids.update(id(rec.param) for rec in new)
        self._rec_of.update((id(rec.param), rec) for rec in new)
        self._groups_key = self.early_groups = None   # (read the groups again)
        return sorted(new, key=lambda r: -r.position)

    def _join(self) -> None:
        """The owner's params that got a grad since they were added frozen join the
        engine (after the early steps and the copies of backward are done: add_group lays
        the buffers out again)."""
        owner = self._owner() if self._owner is not None else None
        join = getattr(owner, "_join_to_engine", None)   # (a test's bare owner has none)
        if join is not None:
            join()

    def has(self, p: torch.Tensor) -> bool:
        """Whether p is one of the engine's params."""
        return id(p) in self._ids

    # ---- the owner's param_groups, as the user may have edited them ----------------------

    def follow_groups(self, param_groups: List[dict], again: bool = False) -> List[Optional[dict]]:
        """`param_groups` (the owner's, as they are now: a user may delete, reorder or
        pop them, as torch.optim allows) indexed the way the engine's recs and buckets
        are, by the group index each rec was added under (rec.group): for each, the group
        its params are in now (None: no group holds any). A rec whose param is in no
        group is not stepped (its state stays as it was) and its grad not copied. Read
        again when the groups' or their lists' identities or lengths changed, or `again`.
        A group index whose params are now split over two groups cannot be followed (its
        buckets step with one group's hyperparameters): a RuntimeError naming a param."""
        key = (tuple((id(g), id(g["params"]), len(g["params"])) for g in param_groups),
               len(self.recs))
        if key == self._groups_key and not again:
            return self._by_group
        by_group = list(self._by_group) + [None] * (
            1 + max((r.group for r in self.recs), default=-1) - len(self._by_group))
        def group_of(p):
            rec = self._rec_of.get(id(p))
            return rec.group if rec is not None else None

        def split(p, gi, other):
            return (f"offload_adam: {self._rec_of[id(p)].label()} is now in param group {gi}, "
                    f"but other params added with it are in param group {other}: the "
                    "offloaded params of a group step together, with one group's "
                    "hyperparameters. Move params between groups by building a new "
                    "optimizer (or add new params with add_param_group)")
        now, present = groups_now(param_groups, group_of, split)
        for group, (g, _) in now.items():
            by_group[group] = g
        self._by_group, self._groups_key = by_group, key
        self._absent = {id(r) for r in self.recs if id(r.param) not in present}
        return by_group

    def _follow_owner(self, again: bool = False) -> None:
        """follow_groups over the owner's param_groups (a bare engine: its steps'). In
        backward (a hook), read again at its first grad."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and hasattr(owner, "param_groups"):
            self.follow_groups(owner.param_groups, again)

    def _in_no_group(self, rec: ParamRec) -> bool:
        """At a grad's hook: rec's param was taken out of the owner's param_groups (its
        grad is then neither copied nor stepped). The groups are read once per backward."""
        task = torch._C._current_graph_task_id()
        if task != self._groups_task:
            self._groups_task = task
            try:
                self._follow_owner(again=True)
            except RuntimeError:
                pass   # (groups that cannot be followed: step() raises)
        return id(rec) in self._absent

    def _hook_grad(self, rec: ParamRec) -> None:
        """Copies rec's grad as backward produces it (overlap=True). A frozen
        param (requires_grad=False) can have no hook: it gets one at the first
        step() after it is unfrozen; until then its grad, if any, is copied in
        step()."""
        if self.overlap and rec.hook is None and rec.param.requires_grad:
            rec.hook = rec.param.register_post_accumulate_grad_hook(
                _hook(weakref.ref(self), rec))
            rec.pre_hook = rec.param.register_hook(_before_grad(weakref.ref(self)))

    def _rebucket(self, order: List[ParamRec]) -> None:
        """Buckets in `order` (the order grads arrive), with transfer buffers
        laid out bucket after bucket. The old buffers are let go only when no
        copy uses them any more; grads already on the host move over, and so
        do those of a backward that raised, whose packs are sent first."""
        with torch.no_grad():
            self._end_backward()
        self._wait_all()
        self._pack_missing = None   # (counted again over the new buckets)
        pieces = [p for rec in order for p in rec.pieces]
        # (in the ring, a grad's buffer is its span's whatever its bucket: it stays)
        old = {id(p): p.grad for p in pieces if p.grad is not None and self.ring is None}
        # an update stepped in backward waits in staging for step() (the first step, with
        # the state in files, learns the buckets' order after its pass ran in backward)
        staged = {id(p): p.staging for p in pieces
                  if p.rec.home is None and p.staging is not None}
        buckets = make_buckets(pieces, self.bucket_bytes)
        arenas = allocate_transfers(buckets, self.device, self._available,
                                    stage_fp32=self.state_on_disk and self.early is not None,
                                    grads=self.ring is None)
        for p in pieces:
            if id(p) in old:
                p.grad.copy_(old[id(p)])
            if id(p) in staged and p.staging is not None:
                p.staging.copy_(staged[id(p)])
        for a in self._transfer_arenas:
            a.release()
        self._transfer_arenas[:] = [arenas]
        self.buckets[:] = buckets
        self._packs.clear()

    def use_ring(self, size: Callable[[list], int], busy: Callable[[], bool]) -> None:
        """The grads land in a ring (grad_ring.py) from now on, of `size(params)` bytes for
        the params; `busy`: whether a job of the files' pass is pending (disk_early.py)."""
        self._wait_all()
        self._make_ring(size, busy, size([rec.param for rec in self.recs]))
        for rec in self.recs:
            rec.copy = None   # (none made yet: built with the optimizer)
            for p in rec.pieces:
                p.grad = None
        self._rebucket(list(dict.fromkeys(p.rec for b in self.buckets for p in b.pieces)))

    def ring_busy(self, busy: Callable[[], bool]) -> None:
        """The ring's `busy` from now on (a files' pass that follows on the one that
        made it: nvme_tier._files_early_for_now)."""
        self._ring_busy = self.ring.busy = busy

    def _make_ring(self, size: Callable[[list], int], busy: Callable[[], bool],
                   nbytes: int) -> None:
        """A ring of `nbytes`, size(the params) made now; `size` is asked again after a
        step whose grads overflowed it (_grow_ring)."""
        self._ring_size, self._ring_busy = size, busy
        self.ring = GradRing(self.device, nbytes, busy)
        self._ring_overflows = 0
        self._ring_arenas.append(self.ring.arenas)
        if self._worker is not None:   # a hook waiting for room while the worker was busy
            self._worker.after_job = self.ring.nudge   # looks again once a job is done

    def _grow_ring(self) -> None:
        """After a step (every span free) whose grads overflowed the ring (own buffers,
        pageable): a ring sized by the params that took grads at the start (a LoRA model's
        adapters) is made again for those that take them now (a block unfrozen since)."""
        ring = self.ring
        if ring is None or ring.overflow_taken == self._ring_overflows or self._tail_pieces:
            return
        self._ring_overflows = ring.overflow_taken
        want = self._ring_size([rec.param for rec in self.recs])
        if want > ring.nbytes:
            self._ring_arenas.remove(ring.arenas)
            ring.release()
            self._make_ring(self._ring_size, self._ring_busy, want)

    def forget_grads(self) -> None:
        """The ring's spans are all free (a step ended, or the files' pass was abandoned):
        no grad copy is kept, the next step copies the grads it needs again."""
        if self.ring is None:
            return
        keep = {id(p) for p in self._tail_pieces}   # (their jobs hold their copies)
        self.ring.reset([p for rec in self.recs for p in rec.pieces], self._tail_pieces)
        for rec in self.recs:
            rec.copy = None
            for p in rec.pieces:
                if id(p) not in keep:
                    p.grad = None

    def forget_read(self, stepped: set) -> None:
        """After early steps that did not end in a step() (EarlyStart.commit): the grads
        their kernels read (pieces' ids in `stepped`) are gone from the ring, so their
        params' copies are forgotten: a next step() copies a grad still on the device
        again, and finds none for a grad freed after its copy."""
        if self.ring is None:
            return
        for rec in self.recs:
            if any(id(p) in stepped for p in rec.pieces):
                rec.copy = None
                rec.freed = False

    def _wait_all(self) -> None:
        """Host-waits every copy that may still use a host buffer."""
        self.device.wait_host(*_transfers_of(self.recs, self.buckets))

    def host_bytes(self) -> int:
        """Host memory held: master, moments, grad and staging buffers (the grad ring's
        spans that overflowed it included)."""
        return (sum(a.nbytes() for a in self._state_arenas + self._transfer_arenas
                    + self._acc_arenas + self._ring_arenas)
                + (self.ring.overflow_bytes if self.ring is not None else 0))

    def pinned(self) -> bool:
        return all(a.pinned for a in self._state_arenas + self._transfer_arenas
                   + self._ring_arenas)

    def close(self) -> None:
        with self._hooks_lock:
            if self._finalizer.alive and os.getpid() == self._pid:
                self.settle_tail()   # (a deferred step still writes host memory)
                self._close_between_backward_and_step()
            self._finalizer()
        if self._worker is not None:
            self._worker.join()   # (its thread ended: nothing of it runs on at exit)

    def in_hook(self, work: Callable[[], None]) -> None:
        """A hook's or backward-end callback's `work`, unless the engine was closed (from
        another thread, during this backward: the hooks are gone, the rest of it fills
        p.grad as without an optimizer, and step() says closed)."""
        with self._hooks_lock:
            if self._finalizer.alive:
                work()

    def _close_between_backward_and_step(self) -> None:
        """Closed (or taken over) with steps begun in backward and no step() yet: in host
        RAM they cannot be undone. Their params are written, as after a backward that
        raised, and said; left pending, they kept a streamed model's blocks from closing
        ("call step() first") for as long as this optimizer lived (found from outside).
        In files the store abandons its pass (nvme_tier.py)."""
        early = self.early
        if early is None or early.files is not None or not early.pending():
            return
        stepped = early.commit()
        if stepped:
            warn("offload_adam: this optimizer was closed (or taken over by a newer one) "
                 "between backward and step() with step_in_backward=True. "
                 + steps_kept(stepped), RuntimeWarning)

    def lend_pins(self, holder) -> None:
        """`holder` (with release()) pinned buffers through this engine's device for its
        copies (the state files' ring): unpinned with the engine's own memory when the
        engine goes, once its copies are done (a newer optimizer taking the params over
        leaves the old one's state readable, pinned no more)."""
        self._lent_pins.append(holder)

    def _let_go(self, taken: Sequence[torch.Tensor]) -> None:
        """A newer engine took `taken` (params of ours) over: this one closes (its
        hooks, worker and pinned memory go) and refuses to be used again (`check_open`),
        naming what happened."""
        first = next(r for r in self.recs if r.param is taken[0])
        others = f" and {len(taken) - 1} other params" if len(taken) > 1 else ""
        left = len(self.recs) - len(taken)
        # (a param's grads can go to one engine only: one that shares some params with a
        # newer one cannot step the rest alone, where torch's would step them all)
        rest = (f" Its {left} other params are stepped by no optimizer now: give them to the "
                "new optimizer (add_param_group) or to one built over them alone."
                if left > 0 else "")
        self._taken_over = (
            f"offload_adam: this optimizer's params ({first.label()}{others}, of its "
            f"{len(self.recs)}) were taken over by a newer offload_adam optimizer (built "
            "over them, given them by add_param_group, or a copy.copy or an unpickled "
            "copy of this one over the same params), which now takes their grads; "
            "this one let go of its hooks, worker and host memory and cannot step, zero, "
            "clip or unscale any more (its state stays readable): use the new optimizer."
            + rest)
        self.close()

    def check_open(self, closed_ok: bool = False) -> bool:
        """Refuses to go on once taken over by a newer engine, or closed (its memory is
        gone: refuse, do not hang); `closed_ok`: closed by close(), the caller skips
        its part (zero_grad after close() clears the grads as torch's does). Whether
        the engine is open."""
        if self._taken_over is not None:
            raise RuntimeError(self._taken_over)
        self._check_pid()
        if closed_ok:
            return self._finalizer.alive
        if not self._finalizer.alive:
            raise RuntimeError("offload_adam: this optimizer's engine was closed; "
                               "build a new optimizer")
        return True

    def _check_pid(self) -> None:
        """Refuses a forked child: the worker and I/O threads, the device's copies and
        the pinned memory are the parent's; waiting on them in the child hung."""
        if os.getpid() != self._pid:
            raise forked_child_error(self._pid, "nothing was stepped")

    # ---- 1. backward: each grad streams to the host as it is produced ------------

    def _on_grad(self, rec: ParamRec) -> None:
        _refuse_compiled_autograd()
        self._check_pid()
        if self._tail:   # the last step's deferred steps read the grads' places in the ring
            self.settle_tail()
        self._take_deferred()   # autograd is past the hooks of the params before this one
        grad = rec.param.grad
        if grad is None:
            return  # an earlier hook took it (optimizer-in-backward patterns)
        if self._in_no_group(rec):
            return  # taken out of param_groups: not stepped, its grad left as it is
        if self.early is not None:
            if not self.early.before_copy(rec):
                return   # (refused at step(): early.py)
            self._start_param_check()   # (buckets step in this backward)
        if rec.freed and rec.accumulated:   # added to the freed grad's host copy
            rec.accumulated = False
            return
        if rec.freed and self.early is None and not is_freed(grad):
            # the grad we freed was dropped or replaced since (model.zero_grad() after a
            # micro-batch that raised): p.grad is the whole grad now, as with torch, and
            # its copy replaces the freed one's (pending adds to that one are dropped)
            rec.freed = False
        if rec.freed:
            raise RuntimeError(
                "offload_adam: a grad arrived twice before step() with "
                "free_grads_after_copy=True (gradient accumulation?); the first one "
                "was freed, so it cannot be accumulated. Use free_grads_after_copy="
                "False to accumulate over micro-batches.")
        if self._hook_order is not None and rec.copy is None:
            self._hook_order.append(rec)
        self._at_end_of_backward()
        if _hooked_after(rec):
            # A hook the user registered after ours runs next and may edit the grad
            # (p.grad.mul_ in place, .data, a new tensor): a copy queued now would
            # race that write on the device, and an early step would consume the
            # grad as it was. Its copy waits until autograd is past those hooks.
            self._deferred.append(rec)
        else:
            self._take(rec)

    def _take(self, rec: ParamRec) -> None:
        """Starts the host copy of rec's grad in backward, the step of what it
        completes (step_in_backward) and, with free_grads_after_copy, frees it."""
        grad = rec.param.grad
        if grad is None:
            return  # a hook after ours dropped it: nothing to copy
        with torch.no_grad():
            self._copy([rec], hook=True)
        if self._want_norms:
            copy, threads = rec.copy, self.hook_threads()
            self._worker.submit(lambda: sq_sum(self.device, rec, copy, threads))
        if self.early is not None:
            self.early.after_copy(rec)
        if self.free_grads_after_copy:
            rec.param.grad = freed_grad(rec.param, local(grad), rec.label(),
                                        _FreedHost(weakref.ref(self), rec, rec.copy))
            rec.freed = True

    def _copy(self, recs: Sequence[ParamRec], after=None, fingerprints=None,
              flush: bool = False, hook: bool = False) -> None:
        """Starts the host copy of each rec's current grad (after the work queued
        on the current stream, or after event `after`): a new GradCopy record;
        large pieces go at once, packed ones when every packed piece of their
        bucket that came in the last backward has come (from a hook), at the end
        of backward, or with flush=True."""
        # step_in_backward: a hook's param cut in pieces starts each piece's bucket as
        # the piece is sent (early.py, piece_sent), unless its norm is summed from the
        # copy (queued after it: the kernels would free the grads first)
        early = hook and self.early is not None and not self._want_norms
        for i, rec in enumerate(recs):
            grad = rec.param.grad
            check_dense(grad, rec.label())
            early_pieces = early and len(rec.pieces) > 1
            g = local(grad).detach()
            fp = fingerprints[i] if fingerprints is not None else (
                self.device.fingerprint(g) if self.verify_grads else None)
            if rec.flat and not g.is_contiguous():
                # Pieces are ranges of the flat grad: one contiguous copy, on
                # the D2H stream, in order with the copies that read it.
                g = self.device.contiguous(g, after)
            if rec.copy is not None and rec.copy.unsent:
                # an older copy's pieces still wait in their packs (a backward that
                # raised): they go no more, this copy replaces them
                self._drop_from_packs(rec)
            rec.copy = GradCopy(grad, fp, len(rec.pieces))
            for piece in rec.pieces:
                if piece.packed:
                    # (the piece first: a Ctrl-C inside piece.of leaves no empty pack)
                    entry = (piece, piece.of(g))
                    self._packs.setdefault(piece.bucket.index, []).append(entry)
                    if hook and id(piece) not in self._pack_arrived:
                        self._pack_arrived.add(id(piece))
                        if self._pack_missing is not None and id(piece) in self._pack_expected:
                            self._pack_missing[piece.bucket.index] -= 1
                else:
                    self._send([(piece, piece.of(g))], after)
                    if early_pieces:
                        self.early.piece_sent(rec, piece)
        for index in list(self._packs):
            if flush or self._pack_complete(self.buckets[index]):
                self._send(self._packs.pop(index), after)

    def _drop_from_packs(self, rec: ParamRec) -> None:
        for index in {p.bucket.index for p in rec.pieces if p.packed}:
            left = [(p, g) for p, g in self._packs.get(index, ()) if p.rec is not rec]
            if left:
                self._packs[index] = left
            else:
                self._packs.pop(index, None)

    def _pack_complete(self, bucket: Bucket) -> bool:
        """Every packed piece of `bucket` that came in the last backward came. (Counted
        down as they come: a scan of the bucket's pieces at each grad made a backward
        O(pieces^2).)"""
        if not self._pack_expected:
            return False
        if self._pack_missing is None:
            self._pack_missing = {
                b.index: sum(1 for p in b.pieces if p.packed and id(p) in self._pack_expected
                             and id(p) not in self._pack_arrived) for b in self.buckets}
        return self._pack_missing.get(bucket.index, 0) == 0

    def flush_pack(self, bucket: Bucket) -> None:
        """Sends the bucket's waiting pack now (its step is about to start)."""
        if bucket.index in self._packs:
            self._send(self._packs.pop(bucket.index), None)

    def _send(self, entries, after) -> None:
        if not entries:
            return
        pieces = [p for p, _ in entries]
        span = self.ring.take(pieces, pieces[0].rec.dtype.itemsize) if self.ring else None
        t = self.device.d2h([p.grad for p in pieces], [src for _, src in entries], after)
        if span is not None:
            span.transfer = t
        for p in pieces:
            p.rec.copy.sent(t, p)
        self._backward.append(t)
        self._profile.add_d2h(pieces[0].bucket.index, t)

    def _at_end_of_backward(self) -> None:
        """Once per backward: at its end, step 2 (flush and publish)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._backward_task:
            return
        self._backward_task = task
        ref = weakref.ref(self)

        @torch.compiler.disable
        def done():
            engine = ref()
            if engine is not None:
                engine._unended.discard(task)   # (it ended: a backward inside it ran)
                engine.in_hook(engine._backward_done)
        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _take_deferred(self) -> None:
        """Takes the grads whose copy waited for the hooks after ours (_on_grad):
        called once autograd is past them (the next param's hook, backward's end)."""
        while self._deferred:
            self._take(self._deferred.pop(0))

    # ---- 2. end of backward ----------------------------------------------------------

    def _backward_done(self) -> None:
        """Backward's end (autograd's callback, after every hook ran)."""
        self._take_deferred()
        self._end_backward()

    def after_raised_backward(self) -> None:
        """Before a grad is written (autograd adding into p.grad, zero_grad in place): the
        copies a backward that raised started (its end, which publishes them, never came)
        are published first, so that the write is ordered after their reads. Nothing to
        do after a backward that ended, or inside the one that started them."""
        task, now = self._backward_task, torch._C._current_graph_task_id()
        if task is not None and task != now:
            # a grad of another backward: this one raised, or the other runs inside it
            # (reentrant checkpointing's recompute: its own graph task), which only the
            # end of this one (its callback) tells, or a call outside any backward
            self._unended.add(task)
            with torch.no_grad():
                self._end_backward()
        self._raised_unended()

    def _raised_unended(self) -> None:
        """Outside any backward, the backwards whose end never came raised."""
        if self._unended and torch._C._current_graph_task_id() == -1:
            self._unended.clear()
            if self.early is not None:
                self.early.backward_raised()

    def _end_backward(self) -> None:
        # Also called outside a backward's end (step() after a backward that raised,
        # zero_grad, clipping): grads whose copy still waited are copied at step(),
        # never from here, where a step started in backward would race step()'s own.
        self._deferred.clear()
        self._backward_task = None
        if self._pack_arrived:
            self._pack_expected, self._pack_arrived = self._pack_arrived, set()
            self._pack_missing = None
        with torch.no_grad():
            self._copy([], flush=True)
        self.device.publish(self._backward)
        self._backward = []

    # ---- 3. step ----------------------------------------------------------------------

    def step(self, param_groups: List[dict], state, grad_scale: float = 1.0) -> None:
        """One Adam step of every offloaded param that has a grad, its state in the
        engine's own host arenas (the RAM store's engine bucket, state_store.py).
        grad_scale multiplies every grad inside the kernel (clipping coefficient,
        1/loss scale). Returns once the params read on the current stream are the
        updated ones."""
        if self.torn is not None:
            raise RuntimeError(self.torn)
        try:
            run = self.stepping(param_groups, grad_scale, state)
            completed = False
            try:
                run.in_arenas()
                completed = True
            finally:  # also after an error: what was queued must land before reads
                run.end(completed)
        except BaseException as e:
            ran, self._ran = self._ran, set()
            part = [r for r in self.recs if len(r.pieces) > 1
                    and len({id(p) in ran for p in r.pieces}) == 2]
            whole = sum(1 for r in self.recs if r.pieces and all(id(p) in ran for p in r.pieces))
            if part:
                more = f" and {len(part) - 1} more params" if len(part) > 1 else ""
                self.torn = (
                    f"offload_adam: a step raised ({type(e).__name__}: {e}) after its "
                    f"kernels had stepped some of the parts of {part[0].label()}{more}: "
                    "their state is part one step, part the next. No step() or "
                    "state_dict() is taken from it: load_state_dict() a checkpoint (with "
                    "the model's weights) to go on, or build a new optimizer")
            elif whole:
                note = (f"offload_adam: {whole} params were stepped before the error, "
                        "each with its state; the others were not (each param's state "
                        "\"step\" says which). Training can go on; load a checkpoint "
                        "to continue exactly.")
                _add_note(e, note)
            raise

    def stepping(self, param_groups: List[dict], grad_scale: float = 1.0,
                 state=None) -> "EngineStep":
        """The one way a step of the engine's params begins (EngineStep, below):
        `state`, optimizer.state, when the engine's host arenas hold the state
        (`in_arenas`); None when a store lends it bucket by bucket (`lent`: the
        files' buckets, nvme_tier.py)."""
        return EngineStep(self, param_groups, grad_scale, state)

    def _begin_step(self, param_groups: List[dict], state, grad_scale: float = 1.0):
        """What every step starts with: refuse a closed engine or a changed param,
        end what a backward that raised left, learn the bucket order; returns the
        fence and `param_groups` indexed by rec.group (follow_groups)."""
        self._t_enter = time.perf_counter()
        self.check_open()
        self.settle_tail()
        by_group = self.follow_groups(param_groups, again=True)
        self._start_param_check()
        if self.early is not None:
            self._raised_unended()
            self.early.verify(by_group, state, grad_scale)   # raises on a change
        self._end_backward()  # what a backward that raised left unflushed
        self._join()
        by_group = self.follow_groups(param_groups)   # (with the params that joined)
        for rec in self.recs:
            rec.live(check_only=True)   # raises for a param cast or replaced, before anything changes
            self._hook_grad(rec)
        self._learn_bucket_order()
        return self.device.fence(), by_group

    def _publish_step(self, stepped: Sequence[ParamRec]) -> None:
        """What every step ends with, also after an error: the user's stream
        waits for the queued H2D copies; autograd sees the stepped params change
        (a backward of an older forward then raises, as after torch's step)."""
        self.publish_h2d()
        if self.early is not None:
            self.early.new_iteration()
        for rec in stepped:
            increment_version(rec.param)
            home = home_of(rec.param)
            if home is not None:   # a streamed param: the streamer counts writes to it
                home.bumped()
        self.marks.agree(rec.param for rec in stepped)   # the params are the masters'
        if self.param_check is not None:   # (on the user's stream, after the copies)
            self.param_check.expect([rec.param for rec in stepped if rec.home is None])

    def _start_param_check(self) -> None:
        """Queues the comparison of the device params' bits with the last step's
        (param_check.py) before the masters are next looked at; once per step."""
        if self.param_check is not None:
            self.param_check.start([rec.param for rec in self.recs if rec.home is None])

    def _end_step(self) -> None:
        """After a step that completed: the consumed grad copies let go, the profile."""
        self._consumed()
        self.forget_grads()
        self._grow_ring()
        self._ran = set()
        self._profile.exposed_s = time.perf_counter() - self._t_enter
        if self.ring is not None:   # (counted since the last step's end)
            self._profile.ring_waits, self._profile.ring_wait_s = self.ring.since_mark()
            for start, end in self.ring.take_waits():
                self._profile.add_wait("ring", -1, start, end)
        self._last_profile, self._profile = self._profile, StepProfile()

    @property
    def order_learned(self) -> bool:
        """Whether the buckets are in hook order (learned from the first backward)."""
        return self._hook_order is None

    def _learn_bucket_order(self) -> None:
        """The first step after a backward with hooks: buckets in hook order."""
        if self._hook_order:
            # (once each, where it came last: a param whose hook ran in a backward that
            # raised before its copy, and again in the next, is in the hooks' order
            # twice; in two buckets it was stepped twice a step)
            first = list({id(r): r for r in reversed(self._hook_order)}.values())[::-1]
            seen = set(map(id, first))
            rest = sorted((r for r in self.recs if id(r) not in seen), key=lambda r: -r.position)
            self._hook_order, order = None, first + rest
            self._rebucket(order)

    def _plan(self, param_groups, state, grad_scale, fence) -> list:
        """The bucket jobs of this step ((BucketJob or its write_back, continues)
        for the worker), and the recs taking part."""
        checks: Dict[int, object] = {}
        ready = self._ready_grads(checks)
        grad_mul = _factor_of(ready)
        early = self.early.stepped() if self.early is not None else set()
        self.bind_state(ready, param_groups, state)
        take = {id(r) for r in ready}
        # the master rule for every param with a state, stepped now or not (those
        # stepped during backward followed it before their kernel: early.py)
        follow_masters(self.device, [Entry.whole(r) for r in self.recs
                                     if (id(r) in take or is_bound(r, state))
                                     and not any(id(p) in early for p in r.pieces)],
                       self.marks)
        threads = self.threads()
        hypers: Dict[int, Hyper] = {}   # one per group per step
        written = {job.bucket.index: job for job in self._stepped_jobs(early, fence)}
        jobs = []
        for b in self.buckets:
            if b.index in written:  # stepped during backward: only its params to write
                jobs.append((written[b.index].write_back, False))
            todo = [p for p in b.pieces if id(p.rec) in take and id(p) not in early]
            if todo:
                group = param_groups[b.group]
                changed = format_changed(param_groups, b)
                if changed is not None:
                    raise ValueError(changed)
                if b.group not in hypers:
                    hypers[b.group] = Hyper.of(group, b.group)
                job = self._bucket_job(b, todo, hypers[b.group], grad_scale, threads, fence,
                                      checks.get(b.index), grad_mul)
                jobs.append((job, todo[0].start > 0))
        return jobs, ready

    def _bucket_job(self, bucket: Bucket, pieces: List[Piece], hyper: Optional[Hyper] = None,
                   grad_scale: float = 1.0, threads: Optional[int] = None, fence=None,
                   check=None, grad_mul: float = 1.0) -> "BucketJob":
        """The job that steps `pieces` of `bucket` (step 4, below)."""
        return BucketJob(self, bucket, pieces, hyper, grad_scale, threads, fence, check,
                         grad_mul)

    def _stepped_jobs(self, stepped: set, fence) -> List["BucketJob"]:
        """The jobs that write back the pieces (ids in `stepped`) whose kernel
        already ran (step_in_backward): write_back() only."""
        jobs = []
        for b in self.buckets:
            done = [p for p in b.pieces if id(p) in stepped]
            if done:
                jobs.append(self._bucket_job(b, done, fence=fence))
        return jobs

    def _ready_grads(self, checks: Optional[dict] = None) -> List[ParamRec]:
        """The recs taking part in this step, each with a copy of its current
        grad: stale copies are copied again, reused ones are fingerprint-
        checked (verify_grads): queued per bucket into `checks` for the bucket
        jobs, or, without `checks`, waited for and acted on now."""
        self._flush_adds()
        ready, stale, reused = [], [], []
        for rec in self.recs:
            if id(rec) in self._absent:
                continue   # in no param group now: not stepped
            grad = rec.param.grad
            if grad is None or is_freed(grad):
                if rec.freed and grad is not None:
                    ready.append(rec)  # copied, then freed in backward: consume the copy
                else:   # (another engine's: the optimizer refused it, check_freed_grads)
                    rec.freed = False  # none, or the user dropped the one we freed
                continue
            rec.freed = False          # the user gave it a new grad since we freed one
            (reused if rec.copy is not None and rec.copy.is_of(grad) else stale).append(rec)
            ready.append(rec)
        self._copy(stale, flush=True)
        if checks is None:
            self._redo(start_check(self.device, reused))
            return ready
        by_bucket: Dict[int, list] = {}
        for rec in reused:
            by_bucket.setdefault(rec.pieces[0].bucket.index, []).append(rec)
        for index, recs in by_bucket.items():
            check = start_check(self.device, recs)
            if check is not None:
                checks[index] = check
        return ready

    def _redo(self, check) -> None:
        """Waits for `check` and copies again the grads it found changed."""
        if check is not None:
            changed = check.changed()
            if changed:
                recs, _, fps = zip(*changed)
                self._copy(recs, after=check.done, fingerprints=fps, flush=True)

    def bind_state(self, recs: Sequence[ParamRec], param_groups, state) -> None:
        bind_state(self.device, recs, param_groups, state, self._allocate_state, self.marks)

    def _allocate_state(self, recs, roles) -> None:
        if self.state_on_disk:
            return
        # One arena set per precision: the fp32 params' masters are pinned (their
        # copies' source), and the bf16/fp16 params' are not, whatever the mix.
        for low in (True, False):
            same = [r for r in recs if r.low_precision == low]
            if same:
                self._state_arenas.append(
                    allocate_state(same, self.device, self._available, roles))

    def publish_h2d(self) -> None:
        """Step 5: the user's stream waits for every queued H2D copy."""
        self.device.publish([t for b in self.buckets for t in b.h2d])

    # ---- what early start asks of the engine (early.py, disk_early.py) -----------------
    # Besides these three: flush_pack, run, drain, hook_threads, bind_state, buckets,
    # order_learned, publish_h2d and check_open.

    def start_early(self, bucket: Bucket, pieces: List[Piece], param_groups, state,
                    begin: Callable[[List[ParamRec]], Hyper],
                    done: Callable[[List[Piece]], None]) -> None:
        """step_in_backward, the state in the arenas: `pieces` of `bucket` stepped now,
        their kernel only (step() or the early start's commit writes the params): their
        state bound and masters followed, then `begin(recs)` (early start records what
        the step reads and returns the hyperparameters), then the kernel on the worker,
        and `done(the pieces stepped)` after it (also after an error: those whose
        kernel ran before it)."""
        self.run_early(self.prepare_early(bucket, pieces, param_groups, state, begin), done)

    def run_early(self, job: "BucketJob", done: Callable[[List[Piece]], None]
                  ) -> Optional[int]:
        """Queues prepare_early's `job` on the worker now (its kernel only), `done(the
        pieces stepped)` after it; its streamed blocks' readers wait for it. Returns its
        number there (None: it ran)."""
        def kernel_only():
            try:
                job.kernel()
            finally:
                done(job.ran)
        number = self.run(kernel_only)
        self.defer_reads(number, [h.block for h in _homes(job.pieces)])
        return number

    def recs_of(self, params) -> List[ParamRec]:
        """The engine's records of those of `params` it steps."""
        return [r for r in map(self._rec_of.get, map(id, params)) if r is not None]

    def defer_reads(self, number: Optional[int], blocks) -> None:
        """A streamed block's host copies are read (an inference forward, a state dict
        between backward and step()) only once worker job `number` (run's; None: it ran)
        and those before it, which write them, are done: a block in two buckets is
        written by two jobs, and a reader between them would see it half stepped
        (param_stream: `_Block.defer`). An error is left for step() to raise, where the
        step's failure is handled."""
        if number is not None:
            wait = functools.partial(self._worker.wait_for, number, raises=False)
            for block in {id(b): b for b in blocks}.values():
                block.defer(wait)

    def prepare_early(self, bucket: Bucket, pieces: List[Piece], param_groups, state,
                      begin: Callable[[List[ParamRec]], Hyper]) -> "BucketJob":
        """start_early's job, not run: its kernel() steps `pieces` from the grad copies
        they have now (kept by the job: a deferred step runs after step() forgot them)."""
        recs = list({id(p.rec): p.rec for p in pieces}.values())
        self.bind_state(recs, param_groups, state)
        follow_masters(self.device, [Entry.whole(r) for r in recs],
                       self.marks)   # before the kernel reads them
        job = self._bucket_job(bucket, pieces, begin(recs), threads=self.hook_threads())
        job.copies = {id(r): r.copy for r in recs}
        return job

    def run_tail(self, jobs: Sequence["BucketJob"]) -> None:
        """defer_blocks=: the deferred steps' kernels on the worker, after everything
        step() queued; each streamed block they write waits for its own before its
        host copies are read (param_stream: `_Block.defer`), everything else for all
        of them (settle_tail)."""
        jobs = list(jobs)
        pieces = [p for job in jobs for p in job.pieces]
        for k, job in enumerate(jobs):
            number = self._worker.submit(functools.partial(
                _tail_job, weakref.ref(self), jobs, k, pieces))
            self._tail = number
            self._tail_pieces.extend(job.pieces)
            wait = functools.partial(self._worker.wait_for, number)
            for home in _homes(job.pieces):
                home.block.defer(wait)

    def settle_tail(self) -> None:
        """Waits for the deferred steps (run_tail) still running; raises what one
        raised. A no-op without, and on the worker itself (a job must not wait for
        itself)."""
        if not self._tail or self._worker.on_worker():
            return
        try:
            self._worker.wait_for(self._tail)
        except (KeyboardInterrupt, ForkedChildError):
            # (the wait was interrupted, not the steps: they still run, and the next
            # reader waits for them again; cleared first, a state_dict() retried from a
            # Ctrl-C handler read them half done, silently: found from outside. In a
            # forked child they never end: each reader is refused)
            raise
        except BaseException:
            self._tail, self._tail_pieces = 0, []   # (one raised: they are done)
            raise
        self._tail, self._tail_pieces = 0, []

    @property
    def tail_pending(self) -> bool:
        """Whether deferred steps may still run (defer_blocks=)."""
        return bool(self._tail)

    def step_lent_early(self, entries: Sequence[Entry], views: Dict[str, torch.Tensor],
                        hyper_of: Callable[[int], Hyper], keep: Dict[int, torch.Tensor],
                        after=None) -> None:
        """step_in_backward, the state lent by a store (the files): a lent bucket's
        kernels, on the caller's thread (the worker), no param written but the streamed
        ones, whose update goes to their host copy; `keep` gets, by id(rec), the values
        of those that the files' masters cannot give back if the pass is abandoned
        (step_lent); `after`: an event taken on the user's stream once the bucket's grads
        were all produced (a param read to start its master is read after it)."""
        step_lent(self, entries, views, hyper_of, 1.0, self.hook_threads(), write=False,
                  keep=keep, after=after)

    def write_stepped(self, stepped: set) -> None:
        """The early start's commit: the H2D copies of the pieces (ids in `stepped`)
        whose kernel ran in backward, after a new fence, published."""
        for job in self._stepped_jobs(stepped, self.device.fence()):
            job.write_back()
        self.publish_h2d()

    # ---- after the step -----------------------------------------------------------------

    def _consumed(self) -> None:
        for rec in self.recs:
            if rec.freed:   # consumed: until zero_grad(), its grad refuses to be used
                rec.freed = False   # (freed_grad.Stepped)
                rec.copy = None
                if is_freed(rec.param.grad):
                    rec.param.grad = freed_grad(rec.param, local(rec.param.grad),
                                                rec.label(), Stepped(rec.label()))

    def drain(self, finish: bool = False) -> None:
        """Waits for the jobs queued on the worker (raises what one raised)."""
        if self._worker is not None:
            self._worker.drain(finish)

    def worker_busy(self) -> bool:
        """Whether the worker has a job queued or running that will run, other than the
        caller's own (a job waiting for itself would never end)."""
        w = self._worker
        return w is not None and not w.on_worker() and w.busy()

    def wait_for(self, number: int) -> None:
        """Waits for worker job `number` (run's) and those before it; an error is left
        for whoever drains (step())."""
        self._worker.wait_for(number, raises=False)

    def run(self, job, continues: bool = False) -> Optional[int]:
        """Runs `job` on the worker thread (inline without overlap); returns its number
        there (None: it ran)."""
        if self._worker is not None:
            return self._worker.submit(job, continues)
        job()
        return None

    def profile(self) -> Optional[dict]:
        return self._last_profile.as_dict() if self._last_profile else None

    # ---- between backward and step: clipping, unscaling, zero_grad --------------------

    def grad_sq_sums(self) -> List[tuple]:
        """(param, sum of squares of its current grad) for each param with a
        grad (inf/NaN propagate), from the host copies: no second transfer and
        no GPU work. A DTensor's: of its local shard."""
        self.check_open()
        self.settle_tail()
        self.drain()
        self._want_norms = self.overlap  # from now on, computed while streaming
        with torch.no_grad():
            self._end_backward()
            self._join()
            self._follow_owner(again=True)   # (a param in no group counts no more)
            ready = self._ready_grads()
            threads = self.threads()
            for rec in ready:
                sq_sum(self.device, rec, rec.copy, threads)
        return [(rec.param, rec.copy.sq_sum * rec.copy.factor ** 2) for rec in ready]

    def invalidate_copies(self) -> None:
        """The grads changed in a way version counters do not show (GradScaler's
        unscale_): the next step copies every grad again."""
        self.check_open()
        if any(r.freed for r in self.recs):
            raise RuntimeError(
                "offload_adam: the grads were changed in place (GradScaler.unscale_?) "
                "after free_grads_after_copy=True freed them; with that option let "
                "GradScaler.step unscale (do not call unscale_) and clip with "
                "max_grad_norm=")
        if not self.verify_grads:
            for rec in self.recs:
                if rec.copy is not None:
                    rec.copy.invalidate()

    @property
    def sees_in_place_edits(self) -> bool:
        """Whether a grad changed without a version bump is noticed."""
        return self.verify_grads

    def drop_freed_grads(self, zeros: bool = False) -> None:
        """p.grad = None where it holds a FreedGrad (before zero_grad, which would zero
        it in place); `zeros` (zero_grad(set_to_none=False)): a zero grad instead, as
        torch leaves: a param without a grad in the next backward is stepped with it
        (its moments decay), and one with a grad frees it again once copied."""
        self.check_open(closed_ok=True)
        for rec in self.recs:
            grad = rec.param.grad
            if is_freed(grad):
                rec.param.grad = (torch.zeros_like(rec.param, dtype=grad.dtype)
                                  if zeros else None)

    def zero_grad(self) -> None:
        """Called by the optimizer's zero_grad: grads freed by us are gone too."""
        if not self.check_open(closed_ok=True):
            return
        # (deferred steps, defer_blocks=, read host copies of the grads: not waited for)
        if self.early is not None:
            self.early.on_zero_grad()
        if self._worker is not None:
            self._worker.raise_pending()
        self._end_backward()
        self._flush_adds()
        for rec in self.recs:
            rec.freed = False
            rec.accumulated = False

    # ---- accumulation into freed grads ----------------------------------------------

    def accumulate(self, rec: ParamRec, copy: GradCopy, new: torch.Tensor) -> None:
        """autograd's `p.grad += new` into a freed grad (free_grads_after_copy, another
        micro-batch): `new` goes to the host piece by piece and is added to the host
        copy there, so the device keeps no grad between micro-batches. The add rounds
        as the device's would (bf16 + bf16 computed in fp32, rounded to nearest even),
        so the sum is bit for bit the one accumulated on the device."""
        if not self.check_open(closed_ok=True):
            raise _freed_by_a_closed_optimizer(rec)
        if self.early is not None:
            self.early.fail("a grad was accumulated (another micro-batch) into a freed "
                            "grad whose step already ran in backward")
        if copy.factor != 1.0:
            raise RuntimeError(
                f"offload_adam: the freed grad of {rec.label()} was multiplied (clipped or "
                "unscaled) and then another micro-batch was accumulated into it: clip and "
                "unscale once every micro-batch's backward is done")
        if copy.unsent:
            self._end_backward()   # its first copy's pack goes before anything adds to it
        g = local(new).detach()
        if rec.flat and not g.is_contiguous():
            g = self.device.contiguous(g)
        for piece in rec.pieces:
            index = self._acc_slot(piece)
            slot = self._acc_slots[index][:piece.numel * g.element_size()].view(g.dtype)
            t = self.device.d2h([slot], [piece.of(g).reshape(-1)])
            copy.transfers.append(t)   # waited for with the rest (step, shutdown)
            copy.adds += 1
            self._acc_pending.append((rec, copy, piece, index, slot))
        copy.generation += 1   # a sum of squares computed before is not this grad's
        copy.sq_sum = None
        rec.accumulated = True

    def _acc_slot(self, piece: Piece) -> int:
        """A free slot of the accumulation ring for `piece` (its oldest pending add done
        first when none is free); the ring is sized on first use for the largest piece."""
        need = piece.numel * 4
        if not self._acc_slots or self._acc_slots[0].numel() < need:
            need = max(p.numel for r in self.recs for p in r.pieces) * 4   # (fp32 at most)
            self._flush_adds()
            for a in self._acc_arenas:
                a.release()
            self._acc_arenas.clear()
            arenas = HostArenas(self.device)
            offsets = [arenas.reserve("accumulate", torch.uint8, need) for _ in range(_ACC_SLOTS)]
            arenas.allocate()
            self._acc_arenas.append(arenas)
            self._acc_slots = [arenas.view("accumulate", o, (need,)) for o in offsets]
            self._acc_free = list(range(_ACC_SLOTS))
        if not self._acc_free:
            self._flush_adds(len(self._acc_pending) - 1)
        return self._acc_free.pop(0)

    def _flush_adds(self, keep: int = 0) -> None:
        """Adds the pending accumulated pieces (oldest first) until `keep` are left."""
        while len(self._acc_pending) > keep:
            rec, copy, piece, index, slot = self._acc_pending.pop(0)
            self.device.wait_host(*copy.transfers)   # its first copy and this one landed
            if rec.copy is copy:
                with torch.no_grad():
                    piece.grad.view(-1).add_(slot)
            copy.adds -= 1
            copy.generation += 1   # (a sum of squares being computed meanwhile is dropped)
            copy.sq_sum = None
            self._acc_free.append(index)


# ---- 3'. the step's session: the engine's own arenas, or state lent by a store --------
# (what a store lends: layout.Entry, a param or a part of one in a store's bucket)


class EngineStep:
    """One step of the engine's params (OffloadEngine.stepping; state_store.py lends the
    state). Begun, it has refused what must be refused and taken the fence; then either

        in_arenas()     the state is in the engine's host arenas (optimizer.state shows
                        them): a job per transfer bucket on the worker (step 4)
        lent(...)       per bucket a store lends (the files': nvme_tier.py): the recs'
                        state views point at the lent tensors, the same bucket jobs
                        run on the caller's thread; every grad was made ready when the
                        step began, so all are on their way to the host before the store
                        reads its first bucket
        write_early()   the params stepped during backward over lent state
                        (step_in_backward, disk_early.py), once the store committed

    and end() (also after an error) publishes the H2D copies and bumps the versions of
    what was stepped."""

    def __init__(self, engine: OffloadEngine, param_groups: List[dict], grad_scale: float,
                 state=None):
        self.engine, self.state = engine, state
        # (param_groups indexed by rec.group: as the user may have edited them since)
        self.fence, self.param_groups = engine._begin_step(
            param_groups, {} if state is None else state, grad_scale)
        self.grad_scale = grad_scale
        self.grad_mul = 1.0   # the freed grads' factor (_factor_of), lent path: set below
        self.stepped: List[ParamRec] = []
        self._stepped_ids: set = set()   # (a param in parts is lent once per part)
        self._hypers: Dict[int, Hyper] = {}
        self._parts: Dict[int, ParamRec] = {}   # params lent in parts, not stepped
        self._begun = state is None   # (in_arenas: once its plan is made)
        self.ready: Dict[int, ParamRec] = {}
        if state is None:
            with torch.no_grad():
                ready = engine._ready_grads()   # fingerprint checks done (and acted on) here
            self.grad_mul = _factor_of(ready)
            self.ready = {id(r): r for r in ready}
            self.threads = engine.threads()

    def in_arenas(self) -> None:
        engine = self.engine
        with torch.no_grad():
            jobs, self.stepped = engine._plan(self.param_groups, self.state, self.grad_scale,
                                              self.fence)
            self._begun = True
            with interrupts_deferred() as deferring:
                for job, continues in jobs:
                    engine.run(job, continues)
                engine.drain(finish=not deferring)  # all, or fewer after a second ^C
            if engine.early is not None:   # defer_blocks=: left running, after the rest
                engine.run_tail(engine.early.take_held())

    def lent(self, entries: Sequence[Entry], views: Dict[str, torch.Tensor]) -> None:
        """Steps the recs of one lent bucket that take part in this step; the masters
        of the others follow their params (master_rule.py). `views`: the bucket's
        tensors. (A bucket stepped during backward is not lent again.)"""
        todo = [e for e in entries if id(e.rec) in self.ready]
        idle = [e for e in entries if id(e.rec) not in self.ready]
        if idle:
            with torch.no_grad():
                _lend(idle, views)
                # (after the step's fence: a param written since the last step, a
                # model's load, is read back for the comparison; without it the read
                # raced the write, an ordering violation found by a test of loads)
                follow_masters(self.engine.device, idle, self.engine.marks, self.fence)
                _lend(idle, None)
            self._parts.update((id(e.rec), e.rec) for e in idle if e.part)
        if todo:
            step_lent(self.engine, todo, views, self._hyper, self.grad_scale, self.threads,
                      self.fence, grad_mul=self.grad_mul)
            self._add_stepped(e.rec for e in todo)

    def host_grads(self, rec: ParamRec, pieces=None) -> List[Tuple[int, torch.Tensor]]:
        """rec's grad as this step's kernels read it, (start, host tensor) per piece (of
        `pieces`, default all), once its copies landed: what the NVMe tier's redo log
        keeps (nvme_tier.py)."""
        self.engine.device.wait_host(*rec.copy.transfers)
        return [(p.start, p.grad) for p in (pieces if pieces is not None else rec.pieces)]

    def host_params(self, rec: ParamRec, pieces=None) -> List[Tuple[int, torch.Tensor]]:
        """rec's param now, (start, host copy) per piece (of `pieces`, default all), read
        from the device after the user's queued work (or its streamed host copy)."""
        pieces = pieces if pieces is not None else rec.pieces
        like = rec.home.like if rec.home is not None else rec.live()
        dsts = [torch.empty(p.of(like).shape, dtype=rec.dtype) for p in pieces]
        read_params(self.engine.device, dsts, pieces)
        return [(p.start, d) for p, d in zip(pieces, dsts)]

    def write_early(self, recs: Sequence[ParamRec]) -> None:
        """Queues the H2D copies of the params stepped during backward (their updates
        wait in staging), once the store holds their step."""
        pieces = {id(p) for rec in recs for p in rec.pieces}
        for job in self.engine._stepped_jobs(pieces, self.fence):
            job.write_back()
        self._add_stepped(recs)

    def _add_stepped(self, recs) -> None:
        for rec in recs:
            if id(rec) not in self._stepped_ids:
                self._stepped_ids.add(id(rec))
                self.stepped.append(rec)

    def end(self, completed: bool) -> None:
        """Publishes the H2D copies and bumps the stepped params' versions, also after
        an error; the rest of the step's end only when it completed."""
        if self._begun:
            self.engine._publish_step(self.stepped)
        if completed:   # every part of a param not stepped followed: it agrees
            self.engine.marks.agree(r.param for r in self._parts.values())
            self.engine._end_step()

    def _hyper(self, group: int) -> Hyper:
        if group not in self._hypers:   # one per group per step, as in the arenas
            self._hypers[group] = Hyper.of(self.param_groups[group], group)
        return self._hypers[group]


def step_lent(engine: OffloadEngine, todo: Sequence[Entry], views: Dict[str, torch.Tensor],
              hyper_of: Callable[[int], Hyper], grad_scale: float, threads: int, fence=None,
              write: bool = True, keep: Optional[Dict[int, torch.Tensor]] = None,
              after=None, grad_mul: float = 1.0) -> None:
    """One lent bucket's recs (each with a grad copy on its way): their state views
    pointed at the lent tensors, their masters following their params (master_rule.py),
    the bucket jobs' kernels grouped by transfer bucket, each param's "<name>.step" set
    to the count after the step. With `write` the params' H2D copies are queued too
    (after `fence`), and waited for where they read the lent tensors themselves (an fp32
    param's master, unstaged), since the store reuses them for its next bucket;
    write=False (step_in_backward) leaves the params to step(): an fp32 master is then
    in its staging (layout.allocate_transfers). Each piece keeps its own step count, as
    in the arenas, loaded from and stored into the lent "step". `keep` (step_in_backward):
    the streamed params' values before their step where they are not their committed
    master's rounding (changed since), for an abandoned pass to restore (disk_early.py);
    None for those in their first step (a copy of every param at the first step would
    cost the host memory the ring saves)."""
    for rec, _, _ in todo:   # (a streamer closed, a param cast: named before any change)
        rec.live(check_only=True)
    with torch.no_grad():
        _lend(todo, views)
        if keep is not None:
            for rec, _, pieces in todo:
                if rec.home is None or id(rec) in keep:   # (a part: kept whole once)
                    continue
                if float(pieces[0].step_t) == 0:
                    keep[id(rec)] = None   # its first step: nothing to go back to but this
                elif not engine.marks.current(rec.param):
                    with rec.home.held() as values:   # (see disk_early)
                        keep[id(rec)] = values.clone()
        follow_masters(engine.device, todo, engine.marks, after)
        by_bucket: Dict[int, list] = {}
        for e in todo:
            for piece in e.pieces:
                by_bucket.setdefault(piece.bucket.index, []).append(piece)
        ring_reads = []
        for index, pieces in sorted(by_bucket.items()):
            bucket = engine.buckets[index]
            job = engine._bucket_job(bucket, pieces, hyper_of(bucket.group), grad_scale,
                                     threads, fence, grad_mul=grad_mul)
            job.kernel()
            if write:
                before = len(bucket.h2d)
                job.write_back()
                if any(p.rec.home is None and p.staging is None
                       for p in pieces):   # the source is the master
                    ring_reads += bucket.h2d[before:]
        engine.device.wait_host(*ring_reads)
        for e in todo:
            ParamState.in_bucket(views, e.name).step.copy_(e.pieces[0].step_t)
        _lend(todo, None)


def _lend(entries: Sequence[Entry], views: Optional[Dict[str, torch.Tensor]]) -> None:
    """Points the entries' state views (what their pieces' kernels read and write: a
    whole param's, or a part's own, layout.Piece.state) and step counts at their tensors
    in a lent bucket's `views`; None: back to none, once the bucket is done with."""
    for e in entries:
        st = ParamState.in_bucket(views, e.name) if views is not None else None
        if e.part:
            for piece in e.pieces:
                piece.lent, piece.lent_start = st, e.start
        else:
            for role in ROLES + SPLIT_ROLES:
                setattr(e.rec, role, getattr(st, role) if st is not None else None)
        if st is not None:
            for piece in e.pieces:
                piece.step_t.fill_(float(st.step))


# ---- 4. the bucket job (worker thread) ------------------------------------------------

class BucketJob:
    """One bucket's step, the unit the worker runs: kernel() waits for its
    fingerprint check (copying again what changed), its grads' D2H copies and
    its last H2D copies (its buffers are free again), then runs the fused Adam
    step on `pieces`; write_back() queues the H2D copies of the stepped values
    into the params, after `fence`. Called, it does both. step() builds one per
    bucket; step_in_backward runs kernel() during backward, and its write-back
    comes from step() or from EarlyStart.commit (OffloadEngine.stepped_jobs)."""

    def __init__(self, engine: OffloadEngine, bucket: Bucket, pieces: List[Piece],
                 hyper: Optional[Hyper] = None, grad_scale: float = 1.0,
                 threads: Optional[int] = None, fence=None, check=None, grad_mul: float = 1.0):
        self.engine, self.bucket, self.pieces = engine, bucket, pieces
        self.hyper, self.grad_scale, self.threads = hyper, grad_scale, threads
        self.grad_mul = grad_mul   # freed grads' factor, rounded in their dtype (_factor_of)
        self.fence, self.check = fence, check
        self.copies: Optional[Dict[int, GradCopy]] = None   # id(rec) -> the copy read, if kept
        self.ran: List[Piece] = []   # the pieces whose kernel ran (all, once kernel() returns)

    def __call__(self) -> None:
        try:
            self.kernel()
        except BaseException:
            # (a later block's hold failed: ENOSPC on the param files) the params stepped
            # before it get their values, as their state says: each param stepped or not
            if self.ran:
                self.write_back(self.ran)
            raise
        self.write_back()

    def kernel(self) -> None:
        engine, bucket, pieces, hyper = self.engine, self.bucket, self.pieces, self.hyper
        dev = engine.device
        engine._redo(self.check)
        kept = self.copies or {id(p.rec): p.rec.copy for p in pieces}
        copies = kept.values()
        if any(id(p) not in kept[id(p.rec)].sent_ids for p in pieces):
            # a pack not flushed: a bug, never a wrong step (the other pieces of a param
            # may still be on their way: early.py, piece_sent)
            raise RuntimeError("offload_adam: internal error: a bucket's step started "
                               "before all of its grads were sent to the host")
        t0 = time.perf_counter()
        dev.wait_host(*{id(t): t for c in copies for t in list(c.transfers)}.values())
        engine._profile.add_wait("grads", bucket.index, t0, time.perf_counter())
        dev.wait_host(*bucket.h2d)                     # its buffers are free again
        bucket.h2d = []
        # The kernel runs once per streamed block of the bucket (and once for the resident
        # pieces), elementwise as one run would: a block stays held in the param files'
        # cache while its pieces step, and a bucket may span more blocks than it has slots.
        by_block: Dict[int, List[Piece]] = {}
        for p in pieces:
            by_block.setdefault(id(p.rec.home.block) if p.rec.home is not None else 0,
                                []).append(p)
        for group in by_block.values():
            with contextlib.ExitStack() as writes:
                for home in _homes(group):   # a streamed param's update goes to its host
                    # copy: no fetch may still read it (in files: held in the cache, and not
                    # read first: the kernel writes these elements and reads none of them)
                    mine = [p for p in group if p.rec.home is home]
                    t0 = time.perf_counter()
                    writes.enter_context(home.writing([(p.start, p.stop) for p in mine],
                                                      stepped=sum(p.numel for p in mine)))
                    engine._profile.add_wait("home", bucket.index, t0, time.perf_counter())
                # (a split master, lent by the files, steps its head as its high half: one
                # kernel call for those, one for the others; then its head is the update)
                split = [p for p in group if p.split]
                t0 = time.perf_counter()   # (the profile's CPU step: not the holds' waits)
                for run in (split, [p for p in group if not p.split]):
                    if not run:
                        continue
                    args = KernelArgs()
                    for p in run:
                        st = p.param_state()
                        args.add(st, st.head if st.head is not None else
                                 p.staging if bucket.low_precision else None, p.start)
                    args.run([p.grad for p in run], hyper, self.grad_scale, self.threads,
                             grad_mul=self.grad_mul)
                for p in split:
                    p.staging.view(-1).copy_(p.state("head"))
                self.ran += group
                engine._ran.update(id(p) for p in group)
                if not bucket.low_precision:
                    # An fp32 update that goes back from staging (packed, or with the
                    # state in files: layout.allocate_transfers) is the master.
                    for p in group:
                        if p.staging is not None:
                            p.staging.copy_(p.state("master"))
                engine._profile.add_cpu(bucket.index, t0, time.perf_counter())
        if engine.ring is not None:   # their grads are read: their spans may be reused
            for p in pieces:
                engine.ring.done(p)

    def write_back(self, pieces: Optional[List[Piece]] = None) -> None:
        """Queues the copies of the stepped values into the params (H2D): of `pieces`
        (default: all the job's)."""
        engine, bucket = self.engine, self.bucket
        pieces = self.pieces if pieces is None else pieces
        # (a streamed param's update is in its host copy already: its staging)
        resident = [i for i, p in enumerate(pieces) if p.rec.home is None]
        srcs = {i: pieces[i].state("master") if pieces[i].staging is None
                else pieces[i].staging for i in resident}
        dsts = {i: pieces[i].of(pieces[i].rec.live()) for i in resident}
        packed = [i for i in resident if pieces[i].packed]
        sends = [[i] for i in resident if not pieces[i].packed] + ([packed] if packed else [])
        for idx in sends:
            t = engine.device.h2d([dsts[i] for i in idx], [srcs[i] for i in idx], self.fence)
            bucket.h2d.append(t)
            engine._profile.add_h2d(bucket.index, t)


def _homes(pieces: Sequence[Piece]) -> list:
    """The host copies (param_stream.Home) of the streamed params among `pieces`."""
    return list({id(p.rec.home): p.rec.home for p in pieces if p.rec.home is not None}.values())


def _freed_by_a_closed_optimizer(rec: ParamRec) -> RuntimeError:
    return RuntimeError(
        f"offload_adam: the grad of {rec.label()} was freed by this optimizer after its copy "
        "(free_grads_after_copy=True), and the optimizer was closed (close()): the host copy "
        "that held it is gone (a backward accumulating into it, a clip reading it). Call "
        "zero_grad() before a backward after close(), or build a new optimizer")


class _FreedHost:
    """What a freed grad's FreedGrad asks of its host copy (freed_grad.py)."""

    def __init__(self, engine_ref, rec: ParamRec, copy: GradCopy):
        self.engine_ref, self.rec, self.copy = engine_ref, rec, copy

    def _engine(self) -> "OffloadEngine":
        """The engine, while this copy is still the grad's (else a RuntimeError)."""
        engine = self.engine_ref()
        if engine is not None and not engine.check_open(closed_ok=True):
            # (said first: closed between backward and step(), the steps begun in backward
            # took their copies, and "its step was taken" hid why)
            raise _freed_by_a_closed_optimizer(self.rec)
        if engine is None or self.rec.copy is not self.copy:
            raise RuntimeError(f"offload_adam: the host copy of the freed grad of "
                               f"{self.rec.label()} is gone (its step was taken)")
        return engine

    def sq_sum(self) -> float:
        engine = self._engine()
        engine._flush_adds()
        if self.copy.sq_sum is None:
            with torch.no_grad():
                engine._end_backward()   # its pack sent, if it still waited
            sq_sum(engine.device, self.rec, self.copy, engine.threads())
        return self.copy.sq_sum * self.copy.factor ** 2

    def accumulate(self, new: torch.Tensor) -> None:
        self._engine().accumulate(self.rec, self.copy, new)

    def scale(self, factor: float) -> None:
        engine = self.engine_ref()
        if engine is not None and engine.early is not None and factor != 1.0:
            engine.early.fail("a freed grad was scaled (clipping?): the step started in "
                              "backward from the grad as it was")
        self.copy.factor *= factor


def _factor_of(ready: Sequence[ParamRec]) -> float:
    """The factor freed grads were multiplied by since backward (clipping by
    torch.nn.utils.clip_grad_norm_: one for all): the kernel's grad_mul, which
    rounds each product to the grad's dtype as torch's multiplication of the
    grad on the device would have (so that the step equals the one of the grads
    kept, bit for bit), before the grad scale multiplies it in fp32."""
    factors = {r.copy.factor for r in ready if r.freed}
    if not factors or factors == {1.0}:
        return 1.0
    if len(factors) > 1:
        raise RuntimeError(
            "offload_adam: freed grads (free_grads_after_copy=True) were multiplied by "
            "different factors before step(); only one factor for all of them (a "
            "clipping coefficient) can be applied inside the step")
    # The factor multiplies every grad of the step. A grad not freed (no grad in this
    # backward: the zeros zero_grad(set_to_none=False) left, which the clip multiplied
    # too) is unchanged by it only when zero (one device reduction each, rare).
    for r in ready:
        grad = r.param.grad
        if not r.freed and grad is not None and bool(local(grad).detach().any()):
            raise RuntimeError(
                f"offload_adam: freed grads (free_grads_after_copy=True) were multiplied by "
                f"{factors.pop()!r} before step() (a clipping coefficient), which the step "
                f"applies to every grad, and the grad of {r.label()} is not a freed one (set "
                "by hand, or kept since an earlier backward) and not zero: it would be "
                "multiplied twice. Set it before clipping to None or to zeros, or use "
                "free_grads_after_copy=False")
    return factors.pop()


# param -> a weak reference to the engine that hooks it.
_owners = WeakIdKeyDictionary()


def _claim(engine: OffloadEngine, recs: Sequence[ParamRec]) -> None:
    """Makes `engine` the one that takes recs' grads. Two live engines would split
    a param's grads between them (each hook copies and, with free_grads_after_copy,
    frees the grad), so an older live engine over any of them lets go of all its
    params: `opt = AdamW(params)` run again while the old optimizer is still bound
    to `opt` (an LR sweep, a notebook cell run twice, torch's own optimizer tests)
    trains as with torch, and the old optimizer, used again, says why it cannot."""
    # (the first named is the first added)
    let_go_of([rec.param for rec in sorted(recs, key=lambda r: r.position)], engine)


def let_go_of(params: Sequence[torch.Tensor], engine: Optional[OffloadEngine] = None) -> None:
    """An older live engine over any of `params` lets go of all its params (_claim);
    `engine`: the newer one that takes them, None when the newer optimizer steps them in
    place. (With no engine of its own, the newer one left the older one's hooks on: a
    notebook cell that built offload_adam.AdamW(step_in_backward=True) and, run again,
    one stepped in place, had the old one step in each backward and refuse the grads it
    had freed or stepped; found from outside.)"""
    taken: Dict[int, tuple] = {}   # id(older engine) -> (it, its params taken)
    for p in params:
        ref = _owners.pop(p, None)
        old = ref() if ref is not None else None
        if old is not None and old is not engine and old._finalizer.alive:
            taken.setdefault(id(old), (old, []))[1].append(p)
        if engine is not None:
            _owners[p] = weakref.ref(engine)
    for old, ps in taken.values():
        old._let_go(ps)


class _EarlyOwner:
    """The optimizer as early.py sees it: its param_groups indexed by rec.group
    (OffloadEngine.follow_groups), its state."""

    def __init__(self, engine: OffloadEngine, owner):
        self._engine, self._owner = engine, owner

    @property
    def param_groups(self) -> List[Optional[dict]]:
        """Followed once per backward (its early starts ask at each bucket; reading the
        groups' key is O(groups), which made a backward O(groups^2) with many groups);
        outside a backward, each time."""
        groups = self._owner.param_groups
        task = torch._C._current_graph_task_id()
        seen = self._engine.early_groups
        if task != -1 and seen is not None and seen[0] == task and seen[1] is groups:
            return seen[2]
        out = self._engine.follow_groups(groups)
        self._engine.early_groups = (task, groups, out) if task != -1 else None
        return out

    def raw_state(self):
        raw = getattr(self._owner, "raw_state", None)
        return raw() if raw is not None else self._owner.state

    @property
    def state(self):
        return self._owner.state

    def check_addresses(self) -> None:
        """The optimizer's check of its params' memory (params.Addresses), as at step()."""
        addresses = getattr(self._owner, "_addresses", None)   # (a test's bare owner: none)
        if addresses is not None:
            addresses.check(self._owner.param_groups)


def _early_owner(engine_ref, owner_ref):
    """A weakref-like call for early.py: its _EarlyOwner, None once either is gone."""
    if owner_ref is None:
        return None

    def get():
        engine, owner = engine_ref(), owner_ref()
        return None if engine is None or owner is None else _EarlyOwner(engine, owner)
    return get


# The hooks autograd calls and the end-of-backward callback are never traced: a compiled
# training-step function (torch.compile of forward, backward, step) runs backward eagerly
# with dynamo's frame callback still set, and dynamo traced the engine's Python from them
# (and failed inside, "sources must not be empty for symbol": found from outside).
def _hook(engine_ref, rec):
    @torch.compiler.disable
    def hook(param):
        engine = engine_ref()
        if engine is not None:
            engine.in_hook(lambda: engine._on_grad(rec))
    return hook


def _before_grad(engine_ref):
    """A param's tensor hook: runs before autograd adds the grad into p.grad. (Marked
    unserializable: torch.save of a plain-tensor param warned of a hook the user never
    registered; found from outside.)"""
    @torch.utils.hooks.unserializable_hook
    @torch.compiler.disable
    def hook(grad):
        engine = engine_ref()
        if engine is not None:
            engine.in_hook(engine.after_raised_backward)
    return hook


def _hooked_after(rec: ParamRec) -> bool:
    """Whether rec's param has a post-accumulate-grad hook registered after the
    engine's (torch runs them in registration order)."""
    hooks = rec.param._post_accumulate_grad_hooks
    return rec.hook is not None and bool(hooks) and next(reversed(hooks)) != rec.hook.id


def _transfers_of(recs, buckets) -> list:
    out = [t for b in buckets for t in b.h2d]
    for rec in recs:
        if rec.copy is not None:
            out.extend(rec.copy.transfers)
    return out


def _worker_busy(engine_ref):
    """The grad ring's `busy` for the early steps in host RAM: a kernel queued or running
    frees room (a weak reference: the ring must not keep the engine alive)."""
    def busy() -> bool:
        engine = engine_ref()
        return engine is not None and engine.worker_busy()
    return busy


def _shutdown(device, worker, recs, buckets, state_arenas, transfer_arenas,
              acc_arenas, ring_arenas, lent_pins, pid: int) -> None:
    for rec in recs:
        if rec.hook is not None:
            rec.hook.remove()
            rec.pre_hook.remove()
            rec.hook = rec.pre_hook = None
    if os.getpid() != pid:
        # a forked child (its close(), a newer optimizer built over the params, its
        # exit): the threads, copies and pinned memory are its parent's; only the hooks
        # on the child's params are its own, which left there refused every backward
        # in the child for good, a new optimizer or close() notwithstanding (found from
        # outside)
        return
    if put_off(device, lambda: _shutdown(device, worker, recs, buckets, state_arenas,
                                         transfer_arenas, acc_arenas, ring_arenas,
                                         lent_pins, pid)):
        return   # (the simulated device: a wait here would wait for itself)
    if worker is not None:
        worker.close()   # (its queued jobs run on; the exit waits for them: worker.py)
    # No copy may still read or write the memory about to be unpinned and freed.
    device.wait_host(*_transfers_of(recs, buckets))
    for a in state_arenas + transfer_arenas + acc_arenas + ring_arenas + lent_pins:
        a.release()
    lent_pins.clear()
    # held no more (host_bytes() 0): what optimizer.state still shows stays readable
    state_arenas.clear()
    transfer_arenas.clear()
    acc_arenas.clear()
    ring_arenas.clear()


def _tail_job(engine_ref, jobs: list, k: int, pieces: list) -> None:
    """Deferred step k of `jobs` (run_tail's), on the worker. The worker skips the jobs
    after one that raised, so its error says what stayed a step behind: the params of
    the jobs not run, and none torn (a param in parts, some stepped: `torn`, as a step
    that raised halfway)."""
    try:
        jobs[k].kernel()
    except BaseException as e:
        ran = {id(p) for j in jobs[:k] for p in j.pieces}
        ran |= {id(p) for p in getattr(jobs[k], "ran", ())}
        recs = list({id(p.rec): p.rec for p in pieces}.values())
        left = {id(p) for p in pieces} - ran
        behind = [r for r in recs if any(id(p) in left for p in r.pieces)]
        # (its other pieces stepped: in the deferred jobs that ran, or before step() returned)
        torn = [r for r in behind if not all(id(p) in left for p in r.pieces)]
        engine = engine_ref()
        if torn and engine is not None:
            more = f" and {len(torn) - 1} more params" if len(torn) > 1 else ""
            engine.torn = (
                f"offload_adam: a step deferred past step() (defer_blocks=) raised "
                f"({type(e).__name__}: {e}) after its kernels had stepped some of the parts "
                f"of {torn[0].label()}{more}: their state is part one step, part the next. "
                "No step() or state_dict() is taken from it: load_state_dict() a "
                "checkpoint (with the model's weights) to go on, or build a new optimizer")
        note = (f"offload_adam: this step was deferred past step() (defer_blocks=): "
                f"{len(behind)} of the {len(recs)} params of its blocks were not stepped "
                "(their state and values are the step before's; each param's state "
                "\"step\" says which). Load a checkpoint to continue exactly.")
        _add_note(e, note)
        raise


def _add_note(e: BaseException, note: str) -> None:
    """`note` added to error e (what a failed step left stepped)."""
    if hasattr(e, "add_note"):   # (Python 3.11+)
        e.add_note(note)
    else:   # (3.10: kept where 3.11 keeps it, not printed)
        e.__notes__ = [*getattr(e, "__notes__", []), note]


def _refuse_compiled_autograd() -> None:
    """Compiled autograd traces the grad hooks into its graph: the engine's (host
    copies on its own streams, end-of-backward callbacks, graph task ids) cannot be
    traced, and failed inside dynamo part way. Refused before anything is copied."""
    ca = getattr(torch._dynamo, "compiled_autograd", None) if hasattr(torch, "_dynamo") else None
    if ca is not None and getattr(ca, "in_compiled_autograd_region", False):
        raise RuntimeError(
            "offload_adam: backward runs under compiled autograd (torch._dynamo."
            "config.compiled_autograd=True, or compiled_autograd._enable), which traces "
            "the grad hooks the offload engine copies grads to the host from, and "
            "cannot trace them. Run backward without compiled autograd (torch.compile "
            "of the model itself works); nothing was copied")
