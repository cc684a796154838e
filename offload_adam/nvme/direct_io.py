"""Aligned host buffers and a small pool of threads doing direct pread/pwrite.

Why threads and not asyncio or io_uring: os.preadv/os.pwritev release the GIL, so a few
threads keep several large requests in flight (an NVMe drive reaches its bandwidth at a
queue depth of a few 1-8 MiB requests), with nothing but the standard library.

O_DIRECT moves the bytes between the drive and our buffers without the page cache (which
would double the RAM the state takes and evict everything else); it wants buffers, offsets
and sizes aligned to the logical block (4096 B covers every common drive). Buffers are
anonymous mmaps (page aligned), page-locked for the GPU when CUDA is there. A filesystem
that refuses O_DIRECT (tmpfs, some network filesystems) gets buffered I/O and one warning
naming the directory.
"""

from __future__ import annotations

import concurrent.futures.thread as _pools
import ctypes
import errno
import functools
import mmap
import os
import threading

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import List, Optional, Sequence, Tuple

import torch

from ..warn import warn
from .fd_limit import open_fd, at_limit
from .layout import ALIGN, SUM_BYTES, round_up

# One pread/pwrite: large enough for the drive's bandwidth; each is checksummed on its own.
REQUEST_BYTES = SUM_BYTES
# The checksum of a request's bytes (store.SUM_ALGO): CRC32C, by the compiled kernels
# (csrc/crc32c.h: the CPU's CRC instruction, ~8 bytes a cycle, where it has one; zlib's
# CRC32 ran at ~4 GB/s a thread, a bound on a host with several drives). It releases the
# GIL, so the I/O threads checksum their requests in parallel with the kernel and each
# other.
_crc32c = None


def load_checksum():
    """The kernels' CRC32C, loaded (built on first use) now: NvmeState.open calls this in
    the caller's thread, so that a failed build is an error there, not in an I/O thread."""
    global _crc32c
    if _crc32c is None:
        from .._build import load_kernels   # (the build, not the Adam code around it)
        _crc32c = load_kernels().crc32c
    return _crc32c


def crc32(data, value: int = 0) -> int:
    """CRC32C of `data` (bytes or a memoryview), continuing `value`. (A name of its own:
    bench/nvme_bench.py swaps it for a constant to measure what checksumming costs.)"""
    return (_crc32c or load_checksum())(data, value)


class NvmeError(OSError):
    """An I/O error of the state files, with what was being done and what is still intact."""


def map_file(fd: int, length: int, offset: int) -> mmap.mmap:
    """`length` bytes of the file `fd` from `offset` (a multiple of the allocation
    granularity), mapped copy-on-write. Python's mmap keeps a descriptor of its own for
    each mapping: a streamed model's state_dict() with param files maps each block so (an
    80-block model passes no limit), and so does a state dict of state in files where
    files cannot be mapped into a range of our own (not Linux: tensor by tensor, some
    2,000 for a 70B model). Past a soft limit of open files, the limit is raised to the
    hard one (the process may, and nothing else changes), and where that is not enough
    the error says why so many are open."""
    return at_limit(lambda: mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset),
                    "a state_dict() of state in files, and a streamed model's state_dict() "
                    "with param files, map each tensor from its file, one descriptor each "
                    "while the dict is alive (drop the dicts already saved)")


_MAP_FIXED = 0x10   # Linux's: replace the pages at that address (within our own range)


@functools.lru_cache(maxsize=None)
def _libc_mmap():
    mmap_ = ctypes.CDLL(None, use_errno=True).mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
    return mmap_


def fixed_maps() -> bool:
    """Whether files can be mapped into a range of our own (Linux's MAP_FIXED)."""
    return hasattr(mmap, "MAP_ANONYMOUS") and os.uname().sysname == "Linux"


def address_of(region: mmap.mmap) -> int:
    """Where an anonymous mapping starts. (It unmaps its whole range when freed, the file
    pages mapped over it too.)"""
    view = (ctypes.c_char * len(region)).from_buffer(region)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def map_at(address: int, length: int, fd: int, offset: int) -> None:
    """mmap(2) of file `fd` from `offset`, private and writable (copy-on-write), at
    `address` exactly (a range the caller holds)."""
    got = _libc_mmap()(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                       mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset)
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"offload_adam: mapping a file failed: {os.strerror(err)}")


def map_copy(fd: int, offset: int, nbytes: int) -> Optional[Tuple[mmap.mmap, int]]:
    """The file's bytes [offset, offset + nbytes) mapped copy-on-write, from the page
    below `offset`, into an anonymous range of our own: (the range, where `offset` lies in
    it). Unlike map_file, no descriptor is kept. None where files cannot be mapped so."""
    if not fixed_maps():
        return None
    page = mmap.PAGESIZE
    lo = offset - offset % page
    region = mmap.mmap(-1, max(page, -(-(offset + nbytes - lo) // page) * page),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    map_at(address_of(region), len(region), fd, lo)
    return region, offset - lo


# /proc/self/pagemap's flags of a page (Documentation/admin-guide/mm/pagemap.rst): 8 bytes
# a page; readable without privileges (the frame numbers are not, and not needed)
_PRESENT, _SWAPPED, _FILE_PAGE = 63, 62, 61
_PAGEMAP_READ = 1 << 20   # entries read at a time (8 MiB: 4 GiB of mappings)


def written_pages(address: int, nbytes: int) -> Optional[bool]:
    """Whether this process wrote into the copy-on-write file mapping [address, address +
    nbytes) (map_copy, map_file): a page written is anonymous since (present but no
    longer the file's page, or swapped out); one never written is the file's, or not
    present (never read, or dropped: the file still has it). None where the kernel's
    pagemap cannot be read (not Linux): the caller assumes written. ~nbytes / 512 bytes read."""
    if nbytes <= 0:
        return False
    page = mmap.PAGESIZE
    first, last = address // page, (address + nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            for at in range(first, last + 1, _PAGEMAP_READ):
                count = min(_PAGEMAP_READ, last + 1 - at)
                raw = os.pread(f.fileno(), count * 8, at * 8)
                if len(raw) != count * 8:
                    return None
                flags = torch.frombuffer(bytearray(raw), dtype=torch.int64)
                bit = lambda k: (flags >> k) & 1   # noqa: E731
                if bool(((bit(_PRESENT) & (1 - bit(_FILE_PAGE))) | bit(_SWAPPED)).any()):
                    return True
    except OSError:
        return None
    return False


# fallocate(2)'s FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: a range's disk blocks given
# back, the file's size kept
_PUNCH_HOLE = 0x02 | 0x01


@functools.lru_cache(maxsize=None)
def _libc_fallocate():
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return f


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Gives the disk blocks of bytes [offset, offset + nbytes) of file `fd` back to the file
    system (they read as zeros after; the file's size stays): True when it did; False where
    it cannot (no fallocate, or a file system without holes), the bytes then staying. A
    scratch file whose bytes live elsewhere for a while (param files: a block whose values
    the state's heads hold) so stops taking their room on the disk."""
    f = _libc_fallocate()
    if f is None or nbytes <= 0:
        return False
    if f(fd, _PUNCH_HOLE, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"punching a hole of {nbytes} bytes at {offset}: {os.strerror(err)}")


def allocated_bytes(path: str) -> int:
    """The disk bytes file `path` takes (its blocks: a hole takes none)."""
    return os.stat(path).st_blocks * 512


def bytes_of(region: mmap.mmap, at: int, nbytes: int):
    """`nbytes` of `region` from `at`, as a buffer of their own that keeps the region
    (torch.frombuffer of it: a storage of just those bytes, which torch.save writes)."""
    return (ctypes.c_char * nbytes).from_buffer(region, at)


class AlignedBuffer:
    """`nbytes` of page-aligned host memory (an anonymous mmap), as a uint8 tensor (`.tensor`)
    and a memoryview (`.view`); pinned (cudaHostRegister) when CUDA is available and `pin`."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.nbytes = max(ALIGN, round_up(nbytes, ALIGN))
        self._mmap = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._mmap)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(rc) == 0

    def close(self) -> None:
        """Unpins; the memory is unmapped when the last view of it (a tensor handed out,
        a request's slice held by a traceback) is gone."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = self.view = self._mmap = None


def open_direct(path: str, create: bool, size: int = 0,
                ranges: Optional[Sequence[Tuple[int, int]]] = None) -> Tuple[int, bool]:
    """A read/write fd of `path` and whether it is O_DIRECT: buffered where the filesystem
    refuses direct I/O at open or at the first aligned read (tmpfs before Linux 6.6, some
    network and FUSE filesystems). `size`: when creating, the bytes to reserve
    (posix_fallocate: a full disk fails here, not mid-step); `ranges`: (offset, bytes)
    the only ones reserved of them (the rest a hole until reserved later)."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    for mode in ((flags | direct, True), (flags, False)) if direct else ((flags, False),):
        try:
            fd = open_fd(path, mode[0])
        except OSError as e:
            if e.errno == errno.EINVAL and mode[1]:
                continue
            raise
        try:
            if create:
                os.ftruncate(fd, 0)
                if ranges is not None:
                    os.ftruncate(fd, size)
                    for at, n in ranges:
                        if n:
                            os.posix_fallocate(fd, at, n)
                elif size:
                    os.posix_fallocate(fd, 0, size)
            if not mode[1] or _reads_aligned(fd):
                return fd, mode[1]
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise AssertionError("unreachable")


def _reads_aligned(fd: int) -> bool:
    probe = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(fd, [probe], 0)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.close()


def warn_buffered(folders: List[str]) -> None:
    """The one warning of an open whose `folders` refused O_DIRECT."""
    if folders:
        warn(f"offload_adam: {', '.join(map(repr, folders))} "
             f"{'does' if len(folders) == 1 else 'do'} not support direct I/O "
             "(O_DIRECT); the optimizer state files there use buffered I/O through "
             "the page cache (slower, and the cache takes host RAM)", RuntimeWarning)


def _upto(op, fd: int, view: memoryview, offset: int) -> int:
    """preadv/pwritev `view` at `offset`, continuing after short transfers, until it is
    all done or the file ends; the bytes done."""
    done = 0
    while done < len(view):
        n = op(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _full(op, fd: int, view: memoryview, offset: int) -> None:
    """All of `view`, or an error: the file ended first."""
    if _upto(op, fd, view, offset) < len(view):
        raise OSError(errno.EIO, "unexpected end of file")


def _read(fd, view, offset) -> int:
    """Reads `view` whole; its checksum, once the bytes are there."""
    _full(os.preadv, fd, view, offset)
    return crc32(view)


def _write(fd, view, offset) -> int:
    """Writes `view` whole; its checksum, taken before (the bytes as they go to disk)."""
    crc = crc32(view)
    _full(os.pwritev, fd, view, offset)
    return crc


_IO_THREAD = "offload_adam_io"


class IOPool:
    """Threads running aligned requests; `read`/`write` cut a range into `request_bytes`
    requests and return their futures, whose results are the requests' checksums."""

    def __init__(self, threads: int = 4, request_bytes: int = REQUEST_BYTES):
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=_IO_THREAD)
        self.request_bytes = request_bytes
        self._futures: List[Future] = []   # the requests close() waits for
        self._pid = os.getpid()

    def _check_process(self) -> None:
        """A forked child has none of the pool's threads: a request would wait forever."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"offload_adam: these files' I/O threads are process {self._pid}'s, and this "
                f"is a child it forked (pid {os.getpid()}), which has none of them: a file "
                "read or write here would never end. Build the optimizer (or streamer) in "
                "the process that uses it; the parent's goes on as it was")

    def _submit(self, fn, fd: int, view: memoryview, offset: int) -> List[Future]:
        self._check_process()
        step = self.request_bytes
        futures = [self._run(fn, fd, view[i:i + step], offset + i)
                   for i in range(0, len(view), step)]
        if len(self._futures) > 4096:
            self._futures = [f for f in self._futures if not f.done()]
        self._futures.extend(futures)
        return futures

    def read(self, fd: int, view: memoryview, offset: int) -> List[Future]:
        return self._submit(_read, fd, view, offset)

    def call(self, fn, *args) -> Future:
        """fn(*args) on an I/O thread (a read that checks and parses what it read);
        close() waits for it as for the requests. Those done are let go here: a done
        future keeps its result (a record's buffer) alive while it is listed."""
        self._check_process()
        self._futures = [f for f in self._futures if not f.done()]
        future = self._run(fn, *args)
        self._futures.append(future)
        return future

    def _run(self, fn, *args) -> Future:
        """fn(*args) on a pool thread; once the interpreter is ending (its threading
        shutdown stops every pool before the atexit handlers and the non-daemon threads
        still running are done: a checkpoint saved then, a step of a thread that
        outlives the main one) on this thread, at once, its future done."""
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:
            if not getattr(_pools, "_shutdown", False):
                raise
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:   # (as a pool thread would: the caller's wait raises it)
            future.set_exception(e)
        return future

    def write(self, fd: int, view: memoryview, offset: int) -> List[Future]:
        return self._submit(_write, fd, view, offset)

    def close(self) -> None:
        """Waits for the requests queued so far (the files may be closed after), then lets
        the threads end on their own. No join: close() may run in a finalizer that the
        garbage collector calls inside threading's own locked code (a thread starting
        up), where joining a thread deadlocks on that lock (seen: a test run hung)."""
        if (not threading.current_thread().name.startswith(_IO_THREAD)   # (not its own)
                and os.getpid() == self._pid):   # (a forked child's would never end)
            futures_wait(self._futures)
        self._futures = []
        self._pool.shutdown(wait=False)


def wait(futures: List[Future]) -> Optional[BaseException]:
    """Waits for every future; the first error, or None."""
    first = None
    for f in futures:
        e = f.exception()
        if e is not None and first is None:
            first = e
    return first
