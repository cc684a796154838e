"""The device side of the offload engine, behind one small interface.

The engine moves grads device->host, updated params host->device and, once per
param, the param itself device->host (to start its fp32 master). All it needs
from the device is this (`dsts`/`srcs`: a tensor or equal-length lists):

    d2h(dsts, srcs, after=None) -> Transfer  copy on the D2H side stream, after the
                                              work queued so far on the caller's
                                              current stream (or after event `after`)
    h2d(dsts, srcs, after)      -> Transfer  copy on the H2D side stream, after event
                                              `after` (a fence: backward may still read
                                              the params until then)
    fence()            -> event              "the work queued so far on the current stream"
    wait_host(*transfers)                    block this thread until the copies landed
    publish(transfers)                       make the current stream wait for the copies
                                              (a device-side wait: the host goes on)
    fetch(t)           -> (result, done)     t's values: result() waits and returns
                                              t.tolist(); `done` is a fence after it
    contiguous(t, after=None) -> tensor      a contiguous copy of device tensor t, made
                                              on the D2H side stream (after the caller's
                                              work, or event `after`), so that the D2H
                                              copies queued after it read it in order
    on_thread()        -> context            entered by every thread other than the
                                              user's that issues device work (the
                                              engine's worker): its device, its stream
    pin(t) / unpin(t)                        page-lock host memory in place, and undo it
    fingerprint(grad)  -> 0-dim int64 tensor  grads.grad_fingerprint's number for a grad,
                                              computed in the device's order (queued on
                                              the current stream), not waited for
    materialize(t) / release(t)              give device tensor t's storage its bytes (on
                                              the current stream), and take them back
                                              (param_stream.py: a streamed block's params
                                              between uses hold no device memory)

In a list, small host views that abut (a bucket's packed buffers, layout.py)
go as one copy through a temporary on the device (a gather before D2H, a
scatter after H2D: packed_copy.py), so that norms and biases do not cost a DMA
each; every other pair is a copy of its own. No copy moves a host byte that is
not one of the list's.

The rules the engine follows (checked by offload_adam.testing's AsyncSimDevice on
CPU, and by compute-sanitizer on a GPU):
  * the host touches a host buffer only after `wait_host` on every copy that
    uses it (a D2H destination before reading it; an H2D source before
    rewriting it; any of them before unpinning or freeing it);
  * an H2D copy into a param waits for a fence taken after the last work that
    reads the param (backward);
  * a grad is not changed by later work while its D2H copy may still read it:
    the copies of a backward are published at its end, so whatever the user
    does next (clip, edit, another micro-batch) is ordered after them;
  * device work is issued on a named stream with its ordering explicit: a
    thread that never chose a stream runs on the default stream, not on the
    user's (the worker's only device work goes through `contiguous`, `h2d`, and a
    `d2h` of params after an event taken on the user's stream).

Implementations: `HostDevice` (CPU params: every copy is a plain copy, done on
the spot), `CudaDevice` (the only code that touches streams and events) and,
for tests, offload_adam.testing's AsyncSimDevice, put in for the host with
`host_stand_in()` (offload_adam.testing.simulated).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

import torch

from .grads import grad_fingerprint, host_fingerprint
from .packed_copy import plan_copy, run_plan


class Transfer:
    """One queued copy. `host_start` is the perf_counter() time it was queued;
    `seconds()` is how long it ran, resolved lazily (on CUDA it waits for the
    copy's timing events, which the step itself never does)."""

    def __init__(self, host_start: float, host_end: Optional[float] = None,
                 waiter: Optional[Callable[[], float]] = None, end: Any = None):
        self.host_start = host_start
        self.end = end                 # the device event after the copy (CUDA)
        self._seconds = None if host_end is None else host_end - host_start
        self._waiter = waiter

    def seconds(self) -> float:
        if self._seconds is None:
            self._seconds = self._waiter()
        return self._seconds


def as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def outside_transforms():
    """The engine's and the streamer's own copies (a block's params fetched, grads
    taken) run outside torch.func's transforms: called from a module hook inside
    torch.func.grad or vjp, a fetch's copy into the device buffers was taken for the
    user's function mutating a captured tensor, and refused (found from outside). They
    are bookkeeping, not part of the function being differentiated."""
    return torch._C._DisableFuncTorch()


class HostDevice:
    """bf16/fp16 CPU params in the engine (step_in_backward, free_grads_after_copy):
    the "device copy" is the param, every transfer a plain copy done on the spot."""

    type = "cpu"
    pins_memory = False

    def __init__(self, device: torch.device):
        self.device = device

    def _copy(self, dsts, srcs) -> Transfer:
        t0 = time.perf_counter()
        with outside_transforms():
            for d, s in zip(as_list(dsts), as_list(srcs)):
                d.copy_(s)
        return Transfer(t0, time.perf_counter())

    def d2h(self, dsts, srcs, after=None) -> Transfer:
        return self._copy(dsts, srcs)

    def h2d(self, dsts, srcs, after=None) -> Transfer:
        return self._copy(dsts, srcs)

    fingerprint = staticmethod(host_fingerprint)   # (the kernels: on the spot)

    def fence(self):
        return None

    def wait_host(self, *transfers) -> None:
        pass

    def synchronize(self) -> None:
        """Waits for every copy on the device (before host memory they may use goes:
        unpin_all)."""

    def publish(self, transfers) -> None:
        pass

    def fetch(self, t: torch.Tensor):
        values = t.tolist()
        return (lambda: values), None

    def contiguous(self, t: torch.Tensor, after=None) -> torch.Tensor:
        return t.contiguous()

    def on_thread(self):
        return contextlib.nullcontext()

    def pin(self, t: torch.Tensor) -> bool:
        return False

    def unpin(self, t: torch.Tensor) -> None:
        pass

    def materialize(self, t: torch.Tensor) -> None:
        t.untyped_storage().resize_(storage_bytes(t))

    def release(self, t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)

    def default_num_threads(self) -> int:
        return torch.get_num_threads()


def storage_bytes(t: torch.Tensor) -> int:
    """The storage bytes device tensor `t` (a streamed param's) needs."""
    return (t.storage_offset() + t.numel()) * t.element_size()


def _register(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory in place (exactly its bytes: torch's pinned
    allocator would round a 12 GiB arena up to 16 GiB)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        # The failed call also set CUDA's (non-sticky) last error, which torch's
        # next kernel-launch check would report as its own: clear it.
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")


def _unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # interpreter shutdown: nothing sensible left to do
        pass


class CudaDevice:
    """CUDA params: two side streams (D2H, H2D) and events; never a device sync.

    Threads: d2h() runs on autograd's device thread (hooks) and on the thread
    calling step(); h2d() on the engine's worker. Streams and events work from
    any thread; `torch.cuda.device(...)` selects the right device in each.
    Lifetimes: a device tensor read or written by a side stream is marked with
    record_stream, so the caching allocator does not hand its memory out again
    (zero_grad, free_grads_after_copy, `p.data = ...`) before the copy ran; a
    temporary of a packed copy is allocated on the side stream that uses it.
    """

    type = "cuda"
    pins_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)

    def _current(self):
        return torch.cuda.current_stream(self.device)

    def _timed(self, stream, ready, body) -> Transfer:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record(stream)
            with outside_transforms():
                body()
            end.record(stream)

        def seconds():
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return Transfer(t0, waiter=seconds, end=end)

    def d2h(self, dsts, srcs, after=None) -> Transfer:
        # The grads were produced on the caller's current stream (autograd makes
        # it current in hooks): copy only after that work.
        ready = after if after is not None else self._current().record_event()
        return self._copy(self.d2h_stream, ready, as_list(dsts), as_list(srcs), to_host=True)

    def h2d(self, dsts, srcs, after) -> Transfer:
        return self._copy(self.h2d_stream, after, as_list(dsts), as_list(srcs), to_host=False)

    def _copy(self, stream, ready, dsts, srcs, to_host: bool) -> Transfer:
        """One copy, or a pack of them through temporaries on the device
        (packed_copy.py: a gather then one D2H, or one H2D then a scatter)."""
        host, device_side = (dsts, srcs) if to_host else (srcs, dsts)
        runs = plan_copy(host, device_side)

        def body():
            # Called with `stream` current: each temporary is allocated on the
            # stream that alone uses it, so the caching allocator hands its
            # memory out again (once dropped, right after its copies are
            # queued) only to later work of that stream.
            run_plan(runs, host, device_side, to_host, non_blocking=True,
                     empty=lambda like: torch.empty(like.shape, dtype=like.dtype,
                                                    device=self.device))

        transfer = self._timed(stream, ready, body)
        for t in device_side:
            t.record_stream(stream)
        return transfer

    def contiguous(self, t: torch.Tensor, after=None) -> torch.Tensor:
        ready = after if after is not None else self._current().record_event()
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            out = t.contiguous()   # allocated on the D2H stream, which alone uses it
        t.record_stream(self.d2h_stream)
        return out

    def on_thread(self):
        # The worker's thread would otherwise use device 0 and the default
        # stream; every copy it issues names a side stream itself.
        return torch.cuda.device(self.device)

    fingerprint = staticmethod(grad_fingerprint)   # (torch ops on the current stream)

    def fence(self):
        return self._current().record_event()

    def wait_host(self, *transfers) -> None:
        for t in transfers:
            if t is not None and t.end is not None:
                t.end.synchronize()  # releases the GIL while it waits

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def publish(self, transfers) -> None:
        cur = self._current()
        for t in transfers:
            cur.wait_event(t.end)

    def fetch(self, t: torch.Tensor):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(self.device):
            host.copy_(t, non_blocking=True)  # on the current stream: `t` stays valid
            done = self._current().record_event()

        def result():
            done.synchronize()
            return host.tolist()
        return result, done

    def pin(self, t: torch.Tensor) -> bool:
        _register(t)
        return True

    def unpin(self, t: torch.Tensor) -> None:
        _unregister(t)

    def materialize(self, t: torch.Tensor) -> None:
        # Allocated on the current (compute) stream: an H2D copy into it waits for a
        # fence taken after this, so it cannot overwrite memory whose last compute
        # reader (the caching allocator's previous owner) has not run yet.
        with torch.cuda.device(self.device):
            t.untyped_storage().resize_(storage_bytes(t))

    def release(self, t: torch.Tensor) -> None:
        # Freed in the current stream's order; a side-stream copy into it was recorded
        # on its stream (record_stream in _copy), so the memory is not handed out again
        # before that copy ran either.
        with torch.cuda.device(self.device):
            t.untyped_storage().resize_(0)

    def default_num_threads(self) -> int:
        # Leave one core to the thread that drives the GPU.
        return max(1, torch.get_num_threads() - 1)


# ---- choosing the device ------------------------------------------------------------

_host_stand_ins: list = []  # pushed by host_stand_in(), innermost last


@contextlib.contextmanager
def host_stand_in(device) -> Iterator[Any]:
    """The seam for test support (offload_adam.testing.simulated): optimizers
    built inside this block route every CPU param to the engine and move it
    through `device` (None: the normal choice, even inside an outer block)."""
    _host_stand_ins.append(device)
    try:
        yield device
    finally:
        _host_stand_ins.pop()


def current_host_stand_in():
    """The device of the innermost host_stand_in() block, or None."""
    return _host_stand_ins[-1] if _host_stand_ins else None


def make_device(device: torch.device, stand_in=None):
    """The device interface for params on `device`; for CPU params `stand_in`
    when given (test support's simulated device), else HostDevice."""
    if device.type == "cpu":
        return stand_in if stand_in is not None else HostDevice(device)
    if device.type == "cuda":
        return CudaDevice(device)
    raise ValueError(f"offload_adam: params on {device} are not supported "
                     "(cpu and cuda are)")
