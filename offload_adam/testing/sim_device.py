"""An adversarial asynchronous device for CPU tensors: CUDA's stream rules, checked.

The offload engine talks to its device through the interface of engine/device.py
(d2h, h2d, fence, wait_host, publish, fetch, pin/unpin). On a GPU, a mistake in
how it orders copies (a missing wait, a missing fence, a buffer reused while a
copy still reads it) gives wrong numbers only now and then. This device runs the
same interface on CPU tensors the way CUDA would, and is hostile about timing:

  * two side streams (D2H, H2D), each a FIFO run by its own thread; every copy
    waits for the events it was ordered after, then a random delay (seeded), or
    is held until someone needs it ("latest": as late as CUDA allows);
  * a copy reads its source and writes its destination when it *executes*, not
    when it is queued; the host side of a device->host copy is poisoned (NaN) at
    queue time, so a host read before the copy landed sees NaN;
  * a copy of a list moves the bytes CudaDevice's would: the same plan and the
    same copies (engine/packed_copy.py: straight, or gathered and scattered
    through temporaries, here filled with NaN as uninitialised memory), and its
    host side, poisoned and checked, is every host byte the plan moves;
  * events complete when their stream reaches them; `publish` makes the compute
    stream (the caller's own work) wait for copies without blocking the host.

Compute streams: as on CUDA, each host thread has its own current stream (a
thread that never chooses one runs on the default stream, not on the user's):
the work a thread queues is ordered after its own earlier work, and after
another thread's only through an event, a publish or a host wait (`synchronize()`,
as torch.cuda.synchronize(), waits for every stream). On CPU that
work executes at once, so the device watches it instead: a TorchDispatchMode
(entered by `watch()` on the caller's thread, and by `on_thread()` on every
other thread that issues device work, e.g. the engine's worker) sees each aten
op, which tensors it reads and writes, and checks the happens-before rules that
CUDA leaves to the programmer:

  * a host buffer (one side of a copy) touched by the host while a copy that
    uses it has not been waited for by the host (`wait_host`, or a `fetch`
    result): the host may run ahead of the device (e.g. overwriting the source
    of a host->device copy that has not run yet);
  * a device tensor (a param, a grad) touched by compute work while a copy that
    conflicts with it (one writes) is neither published to the compute stream
    nor waited for by the host; a published copy is waited for here, as the
    compute stream would;
  * a host->device copy queued without an `after` event that covers the last
    compute work on its destination (a missing fence: backward may still read
    the params), a device->host copy ordered before the work that produced its
    source (an event covers the work of its own thread's stream up to it, and
    of another stream only as far as the host waited for that stream);
  * a copy whose host source changed between queueing and executing, or whose
    device source changed although nothing ordered the change after the copy;
  * a host buffer unpinned (freed) while a copy still uses it; it is poisoned
    too, so that copy moves NaN;
  * device memory given back (`release`, a streamed param between uses) while a
    copy into it is neither published nor waited for; memory given out again
    (`materialize`) counts as written by the caller's stream at that moment, so a
    copy into it must be ordered after that (the memory's last reader may not
    have run on a GPU).

It counts what a test of memory and traffic asks (`counters()`): the bytes each
copy direction moved, and device memory given out by `materialize` (now and peak).

Its watch is a TorchDispatchMode, and torch bumps no version counter for in-place foreach
ops (`_foreach_mul_`: clip_grad_norm_'s) under a mode; the watch bumps them itself, as torch
does on a GPU outside any mode, so that a grad clipped after its copy is seen with
verify_grads=False too (under the user's own mode, FlopCounterMode for one, only
verify_grads sees it, on a GPU as here).

Every violation is recorded with a message; `check()` raises them (tests call
it at the end of each test). The engine cannot tell this device from a GPU: it
is selected with `offload_adam.testing.simulated(...)`, which makes the
optimizers built inside it hand every CPU param (fp32 included) to the engine,
as they do CUDA params.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..byte_view import byte_view
from ..distributed import local
from ..engine.device import Transfer, as_list, outside_transforms, storage_bytes
from ..engine.grads import grad_fingerprint
from ..engine.packed_copy import plan_copy, run_plan
from ..params import byte_span

_local = threading.local()  # .inside: the device's own ops (not checked)


@contextlib.contextmanager
def _unchecked():
    before = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = before


def _span(t: torch.Tensor):
    """(storage address, first byte, end byte) of the bytes `t` can touch."""
    base = t.untyped_storage().data_ptr()
    if t.numel() == 0:
        return base, 0, 0
    first, end = byte_span(t)   # (torch's strides are never negative)
    return base, base + first, base + end


def _overlaps(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _by_storage(spans) -> dict:
    """`spans` by their storage: only spans of one storage can overlap, and every aten op
    asks about every pinned buffer and every copy in flight."""
    index: dict = {}
    for s in spans:
        index.setdefault(s[0], []).append(s)
    return index


def _checksum(ts: Sequence[torch.Tensor]) -> List[bytes]:
    with _unchecked():
        return [bytes(byte_view(t.detach().contiguous())) for t in ts]


def _temporary(like: torch.Tensor) -> torch.Tensor:
    """A packed copy's temporary on the device: uninitialised memory, which
    is what lands wherever a copy of it writes bytes its gather did not fill."""
    t = torch.empty(like.shape, dtype=like.dtype)
    _poison(t)
    return t


def _poison(t: torch.Tensor) -> None:
    with _unchecked(), outside_transforms():
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(0x55)


def _compute_stream() -> int:
    """The calling thread's current compute stream: one per thread, as CUDA's
    default stream is not the user's stream when the user chose one."""
    return threading.get_ident()


_WHAT = {"d2h": "device->host", "h2d": "host->device", "d2d": "device (contiguous)"}


@dataclass(eq=False)
class _Copy:
    """One queued copy (or a pack of copies) on a side stream."""

    kind: str                      # "d2h" | "h2d" | "d2d" (a contiguous copy on the device)
    stream: "_Stream"
    seq: int
    dsts: List[torch.Tensor]       # what it writes and what it reads; on the host side:
    srcs: List[torch.Tensor]       # ... the host bytes of each run of its plan (packed_copy.py)
    body: Callable[[], None]       # the copy itself, run when it executes
    after: List["_Copy"]           # copies that must have executed first
    after_stream: int              # the compute stream of the event it waits for ...
    after_epoch: int               # ... and the compute work on it ordered before this copy
    hold: float                    # seconds it waits before running unless forced
    host_side: list = field(default_factory=list)    # spans of its host tensors
    device_side: list = field(default_factory=list)  # spans of its device tensors
    device_writes: list = field(default_factory=list)  # ... of those, the ones it writes
    src_sums: Optional[List[bytes]] = None
    executed: threading.Event = field(default_factory=threading.Event)
    forced: threading.Event = field(default_factory=threading.Event)
    host_synced: bool = False      # the host waited for it (directly or not)
    published_to: set = field(default_factory=set)  # compute streams that wait for it
    transfer: Optional[Transfer] = None
    _indexed: dict = field(default_factory=dict)   # touches()'s index of each side list

    def touches(self, side: list, span) -> bool:
        """Whether a span of `side` (host_side, device_side or device_writes: lists
        replaced, never edited) overlaps `span`. Every aten op asks it of every copy in
        flight, so it looks up `span`'s storage rather than scanning a pack's spans."""
        hit = self._indexed.get(id(side))
        if hit is None or hit[0] is not side:   # (holding side keeps its id unique)
            hit = self._indexed[id(side)] = (side, _by_storage(side))
        return any(_overlaps(span, s) for s in hit[1].get(span[0], ()))

    def name(self) -> str:
        return f"{_WHAT[self.kind]} copy #{self.seq} ({sum(t.numel() for t in self.dsts)} elements)"

    @property
    def writes_host(self) -> bool:
        return self.kind == "d2h"


class SimEvent:
    """A point on one compute stream: the copies published to it and not yet
    waited for by the host (it comes after them) and the compute epoch."""

    def __init__(self, copies: List[_Copy], epoch: int, stream: Optional[int] = None):
        self.copies, self.epoch = copies, epoch
        self.stream = _compute_stream() if stream is None else stream


class _Stream:
    def __init__(self, device: "AsyncSimDevice", name: str):
        self.device, self.name = device, name
        self.pending: List[_Copy] = []        # queued, not executed, in order
        self.cv = threading.Condition(device.lock)
        self.seq = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dev = self.device
        while True:
            with dev.lock:
                while not self.pending and not self.stopped:
                    self.cv.wait()
                if self.stopped and not self.pending:
                    return
                op = self.pending[0]
            for dep in op.after:
                dep.forced.set()
                dep.executed.wait()
            op.forced.wait(op.hold)
            try:
                dev._execute(op)
            except Exception as e:   # noqa: BLE001 -- reported, never a dead stream:
                # (a CUDA copy raises when queued, in its caller's thread; here it runs on
                # this one, whose death left every wait for it hanging: found from outside)
                with dev.lock:
                    dev._violation(f"{op.name()} raised {type(e).__name__}: {e}")
            with dev.lock:
                self.pending.pop(0)
                op.executed.set()
                dev.progress.notify_all()


class AsyncSimDevice:
    """The device interface of engine/device.py on CPU tensors, asynchronous
    and checked (see the module docstring).

    seed: the random delays. latency: "random" (most copies run after up to
    `max_delay` seconds, some are held until needed) or "latest" (every copy is
    held until something waits for it: the most adversarial order)."""

    type = "sim"
    pins_memory = True

    def __init__(self, device: torch.device = torch.device("cpu"), seed: int = 0,
                 latency: str = "random", max_delay: float = 0.002):
        if latency not in ("random", "latest"):
            raise ValueError(f"latency must be 'random' or 'latest', got {latency!r}")
        self.device = device
        self._lock = threading.RLock()
        self._pid = os.getpid()   # (a forked child has none of the streams' threads: lock)
        self.progress = threading.Condition(self._lock)
        self._rng = random.Random(seed)
        self._latency, self._max_delay = latency, max_delay
        self._copies: List[_Copy] = []       # copies that may still conflict with something
        self._epoch = 0                      # compute work so far (one per aten op)
        self._synced_all = -1                # epoch up to which the host waited for every stream
        self._last_access: dict = {}         # device storage -> {stream: (last read, last write epoch)}
        self._prune_at = 4096                # (_forget_ordered: its size when next pruned)
        self._synced: dict = {}              # stream -> epoch up to which the host waited for it
        self._freed: list = []               # spans of unpinned host buffers
        self._freed_tensors: list = []
        self._pinned: list = []              # spans of pinned host buffers
        self._pin_index: Optional[dict] = None   # them by storage (_pinned_in)
        self._moved = {"d2h": 0, "h2d": 0}   # bytes each direction copied
        self._pageable = 0   # ... of which the host side was not pinned (a GPU copies those
        #                      synchronously, through a staging buffer of its own)
        self._held = self._peak = 0          # device bytes materialized, now and at most
        self.violations: List[str] = []
        self._mode = _Watch(self)
        self._streams = {"d2h": _Stream(self, "d2h"), "h2d": _Stream(self, "h2d")}
        self._deferred: list = []   # finalizers that asked to wait while the lock was held

    @property
    def lock(self) -> threading.RLock:
        """The device's lock, which every copy and wait takes. In a child forked from
        the process that made the device, refused: the streams' threads, which run the
        copies, are the parent's (a stream thread may even hold the lock at the fork),
        and waiting on them hung; a CUDA context cannot be used in a forked child either
        (torch raises "Cannot re-initialize CUDA in forked subprocess"). The child's ops
        run unwatched (_Watch)."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"AsyncSimDevice: this simulated device is process {self._pid}'s, and this "
                f"is a child it forked (pid {os.getpid()}), which has none of its streams' "
                "threads: as a CUDA device, it cannot be used in a forked child (start the "
                "child with 'spawn')")
        return self._lock

    def defer_while_locked(self, fn) -> bool:
        """Whether `fn` (a finalizer that waits for the copies: unpin_when_dropped) was
        put off because this thread holds the lock: the garbage collector ran it inside
        an op's check, where waiting for the stream threads, which need the lock,
        would never end (a test hung so); or because this thread is one of the copy
        streams': the garbage collector ran it inside a copy (its checksum's bytes), where
        waiting for that stream waits for the copy running it (a CI run hung so: the h2d
        stream in synchronize, every other thread waiting for that copy; a CUDA copy runs
        no Python). Run once the op's check has let go of it, on a thread of the model's."""
        if os.getpid() != self._pid:
            return True   # (a forked child's garbage: its copies are the parent's)
        if not self.lock._is_owned() and not self._on_stream_thread():
            return False
        self._deferred.append(fn)
        return True

    def _on_stream_thread(self) -> bool:
        me = threading.current_thread()
        return any(stream.thread is me for stream in self._streams.values())

    def _run_deferred(self) -> None:
        while (self._deferred and os.getpid() == self._pid
               and not self.lock._is_owned() and not self._on_stream_thread()):
            try:
                fn = self._deferred.pop(0)
            except IndexError:   # (another thread took the last one)
                return
            fn()

    # ---- the device interface ---------------------------------------------------

    def pin(self, t: torch.Tensor) -> bool:
        with self.lock:
            self._pinned.append(_span(t))
            self._pin_index = None
        return True

    def unpin(self, t: torch.Tensor) -> None:
        span = _span(t)
        with self.lock:
            in_use = [op for op in self._in_flight()
                      if any(_overlaps(span, s) for s in op.host_side)
                      and not (op.executed.is_set() and op.host_synced)]
            for op in in_use:
                self._violation(f"a host buffer was unpinned/freed while {op.name()} "
                                "still used it (wait for the copies first)")
            self._pinned = [s for s in self._pinned if not _overlaps(s, span)]
            self._pin_index = None
            # Kept alive: its address must not be reused while it counts as freed.
            self._freed.append(span)
            self._freed_tensors.append(t)
        if in_use:
            # What a copy still in flight would find. Otherwise the values stay:
            # unpinning frees nothing while tensors (a state_dict's views) hold
            # the memory, on a GPU as here.
            _poison(t)

    def materialize(self, t: torch.Tensor) -> None:
        """Gives device tensor t's storage its bytes: new memory, uninitialised (NaN),
        written by the caller's stream now (a copy into it waits for a fence after)."""
        nbytes = storage_bytes(t)
        with _unchecked():
            t.untyped_storage().resize_(nbytes)
        _poison(t)
        with self.lock:
            self._epoch += 1
            self._last_access[_span(t)[0]] = {_compute_stream(): (-1, self._epoch)}
            self._held += nbytes
            self._peak = max(self._peak, self._held)

    def release(self, t: torch.Tensor) -> None:
        """Takes t's bytes back (a resize to 0, as CudaDevice does). A copy into it
        that nothing ordered before the release is a violation; it runs first here
        (on a GPU it would write memory handed out again)."""
        span = _span(t)
        stream = _compute_stream()
        with self.lock:
            pending = [op for op in self._in_flight()
                       if any(_overlaps(span, s) for s in op.device_side)]
            for op in pending:
                if not (op.host_synced or stream in op.published_to):
                    self._violation(f"device memory was released while {op.name()} still "
                                    "used it (neither published to the releasing stream "
                                    "nor waited for)")
        for op in pending:
            self._force(op)
            op.executed.wait()
        with self.lock:
            # They ran: what they did to this memory is over. A later allocation at this
            # address (on any thread: host and "device" share one address space here) is
            # unrelated to them (their host sides stay checked).
            for op in pending:
                op.device_side = [s for s in op.device_side if not _overlaps(span, s)]
                op.device_writes = [s for s in op.device_writes if not _overlaps(span, s)]
            self._last_access.pop(span[0], None)
            self._held -= t.untyped_storage().nbytes()
        with _unchecked():
            t.untyped_storage().resize_(0)

    def _pinned_in(self, span) -> list:
        """The pinned spans of `span`'s storage."""
        if self._pin_index is None:
            self._pin_index = _by_storage(self._pinned)
        return self._pin_index.get(span[0], ())

    def _is_pinned(self, span) -> bool:
        return span[1] == span[2] or any(p[1] <= span[1] and span[2] <= p[2]
                                         for p in self._pinned_in(span))

    def counters(self) -> dict:
        """Bytes copied host->device and device->host so far (`pageable_bytes`: those
        whose host memory was not pinned), and the device bytes materialized now and
        at most (`reset_peak` starts a new peak)."""
        with self.lock:
            return {"h2d_bytes": self._moved["h2d"], "d2h_bytes": self._moved["d2h"],
                    "pageable_bytes": self._pageable,
                    "materialized_bytes": self._held, "peak_materialized_bytes": self._peak}

    def reset_peak(self) -> None:
        with self.lock:
            self._peak = self._held

    def fence(self) -> SimEvent:
        return self._now()

    def _now(self) -> SimEvent:
        """An event on the calling thread's compute stream: after the work so
        far, which includes waiting for the copies published to it."""
        stream = _compute_stream()
        with self.lock:
            return SimEvent([op for op in self._in_flight() if stream in op.published_to],
                            self._epoch, stream)

    def d2h(self, dsts, srcs, after: Optional[SimEvent] = None) -> Transfer:
        return self._transfer("d2h", dsts, srcs, after if after is not None else self._now())

    def h2d(self, dsts, srcs, after: Optional[SimEvent] = None) -> Transfer:
        # after=None: ordered after nothing, as CudaDevice.h2d's copy (no event to wait
        # for). It waited for the last fence anyone took, which hid a call site that
        # dropped its fence (mutation audit: the step's write-back, the streamer's fetch)
        return self._transfer("h2d", dsts, srcs, after if after is not None else SimEvent([], -1))

    def contiguous(self, t: torch.Tensor, after: Optional[SimEvent] = None) -> torch.Tensor:
        """A contiguous copy of device tensor `t`, made on the D2H stream (after
        `after`, or the caller's work so far); undefined (NaN) until it runs."""
        with _unchecked():
            out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        with self.lock:
            self._last_access.pop(_span(out)[0], None)  # new memory: no past
        self._queue("d2d", [out], [t], after if after is not None else self._now(),
                    lambda: out.data.copy_(t))
        return out

    def on_thread(self):
        """Watches the calling thread's aten ops as the work of its own compute
        stream (the engine's worker enters this around each job)."""
        return _Watch(self)

    def wait_host(self, *transfers) -> None:
        for t in transfers:
            if t is None:
                continue
            op = getattr(t, "sim_copy", None)
            if op is None:
                continue
            self._force(op)
            op.executed.wait()
            with self.lock:
                self._host_waited(op)

    def synchronize(self) -> None:
        """The host waits for every copy and for every thread's compute work so far
        (torch.cuda.synchronize waits for every stream of the device): what any thread
        queues afterwards is ordered after all of it. A model built on one thread and
        trained on another is such a case: on CUDA, with the threads on streams of their
        own, its params' initialization is ordered before the training only so (or by
        an event the training stream waits for)."""
        self._run_deferred()
        with self.lock:
            ops = list(self._in_flight())
            upto = self._epoch
        for op in ops:
            self.wait_host(op.transfer)
        with self.lock:
            self._synced_all = max(self._synced_all, upto)

    def publish(self, transfers) -> None:
        stream = _compute_stream()
        with self.lock:
            for t in transfers:
                op = getattr(t, "sim_copy", None)
                if op is not None:
                    for x in self._before(op):
                        x.published_to.add(stream)

    # The device's own: torch ops, watched as compute work, as CUDA runs them.
    fingerprint = staticmethod(grad_fingerprint)

    def fetch(self, t: torch.Tensor):
        values = t.tolist()
        done = self._now()

        def result():
            for op in done.copies:
                self._force(op)
                op.executed.wait()
            with self.lock:
                for op in done.copies:
                    self._host_waited(op)
                self._sync(done.stream, done.epoch)
            return values
        return result, done

    def default_num_threads(self) -> int:
        return torch.get_num_threads()

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether every byte `t` can touch lies in a pinned span."""
        with self.lock:
            return self._is_pinned(_span(t))

    def pinned(self) -> list:
        """The spans (storage, first byte, end byte) pinned now: a test checks
        that an optimizer unpins what it pinned (unpin() checks that no copy
        still uses it)."""
        with self.lock:
            return list(self._pinned)

    # ---- checking -------------------------------------------------------------------

    def watch(self):
        """A context in which the calling thread's aten ops are checked (the
        compute stream and the host, as seen from this thread)."""
        return self._mode

    def check(self) -> None:
        """Raises AssertionError listing every violation seen so far."""
        self.settle()
        with self.lock:
            found, self.violations = self.violations, []
        if found:
            raise AssertionError("CUDA stream-ordering violations on the simulated device:\n  "
                                 + "\n  ".join(dict.fromkeys(found)))

    def settle(self) -> None:
        """Lets every queued copy run (the end of a test)."""
        with self.lock:
            ops = [op for s in self._streams.values() for op in s.pending]
        for op in ops:
            op.forced.set()
            op.executed.wait()

    def close(self) -> None:
        self._run_deferred()
        self.settle()
        with self.lock:
            for s in self._streams.values():
                s.stopped = True
                s.cv.notify_all()

    # ---- internals -------------------------------------------------------------------

    def _violation(self, msg: str) -> None:
        self.violations.append(msg)

    def _in_flight(self) -> List[_Copy]:
        # A copy the host waited for can conflict with nothing any more: forget
        # it. One that only ran (or that the compute stream waited for) stays:
        # as far as the host knows, it may not have run yet.
        self._copies = [op for op in self._copies
                        if not (op.executed.is_set() and op.host_synced)]
        return self._copies

    def _transfer(self, kind, dsts, srcs, after: SimEvent) -> Transfer:
        """A d2h or h2d copy as CudaDevice makes it (packed_copy.py's plan and
        copies: straight, or gathered/scattered through temporaries), queued to
        run late. The copy writes or reads the whole host side of each run of
        the plan, so that is what it poisons, checksums and conflicts on."""
        dsts, srcs = as_list(dsts), as_list(srcs)
        to_host = kind == "d2h"
        # .data: a device write leaves autograd's version counters alone (the
        # engine bumps them itself at step(), as torch's step does).
        host, device = [[t.data for t in ts] for ts in ((dsts, srcs) if to_host else (srcs, dsts))]
        runs = plan_copy(host, device)
        spans = [run.host for run in runs]

        def body():
            run_plan(runs, host, device, to_host, empty=_temporary, non_blocking=False)
        writes, reads = (spans, device) if to_host else (device, spans)
        with self.lock:
            self._moved[kind] += sum(t.numel() * t.element_size() for t in device)
            self._pageable += sum(t.numel() * t.element_size() for t in host
                                  if not self._is_pinned(_span(t)))
        return self._queue(kind, writes, reads, after, body).transfer

    def _queue(self, kind, dsts, srcs, after: SimEvent, body) -> _Copy:
        host, dev = {"d2h": (dsts, srcs), "h2d": (srcs, dsts), "d2d": ([], dsts + srcs)}[kind]
        stream = self._streams["h2d" if kind == "h2d" else "d2h"]
        with self.lock:
            stream.seq += 1
            hold = (1.0 if self._latency == "latest" or self._rng.random() < 0.2
                    else self._rng.random() * self._max_delay)
            op = _Copy(kind, stream, stream.seq, dsts, srcs, body, list(after.copies), after.stream,
                       after.epoch, hold, [_span(t) for t in host], [_span(t) for t in dev],
                       [_span(t) for t in dsts] if kind != "d2h" else [])
            for span in op.device_side:
                for s, (read, write) in self._last_access.get(span[0], {}).items():
                    needed = write if kind == "d2h" or span not in op.device_writes else max(read, write)
                    if not self._ordered(s, needed, after):
                        what = ("the compute work that last used its destination (a "
                                "missing fence: backward may still read the param)"
                                if kind == "h2d" else "the compute work that produced its source")
                        self._violation(f"{op.name()} is not ordered after {what}")
            for span in op.host_side:
                if any(_overlaps(span, f) for f in self._freed):
                    self._violation(f"{op.name()} uses a host buffer that was unpinned/freed")
                if kind == "h2d":
                    # A new copy from a host buffer means the host wrote new data
                    # into it (the kernel, which this device cannot watch): the
                    # earlier copies from it must have been waited for first.
                    for old in self._in_flight():
                        if (old.kind == "h2d" and not old.host_synced
                                and any(_overlaps(span, h) for h in old.host_side)):
                            self._violation(
                                f"{op.name()} sends a host buffer again while {old.name()} "
                                "from it was never waited for by the host (the host "
                                "rewrote its source without waiting)")
            op.src_sums = _checksum(srcs)
            if kind == "d2h":
                for d in dsts:  # undefined until the copy lands (poisoned before it can)
                    _poison(d)
            op.transfer = Transfer(time.perf_counter(), waiter=lambda op=op: self._timed(op))
            op.transfer.sim_copy = op
            self._copies.append(op)
            stream.pending.append(op)
            stream.cv.notify_all()
        return op

    def _timed(self, op: _Copy) -> float:
        self._force(op)
        op.executed.wait()
        return op.ran_for

    def _execute(self, op: _Copy) -> None:
        t0 = time.perf_counter()
        with _unchecked():
            if _checksum(op.srcs) != op.src_sums:
                side = "host source" if op.kind == "h2d" else "device source"
                self._violation(f"the {side} of {op.name()} changed between queueing and "
                                "executing it (written while the copy was in flight)")
            for span in op.host_side:
                if any(_overlaps(span, f) for f in self._freed):
                    self._violation(f"{op.name()} ran on a host buffer that was freed")
            op.body()
            if op.kind == "d2d":
                # Later copies of this stream read what it wrote: their sources
                # are defined from now on (poisoned before).
                with self.lock:
                    for later in op.stream.pending:
                        if later.seq > op.seq and any(
                                _overlaps(d, w) for d in later.device_side for w in op.device_writes):
                            later.src_sums = _checksum(later.srcs)
        op.ran_for = time.perf_counter() - t0

    def _force(self, op: _Copy) -> None:
        """Runs `op` as soon as possible (and what must run before it)."""
        with self.lock:
            for x in self._before(op):
                x.forced.set()

    def _host_waited(self, op: _Copy) -> None:
        """The host waited for `op`: so for what ran before it, and for the
        compute work its stream waited for. Holds the lock."""
        for x in self._before(op):
            x.host_synced = True
            self._sync(x.after_stream, x.after_epoch)
            # (executed, as all before it: what it waited for is never asked again, and
            # kept, each copy held the ones before it, a chain as long as the run)
            x.after = []

    def _sync(self, stream: int, epoch: int) -> None:
        self._synced[stream] = max(self._synced.get(stream, -1), epoch)

    def _forget_ordered(self) -> None:
        """Drops the accesses the host has waited past (ordered before any copy to come:
        _ordered), and the storages left with none. The compute work's temporaries are
        freed by torch, unseen here, so their entries piled up (~65 a step of a small
        model, without end: found from outside); pruned when the table doubled."""
        for storage, by_stream in list(self._last_access.items()):
            for s, (read, write) in list(by_stream.items()):
                if max(self._synced.get(s, -1), self._synced_all) >= max(read, write):
                    del by_stream[s]
            if not by_stream:
                del self._last_access[storage]
        self._prune_at = max(4096, 2 * len(self._last_access))

    def _ordered(self, stream: int, epoch: int, after: SimEvent) -> bool:
        """Whether compute work at `epoch` on `stream` is ordered before `after`."""
        return ((stream == after.stream and epoch <= after.epoch)
                or max(self._synced.get(stream, -1), self._synced_all) >= epoch)

    def _before(self, op: _Copy) -> List[_Copy]:
        """`op`, the earlier copies of its stream (FIFO) and what it waited for,
        transitively."""
        fifo: Dict[int, List[_Copy]] = {}   # each stream's copies, by seq
        for y in self._copies:
            fifo.setdefault(id(y.stream), []).append(y)
        for line in fifo.values():
            line.sort(key=lambda y: y.seq)
        queued: Dict[int, int] = {}   # how many of a stream's first copies are in todo
        todo, seen = [op], {}
        while todo:
            x = todo.pop()
            if id(x) in seen:
                continue
            seen[id(x)] = x
            # A copy executed and waited for by the host is done with, and so is all
            # before it (it ran after them, and the host wait marked them): nothing to
            # force, mark or publish there, and no need to walk its long `after` lists.
            todo.extend(y for y in x.after if id(y) not in seen and not (
                y.host_synced and y.executed.is_set()))
            # the copies of x's stream before it: a prefix of its line, each queued once
            # (was a scan of every copy per x: quadratic, most of a long test's time)
            line, k = fifo.get(id(x.stream), ()), queued.get(id(x.stream), 0)
            n = k
            while n < len(line) and line[n].seq < x.seq:
                n += 1
            if n > k:
                todo.extend(line[k:n])
                queued[id(x.stream)] = n
        return list(seen.values())

    def _on_output(self, spans) -> None:
        """Fresh tensors an op of the calling thread's stream wrote."""
        stream = _compute_stream()
        with self.lock:
            for span in spans:   # new memory: what touched its address before is gone
                self._last_access[span[0]] = {stream: (-1, self._epoch)}

    def _on_op(self, func, reads, writes) -> None:
        """One aten op on a watched thread: check it against the copies in flight."""
        waits = []
        stream = _compute_stream()
        with self.lock:
            self._epoch += 1
            accesses = [(s, False) for s in reads] + [(s, True) for s in writes]
            flight = None   # (nothing lands while this holds the lock: one list for all)
            for span, is_write in accesses:
                host = any(_overlaps(span, p) for p in self._pinned_in(span)) or any(
                    op.touches(op.host_side, span) for op in self._copies)
                if flight is None:
                    flight = self._in_flight()
                for op in flight:
                    if not op.touches(op.host_side if host else op.device_side, span):
                        continue
                    op_writes = op.writes_host if host else op.touches(op.device_writes, span)
                    if not (is_write or op_writes):
                        continue  # two reads never conflict
                    if host:
                        if not (op.host_synced and op.executed.is_set()):
                            self._violation(
                                f"the host {'wrote' if is_write else 'read'} a buffer that "
                                f"{op.name()} {'writes' if op_writes else 'reads'} before "
                                f"waiting for that copy ({func})")
                    elif stream in op.published_to or op.host_synced:
                        waits.append(op)
                    else:
                        self._violation(
                            f"compute work ({func}) {'wrote' if is_write else 'read'} a device "
                            f"tensor that {op.name()} {'writes' if op_writes else 'reads'}, "
                            "with nothing ordering the two (no publish/wait)")
                if not host:
                    if len(self._last_access) > self._prune_at:
                        self._forget_ordered()
                    by_stream = self._last_access.setdefault(span[0], {})
                    read, write = by_stream.get(stream, (-1, -1))
                    by_stream[stream] = (read, self._epoch) if is_write else (self._epoch, write)
        for op in waits:  # the compute stream waits for published copies
            self._force(op)
            op.executed.wait()
        self._run_deferred()


# Ops that look at tensors' metadata only (a GPU runs them on the host, touching no
# device memory): `p.data = t` asks _has_compatible_shallow_copy_type of the two
# (dispatched in inference_mode), on a device tensor whose copy may be in flight.
_NO_DATA = frozenset({torch.ops.aten._has_compatible_shallow_copy_type.default,
                      torch.ops.aten.is_same_size.default})


class _Watch(TorchDispatchMode):
    def __init__(self, device: AsyncSimDevice):
        super().__init__()
        self.sim = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if os.getpid() != self.sim._pid:
            # A forked child (a DataLoader's worker): its ops run unwatched, as a CUDA
            # process's child runs CPU ops; the device's own calls are refused (`lock`)
            return func(*args, **kwargs)
        if not getattr(_local, "inside", False) and func not in _NO_DATA:
            reads, writes = [], []
            schema = func._schema.arguments
            for i, arg in enumerate(schema):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                # A DTensor's op touches its local tensor (the op on the local
                # tensor that it dispatches to runs unwatched, inside this one).
                tensors = [local(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
                if not tensors:
                    continue
                alias = arg.alias_info
                if alias is not None and not alias.is_write:
                    continue  # a view: no data touched
                spans = [_span(t) for t in tensors if _holds_data(t)]
                (writes if alias is not None and alias.is_write else reads).extend(spans)
            if reads or writes:
                with _unchecked():
                    self.sim._on_op(func, reads, writes)
        bumped = _foreach_written(func, args)
        before = [t._version for t in bumped]
        out = func(*args, **kwargs)
        for t, v in zip(bumped, before):
            # torch bumps no version counter for an in-place foreach op under a mode
            # (a GPU run outside one sees clip_grad_norm_'s _foreach_mul_ move it):
            # bumped here, where torch left it, so that the watch hides no edit
            if t._version == v:
                increment_version(t)
        if not getattr(_local, "inside", False):
            # A fresh result (clone, contiguous, an op's output) is written by
            # this stream now: a copy that reads it must be ordered after it.
            fresh = [_span(t) for ret, value in zip(func._schema.returns, _as_tuple(out))
                     if ret.alias_info is None
                     for t in map(local, tree_flatten(value)[0])
                     if isinstance(t, torch.Tensor) and _holds_data(t)]
            if fresh:
                self.sim._on_output(fresh)
        return out


def _foreach_written(func, args) -> list:
    """The tensors an in-place foreach op writes (its first argument, a list)."""
    schema = func._schema
    if not (schema.name.startswith("aten::_foreach_") and schema.name.endswith("_")):
        return []
    alias = schema.arguments[0].alias_info
    if alias is None or not alias.is_write or not args:
        return []
    return [t for t in args[0] if isinstance(t, torch.Tensor) and not t.is_inference()]


def _holds_data(t: torch.Tensor) -> bool:
    """A CPU tensor with memory of its own to watch: not a wrapper subclass (a
    FreedGrad, a collective's result; a DTensor is watched through its local
    tensor), nor an empty one (no bytes; every empty storage is at address 0, where
    one would be taken for all the others)."""
    return (t.device.type == "cpu" and t.layout is torch.strided and t.numel() > 0
            and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)
