"""Host buffers of the offload engine: one arena per dtype, checked, then pinned.

Why arenas: torch's pinned allocator rounds every request up to a power of two
(a 12 GiB state would pin 16 GiB) and pins tensor by tensor. We allocate one
plain tensor per (role, dtype), check the total against the free host memory
*before* allocating, and page-lock each arena in place with cudaHostRegister
(exactly its size). Per-param buffers are views into the arenas.

If pinning fails (RLIMIT, driver, too little lockable memory) we warn and keep
the pageable memory: transfers still work, only slower and less asynchronous.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(needed: int, available: Optional[int] = None) -> None:
    if available is None:
        available = available_host_bytes()
    if available is not None and needed > available:
        raise MemoryError(
            f"offload_adam: the optimizer needs {needed / 2**30:.2f} GiB "
            f"({needed} bytes) of host memory for master weights, moments and "
            f"transfer buffers, but only {available / 2**30:.2f} GiB "
            f"({available} bytes) is available")


def _register(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory in place. True on success."""
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        # The failed call also set CUDA's (non-sticky) "last error", which torch's
        # next kernel-launch check would report as its own: clear it when the
        # binding exists (untested here: no GPU on the dev machine).
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
    return True


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: nothing sensible left to do
        pass


class HostArenas:
    """Carves per-param views out of one flat tensor per (role, dtype).

    Usage: reserve() every buffer, then allocate() once, then view() them."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._sizes: Dict[Tuple[str, torch.dtype], int] = {}
        self._arenas: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}
        self._registered: List[int] = []
        self.pinned = False

    def reserve(self, role: str, dtype: torch.dtype, numel: int) -> int:
        """Returns the offset of a future `numel`-element buffer."""
        key = (role, dtype)
        offset = self._sizes.get(key, 0)
        # Keep every buffer 64-byte aligned: the kernels split work on cache lines.
        per_line = max(1, 64 // torch.empty((), dtype=dtype).element_size())
        self._sizes[key] = offset + (numel + per_line - 1) // per_line * per_line
        return offset

    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=d).element_size()
                   for (_, d), n in self._sizes.items())

    def allocate(self, available: Optional[int] = None) -> None:
        check_host_memory(self.nbytes(), available)
        for key, n in self._sizes.items():
            self._arenas[key] = torch.empty(n, dtype=key[1])
        if self.pin:
            self.pinned = self._pin_all()

    def _pin_all(self) -> bool:
        try:
            for t in self._arenas.values():
                if t.numel():
                    _register(t)
                    self._registered.append(t.data_ptr())
            return True
        except Exception as e:  # noqa: BLE001 -- any failure means "not pinned"
            self.unpin()
            warnings.warn(
                f"offload_adam: could not pin {self.nbytes()} bytes of host memory "
                f"({e}); using pageable memory, transfers will be slower",
                RuntimeWarning, stacklevel=4)
            return False

    def unpin(self) -> None:
        while self._registered:
            _unregister(self._registered.pop())
        self.pinned = False

    def view(self, role: str, dtype: torch.dtype, offset: int, shape) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        return self._arenas[(role, dtype)][offset:offset + numel].view(shape)
