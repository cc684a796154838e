"""Host buffers of the offload engine: one arena per role, checked, then pinned.

Why arenas: torch's pinned allocator rounds every request up to a power of two
(a 12 GiB state would pin 16 GiB) and pins tensor by tensor. Each role (master,
exp_avg, grad copies, ...) gets one plain tensor; the total is checked against
the free host memory *before* anything is allocated, and each arena that a copy
to or from the device uses is page-locked in place by the device
(cudaHostRegister: exactly its size). Per-param buffers are views into the
arenas, 64-byte aligned (the kernels split work on cache lines).

Why only those: page-locking is not free, and memory that no copy touches (the
moments, their scales, a bf16 param's fp32 master: only the CPU kernel reads
them) gains nothing from it. cudaHostRegister faults in and locks every page
of its range before it returns. A 13B model's optimizer (77 GB of state, 8-bit
moments) took 44-47 s to build on an H200 host (2026-11-28), where the build's
other work takes well under a second per billion params on the CPU; unpinned,
the pages are faulted in where they are first written instead (the masters'
and moments' first fill).

Why each role is its own allocation, started at its own offset: the kernel
streams master, moments, grad and bf16 copy of one tensor side by side. Laid
end to end in one allocation, a 64M-element tensor put them exactly 256 MiB
apart, and the streams collided in the caches: the step ran 1.7x slower than
on separately allocated tensors (measured on the 2-core AVX-512 dev machine;
bench/step_bench.py --tensors 1). Separate allocations whose starts differ by a
role-specific odd number of cache lines (`_SKEW_LINES`) keep every pair of
streams apart modulo the page size.

If pinning fails (RLIMIT, driver, too little lockable memory) we warn and keep
the pageable memory: transfers still work, only slower and less asynchronous.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..warn import warn

_LINE = 64
_PAGE = 4096
# Start offset of each successive role within its page, in cache lines: 29
# lines = 1856 bytes, so the first 6 roles start at distinct offsets modulo 4096.
_SKEW_LINES = 29


def _meminfo(key: str) -> Optional[int]:
    """A line of /proc/meminfo in bytes (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> Optional[int]:
    """A cgroup file's number; None when absent, unreadable or "max" (no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup"
                  ) -> Optional[Tuple[int, int]]:
    """(limit, available) of this process's memory cgroup in bytes, or None without a
    limit. Why: in a container /proc/meminfo describes the host, and a run sized by it
    is killed at the container's limit. The limit is the smallest of the cgroup's and its
    ancestors' (v2 memory.max, v1 memory.limit_in_bytes; values near 2^63 mean none);
    available is the limit less the usage, its page cache counted free (the kernel
    reclaims it before it kills, and MemAvailable counts it so)."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    dirs = []   # (directory, limit file, usage file, page cache's key), leaf first
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            base, files = root, ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), (
                "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for n in range(len(parts), -1, -1):   # (a namespaced cgroup mounts at its base)
            dirs.append((os.path.join(base, *parts[:n]),) + files)
    best = None
    for d, limit_file, usage_file, cache in dirs:
        limit = _read_int(os.path.join(d, limit_file))
        if limit is None or limit >= 1 << 60 or (best is not None and limit >= best[0]):
            continue
        usage = _read_int(os.path.join(d, usage_file))
        free = limit - usage + _stat(os.path.join(d, "memory.stat"), cache) \
            if usage is not None else limit
        best = (limit, max(0, min(limit, free)))
    return best


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def total_host_bytes() -> Optional[int]:
    """The RAM this process may use: MemTotal, or its memory cgroup's limit if smaller;
    None where neither can be read."""
    return _least(_meminfo("MemTotal"), cgroup_memory(), 0)


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux), or what the memory cgroup's limit leaves
    if less; None where neither can be read."""
    return _least(_meminfo("MemAvailable"), cgroup_memory(), 1)


def _least(meminfo: Optional[int], cgroup: Optional[Tuple[int, int]], i: int
           ) -> Optional[int]:
    got = [v for v in (meminfo, cgroup[i] if cgroup else None) if v is not None]
    return min(got) if got else None


def check_host_memory(needed: int, available: Optional[int] = None,
                      parts: Optional[Dict[str, int]] = None) -> None:
    """A MemoryError when `needed` bytes are more than the host has available; `parts`:
    the bytes of each role, the largest named (a grad_ring_mb= given too large was
    blamed on the master weights and moments: found from outside)."""
    if available is None:
        available = available_host_bytes()
    if available is not None and needed > available:
        most = ""
        if parts:
            top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
            most = "; the most: " + ", ".join(f"{role} {n / 2**30:.2f} GiB" for role, n in top)
            if "grad ring" in dict(top):
                most += " (the grad ring's size is grad_ring_mb=)"
        raise MemoryError(
            f"offload_adam: the optimizer needs {needed / 2**30:.2f} GiB "
            f"({needed} bytes) of host memory for master weights, moments and "
            f"transfer buffers{most}, but only {available / 2**30:.2f} GiB "
            f"({available} bytes) is available")


def pin_all(device, tensors, pinned: list, what: str) -> bool:
    """Pins each of `tensors` through `device`, appending it to `pinned` (what unpin_all
    lets go); whether all were. A refused pin unpins those pinned before it and warns
    (`what` names the memory, the warning the user's line that asked for it):
    the memory stays usable, pageable."""
    try:
        for t in tensors:
            device.pin(t)
            pinned.append(t)
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means "not pinned"
        unpin_all(device, pinned)
        warn(f"offload_adam: could not pin {what} ({e}); using pageable memory, "
             "transfers will be slower", RuntimeWarning)
        return False


def unpin_all(device, pinned: list) -> None:
    """Unpins `pinned` (the caller waited for every copy that uses them)."""
    while pinned:
        device.unpin(pinned.pop())


def put_off(device, fn) -> bool:
    """Whether the device took `fn`, a finalizer that waits for it, to run later: the
    simulated device does where the garbage collector ran it on a thread whose wait would
    wait for itself (testing/sim_device.py defer_while_locked); a real one never."""
    defer = getattr(device, "defer_while_locked", None)
    return defer is not None and defer(fn)


def unpin_when_dropped(device, pinned: list) -> None:
    """A finalizer's unpin_all: an object dropped without close() (a streamer whose
    forward was refused partway) may have copies in flight that nothing will wait for:
    the device is synchronized first (by the simulated device later if it cannot wait
    now: put_off)."""
    if pinned:
        if put_off(device, lambda: unpin_when_dropped(device, pinned)):
            return
        device.synchronize()
    unpin_all(device, pinned)


class HostArenas:
    """Carves per-param views out of one flat tensor per role.

    Usage: reserve() every buffer, then allocate() once, then view() them;
    release() unpins (the device must have no copy in flight on them)."""

    def __init__(self, device):
        self.device = device  # pins and unpins (device.py)
        self._sizes: Dict[str, Tuple[torch.dtype, int]] = {}
        self._arenas: Dict[str, torch.Tensor] = {}
        self._pinned: List[torch.Tensor] = []
        self.pinned = False

    def reserve(self, role: str, dtype: torch.dtype, numel: int) -> int:
        """Returns the offset of a future `numel`-element buffer of `role`."""
        size = torch.empty((), dtype=dtype).element_size()
        old_dtype, offset = self._sizes.get(role, (dtype, 0))
        if old_dtype != dtype:
            raise ValueError(f"arena {role!r} holds {old_dtype}, not {dtype}")
        per_line = max(1, _LINE // size)
        self._sizes[role] = (dtype, offset + -(-numel // per_line) * per_line)
        return offset

    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for d, n in self._sizes.values())

    def allocate(self, available: Optional[int] = None,
                 pin: Optional[Iterable[str]] = None) -> None:
        """Allocates every reserved role; `pin`: the roles a device copy reads or
        writes, to page-lock (None: all)."""
        check_host_memory(self.nbytes(), available, {
            role: n * torch.empty((), dtype=d).element_size()
            for role, (d, n) in self._sizes.items()})
        for i, (role, (dtype, n)) in enumerate(self._sizes.items()):
            size = torch.empty((), dtype=dtype).element_size()
            skew = (i * _SKEW_LINES * _LINE) % _PAGE
            # A page of slack at each end: the arena starts `skew` bytes into a
            # page of its own and ends inside the allocation, so pinning it
            # (page-granular) never touches a page another tensor shares.
            raw = torch.empty(n + (2 * _PAGE + skew) // size, dtype=dtype)
            start = ((-raw.data_ptr()) % _PAGE + skew) // size
            self._arenas[role] = raw[start:start + n]
        if self.device.pins_memory:
            self.pinned = self._pin_all(self._arenas if pin is None else set(pin))

    def _pin_all(self, roles) -> bool:
        """Pins `roles`; whether they all were (True when none was asked)."""
        return pin_all(self.device, [t for role, t in self._arenas.items()
                                     if t.numel() and role in roles],
                       self._pinned, f"{self.nbytes()} bytes of host memory")

    def release(self) -> None:
        unpin_all(self.device, self._pinned)
        self.pinned = False

    def view(self, role: str, offset: int, shape) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        return self._arenas[role][offset:offset + numel].view(shape)
