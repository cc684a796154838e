"""Streamed blocks' params in files: `stream_params(..., param_dirs=[...], param_cache_mb=N)`.

With params in host RAM (param_stream.py) host RAM caps the model: a 70B model's bf16
params alone are 141 GB. Here each streamed block's host copy lives in a file, and a cache
of host buffers (slots, pinned, one block each, `param_cache_mb` in all) holds the blocks in
use and those about to be:

    param file (O_DIRECT, block i in directory i % len(dirs))
        --read ahead, in the order of uses recorded on the first step--> slot
        --H2D on the device's side stream (param_stream.py)--> the block's device tensors
    the CPU step writes a block's new values into its slot (the kernel's output: the
    slot is the params' `Home`), and the slot goes back to the file before it is reused

Which block leaves the cache: the one whose next use is farthest (the recorded order says
when each is used next: the last blocks of forward are the first of backward); before the
order is known, the least recently used. A block that a step in backward will write next
(used in backward, not yet stepped) counts as the nearest. A slot is not reused while
the block's copy to the device may still read it (the streamer's settle), while the CPU
step writes it (`hold`), or while its read or write is in flight.

Crash safety: the param files are scratch, written afresh when streaming starts and
removed by close(). What a kill must not lose is in the state files: `state_resume=True`
(state_dirs=) writes every stepped param from its committed master, here into the param
files, so a file holding a step cut short is never read again. Each block's bytes are
checksummed (CRC32C per I/O request) when written and checked when read back.

Bytes per step, per streamed param: forward and backward each read what the cache does not
hold (2 B/param each at most), the step writes 2 B/param (with step_in_backward the block
is still in the cache when its kernel runs; without, a block not in the cache is read
before its step: its frozen params and the params not stepped keep their values).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .nvme.direct_io import AlignedBuffer, IOPool, NvmeError, open_direct, wait, warn_buffered
from .nvme.layout import ALIGN, round_up

__all__ = ["ParamFiles", "FILE_NAME", "min_slots"]

FILE_NAME = "offload_adam_params.bin"


def min_slots(prefetch: int) -> int:
    """Slots the streamer needs at once: the block in use, `prefetch` ahead, one given
    back whose copy may still be queued, and one the CPU step writes."""
    return prefetch + 3


class _Slot:
    def __init__(self, buffer: AlignedBuffer):
        self.buffer = buffer
        self.block: Optional[int] = None
        self.holds = 0          # users writing or reading it now (the CPU step, a load)
        self.dirty = False      # newer than its file
        self.loading: list = []   # read futures in flight
        self.writing: list = []   # write futures in flight
        self.used = 0           # when last asked for (LRU before the order is known)


class ParamFiles:
    """The files and the cache of one streamer's blocks (see the module docstring).

    `sizes[i]`: the bytes of block i's host copy; `settle(i)`: waits until no copy to
    the device reads block i's host copy any more (the streamer's); `rank(i)`: how soon
    block i is used next (smaller: sooner; negative: before any use in the recorded
    order, e.g. the CPU step's write), None while unknown."""

    def __init__(self, dirs: Sequence[str], sizes: Sequence[int], cache_bytes: int,
                 prefetch: int, device, settle: Callable[[int], None],
                 threads: int = 4):
        dirs = [os.fspath(d) for d in dirs]   # (stream_params refused an empty list)
        self.dirs, self.sizes = dirs, [int(s) for s in sizes]
        self.slot_bytes = round_up(max(self.sizes), ALIGN)
        need = min_slots(prefetch)
        count = int(cache_bytes) // self.slot_bytes
        if count < need:
            raise ValueError(
                f"offload_adam.stream_params: param_cache_mb={cache_bytes / 2**20:.0f} holds "
                f"{count} of the largest block ({self.slot_bytes / 2**20:.1f} MiB); "
                f"prefetch={prefetch} needs {need} "
                f"(param_cache_mb >= {need * self.slot_bytes / 2**20:.0f})")
        self.device, self.settle = device, settle
        self.rank: Callable[[int], Optional[float]] = lambda i: None
        self.lock = threading.RLock()
        self.clock = 0
        self.read_bytes = self.written_bytes = 0
        # Where each block lives: file i % len(dirs), after the blocks before it there.
        self.where: List[tuple] = []
        ends = [0] * len(dirs)
        for i, size in enumerate(self.sizes):
            d = i % len(dirs)
            self.where.append((d, ends[d]))
            ends[d] += round_up(size, ALIGN)
        self.paths = [os.path.join(d, FILE_NAME) for d in dirs]
        self.fds: List[int] = []
        buffered = []
        self._locks: List[int] = []
        try:
            for d, path, end in zip(dirs, self.paths, ends):
                os.makedirs(d, exist_ok=True)
                # One streamer per directory at a time (a second would clobber the first's
                # blocks): locked before the file is cut to its new size.
                lock = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                self._locks.append(lock)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ValueError(f"offload_adam.stream_params: {path} is in use by "
                                     "another streamer (give each its own param_dirs)") from None
                fd, direct = open_direct(path, create=True, size=max(end, ALIGN))
                self.fds.append(fd)
                if not direct:
                    buffered.append(d)
        except OSError as e:
            self._close_files()
            raise NvmeError(e.errno, f"offload_adam.stream_params: cannot make the param "
                            f"files in {dirs} ({e.strerror}); nothing was streamed") from e
        except BaseException:
            self._close_files()
            raise
        warn_buffered(buffered)
        # a streamer dropped without close() lets go of its files' descriptors (and locks)
        self._finalizer = weakref.finalize(self, _close_fds, list(self.fds + self._locks))
        self.pool = IOPool(threads)
        self.slots: List[_Slot] = []
        for _ in range(count):
            buf = AlignedBuffer(self.slot_bytes, pin=False)
            device.pin(buf.tensor)
            self.slots.append(_Slot(buf))
        self.slot_of: Dict[int, _Slot] = {}
        self.sums: Dict[int, List[int]] = {}   # block -> its requests' CRC32Cs, as written

    @property
    def cache_bytes(self) -> int:
        return len(self.slots) * self.slot_bytes

    # ---- the cache -------------------------------------------------------------------

    def hold(self, i: int, read: bool = True) -> torch.Tensor:
        """Block i's host copy (uint8, its size), in a slot that stays until unhold();
        loaded first unless `read=False` (the caller writes it all). Its read (or write
        back) is waited for outside the lock: the other threads' holds and unholds (the
        CPU step's, during backward) go on meanwhile, and the held slot stays put."""
        while True:
            with self.lock:
                slot = self.slot_of.get(i)
                if slot is None:
                    slot = self._take_slot(i)
                    if read:
                        self._load(i, slot)
                slot.holds += 1
                self._touch(slot)
                pending = slot.loading + slot.writing
            try:
                wait(pending)   # (its error, if any, is raised by _finish below)
                with self.lock:
                    if self.slot_of.get(i) is not slot:   # its read failed for another
                        slot.holds -= 1                   # holder, who dropped it: again
                        continue
                    self._finish(slot)
                    if slot.writing:           # the caller may write it: let its write land
                        self._finish_writes(slot)
                    return slot.buffer.tensor[:self.sizes[i]]
            except BaseException:
                with self.lock:
                    slot.holds -= 1
                raise

    def unhold(self, i: int, dirty: bool) -> None:
        with self.lock:
            slot = self.slot_of[i]
            slot.holds -= 1
            slot.dirty = slot.dirty or dirty

    def read_ahead(self, blocks: Sequence[int]) -> None:
        """Starts reading `blocks` (soonest first) into slots holding blocks used later
        (or none); stops at the first that has no such slot. A dirty slot in the way is
        written back now, and taken by a later call."""
        with self.lock:
            for i in blocks:
                slot = self.slot_of.get(i)
                if slot is not None:
                    continue
                slot = self._victim(sooner_than=i, wait=False)
                if slot is None:
                    return
                self._evict(slot)
                self._load(i, slot)

    def flush(self, i: Optional[int] = None) -> None:
        """Writes block i (every block: None) back to its file if the cache has newer."""
        with self.lock:
            for slot in self.slots:
                if slot.block is not None and (i is None or slot.block == i):
                    self._finish(slot)
                    if slot.dirty:
                        self._write(slot)
                    self._finish_writes(slot)

    def mapped(self, i: int) -> torch.Tensor:
        """Block i's bytes as in its file after a flush, mapped copy-on-write (writes to it
        stay in it): what model.state_dict() shows without reading a model into RAM."""
        self.flush(i)
        fd, offset, size = self._extent(i)
        m = mmap.mmap(fd, size, offset=offset, access=mmap.ACCESS_COPY)
        return torch.frombuffer(m, dtype=torch.uint8)[:self.sizes[i]]

    # ---- inside (the lock held) --------------------------------------------------------

    def _touch(self, slot: _Slot) -> None:
        self.clock += 1
        slot.used = self.clock

    def _rank(self, slot: _Slot) -> float:
        r = self.rank(slot.block)
        return -slot.used if r is None else r   # unknown order: least recently used last

    def _victim(self, sooner_than: Optional[int], wait: bool) -> Optional[_Slot]:
        """The slot to give block `sooner_than` (any block: None): an empty one, else the
        one whose block is used latest, not held; with wait=False also not busy (I/O in
        flight, dirty, copies to the device pending) and used later than the new one."""
        free = [s for s in self.slots if s.block is None and s.holds == 0]
        if free:
            return free[0]
        candidates = [s for s in self.slots if s.holds == 0]
        if not wait:
            for s in candidates:
                if s.writing and all(f.done() for f in s.writing):
                    self._finish_writes(s)
            candidates = [s for s in candidates if not s.loading and not s.writing]
        if not candidates:
            return None
        slot = max(candidates, key=self._rank)
        if sooner_than is not None:   # reading ahead: only over a block used later, and
            mine = self.rank(sooner_than)   # never over one needed before any recorded use
            if mine is None or self._rank(slot) <= mine or self._rank(slot) < 0:
                return None
            if slot.dirty:   # written back now, taken next time
                self._write(slot)
                return None
        return slot

    def _take_slot(self, i: int) -> _Slot:
        slot = self._victim(None, wait=True)
        if slot is None:
            raise RuntimeError(
                f"offload_adam.stream_params: every one of the {len(self.slots)} param cache "
                "slots is in use at once (more blocks held than prefetch + 3); raise "
                "param_cache_mb")
        self._evict(slot)
        slot.block = i
        self.slot_of[i] = slot
        return slot

    def _evict(self, slot: _Slot) -> None:
        """Empties `slot`: its block's copies to the device done, its bytes in the file."""
        if slot.block is None:
            return
        self._finish(slot)
        self.settle(slot.block)
        if slot.dirty:
            self._write(slot)
        self._finish_writes(slot)
        del self.slot_of[slot.block]
        slot.block = None

    def _path(self, i: int) -> str:
        """Block i's file."""
        return self.paths[self.where[i][0]]

    def _extent(self, i: int) -> tuple:
        """Block i's place: (its file's descriptor, offset, size rounded for O_DIRECT)."""
        d, offset = self.where[i]
        return self.fds[d], offset, round_up(self.sizes[i], ALIGN)

    def _load(self, i: int, slot: _Slot) -> None:
        slot.block = i
        self.slot_of[i] = slot
        fd, offset, size = self._extent(i)
        slot.loading = self.pool.read(fd, slot.buffer.view[:size], offset)
        slot.dirty = False
        self.read_bytes += size

    def _finish(self, slot: _Slot) -> None:
        """Waits for the slot's read; its bytes checked against the block's sums."""
        if not slot.loading:
            return
        futures, slot.loading = slot.loading, []
        i = slot.block
        error = wait(futures)
        if error is not None:
            self._drop(slot)
            raise NvmeError(getattr(error, "errno", None),
                            f"offload_adam: reading block {i}'s params from "
                            f"{self._path(i)} failed: {error}") from error
        sums = [f.result() for f in futures]
        if i in self.sums and sums != self.sums[i]:
            self._drop(slot)
            raise NvmeError(None, f"offload_adam: block {i}'s params in "
                            f"{self._path(i)} (bytes {self.where[i][1]}..) "
                            "fail their checksum: the file was changed or damaged "
                            "since it was written")

    def _drop(self, slot: _Slot) -> None:
        del self.slot_of[slot.block]
        slot.block, slot.dirty = None, False

    def _write(self, slot: _Slot) -> None:
        fd, offset, size = self._extent(slot.block)
        slot.writing = self.pool.write(fd, slot.buffer.view[:size], offset)
        slot.dirty = False
        self.written_bytes += size

    def _finish_writes(self, slot: _Slot) -> None:
        if not slot.writing:
            return
        futures, slot.writing = slot.writing, []
        error = wait(futures)
        if error is not None:
            slot.dirty = True   # still only in the cache
            raise NvmeError(getattr(error, "errno", None),
                            f"offload_adam: writing block {slot.block}'s params to "
                            f"{self._path(slot.block)} failed: {error}"
                            ) from error
        self.sums[slot.block] = [f.result() for f in futures]

    # ---- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Lets go of the slots and removes the files (scratch: see the module docstring)."""
        with self.lock:
            for slot in self.slots:
                for fs in (slot.loading, slot.writing):
                    wait(fs)
                if slot.block is not None:
                    self.settle(slot.block)
                self.device.unpin(slot.buffer.tensor)
                slot.buffer.close()
            self.slots, self.slot_of = [], {}
            self.pool.close()
            self._close_files(remove=True)

    def _close_files(self, remove: bool = False) -> None:
        if remove:   # (still locked: no other streamer is using them)
            for path in self.paths:
                try:
                    os.remove(path)
                except OSError:
                    pass
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _close_fds(self.fds + self._locks)
        self.fds, self._locks = [], []


def _close_fds(fds: List[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
