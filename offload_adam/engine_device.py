"""The device side of the offload engine, behind one small interface.

The engine moves three things per step: grads device->host, the fp32 master
param device->host once (when a param's state is created), and the updated
low-precision param host->device. Everything it needs from the device is here:

    d2h(dst_host, src_dev, after=None)
                            -> Transfer   copy on the D2H side stream, after the work
                                           already queued on the caller's current stream
                                           (or after the event `after`)
    h2d(dst_dev, src_host)  -> Transfer   copy on the H2D side stream, after `fence()`
    fence()                               remember "all work queued so far on the current
                                           stream"; the next h2d copies wait for it
    wait_host(transfer)                   block this thread until the copy has landed
    publish(transfers)                    make the current stream wait for the copies
                                           (a GPU-side wait: the host does not block)
    fetch(t) -> (result, done)            queue t's copy to the host: result() waits for
                                           it and returns t.tolist(); `done` is an event
                                           after the work queued so far (for `after`)

`HostDevice` runs the same pipeline for bf16/fp16 *CPU* params: the "device copy"
is the param itself and every transfer is a plain synchronous copy, so the
hooks, buckets, ordering, redo and resume logic are exercised without a GPU.
`CudaDevice` is the only place that touches streams and events.

A grad copied before step() may be changed in place later in a way its version
counter does not show (`p.grad.data.mul_()`, GradScaler.unscale_).
`grad_fingerprint` is the cheap check for that: taken when a grad is copied and
again when the copy is reused, on the device that holds the grad.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Transfer:
    """One queued copy. `host_start` is the perf_counter() time it was queued.

    On CPU the copy is already done and `host_end` is set. On CUDA `start`/`end`
    are timing events around the copy; `seconds()` reads their elapsed time
    (which waits for the copy), so profiles are resolved lazily."""

    host_start: float
    host_end: Optional[float] = None
    start: Any = None
    end: Any = None
    _seconds: Optional[float] = field(default=None, repr=False)

    def seconds(self) -> float:
        if self._seconds is None:
            if self.host_end is not None:
                self._seconds = self.host_end - self.host_start
            else:
                self.end.synchronize()
                self._seconds = self.start.elapsed_time(self.end) / 1e3
        return self._seconds


# Elements per reduction in grad_fingerprint: bounds its int64 temporaries on
# the device (two of 8 MiB).
_FINGERPRINT_CHUNK = 1 << 20
_fingerprint_weights: dict = {}


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """Fixed pseudo-random odd int64 weights, one per position in a chunk."""
    key = (device, _FINGERPRINT_CHUNK)
    w = _fingerprint_weights.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x0FF10AD)
        w = torch.randint(-2**62, 2**62, (_FINGERPRINT_CHUNK,), generator=gen,
                          dtype=torch.int64).bitwise_or_(1).to(device)
        _fingerprint_weights[key] = w
    return w[:n]


def grad_fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """An int64 (a 0-dim tensor on the grad's device, computed without waiting
    for it) that changes when the grad's values change: the sum, modulo 2^64, of
    each element's bit pattern times an odd weight fixed for its position (per
    chunk). One changed element always moves it (an odd weight is invertible
    modulo 2^64); several changes cancel out only by a 2^-64 chance, whatever
    they are (sign flips, swaps, scaling). Device memory traffic per element:
    the grad read once plus two int64 temporaries written and read (~35 B for
    a bf16 grad): about 12 ms per billion elements at an H100's 3 TB/s, an
    estimate (not measured: no GPU here). A fused CUDA kernel would need 2 B."""
    g = grad.detach().reshape(-1)  # a grad is contiguous: no copy
    bits = g.view(torch.int16 if g.element_size() == 2 else torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=g.device)
    for i in range(0, g.numel(), _FINGERPRINT_CHUNK):
        part = bits[i:i + _FINGERPRINT_CHUNK]
        total += (part.to(torch.int64) * _weights(g.device, part.numel())).sum()
    return total


class HostDevice:
    """CPU params: transfers are plain copies done on the spot.

    The grads need no transfer at all: with aliases_grads the engine hands the
    kernel the live p.grad at step() (no copy, and in-place edits are seen by
    construction). Tests turn it off to run the copy-and-verify path a GPU takes."""

    type = "cpu"
    pins_memory = False
    aliases_grads = True

    def __init__(self, device: torch.device):
        self.device = device

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Transfer:
        t0 = time.perf_counter()
        dst.copy_(src)
        return Transfer(t0, time.perf_counter())

    def fetch(self, t: torch.Tensor):
        values = t.tolist()
        return (lambda: values), None

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        t0 = time.perf_counter()
        dst.copy_(src)
        return Transfer(t0, time.perf_counter())

    def fence(self) -> None:
        pass

    def wait_host(self, transfer: Optional[Transfer]) -> None:
        pass

    def publish(self, transfers) -> None:
        pass

    def default_num_threads(self) -> int:
        return torch.get_num_threads()


class CudaDevice:
    """CUDA params: two side streams (D2H, H2D) and events; never a device sync.

    Thread safety: d2h() is called from autograd's device thread (hooks) and
    from the thread calling step(); h2d() from the engine's worker thread. CUDA
    streams and events may be used from any thread; `torch.cuda.device(...)`
    pins the right device in each.
    """

    type = "cuda"
    pins_memory = True
    aliases_grads = False

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
        self._fence = None

    def _timed_copy(self, stream, dst, src, wait_for) -> Transfer:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if wait_for is not None:
                stream.wait_event(wait_for)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        return Transfer(t0, start=start, end=end)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Transfer:
        # The grad was produced on the caller's current stream (autograd sets it
        # in hooks): copy only after that work. A copy started from the worker
        # thread (whose current stream is not the user's) passes the event.
        ready = after if after is not None else torch.cuda.current_stream(self.device).record_event()
        transfer = self._timed_copy(self.d2h_stream, dst, src, ready)
        # The caching allocator must not hand `src` to someone else (e.g. after
        # zero_grad or free_grads_after_copy) before the side stream read it.
        src.record_stream(self.d2h_stream)
        return transfer

    def fetch(self, t: torch.Tensor):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(self.device):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.current_stream(self.device).record_event()

        def result():
            done.synchronize()
            return host.tolist()
        return result, done

    def fence(self) -> None:
        # Backward kernels still queued may read the params: H2D writes wait for
        # everything queued on the current stream up to now.
        self._fence = torch.cuda.current_stream(self.device).record_event()

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        return self._timed_copy(self.h2d_stream, dst, src, self._fence)

    def wait_host(self, transfer: Optional[Transfer]) -> None:
        if transfer is not None and transfer.end is not None:
            transfer.end.synchronize()  # releases the GIL while it waits

    def publish(self, transfers) -> None:
        cur = torch.cuda.current_stream(self.device)
        for t in transfers:
            cur.wait_event(t.end)

    def default_num_threads(self) -> int:
        # Leave one core to the thread that drives the GPU.
        return max(1, torch.get_num_threads() - 1)


def device_for(params) -> torch.device:
    """The one device all `params` live on; a clear error for a mix."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            "offload_adam: the offloaded params live on several devices "
            f"({names}); one optimizer handles params of one device (use one "
            "optimizer per device)")
    (device,) = devices
    return device


def make_device(device: torch.device):
    if device.type == "cpu":
        return HostDevice(device)
    if device.type == "cuda":
        return CudaDevice(device)
    raise ValueError(f"offload_adam: params on {device} are not supported "
                     "(cpu and cuda are)")
