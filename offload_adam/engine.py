"""The offload engine: fp32 master weights and Adam moments in (pinned) host memory.

What runs where, for a param on the GPU (bf16, fp16 or fp32):

    backward (autograd's thread)   post-accumulate-grad hook per param: queue the
                                   grad's device->host copy on a side stream into a
                                   host buffer, note (grad tensor, version counter)
    step() (the caller's thread)   1. every param whose grad has no up-to-date host
                                      copy (edited, clipped, scaled, accumulated,
                                      replaced since: a new tensor or version) is
                                      copied again: redo only that; the others get
                                      their fingerprint compared on the device
                                      (verify_grads), a check queued per bucket
                                   2. queue one job per bucket on the worker
                                   3. wait for the worker, then make the current stream
                                      wait (GPU side) for the host->device copies
    worker thread                  per bucket: wait for its check and copy again the
                                   grads it found changed (p.grad.data edits and
                                   GradScaler.unscale_ leave version counters alone),
                                   wait for its grad copies' events, run the fused
                                   kernel (GIL released) which also writes the
                                   bf16/fp16 params into staging buffers, queue the
                                   staging->param copy on the H2D side stream

The fingerprint check is waited for by the bucket's job, not by step(): the
CPU starts on the first buckets while the device may still run the end of
backward.

When does the CPU step start: by default (step_in_backward=False) at step(),
bucket by bucket. A bucket's grads are only known to be final at step():
another micro-batch may accumulate into them, or the user may clip, unscale,
edit or drop them, or an LR scheduler may change lr, between backward and step.
So the default is exact in every case and hides the transfers, not the CPU step.

step_in_backward=True (opt-in) starts a bucket's kernel during backward, in the
worker, as soon as every param of the bucket that got its grad from a hook in
the previous backward has fired its hook in this one (the buckets and their
order are learned in the first backward, so the first step starts at step()).
Only the engine's own host buffers are written then (master, moments, step,
staging): the params themselves are written at step(), so a param read later in
backward (a detached use, a recomputation) still sees its old value. The early
step uses the group's hyperparameters at that moment and a grad scale of 1.
step() checks that nothing it depends on changed since (each stepped grad is
the tensor and version that was copied, the hyperparameters are equal, the
state was not replaced); a hook firing again for a stepped param (accumulation
over micro-batches), zero_grad() before step(), clipping and GradScaler are
errors too. There is no undo (a backup of master and moments would cost 12
B/param of host memory and the bandwidth to write it), so such an error leaves
the params that were stepped early stepped (their params written, the state
consistent per param) and the others not stepped, and says so.

The same engine runs bf16/fp16 CPU params: the "device copy" is the param and
each transfer is a plain synchronous copy (engine_device.HostDevice), so all of
the logic here is tested without a GPU. Grads are the exception: the kernel
reads the live p.grad (HostDevice.aliases_grads), which needs neither a copy
nor a check; the tests also run with the copy forced, the GPU's path.

State: optimizer.state[p] holds "step" (0-dim fp32 CPU tensor), "exp_avg",
"exp_avg_sq" (+ "max_exp_avg_sq") and "master_param", all fp32 on the CPU and
shaped like the param: the CPU classes' format. The tensors are views into the
engine's host arenas (engine_host_memory); whatever the user puts in the state
(load_state_dict) is copied into the arenas at the next step.

Nothing assumes whole tensors or one process: a param is whatever tensor the
optimizer was given (a DTensor's local shard under FSDP2), and the only
cross-param reduction is the clipping norm, exposed as `grad_sq_sum()` so that
a sharded caller can all-reduce it before `clip_coefficient`.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from .engine_device import device_for, grad_fingerprint, make_device
from .engine_host_memory import HostArenas
from .engine_profile import StepProfile
from .engine_worker import Worker, interrupts_deferred

MASTER_KEY = "master_param"
LOW_PRECISION = (torch.bfloat16, torch.float16)

_tokens = itertools.count(1)


def _kernels():
    """The compiled kernels (offload_adam/_build.py). Imported here, not at module
    level: importing the package must not compile anything."""
    from ._build import load_kernels
    return load_kernels()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process owns (a DTensor's local shard under FSDP2)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s multiplier, computed as it does (fp32)."""
    total = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(float(max_norm), dtype=torch.float32) / (total + 1e-6)
    return float(torch.clamp(coef, max=1.0))


class _Slot:
    """One offloaded param: its host buffers and the state of its grad's copy."""

    def __init__(self, param: torch.Tensor, group_index: int, position: int):
        local = _local(param)
        self.param = param
        self.group_index = group_index
        self.position = position           # registration order, for bucketing
        self.dtype = local.dtype
        self.shape = tuple(local.shape)
        self.numel = local.numel()
        self.low_precision = local.dtype in LOW_PRECISION
        self.amsgrad = False
        self.bucket = 0
        # host buffers (views into the arenas)
        self.master = self.exp_avg = self.exp_avg_sq = self.max_exp_avg_sq = None
        self.host_grad = self.staging = None
        # CPU params stepped only inside step(): the kernel writes the rounded
        # param straight into it (staging *is* the param) in its one pass.
        self.staging_is_param = False
        self.step_t: Optional[torch.Tensor] = None
        # the host copy of the grad: which tensor, at which version
        self.copy_of = None
        self.copy_version = -1
        self.copy_token = 0
        self.d2h = None
        self.fingerprint = None            # grad_fingerprint of the grad copied (verify_grads)
        self.sq_sum = None                 # (copy_token, float)
        self.freed = False                 # free_grads_after_copy dropped p.grad
        self.master_d2h = None             # pending master initialisation copy
        self.hook = None
        # step_in_backward bookkeeping (see the module docstring)
        self.hooked = False                # its hook copied a grad since the last step()
        self.expected = False              # ... and did in the previous iteration
        self.early_token = 0               # copy_token stepped during backward (0: none)
        self.stepped_early = False         # that step ran (set by the worker)

    def has_fresh_copy(self, grad: torch.Tensor) -> bool:
        return (self.copy_of is not None and self.copy_of() is grad
                and self.copy_version == grad._version)


class _Check:
    """Fingerprint comparisons queued on the device for some slots: `result()`
    waits for them and lists which changed; `done` is the device event after
    which a grad may be copied again (the grads' state when it was queued)."""

    def __init__(self, slots, grads, now, result, done):
        self.slots, self.grads, self.now = slots, grads, now
        self.result, self.done = result, done


class _Bucket:
    def __init__(self, index: int, slots: List[_Slot]):
        self.index = index
        self.slots = slots
        self.group_index = slots[0].group_index
        self.low_precision = slots[0].low_precision
        self.h2d: list = []                # the last host->device copies from staging
        self.waiting = 0                   # step_in_backward: expected hooks still to come
        self.early_hyper = None            # the hyperparameters its early step used


def _hyper(group: dict, decoupled: bool) -> tuple:
    """A group's step hyperparameters, as the kernel receives them."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
            float(group["weight_decay"]),
            bool(group.get("decoupled_weight_decay", decoupled)),
            bool(group.get("maximize", False)), bool(group.get("amsgrad", False)))


_HYPER_NAMES = ("lr", "beta1", "beta2", "eps", "weight_decay",
                "decoupled_weight_decay", "maximize", "amsgrad")


class OffloadEngine:
    """Steps the offloaded params of one optimizer. Built and driven by it.

    managed[i] lists the params of param_groups[i] the engine owns (all on one
    device); amsgrad[i] says whether that group keeps max_exp_avg_sq."""

    def __init__(self, managed: Sequence[Sequence[torch.Tensor]],
                 amsgrad: Sequence[bool], *, decoupled: bool, overlap: bool = True,
                 bucket_mb: float = 32.0, free_grads_after_copy: bool = False,
                 num_threads: Optional[int] = None, step_in_backward: bool = False,
                 verify_grads: bool = True, owner=None, available_host_bytes: Optional[int] = None,
                 kernels=_kernels):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if num_threads is not None and int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if free_grads_after_copy and not overlap:
            raise ValueError("free_grads_after_copy=True needs overlap=True "
                             "(grads are freed as they are copied during backward)")
        if step_in_backward and not overlap:
            raise ValueError("step_in_backward=True needs overlap=True (the step "
                             "starts from the grads copied during backward)")
        if step_in_backward and owner is None:
            raise ValueError("step_in_backward=True needs the owning optimizer "
                             "(owner=weakref.ref(optimizer))")
        all_params = [p for ps in managed for p in ps]
        self.device = make_device(device_for([_local(p) for p in all_params]))
        self.decoupled = decoupled
        self.overlap = overlap
        self.step_in_backward = bool(step_in_backward)
        # CPU params: the kernel reads the live p.grad at step() instead of a
        # copy, unless an early step must read the grad during backward.
        self._alias_grads = self.device.aliases_grads and not self.step_in_backward
        # A copy reused after the call that made it is checked against the grad
        # (grad_fingerprint): edits that leave version counters alone are seen.
        self.verify_grads = bool(verify_grads) and not self._alias_grads
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.free_grads_after_copy = free_grads_after_copy
        self._owner = owner                # weakref to the optimizer (its groups, state)
        self._early_error: Optional[str] = None
        self._num_threads = None if num_threads is None else int(num_threads)
        self._kernels = kernels  # the optimizer passes its own loader (tests count calls)
        self._last_threads = self._num_threads or self.device.default_num_threads()
        self.slots: List[_Slot] = []
        self._by_param: Dict[torch.Tensor, _Slot] = {}
        self._arenas: List[HostArenas] = []
        self._available = available_host_bytes
        self._profile = StepProfile()
        self.last_step_profile: Optional[dict] = None
        self._last_profile: Optional[StepProfile] = None
        self._hook_order: List[_Slot] = []
        self._rebucketed = False
        self._want_norms = False
        # CPU params with live grads have nothing to overlap: their step runs on
        # the caller's thread (a kernel run from a second thread slowed the next
        # forward and backward by ~30% on 2 cores in the end-to-end benchmark).
        self._worker = Worker() if overlap and not self._alias_grads else None
        # Ends the worker, removes the hooks and unpins when the optimizer goes
        # (or when this constructor fails), holding nothing that keeps the engine
        # alive: the lists are the engine's own, filled in later.
        self._finalizer = weakref.finalize(
            self, _shutdown, self._worker, self._arenas, self.slots)
        for i, (params, ams) in enumerate(zip(managed, amsgrad)):
            self.add_group(i, params, ams)

    def _threads(self) -> int:
        """Kernel threads: the option, or follow torch.get_num_threads() as the
        caller's thread sees it (it is per thread: read it in step(), not in the
        worker). Remembered for the norm jobs queued from autograd's thread."""
        if self._num_threads is not None:
            return self._num_threads
        self._last_threads = self.device.default_num_threads()
        return self._last_threads

    # ---- construction -------------------------------------------------------

    def add_group(self, group_index: int, params: Sequence[torch.Tensor],
                  amsgrad: bool) -> None:
        if not params:
            return
        if self.slots:
            device_for([_local(self.slots[0].param)] + [_local(p) for p in params])
        arenas = HostArenas(pin=self.device.pins_memory)
        new = []
        for p in params:
            s = _Slot(p, group_index, len(self.slots) + len(new))
            s.amsgrad = amsgrad
            keys = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
            s._offsets = {k: arenas.reserve("state", torch.float32, s.numel) for k in keys}
            if not self._alias_grads:
                s._offsets["host_grad"] = arenas.reserve("transfer", s.dtype, s.numel)
            # A CPU param is its own "device copy": when nothing reads it while the
            # kernel runs (the kernel runs inside step() unless step_in_backward,
            # which must leave params alone until step()), the kernel writes it
            # directly, saving the staging buffer and the copy out of it.
            s.staging_is_param = (self.device.type == "cpu" and s.low_precision
                                  and not self.step_in_backward and _local(p).is_contiguous())
            if s.low_precision and not s.staging_is_param:
                s._offsets["staging"] = arenas.reserve("transfer", s.dtype, s.numel)
            new.append(s)
        arenas.allocate(self._available)
        for s in new:
            for k, off in s._offsets.items():
                dtype = s.dtype if k in ("host_grad", "staging") else torch.float32
                role = "transfer" if k in ("host_grad", "staging") else "state"
                setattr(s, k, arenas.view(role, dtype, off, s.shape))
            del s._offsets
            self._by_param[s.param] = s
            if self.overlap:
                s.hook = s.param.register_post_accumulate_grad_hook(
                    _make_hook(weakref.ref(self), s))
        self._arenas.append(arenas)
        self.slots.extend(new)
        self._rebuild_buckets(sorted(self.slots, key=lambda s: -s.position))

    def _rebuild_buckets(self, order: List[_Slot]) -> None:
        """Fills buckets of at most bucket_bytes (device bytes) per (group, dtype),
        in `order` (the order grads arrive in backward), and runs buckets in the
        order of their first grad."""
        by_key: Dict[tuple, List[List[_Slot]]] = {}
        for s in order:
            chunks = by_key.setdefault((s.group_index, s.dtype), [[]])
            last = chunks[-1]
            size = sum(x.numel for x in last) * last[0].dtype.itemsize if last else 0
            if last and size + s.numel * s.dtype.itemsize > self.bucket_bytes:
                chunks.append([s])
            else:
                last.append(s)
        rank = {id(s): i for i, s in enumerate(order)}
        chunks = [c for cs in by_key.values() for c in cs if c]
        chunks.sort(key=lambda c: rank[id(c[0])])
        self.buckets = [_Bucket(i, c) for i, c in enumerate(chunks)]
        for b in self.buckets:
            for s in b.slots:
                s.bucket = b.index

    def host_bytes(self) -> int:
        """Host memory held: master, moments, grad and staging buffers."""
        return sum(a.nbytes() for a in self._arenas)

    def pinned(self) -> bool:
        return all(a.pinned for a in self._arenas)

    def close(self) -> None:
        self._finalizer()

    # ---- backward: grads stream to the host ---------------------------------

    def _on_grad(self, slot: _Slot) -> None:
        grad = slot.param.grad
        if grad is None:
            return
        if slot.early_token:
            msg = ("a grad arrived again for a param whose step already started "
                   "during backward (gradient accumulation over micro-batches, or "
                   "a param used again after its grad was final)")
            self._early_error = self._early_error or msg
            raise RuntimeError(
                f"offload_adam: {msg}; step_in_backward=True forbids this. The "
                "next step() or zero_grad() raises too and says what was stepped; "
                "use step_in_backward=False to accumulate.")
        if not self._rebucketed and slot.copy_token == 0:
            self._hook_order.append(slot)
        if slot.freed:
            raise RuntimeError(
                "offload_adam: a grad arrived twice before step() with "
                "free_grads_after_copy=True (gradient accumulation?); the first one "
                "was freed, so it cannot be accumulated. Use free_grads_after_copy="
                "False to accumulate over micro-batches.")
        with torch.no_grad():
            self._copy_grad(slot, grad)
        if self._want_norms:
            token = slot.copy_token
            self._worker.submit(lambda: self._sq_sum_job(slot, token))
        if self.step_in_backward:
            self._maybe_start_early(slot)
        if self.free_grads_after_copy:
            slot.param.grad = None
            slot.freed = True

    # ---- step_in_backward: the kernel starts during backward ------------------

    def _maybe_start_early(self, slot: _Slot) -> None:
        """Counts the hook; queues the bucket's kernel once every param of it
        that got a grad from a hook in the previous iteration has one now."""
        slot.hooked = True
        if not self._rebucketed or not slot.expected:
            return
        slot.expected = False              # counted once per iteration
        bucket = self.buckets[slot.bucket]
        bucket.waiting -= 1
        if bucket.waiting:
            return
        owner = self._owner()
        if owner is None:
            return
        group = owner.param_groups[bucket.group_index]
        hyper = _hyper(group, self.decoupled)
        slots = [s for s in bucket.slots if s.hooked]
        with torch.no_grad():
            if hyper[-1]:
                self._add_amsgrad_buffers([s for s in slots if s.max_exp_avg_sq is None])
            for s in slots:
                self._bind_state(s, owner.state[s.param], group)
        for s in slots:
            s.early_token = s.copy_token
        bucket.early_hyper = hyper
        threads = self._num_threads or self._last_threads
        profile = self._profile
        self._worker.submit(lambda: self._early_step(bucket, slots, hyper, threads, profile))

    def _early_step(self, bucket: _Bucket, slots: List[_Slot], hyper: tuple,
                    threads: int, profile: StepProfile) -> None:
        self._kernel_step(bucket, slots, hyper, 1.0, threads, profile)
        for s in slots:
            s.stepped_early = True

    def _early_problem(self, param_groups: List[dict], state,
                       grad_scale: float) -> Optional[str]:
        """What changed since the early steps started (None: nothing did)."""
        if self._early_error is not None:
            return self._early_error
        early = [s for s in self.slots if s.early_token]
        if not early:
            return None
        if grad_scale != 1.0:
            return (f"step() scales the grads by {grad_scale!r} (a clipping "
                    "coefficient or 1/loss scale), but they were stepped unscaled")
        # one wait on the device for all of them
        edited = set(map(id, self._edited_in_place(
            [s for s in early if s.param.grad is not None and s.has_fresh_copy(s.param.grad)])))
        for s in early:
            where = f"a param of shape {list(s.shape)} in param group {s.group_index}"
            grad = s.param.grad
            if grad is None:
                if not s.freed:
                    return f"the grad of {where} was dropped after it was copied"
            elif (not s.has_fresh_copy(grad) or s.copy_token != s.early_token
                  or id(s) in edited):
                return (f"the grad of {where} changed after it was copied during "
                        "backward (edited in place, replaced, clipped or scaled)")
            st = state[s.param]
            if (st.get("exp_avg") is not s.exp_avg or st.get(MASTER_KEY) is not s.master
                    or st.get("step") is not s.step_t):
                return (f"the optimizer state of {where} was replaced "
                        "(load_state_dict?) after its step started")
        for b in self.buckets:
            if b.early_hyper is None:
                continue
            now = _hyper(param_groups[b.group_index], self.decoupled)
            changed = [f"{n} {a!r} -> {c!r}" for n, a, c in
                       zip(_HYPER_NAMES, b.early_hyper, now) if a != c]
            if changed:
                return (f"param group {b.group_index}'s hyperparameters changed after "
                        f"its step started ({', '.join(changed)}; an LR scheduler "
                        "stepped between backward and step()?)")
        return None

    def fail_early(self, reason: str) -> None:
        """Raises the step_in_backward error for `reason`, after writing the
        params whose step already ran (so each param equals its master)."""
        pending = self._early_error is not None or any(s.early_token for s in self.slots)
        stepped = self._commit_early() if pending else 0
        if stepped:
            what = (f"The Adam step of {stepped} params already ran during backward, "
                    "with the grads and hyperparameters as they were then, and cannot "
                    "be undone (no copy of the previous state is kept): those params "
                    "and their state are stepped, the other params are not. Restore a "
                    "checkpoint to continue exactly")
        else:
            what = "Nothing was stepped"
        raise RuntimeError(
            f"offload_adam: {reason}; step_in_backward=True forbids this (the step "
            f"would differ from a plain step). {what}. Use step_in_backward=False "
            "(the default) to clip, scale, edit or accumulate grads or change "
            "hyperparameters between backward and step().")

    def _commit_early(self) -> int:
        """Writes the params of the early steps that ran, forgets them and starts
        a new iteration. Returns how many params were stepped."""
        try:
            self._drain()
        finally:
            stepped = [s for s in self.slots if s.stepped_early]
            self.device.fence()
            for b in self.buckets:
                done = [s for s in b.slots if s.stepped_early]
                if done:
                    self._write_params(b, done, self._profile)
            self.device.publish([t for b in self.buckets for t in b.h2d])
            self._new_iteration()
        return len(stepped)

    def _new_iteration(self) -> None:
        """The params that got grads from hooks this iteration are the ones the
        next iteration's buckets wait for."""
        self._early_error = None
        for b in self.buckets:
            b.early_hyper = None
            b.waiting = 0
            for s in b.slots:
                s.expected = s.hooked and self._rebucketed
                b.waiting += s.expected
                s.hooked = s.stepped_early = False
                s.early_token = 0

    def _copy_grad(self, slot: _Slot, grad: torch.Tensor, fingerprint=None,
                   after=None) -> None:
        """Starts the host copy of `grad` (after the work queued on the current
        stream, or after the device event `after`); `fingerprint` is the grad's
        when the caller has it."""
        if grad.is_sparse:
            raise RuntimeError(f"offload_adam: param of shape {list(slot.shape)} has "
                               "a sparse grad; sparse grads are not supported")
        # The token changes *before* the copy starts, so a norm computed from
        # the buffer while it is being overwritten is recognised as stale.
        slot.copy_token = next(_tokens)
        slot.sq_sum = None
        slot.copy_of = weakref.ref(grad)
        slot.copy_version = grad._version
        local = _local(grad).detach()
        if self._alias_grads:  # nothing to transfer: the kernel reads the grad itself
            slot.host_grad = local if local.is_contiguous() else local.contiguous()
            slot.d2h = None
            return
        if self.verify_grads and fingerprint is None:
            fingerprint = grad_fingerprint(local)
        slot.fingerprint = fingerprint
        slot.d2h = self.device.d2h(slot.host_grad, local, after=after)
        self._profile.add_d2h(slot.bucket, slot.d2h)

    def _start_check(self, slots: List[_Slot]) -> Optional["_Check"]:
        """Queues the comparison of each slot's grad (up to date by version and
        identity) with its fingerprint, on the device, without waiting for it."""
        slots = [s for s in slots if s.fingerprint is not None]
        if not slots:
            return None
        grads = [s.param.grad for s in slots]
        now = [grad_fingerprint(_local(g)) for g in grads]
        changed = torch.stack(now) != torch.stack([s.fingerprint for s in slots])
        result, done = self.device.fetch(changed)
        return _Check(slots, grads, now, result, done)

    def _redo_changed(self, check: Optional["_Check"]) -> None:
        """Waits for `check` and copies again the grads it found changed (after
        the device work that was queued when the check was)."""
        if check is None:
            return
        for s, g, fp, changed in zip(check.slots, check.grads, check.now, check.result()):
            if changed:
                self._copy_grad(s, g, fingerprint=fp, after=check.done)

    def _edited_in_place(self, slots: List[_Slot]) -> List[_Slot]:
        """The slots whose grad no longer matches its fingerprint (waits)."""
        check = self._start_check(slots)
        if check is None:
            return []
        return [s for s, c in zip(check.slots, check.result()) if c]

    @property
    def sees_in_place_edits(self) -> bool:
        """Whether a grad changed without a version bump is noticed."""
        return self._alias_grads or self.verify_grads

    def _sq_sum_job(self, slot: _Slot, token: int) -> None:
        self.device.wait_host(slot.d2h)
        threads = self._num_threads or self._last_threads
        (value,) = self._kernels().grad_sq_sums([slot.host_grad], threads)
        if slot.copy_token == token:
            slot.sq_sum = (token, value)

    def _current_grads(self, checks: Optional[dict] = None) -> List[_Slot]:
        """Slots that take part in this step, each with an up-to-date host copy
        of its grad (redoing the copies that went stale since backward: a new
        tensor, a version bump or, with verify_grads, a changed fingerprint).

        The fingerprint comparisons need the device's result. With `checks` (a
        dict) they are only queued, one per bucket, into checks[bucket index]
        for the bucket's job to wait for (_redo_changed): step() must not wait
        for the rest of backward on the device before the CPU starts."""
        ready, reused = [], []
        for s in self.slots:
            grad = s.param.grad
            if grad is None:
                if s.freed:
                    ready.append(s)
                continue
            s.freed = False  # the user gave it a new grad after we freed one
            if self._alias_grads or not s.has_fresh_copy(grad):
                self._copy_grad(s, grad)
            else:
                reused.append(s)
            ready.append(s)
        if checks is None:  # the caller needs the copies now: one check, waited for
            self._redo_changed(self._start_check(reused))
            return ready
        by_bucket: Dict[int, List[_Slot]] = {}
        for s in reused:
            by_bucket.setdefault(s.bucket, []).append(s)
        for index, slots in by_bucket.items():
            check = self._start_check(slots)
            if check is not None:
                checks[index] = check
        return ready

    # ---- clipping: norms from the host copies --------------------------------

    def grad_sq_sum(self) -> float:
        """Sum of squares of all current grads (inf/NaN propagate), from the host
        copies: no second transfer and no GPU work."""
        self._drain()
        # gather them while streaming from now on (aliased grads: at the call)
        self._want_norms = self.overlap and not self._alias_grads
        slots = self._current_grads()
        missing = [s for s in slots if s.sq_sum is None or s.sq_sum[0] != s.copy_token]
        for s in missing:
            self.device.wait_host(s.d2h)
        threads = self._threads()
        by_dtype: Dict[torch.dtype, List[_Slot]] = {}
        for s in missing:
            by_dtype.setdefault(s.dtype, []).append(s)
        for group in by_dtype.values():
            sums = self._kernels().grad_sq_sums([s.host_grad for s in group], threads)
            for s, v in zip(group, sums):
                s.sq_sum = (s.copy_token, float(v))
        return math.fsum(s.sq_sum[1] for s in slots)

    # ---- step ----------------------------------------------------------------

    def _drain(self, finish: bool = False) -> None:
        if self._worker is not None:
            self._worker.drain(finish)

    def _run(self, job) -> None:
        if self._worker is not None:
            self._worker.submit(job)
        else:
            job()

    def step(self, param_groups: List[dict], state, grad_scale: float = 1.0) -> None:
        """One Adam step of every offloaded param that has a grad.

        grad_scale multiplies every grad inside the kernel (clipping coefficient,
        1/loss scale). Returns once the params read on the current stream are
        the updated ones."""
        t_enter = time.perf_counter()
        profile = self._profile
        try:
            self._drain()
        except BaseException:
            if any(s.early_token for s in self.slots):
                self._commit_early()  # what ran stays consistent
            raise
        problem = self._early_problem(param_groups, state, grad_scale)
        if problem is not None:
            self.fail_early(problem)
        if not self._rebucketed and self._hook_order:
            seen = set(map(id, self._hook_order))
            rest = sorted((s for s in self.slots if id(s) not in seen),
                          key=lambda s: -s.position)
            self._rebuild_buckets(self._hook_order + rest)
            self._rebucketed = True
            self._hook_order = []
        self.device.fence()
        with torch.no_grad():
            checks: Dict[int, _Check] = {}
            ready = self._current_grads(checks)
            early = [s for s in ready if s.stepped_early]
            ready_late = [s for s in ready if not s.stepped_early]
            self._add_amsgrad_buffers(
                [s for s in ready_late if s.max_exp_avg_sq is None
                 and param_groups[s.group_index].get("amsgrad", False)])
            for s in ready_late:
                self._bind_state(s, state[s.param], param_groups[s.group_index])
            take = set(map(id, ready_late))
            done_early = set(map(id, early))
            threads = self._threads()
            try:
                with interrupts_deferred() as deferring:
                    for b in self.buckets:
                        stepped = [s for s in b.slots if id(s) in done_early]
                        if stepped:  # stepped during backward: only the params to write
                            self._write_params(b, stepped, profile)
                        slots = [s for s in b.slots if id(s) in take]
                        if slots:
                            hyper = _hyper(param_groups[b.group_index], self.decoupled)
                            self._run(lambda b=b, slots=slots, hyper=hyper: self._step_bucket(
                                b, slots, hyper, grad_scale, threads, profile,
                                checks.get(b.index)))
                    # all buckets, or fewer after a second ^C (with the default
                    # handler the first one is held until the step is done)
                    self._drain(finish=not deferring)
            finally:
                # Even when a bucket failed or the user interrupted: the copies
                # already queued must be waited for before anyone reads the params.
                self.device.publish([t for b in self.buckets for t in b.h2d])
                if self.step_in_backward:
                    self._new_iteration()
        for s in ready:
            if s.freed:  # consumed: a second step() without backward skips it
                s.freed = False
                s.copy_of = None
            if self._alias_grads:  # do not keep the grad alive past zero_grad()
                s.host_grad = None
        profile.exposed_s = time.perf_counter() - t_enter
        self._last_profile, self._profile = profile, StepProfile()

    def profile(self) -> Optional[dict]:
        return self._last_profile.as_dict() if self._last_profile else None

    def _add_amsgrad_buffers(self, slots: List[_Slot]) -> None:
        """amsgrad turned on after construction (load_state_dict, or by hand)."""
        if not slots:
            return
        arenas = HostArenas(pin=self.device.pins_memory)
        offsets = [arenas.reserve("state", torch.float32, s.numel) for s in slots]
        arenas.allocate(self._available)
        for s, off in zip(slots, offsets):
            s.max_exp_avg_sq = arenas.view("state", torch.float32, off, s.shape)
        self._arenas.append(arenas)

    def _bind_state(self, s: _Slot, st: dict, group: dict) -> None:
        """Makes optimizer.state[p] point at the arena buffers, creating the state
        on a param's first step and copying in whatever load_state_dict put there."""
        fresh = "exp_avg" not in st
        keys = [("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)]
        if s.max_exp_avg_sq is not None:
            keys.append(("max_exp_avg_sq", s.max_exp_avg_sq))
        for key, view in keys:
            value = st.get(key)
            if value is view:
                continue
            if value is None:
                view.zero_()
            else:
                view.copy_(value.detach().reshape(s.shape))
            st[key] = view
        step = st.get("step")
        if step is not s.step_t or step is None:
            count = 0.0 if step is None else float(step)
            s.step_t = torch.tensor(count, dtype=torch.float32)
            st["step"] = s.step_t
        master = st.get(MASTER_KEY)
        if master is not s.master:
            if master is None or fresh:
                # First step (or a torch state dict without master): start from
                # the param. Its bytes go through staging, which must be free.
                for t in self.buckets[s.bucket].h2d:
                    self.device.wait_host(t)
                dst = _staging(s) if s.low_precision else s.master
                s.master_d2h = self.device.d2h(dst, _local(s.param).detach())
            else:
                s.master.copy_(master.detach().reshape(s.shape))
            st[MASTER_KEY] = s.master

    def _step_bucket(self, bucket: _Bucket, slots: List[_Slot], hyper: tuple,
                     grad_scale: float, threads: int, profile: StepProfile,
                     check: Optional["_Check"] = None) -> None:
        self._redo_changed(check)
        self._kernel_step(bucket, slots, hyper, grad_scale, threads, profile)
        self._write_params(bucket, slots, profile)

    def _kernel_step(self, bucket: _Bucket, slots: List[_Slot], hyper: tuple,
                     grad_scale: float, threads: int, profile: StepProfile) -> None:
        """The fused kernel over `slots`: master, moments, step and staging."""
        dev = self.device
        with torch.no_grad():
            for s in slots:
                dev.wait_host(s.d2h)
            for t in bucket.h2d:           # staging is free again
                dev.wait_host(t)
            for s in slots:
                if s.master_d2h is not None:
                    dev.wait_host(s.master_d2h)
                    if s.low_precision:
                        s.master.copy_(_staging(s))
                    s.master_d2h = None
            lr, beta1, beta2, eps, weight_decay, decoupled, maximize, amsgrad = hyper
            t0 = time.perf_counter()
            self._kernels().adam_step(
                [s.master for s in slots], [s.host_grad for s in slots],
                [s.exp_avg for s in slots], [s.exp_avg_sq for s in slots],
                [s.max_exp_avg_sq for s in slots] if amsgrad else [],
                [_staging(s) for s in slots] if bucket.low_precision else [],
                [s.step_t for s in slots], lr, beta1, beta2, eps, weight_decay,
                decoupled, maximize, float(grad_scale), threads)
            profile.add_cpu(bucket.index, t0, time.perf_counter())
            bucket.h2d = []  # waited for above: done

    def _write_params(self, bucket: _Bucket, slots: List[_Slot],
                      profile: StepProfile) -> None:
        """Queues the copies of the stepped values into the params."""
        dev = self.device
        with torch.no_grad():
            for s in slots:
                if s.staging_is_param:
                    continue  # the kernel wrote the param itself
                src = s.staging if s.low_precision else s.master
                t = dev.h2d(_local(s.param).detach(), src)
                bucket.h2d.append(t)
                profile.add_h2d(bucket.index, t)

    def invalidate_copies(self) -> None:
        """The grads changed in a way version counters do not show (GradScaler's
        unscale_): the next step copies every grad again."""
        if any(s.freed for s in self.slots):
            raise RuntimeError(
                "offload_adam: the grads were changed in place (GradScaler.unscale_?) "
                "after free_grads_after_copy=True freed them; with that option let "
                "GradScaler.step unscale (do not call unscale_) and clip with "
                "max_grad_norm=")
        if self.sees_in_place_edits:
            return  # the next step sees the change by itself
        for s in self.slots:
            s.copy_of = None

    def zero_grad(self) -> None:
        """Called by the optimizer's zero_grad: grads freed by us are gone too."""
        if any(s.early_token for s in self.slots) or self._early_error is not None:
            self.fail_early(self._early_error or
                            "zero_grad() was called after steps started during "
                            "backward, before step()")
        if self._worker is not None:
            self._worker.raise_pending()
        for s in self.slots:
            s.freed = False
            if s.copy_of is not None and s.copy_of() is None:
                s.copy_of = None


def _staging(slot) -> torch.Tensor:
    """Where the kernel writes a low-precision param: the staging buffer, or the
    param itself (looked up each time: `p.data = ...` may have replaced it)."""
    if not slot.staging_is_param:
        return slot.staging
    param = _local(slot.param).detach()
    if not param.is_contiguous():
        raise RuntimeError(
            f"offload_adam: a bf16/fp16 CPU param of shape {list(slot.shape)} became "
            "non-contiguous after the optimizer was built (p.data replaced?); "
            "rebuild the optimizer")
    return param


def _make_hook(engine_ref, slot):
    def hook(param):
        engine = engine_ref()
        if engine is not None:
            engine._on_grad(slot)
    return hook


def _shutdown(worker, arenas, slots) -> None:
    for s in slots:
        if s.hook is not None:
            s.hook.remove()
            s.hook = None
    if worker is not None:
        worker.close()
    for a in arenas:
        a.unpin()
