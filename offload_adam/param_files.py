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

Crash safety: the param files are scratch, written afresh when streaming starts (but the
blocks of a model built on the meta device: NaN until loaded, made where read, `blank`) and
removed by close() (or by the finalizer of a streamer dropped, or alive at exit). What a
kill must not lose is in the state files: `state_resume=True` (state_dirs=) writes every
stepped param from its committed master, here into the param files, so a file holding a
step cut short is never read again. Each block's bytes are
checksummed (CRC32C per I/O request) when written and checked when read back.

With the state in files laid out with heads (nvme_heads.py, the default: nvme_tier.HEADS), a
block whose params all live in the state's buckets is, once a step committed them, loaded
from those heads (`in_heads`: its file extent given back, a hole), and a resume puts it there
at once, its file not written (`restore_in_heads`); a write by other than the CPU step, or a
state dict's map of it, puts it back in its file.

Bytes per step, per streamed param: forward and backward each read what the cache does not
hold (2 B/param each at most), the step writes 2 B/param: a block goes back to its file in
whole I/O requests (4 MiB, each checksummed on its own), only those holding bytes the step
wrote, so a model whose blocks train little of themselves (LoRA adapters in the blocks,
frozen weights) writes its adapters' requests, not its blocks. With step_in_backward the block
is still in the cache when its kernel runs; without (and in the compact state's pass at
step()), a block not in the cache is not read for its step: the kernel writes its params
and reads none (hold_to_write), and a block it writes whole is never read. Only the bytes a
step leaves out (a frozen param, a param without a grad) are read, in the I/O requests that
hold them: when the block goes back to its file (those it writes), or ahead of its reader (the
streamer's read ahead, _start_completion); a slot lacking most of its block goes first when
the cache needs one (a LoRA block: its reader reads about the block anyway). Read ahead (the
streamer's order) takes only slots the cache would give away before the block read is used:
a block forward finds in the cache is not pushed out by the reads for those before it.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .byte_view import byte_view
from .engine.host_memory import unpin_when_dropped
from .engine.worker import WORKER_NAME
from .nvme.direct_io import (AlignedBuffer, IOPool, NvmeError, bytes_of, crc32, map_copy,
                             map_file, open_direct, punch_hole, wait, warn_buffered)
from .nvme.fd_limit import open_fd
from .nvme.layout import ALIGN, round_up
from .nvme.manifest import lock_exclusive

__all__ = ["ParamFiles", "FILE_NAME", "min_slots", "default_cache_slots"]

FILE_NAME = "offload_adam_params.bin"

# Blocks' worth of reads from the heads into buffers of their own in flight at once (a block
# over several buckets: nvme_heads._HeadReads): two, so that the next block's reads start
# while the one before is put in its slot (with one the disk idled between them; with the
# relaxed first read-ahead, param_stream._floors, forward 2.8-2.9 s -> 1.9-2.2 s on a
# 40-block bench/param_files_big_run.py, bench/README.md); a block's reads start only while
# its buffers fit beside those in flight within HEAD_READS of the largest blocks, host memory
# beside the cache that the planner counts (plan.py, "head reads").
HEAD_READS = 2


def min_slots(prefetch: int) -> int:
    """Slots the streamer needs at once: the block in use, `prefetch` ahead, one given
    back whose copy may still be queued, and one the CPU step writes."""
    return prefetch + 3


def default_cache_slots(prefetch: int) -> int:
    """The cache stream_params makes without param_cache_mb: two slots more than it needs,
    so that reading ahead does not wait for the slot the CPU step writes."""
    return min_slots(prefetch) + 2


def cache_slots(cache_bytes: float, slot_bytes: int, prefetch: int,
                blocks: Optional[int] = None) -> int:
    """The slots of `slot_bytes` a cache of `cache_bytes` holds, `blocks` at most (one
    each is all a cache can use); a ValueError naming the shortfall when they are fewer
    than min_slots(prefetch), or than `blocks` when there are fewer (the planner asks the
    same)."""
    need = min_slots(prefetch) if blocks is None else min(min_slots(prefetch), blocks)
    count = int(cache_bytes) // slot_bytes
    if blocks is not None:
        count = min(count, blocks)
    if count < need:
        # (to the KiB, rounded up: a small model's blocks are well under a MiB, and
        # the bound printed must be one that works when given)
        mib = lambda n: f"{math.ceil(n / 1024) / 1024:.10g}"
        raise ValueError(
            f"param_cache_mb={cache_bytes / 2**20:.10g} holds {count} of the largest block "
            f"({mib(slot_bytes)} MiB); prefetch={prefetch} needs {need} "
            f"(param_cache_mb >= {mib(need * slot_bytes)})")
    return count


class _Slot:
    def __init__(self, buffer: AlignedBuffer):
        self.buffer = buffer
        self.block: Optional[int] = None
        self.holds = 0          # users writing or reading it now (the CPU step, a load)
        # The byte ranges newer than its file: only their I/O requests go back to it (a
        # LoRA block's adapters, not its frozen weights)
        self.dirty_ranges: List[Tuple[int, int]] = []
        self.written: List[Tuple[int, int]] = []   # the runs of requests being written
        self.loading: list = []   # read futures in flight
        self.writing: list = []   # write futures in flight
        self.used = 0           # when last asked for (LRU before the order is known)
        # Byte ranges of the block the slot does not hold yet: a block taken to be written
        # (hold_to_write) is not read first; what its writes leave out is read when
        # someone reads the block or it goes back to its file (_complete).
        self.missing: List[Tuple[int, int]] = []
        # reads of the file's requests that hold missing bytes, in flight (read ahead):
        # (scratch buffer, its byte range in the block, futures), applied by _finish
        self.completing: list = []
        # its block's load from the state's heads in flight (HeadSource.read), or None
        self.heading = None

    @property
    def dirty(self) -> bool:
        return bool(self.dirty_ranges)

    @property
    def busy(self) -> bool:
        """I/O in flight: a read, a write back, or a completion's reads."""
        return bool(self.loading or self.writing or self.completing
                    or self.heading is not None)

    def pending(self) -> list:
        """Every future of the slot's I/O in flight."""
        return self.loading + self.writing + [f for _, _, _, fs in self.completing for f in fs]


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
        # (a block of no bytes, its params all of 0 elements, still has a slot: one block)
        self.slot_bytes = round_up(max(max(self.sizes), 1), ALIGN)
        try:
            count = cache_slots(cache_bytes, self.slot_bytes, prefetch, len(self.sizes))
        except ValueError as e:
            raise ValueError(f"offload_adam.stream_params: {e}") from None
        self.device, self.settle = device, settle
        self.rank: Callable[[int], Optional[float]] = lambda i: None
        self.lock = threading.RLock()
        self.clock = 0
        self.read_bytes = self.written_bytes = 0
        # seconds spent in hold(), summed: by the CPU step (the worker's thread) and by
        # everything else (the streamer's fetches): where compute waited for the disk
        self.hold_s = {"fetch": 0.0, "step": 0.0}
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
        self._made: List[str] = []   # directories made here, in order (a refusal removes them)
        try:
            for d, path, end in zip(dirs, self.paths, ends):
                where = d
                self._made += _make_dirs(d)
                # One streamer per directory at a time (a second would clobber the first's
                # blocks): locked before the file is cut to its new size.
                lock = open_fd(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0))
                try:
                    lock_exclusive(lock)
                except BlockingIOError:
                    os.close(lock)
                    raise ValueError(f"offload_adam.stream_params: {path} is in use by "
                                     "another streamer (give each its own param_dirs)") from None
                self._locks.append(lock)   # (ours: close() removes it)
                fd, direct = open_direct(path, create=True, size=max(end, ALIGN))
                self.fds.append(fd)
                if not direct:
                    buffered.append(d)
        except OSError as e:   # (a full disk: the files made so far go, as at close())
            self._refused()
            raise NvmeError(e.errno, f"offload_adam.stream_params: cannot make the param "
                            f"file of {max(end, ALIGN)} bytes in {where} ({e.strerror}; "
                            f"the {len(dirs)} param files take {sum(ends)} bytes in all); "
                            "nothing was streamed") from e
        except BaseException:
            self._refused()
            raise
        warn_buffered(buffered)
        # a streamer dropped without close() (or alive at the interpreter's exit) removes
        # its files, scratch, and lets go of their descriptors and locks, once the I/O
        # queued is done: a write-back read_ahead queued (not waited for) ran on after the
        # descriptors were closed, into whatever file the process opened next with the
        # same number (found from outside: 1 MiB of a user's file overwritten)
        self.pool = IOPool(threads)
        self._finalizer = weakref.finalize(self, _let_go, list(self.fds + self._locks),
                                           list(self.paths), os.getpid(), self.pool)
        self.slots: List[_Slot] = []
        try:
            for _ in range(count):
                try:
                    buf = AlignedBuffer(self.slot_bytes, pin=False)
                except (OSError, MemoryError) as e:
                    raise MemoryError(
                        f"offload_adam.stream_params: the param files' cache of {count} "
                        f"blocks of {self.slot_bytes / 2**20:.1f} MiB "
                        f"({count * self.slot_bytes / 2**30:.2f} GiB) could not be "
                        f"allocated ({e}): give a smaller param_cache_mb; nothing was "
                        "streamed") from None
                try:
                    device.pin(buf.tensor)
                except BaseException:
                    buf.close()
                    raise
                self.slots.append(_Slot(buf))
        except BaseException:   # (a pin refused): nothing stays pinned, made or locked
            for slot in self.slots:
                device.unpin(slot.buffer.tensor)
                slot.buffer.close()
            self.slots = []
            self.pool.close()
            self._refused()
            raise
        # a streamer dropped without close() unpins the slots when collected (the list
        # holds their memory until then)
        self._unpin = weakref.finalize(self, unpin_when_dropped, device,
                                       [slot.buffer.tensor for slot in self.slots])
        self.slot_of: Dict[int, _Slot] = {}
        self.sums: Dict[int, List[int]] = {}   # block -> its requests' CRC32Cs, as written
        # Design R2 (nvme_tier.HEADS): a file store that keeps the blocks' values as the
        # heads of its buckets links itself here (`heads`, a HeadSource). A block whose
        # values its committed heads hold (`in_heads`) gives its file extent back (a hole)
        # and is loaded from them; written by other than the CPU step, or mapped by a
        # state dict, it goes back to its file. `edits`: per block, the writes that were
        # not the CPU step's (a store's step compares them across its pass).
        self.heads = None
        self.in_heads: set = set()
        self.on_file: set = set(range(len(self.sizes)))   # extents holding their bytes
        # blocks that hold no value yet (`blank`: a meta model's), made when read
        self.blanks: Dict[int, Callable[[torch.Tensor], None]] = {}
        self.edits: Dict[int, int] = {}
        self.heads_read_bytes = 0
        self.head_buffers_peak = 0   # the most bytes of _head_buffers() at once
        # per block, weak references to the maps of its file mapped() handed out
        self._maps: Dict[int, list] = {}

    @property
    def cache_bytes(self) -> int:
        return len(self.slots) * self.slot_bytes

    # ---- the cache -------------------------------------------------------------------

    def hold(self, i: int, read: bool = True) -> torch.Tensor:
        """Block i's host copy (uint8, its size), in a slot that stays until unhold();
        loaded first unless `read=False` (the caller writes it all). Its read (or write
        back) is waited for outside the lock: the other threads' holds and unholds (the
        CPU step's, during backward) go on meanwhile, and the held slot stays put."""
        return self._hold(i, read, None)[0]

    def hold_to_write(self, i: int, fills: Sequence[Tuple[int, int]]
                      ) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
        """hold(i) for a caller that writes the byte ranges `fills` of block i and reads
        nothing: a block not in the cache is not read for it. The CPU step at step()
        writes every byte of a block whose params it all steps, so the block's old
        bytes would be read (2 B/param) only to be overwritten. Returns the host copy
        and the ranges the slot did not hold before (the caller gives them back to
        unhold when its write failed: they are read from the file again then)."""
        return self._hold(i, True, fills)

    def _hold(self, i: int, read: bool, fills: Optional[Sequence[Tuple[int, int]]]):
        t0 = time.perf_counter()
        try:
            return self._hold_now(i, read, fills)
        finally:
            kind = "step" if threading.current_thread().name == WORKER_NAME else "fetch"
            with self.lock:
                self.hold_s[kind] += time.perf_counter() - t0

    def _hold_now(self, i: int, read: bool, fills: Optional[Sequence[Tuple[int, int]]]):
        while True:
            with self.lock:
                slot = self.slot_of.get(i)
                if slot is None:
                    slot = self._take_slot(i)
                    if fills is not None:
                        slot.missing = [(0, self.sizes[i])]
                    elif read:
                        self._load(i, slot)
                claimed: List[Tuple[int, int]] = []
                if fills is not None and slot.missing:
                    claimed = _overlap(slot.missing, fills)
                    slot.missing = _without(slot.missing, fills)
                elif not read:
                    slot.missing = []
                slot.holds += 1
                self._touch(slot)
                pending = slot.pending()
            try:
                wait(pending)   # (its error, if any, is raised by _finish below)
                with self.lock:
                    if self.slot_of.get(i) is not slot:   # its read failed for another
                        slot.holds -= 1                   # holder, who dropped it: again
                        continue
                    self._finish(slot)
                    if slot.writing:           # the caller may write it: let its write land
                        self._finish_writes(slot)
                    if fills is None and read:   # a reader: every byte
                        self._complete(slot)
                    return slot.buffer.tensor[:self.sizes[i]], claimed
            except BaseException:
                with self.lock:
                    slot.holds -= 1
                    if claimed and self.slot_of.get(i) is slot:
                        slot.missing = _union(slot.missing, claimed)
                raise

    def unhold(self, i: int, dirty: bool,
               unwritten: Sequence[Tuple[int, int]] = (),
               written: Optional[Sequence[Tuple[int, int]]] = None,
               by_step: bool = False) -> None:
        """Ends a hold; `dirty`: the caller wrote the byte ranges `written` (None: any);
        `unwritten`: ranges hold_to_write claimed that the caller did not write after all
        (its write failed): the slot reads them from the file again. `by_step`: the
        writer was the CPU step (else an edit: counted in `edits`)."""
        with self.lock:
            slot = self.slot_of[i]
            slot.holds -= 1
            if dirty and not by_step:
                self.edits[i] = self.edits.get(i, 0) + 1
            if dirty:
                slot.dirty_ranges = _union(slot.dirty_ranges, [(0, self.sizes[i])]
                                           if written is None else written)
            if unwritten:
                slot.missing = _union(slot.missing, unwritten)

    def blank(self, i: int, fill: Callable[[torch.Tensor], None]) -> None:
        """Block i holds no value yet (a model built on the meta device: NaN until a state
        dict is loaded): `fill(buffer)` makes its bytes (uint8, its size) wherever it is
        read, and its file is written only once something writes the block (the load;
        else a map of it: mapped()). Until then its extent is not read, nor written: a
        meta model's blocks cost no disk traffic before their load writes them."""
        with self.lock:
            self.blanks[i] = fill
            self.on_file.discard(i)

    def peek(self, i: int) -> torch.Tensor:
        """Block i's host copy as the slot holds it now, for a caller that holds it already
        (hold, or hold_to_write: its missing bytes are not read for this); else hold()'s."""
        with self.lock:
            slot = self.slot_of.get(i)
            if slot is not None and slot.holds > 0:
                return slot.buffer.tensor[:self.sizes[i]]
        buffer = self.hold(i)
        self.unhold(i, dirty=False)
        return buffer

    def read_ahead(self, blocks: Sequence[int],
                   floors: Optional[Sequence[float]] = None) -> None:
        """Starts reading `blocks` (soonest first) into slots holding blocks used later
        (or none); stops at the first that has no such slot. A dirty slot in the way is
        written back now, and taken by a later call. `floors`: for each block, the rank
        a slot's block must be above to be taken for it (default: the block's own). A
        block the cache holds in part (the CPU step wrote the rest: hold_to_write) has
        the requests holding its missing bytes read now, as a load would be, instead
        of by its reader under the lock (_complete). A block in the heads read through
        buffers of its own (nvme_heads._HeadReads) waits until its buffers fit beside
        those in flight within HEAD_READS of the largest blocks: the read-ahead of the
        whole cache would otherwise hold a buffer beside each of its slots (those whose
        reads are done are put in their slots first, their buffers freed)."""
        with self.lock:
            for slot in self.slots:
                if slot.heading is not None and slot.heading.own \
                        and all(f.done() for f in slot.heading.futures):
                    try:
                        self._finish(slot)
                    except Exception:   # noqa: BLE001 -- the slot dropped: its reader reads
                        pass            # the block again and is told
            for k, i in enumerate(blocks):
                slot = self.slot_of.get(i)
                if slot is not None:
                    if slot.missing and not slot.holds and not slot.busy:
                        self._start_completion(slot)
                    continue
                if i in self.in_heads and not self.heads.direct.get(i, True) \
                        and self._head_buffers() + self.sizes[i] > HEAD_READS * max(self.sizes):
                    return   # (read into buffers of their own: HEAD_READS blocks' worth)
                slot = self._victim(sooner_than=i, wait=False,
                                    floor=None if floors is None else floors[k])
                if slot is None:
                    return
                self._evict(slot)
                self._load(i, slot)

    def _head_buffers(self) -> int:
        """The bytes of the buffers beside the slots that reads from the heads in flight
        hold (a block spanning several buckets: nvme_heads._HeadReads)."""
        return sum(s.heading.own for s in self.slots if s.heading is not None)

    def flush(self, i: Optional[int] = None) -> None:
        """Writes block i (every block: None) back to its file if the cache has newer;
        (a block in the heads: to its file from them; a blank one: its fill)."""
        with self.lock:
            elsewhere = self.in_heads | set(self.blanks)   # (not in their extents yet)
            for k in sorted(elsewhere) if i is None else [i] if i in elsewhere else []:
                self._to_file(k)
            for slot in self.slots:
                if slot.block is not None and (i is None or slot.block == i):
                    self._finish(slot)
                    if slot.dirty:
                        self._write(slot)
                    self._finish_writes(slot)

    def mapped(self, i: int) -> torch.Tensor:
        """Block i's bytes as in its file after a flush, mapped copy-on-write (writes to it
        stay in it): what model.state_dict() shows without reading a model into RAM. Its
        bytes are checked against the block's sums as written (a read through the page
        cache, which then serves the mapping): a changed file is an error, not a value."""
        with self.lock:   # (no commit gives its extent back between the flush and the map)
            return self._mapped(i)

    def _mapped(self, i: int) -> torch.Tensor:
        self.flush(i)
        fd, offset, size = self._extent(i)
        if size == 0:   # (params of 0 elements: nothing to map, mmap refuses 0 bytes)
            return torch.empty(0, dtype=torch.uint8)
        have = os.fstat(fd).st_size
        if have < offset + size:   # (cut short since it was written: mmap would refuse it)
            raise NvmeError(errno.EIO, f"offload_adam: block {i}'s params in {self._path(i)} "
                            f"(bytes {offset}..{offset + size}) are past the file's end "
                            f"({have} bytes): the file was cut short since it was written")
        got = map_copy(fd, offset, size)   # (no descriptor kept: direct_io.py)
        if got is not None:
            region, at = got
            data = torch.frombuffer(bytes_of(region, at, size), dtype=torch.uint8)
        else:
            # (mmap's offset: a multiple of the allocation granularity, 64 KiB on some
            # arm64 kernels, where the extents are on 4 KiB)
            page = offset - offset % mmap.ALLOCATIONGRANULARITY
            region = map_file(fd, size + offset - page, page)
            data = torch.frombuffer(region, dtype=torch.uint8)[offset - page:offset - page + size]
        # (alive while a tensor over it is: heads_current asks)
        self._maps[i] = [r for r in self._maps.get(i, []) if r() is not None]
        self._maps[i].append(weakref.ref(region))
        if i in self.sums:
            step = self.pool.request_bytes
            view = byte_view(data)
            got = [crc32(view[a:a + step]) for a in range(0, size, step)]
            if got != self.sums[i]:
                raise NvmeError(errno.EIO, f"offload_adam: block {i}'s params in {self._path(i)} "
                                f"(bytes {offset}..) fail their checksum: the file was "
                                "changed or damaged since it was written")
        return data[:self.sizes[i]]

    # ---- inside (the lock held) --------------------------------------------------------

    def _touch(self, slot: _Slot) -> None:
        self.clock += 1
        slot.used = self.clock

    def _rank(self, slot: _Slot) -> float:
        r = self.rank(slot.block)
        if r is not None and r < 0:
            return r   # the CPU step writes it next (a block it has written in part stays)
        if slot.missing and not slot.holds and (
                2 * sum(b - a for a, b in slot.missing) > self.sizes[slot.block]):
            # most of its block unread (the CPU step wrote a LoRA block's adapters into a
            # slot it took): its next reader reads about the block anyway, so it goes
            # first, not a whole block that reader would find here
            return math.inf
        return -slot.used if r is None else r   # unknown order: least recently used last

    def _victim(self, sooner_than: Optional[int], wait: bool,
                floor: Optional[float] = None) -> Optional[_Slot]:
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
            candidates = [s for s in candidates if not s.busy]
        if not candidates:
            return None
        slot = max(candidates, key=self._rank)
        if sooner_than is not None:   # reading ahead: only over a block used later, and
            mine = self.rank(sooner_than)   # never over one needed before any recorded use
            if mine is not None and floor is not None:
                mine = max(mine, floor)
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
        if slot.dirty and self.heads is not None and self.heads.pending(slot.block):
            # the step wrote it and its commit puts it in the heads: the pass commits
            # what it wrote so far first (compact, on its thread), the slot then clean
            self.heads.settle()
        if slot.dirty:
            self._write(slot)
        self._finish_writes(slot)
        del self.slot_of[slot.block]
        slot.block, slot.missing = None, []

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
        if i in self.in_heads:   # (from the state's heads: its file extent is a hole)
            try:
                slot.heading = self.heads.read(i, slot.buffer)
            except BaseException:   # (the heads cannot be read: the slot holds nothing)
                self._drop(slot)
                raise
            slot.loading = list(slot.heading.futures)
            slot.dirty_ranges, slot.missing = [], []
            self.heads_read_bytes += slot.heading.nbytes
            if slot.heading.own:
                self.head_buffers_peak = max(self.head_buffers_peak, self._head_buffers())
            return
        if i in self.blanks:   # (no value in its file yet: made here)
            slot.loading, slot.dirty_ranges, slot.missing = [], [], []
            self._fill_blank(i, slot.buffer.tensor)
            return
        fd, offset, size = self._extent(i)
        slot.loading = self.pool.read(fd, slot.buffer.view[:size], offset)
        slot.dirty_ranges, slot.missing = [], []
        self.read_bytes += size

    def _finish(self, slot: _Slot) -> None:
        """Waits for the slot's read (and its completion's: _start_completion); its bytes
        checked against the block's sums."""
        if slot.completing:
            self._finish_completion(slot)
        if slot.heading is not None:
            reads, slot.heading, slot.loading = slot.heading, None, []
            try:
                reads.finish(slot.buffer.tensor[:self.sizes[slot.block]])
            except BaseException:
                self._drop(slot)
                raise
            finally:
                reads.close()
            return
        if not slot.loading:
            return
        futures, slot.loading = slot.loading, []
        error = self._read_error(slot.block, futures)
        if error is not None:
            self._drop(slot)
            raise error

    def _start_completion(self, slot: _Slot,
                          runs: Optional[Sequence[Tuple[int, int]]] = None) -> None:
        """Starts reading the whole I/O requests of the slot's block that hold its missing
        bytes (of `runs` only, when given: whole requests), each run into a scratch buffer
        (the rest of a request is newer in the slot: the CPU step's writes), for _finish
        to copy the missing bytes over. Bytes: those requests, not the block (a LoRA
        block's frozen weights, where the step wrote its adapters: about the block, less
        the requests the step wrote whole)."""
        i = slot.block
        fd, offset, size = self._extent(i)
        if i in self.in_heads:   # from the heads (its extent a hole), now
            if slot.missing:
                self._complete_from_heads(slot)
            return
        if i in self.blanks:   # made, not read
            self._complete_from_blank(slot)
            return
        if runs is None:
            runs = self._runs(i, slot.missing, size)
        for a, b in runs:
            if not _overlap(slot.missing, [(a, b)]):
                continue
            scratch = AlignedBuffer(b - a, pin=False)
            try:
                futures = self.pool.read(fd, scratch.view[:b - a], offset + a)
            except BaseException:
                scratch.close()
                raise
            slot.completing.append((scratch, a, b, futures))
            self.read_bytes += b - a

    def _finish_completion(self, slot: _Slot) -> None:
        """Waits for the completion's reads; copies each run's missing bytes into the slot
        (those claimed since by a writer are no longer missing: not copied over its
        bytes). A read that failed, or whose bytes are not the file's as written, leaves
        its bytes missing (the slot keeps what the step wrote) and raises."""
        parts, slot.completing = slot.completing, []
        step, first_error = self.pool.request_bytes, None
        try:
            for scratch, a, b, futures in parts:   # (each waited for, before its buffer goes)
                error = self._read_error(slot.block, futures, a // step)
                if error is not None:
                    first_error = first_error or error
                    continue
                for x, y in _overlap(slot.missing, [(a, b)]):
                    slot.buffer.tensor[x:y].copy_(scratch.tensor[x - a:y - a])
                slot.missing = _without(slot.missing, [(a, b)])
        finally:
            _close_parts(parts)
        if first_error is not None:
            raise first_error

    def _read_error(self, i: int, futures: list, first: int = 0) -> Optional[NvmeError]:
        """Waits for a read of block i's extent, or of the part of it from its request
        `first` on: the error it ended in, or its bytes' mismatch with the block's sums
        as written; None when it read what was written."""
        error = wait(futures)
        if error is not None:
            e = NvmeError(getattr(error, "errno", None) or errno.EIO,
                          f"offload_adam: reading block {i}'s params from {self._path(i)} "
                          f"failed: {error}")
            e.__cause__ = error
            return e
        if i in self.sums and [f.result() for f in futures] != \
                self.sums[i][first:first + len(futures)]:
            at = self.where[i][1] + first * self.pool.request_bytes
            return NvmeError(errno.EIO, f"offload_adam: block {i}'s params in "
                             f"{self._path(i)} (bytes {at}..) "
                             "fail their checksum: the file was changed or damaged "
                             "since it was written")
        return None

    def _drop(self, slot: _Slot) -> None:
        _close_parts(slot.completing)   # (none while a load is: read_ahead)
        slot.completing = []
        del self.slot_of[slot.block]
        slot.block, slot.dirty_ranges, slot.missing = None, [], []

    def _complete(self, slot: _Slot) -> None:
        """Reads the bytes of the slot's block its writes left out (hold_to_write) from
        the block's file, checked as a load is (a block the CPU step wrote only in part:
        frozen params, or a param without a grad)."""
        self._complete_runs(slot, [(0, self._extent(slot.block)[2])])

    def _write(self, slot: _Slot) -> None:
        """Writes back the I/O requests of the block that hold newer bytes (each request
        is checksummed on its own: those left keep their sums), the file's bytes read
        first where the slot lacks some of a request it writes."""
        i = slot.block
        fd, offset, size = self._extent(i)
        if i in self.in_heads:   # its extent a hole: the whole block goes to it
            if slot.missing:
                self._complete_from_heads(slot)
            slot.dirty_ranges = [(0, self.sizes[i])]
            self.in_heads.discard(i)
        if i in self.blanks:   # nothing in its extent yet: the whole block goes to it
            self._complete_from_blank(slot)
            slot.dirty_ranges = [(0, self.sizes[i])]
            del self.blanks[i]
        self.on_file.add(i)
        runs = self._runs(i, slot.dirty_ranges, size)
        if _overlap(slot.missing, runs):
            if runs == [(0, size)]:
                self._complete(slot)
            else:
                self._complete_runs(slot, runs)
        slot.writing = [f for a, b in runs
                        for f in self.pool.write(fd, slot.buffer.view[a:b], offset + a)]
        slot.written, slot.dirty_ranges = runs, []
        self.written_bytes += sum(b - a for a, b in runs)

    def _complete_from_heads(self, slot: _Slot) -> None:
        """The slot's missing bytes of a block in the heads read from them, now."""
        i = slot.block
        scratch = AlignedBuffer(self.sizes[i], pin=False)
        reads = self.heads.read(i, scratch)
        try:
            wait(reads.futures)
            reads.finish(scratch.tensor[:self.sizes[i]])
            for a, b in slot.missing:
                slot.buffer.tensor[a:b].copy_(scratch.tensor[a:b])
            slot.missing = []
            self.heads_read_bytes += reads.nbytes
        finally:
            reads.close()
            scratch.close()

    def _fill_blank(self, i: int, into: torch.Tensor) -> None:
        """Block i's bytes as its blank fill makes them (the padding to its extent's
        end zero: a block's requests are checksummed whole)."""
        size = self._extent(i)[2]
        into[:size].zero_()
        self.blanks[i](into[:self.sizes[i]])

    def _complete_from_blank(self, slot: _Slot) -> None:
        """The slot's missing bytes of a blank block made by its fill."""
        if not slot.missing:
            return
        scratch = torch.empty(self._extent(slot.block)[2], dtype=torch.uint8)
        self._fill_blank(slot.block, scratch)
        for a, b in slot.missing:
            slot.buffer.tensor[a:b].copy_(scratch[a:b])
        slot.missing = []

    def _to_file(self, i: int) -> None:
        """Block i, in the heads, written to its file (for a map of it, or before the
        heads change: a load, the store closed): loaded into a slot, all of it dirty."""
        slot = self.slot_of.get(i)
        if slot is None:
            slot = self._take_slot(i)
            self._load(i, slot)
        wait(slot.pending())
        self._finish(slot)
        self._write(slot)
        self._finish_writes(slot)

    def mapped_alive(self, i: int) -> bool:
        """Whether a map of block i's file that mapped() handed out is still alive."""
        maps = self._maps.get(i)
        return bool(maps) and any(r() is not None for r in maps)

    def heads_current(self, blocks: Dict[int, int]) -> None:
        """The linked store committed the heads of these blocks, their values then the
        slots' (or the files'): block -> its `edits` count when the store first read it in
        the pass. Each not written by other than the CPU step since (nor mapped by a state
        dict: a map of its file would read the hole) is in the heads from now on: its
        extent given back, its slot clean."""
        # (called by the store's commit, once its manifest is stored: nothing here may
        # raise into it; a block that cannot go to the heads now stays in its file)
        with self.lock:
            for i, count in blocks.items():
                if self.edits.get(i, 0) != count or self.mapped_alive(i):
                    continue
                slot = self.slot_of.get(i)
                try:
                    if slot is not None:
                        if slot.holds or slot.loading or slot.completing:
                            continue   # (in use now: its next commit takes it)
                        self._finish_writes(slot)
                    if i in self.on_file:
                        fd, offset, size = self._extent(i)
                        punch_hole(fd, offset, size)
                except OSError:   # (a write back that failed is dirty again: written
                    continue      # at eviction; a hole refused: the bytes stay)
                if slot is not None:
                    slot.dirty_ranges = []
                self._now_in_heads(i)

    def restore_in_heads(self, blocks: Sequence[int]) -> None:
        """A resume of the linked store (state_resume=True): these blocks' values are its
        committed heads, which the restore did not write to their files (2 B/param, and
        the files' bytes on disk beside the state's until the first step): each is in the
        heads from now on, its extent given back, what a slot held of it (the model as
        streamed) dropped unwritten. One that a state dict's map of its file still shows,
        or that a reader holds now, is written from the heads into its slot instead, as a
        restore writes it (to its file when the slot is given away)."""
        with self.lock:
            for i in blocks:
                slot = self.slot_of.get(i)
                if slot is not None and not slot.holds:
                    slot.dirty_ranges = []   # (the model as streamed: not written back)
                    try:
                        self._evict(slot)
                    except Exception:   # noqa: BLE001 -- what failed was to be dropped
                        pass
                    slot = self.slot_of.get(i)
                if slot is None and not self.mapped_alive(i):
                    if i in self.on_file:
                        fd, offset, size = self._extent(i)
                        try:
                            punch_hole(fd, offset, size)
                        except OSError:   # (a hole refused: its old bytes stay, unread)
                            pass
                    self._now_in_heads(i)
                    continue
                if slot is None:
                    slot = self._take_slot(i)
                else:   # (held: no copy to the device may still read what is replaced)
                    self.settle(i)
                slot.missing = [(0, self.sizes[i])]
                self._complete_from_heads(slot)
                slot.dirty_ranges = [(0, self.sizes[i])]
                self.edits[i] = self.edits.get(i, 0) + 1

    def _now_in_heads(self, i: int) -> None:
        """Block i's values are the heads' from now on: its extent (given back, or its
        bytes stale) is neither read nor checked again, nor is it blank."""
        self.on_file.discard(i)
        self.sums.pop(i, None)
        self.blanks.pop(i, None)
        self.in_heads.add(i)

    def heads_out(self, unlink: bool) -> None:
        """Every block in the heads written to its file (the linked store is about to
        rewrite them); `unlink`: and the heads unlinked (the store is closing)."""
        with self.lock:
            for i in sorted(self.in_heads):
                self._to_file(i)
            if unlink:
                self.heads = None

    def _runs(self, i: int, ranges: Sequence[Tuple[int, int]], size: int
              ) -> List[Tuple[int, int]]:
        """The whole I/O requests of block i (of the pool's request_bytes, from the
        extent's start) that `ranges` touch, as runs; every byte of a block never
        written (no sums to keep)."""
        if i not in self.sums:
            return [(0, size)]
        step, runs = self.pool.request_bytes, []
        for a, b in sorted(ranges):
            lo, hi = a - a % step, min(size, round_up(b, step))
            if runs and lo <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
            else:
                runs.append((lo, hi))
        return runs

    def _complete_runs(self, slot: _Slot, runs: Sequence[Tuple[int, int]]) -> None:
        """_complete for the runs (whole I/O requests) a write back needs, now: the
        completion's reads of those that lack bytes, waited for (their requests checked
        against their sums) and the missing bytes copied over."""
        self._start_completion(slot, runs)
        self._finish_completion(slot)

    def _finish_writes(self, slot: _Slot) -> None:
        if not slot.writing:
            return
        futures, slot.writing = slot.writing, []
        runs, slot.written = slot.written, []
        error = wait(futures)
        if error is not None:
            slot.dirty_ranges = _union(slot.dirty_ranges, runs)   # still only in the cache
            raise NvmeError(getattr(error, "errno", None) or errno.EIO,
                            f"offload_adam: writing block {slot.block}'s params to "
                            f"{self._path(slot.block)} failed: {error}"
                            ) from error
        sums = [f.result() for f in futures]
        _, _, size = self._extent(slot.block)
        if runs == [(0, size)]:
            self.sums[slot.block] = sums
            return
        step, at = self.pool.request_bytes, 0
        for a, b in runs:   # (each run's requests, in order)
            n = -(-(b - a) // step)
            self.sums[slot.block][a // step:a // step + n] = sums[at:at + n]
            at += n

    # ---- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Lets go of the slots and removes the files (scratch: see the module docstring)."""
        with self.lock:
            self.heads, self.in_heads = None, set()   # (the streamer read its blocks back)
            for slot in self.slots:
                wait(slot.pending())
                _close_parts(slot.completing)
                slot.completing = []
                if slot.heading is not None:
                    slot.heading.close()
                    slot.heading = None
                if slot.block is not None:
                    self.settle(slot.block)
            self._unpin()
            for slot in self.slots:
                slot.buffer.close()
            self.slots, self.slot_of = [], {}
            self.pool.close()
            self._close_files()

    def _close_files(self) -> None:
        """Removes the files this streamer locked (all of them once made: the finalizer's
        list) and closes their descriptors."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _let_go(self.fds + self._locks, self.paths[:len(self._locks)], os.getpid())
        self.fds, self._locks = [], []


    def _refused(self) -> None:
        """A refused construction leaves the directories as it found them: its files
        removed, and the directories it made (when empty)."""
        self._close_files()
        for d in reversed(self._made):
            try:
                os.rmdir(d)
            except OSError:
                pass


def _close_parts(parts: list) -> None:
    """A completion's reads (_Slot.completing) waited for, their scratch buffers freed."""
    for scratch, _, _, futures in parts:
        wait(futures)
        scratch.close()


def _make_dirs(d: str) -> List[str]:
    """Makes directory `d` and its missing parents; those made, outermost first."""
    missing, at = [], d
    while at and not os.path.exists(at):
        missing.append(at)
        at = os.path.dirname(at)
    os.makedirs(d, exist_ok=True)
    return missing[::-1]


def _let_go(fds: List[int], paths: List[str], pid: int, pool: Optional[IOPool] = None) -> None:
    """The I/O queued on `pool` waited for; the files removed (still locked: no other
    streamer uses them; by the process that made them only: a forked child's exit leaves
    its parent's), the descriptors closed."""
    if pool is not None:
        pool.close()   # (its requests name the descriptors closed below)
    if os.getpid() == pid:
        for path in paths:
            try:
                os.remove(path)
            except OSError:
                pass
    _close_fds(fds)


def _close_fds(fds: List[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- byte ranges [a, b), sorted and disjoint ----------------------------------------------

def _without(ranges: Sequence[Tuple[int, int]], cut: Sequence[Tuple[int, int]]
             ) -> List[Tuple[int, int]]:
    """`ranges` less every range of `cut`."""
    out = list(ranges)
    for c, d in cut:
        out = [piece for a, b in out
               for piece in ((a, min(b, c)), (max(a, d), b)) if piece[0] < piece[1]]
    return out


def _overlap(ranges: Sequence[Tuple[int, int]], other: Sequence[Tuple[int, int]]
             ) -> List[Tuple[int, int]]:
    """The bytes in both."""
    return _union([], [(max(a, c), min(b, d)) for a, b in ranges for c, d in other
                       if max(a, c) < min(b, d)])


def _union(ranges: Sequence[Tuple[int, int]], more: Sequence[Tuple[int, int]]
           ) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for a, b in sorted(list(ranges) + list(more)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
