"""The device side of the offload engine, behind one small interface.

The engine moves three things per step: grads device->host, the fp32 master
param device->host once (when a param's state is created), and the updated
low-precision param host->device. Everything it needs from the device is here:

    d2h(dst_host, src_dev)  -> Transfer   copy on the D2H side stream, after the work
                                           already queued on the caller's current stream
    h2d(dst_dev, src_host)  -> Transfer   copy on the H2D side stream, after `fence()`
    fence()                               remember "all work queued so far on the current
                                           stream"; the next h2d copies wait for it
    wait_host(transfer)                   block this thread until the copy has landed
    publish(transfers)                    make the current stream wait for the copies
                                           (a GPU-side wait: the host does not block)

`HostDevice` runs the same pipeline for bf16/fp16 *CPU* params: the "device copy"
is the param itself and every transfer is a plain synchronous copy, so the
hooks, buckets, ordering, redo and resume logic are exercised without a GPU.
`CudaDevice` is the only place that touches streams and events.
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


class HostDevice:
    """CPU params: transfers are plain copies done on the spot."""

    type = "cpu"
    pins_memory = False

    def __init__(self, device: torch.device):
        self.device = device

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        t0 = time.perf_counter()
        dst.copy_(src)
        return Transfer(t0, time.perf_counter())

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

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        # The grad was produced on the caller's current stream (autograd sets it
        # in hooks): copy only after that work.
        ready = torch.cuda.current_stream(self.device).record_event()
        transfer = self._timed_copy(self.d2h_stream, dst, src, ready)
        # The caching allocator must not hand `src` to someone else (e.g. after
        # zero_grad or free_grads_after_copy) before the side stream read it.
        src.record_stream(self.d2h_stream)
        return transfer

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
