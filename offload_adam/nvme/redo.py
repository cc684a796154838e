"""The redo log of a compact state: what steps each bucket, written before any bucket moves.

A compact state (store.py) keeps one copy of each bucket, so a step cut short cannot go
back: it goes forward. Before the first bucket of step t+1 is overwritten, every bucket's
record is on disk: the grads its params are stepped with (as the kernel reads them), the
param values its masters start again from, and the hyperparameters: all a bucket still at
step t needs to be stepped to t+1 again, bitwise. The records cost the grads' bytes (2 B
per bf16 param) of disk and of writes per step; they are read only after a crash.

One file per directory (LOG_FILE), holding the records of the buckets whose data are in
that directory's data file, one after another from its start each step, each on a cache
line (the last step's records are dead once it is whole). It is direct I/O like the data
files (O_DIRECT where the filesystem allows: the log's 2 B/param a step neither fill the
page cache nor are read back from it unseen): a record goes out through a small aligned
buffer in whole 4 KiB blocks, chunk by chunk, starting with the block the last record ended
in (its bytes kept, written again unchanged) and padded with zeros after its end;
fdatasync makes the records durable before the intent names them. The log is reserved to
what the records take (a larger record, a param's values beside its grads, grows it: a full
disk then fails the step before anything moved): a new state's logs are made sparse, as its
first pass writes no record, and reserved once that pass committed (store.py: by then the
param files of the blocks whose values the state keeps gave their room back).

A record: MAGIC, the JSON length (u64 LE), the JSON ({"meta": the caller's, "tensors":
[[name, dtype, shape], ...]}, padded with spaces so that the tensors start on a cache
line), the tensors' bytes end to end. Its offset, length and CRC32C are in the intent,
checked before it is used. (Records of versions before direct I/O, end to end on no
particular boundary, read back the same way.)
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..byte_view import byte_view
from . import direct_io
from .direct_io import AlignedBuffer, NvmeError, open_direct
from .layout import _DTYPES, ALIGN, TENSOR_ALIGN, round_up
from .manifest import fsync_dir

LOG_FILE = "offload_adam_state.redo"
MAGIC = b"OAREDO1\n"
_LEN = struct.Struct("<Q")
CHUNK = 8 << 20   # the staging buffer a record is written through (bytes)

Record = Tuple[dict, List[Tuple[str, torch.Tensor]]]   # (meta, [(name, tensor), ...])


def _bytes_of(t: torch.Tensor) -> memoryview:
    return byte_view(t.detach().contiguous())


RECORD_HEAD = 1024   # a record's reserve beyond its tensors' bytes: MAGIC, the JSON's
PARAM_HEAD = 256     # fixed part (the hyperparameters), and this per param (its names)


def record_reserve(grad_bytes: Sequence[int]) -> int:
    """The log's reserve for a bucket's record: the grads' bytes of its params (one
    entry each) and the heads (the cache-line padding included). (A record that outgrows
    it, the values of edited params logged beside their grads, grows the log.)"""
    return RECORD_HEAD + sum(PARAM_HEAD + int(b) for b in grad_bytes)


def log_sizes(files: Sequence[int], reserves: Sequence[int], nfiles: int) -> List[int]:
    """Each log file's size: the reserves of the buckets whose data are in that file
    (`files[i]`: bucket i's), in whole 4 KiB blocks (direct I/O writes whole ones)."""
    sizes = [0] * nfiles
    for f, n in zip(files, reserves):
        sizes[f] += int(n)
    return [round_up(n, ALIGN) for n in sizes]


class RedoLog:
    """The log files of `folders`; `sizes`: the bytes each reserves (`create`: made so;
    else a missing one is refused: a state whose files were removed in part is not
    trusted, and nothing is made over it). `reserve=False` with `create`: made that size
    but sparse, its blocks reserved later (`reserve`)."""

    def __init__(self, folders: Sequence[str], sizes: Sequence[int], create: bool = False,
                 reserve: bool = True):
        self.paths = [os.path.join(f, LOG_FILE) for f in folders]
        self.sizes = list(sizes)
        self.fds: List[int] = []
        # Per file: the records not on disk yet, in a buffer of CHUNK bytes that holds the
        # log from `base` (a block boundary) for `filled` bytes; the log's end is there.
        self._bufs: List[Optional[AlignedBuffer]] = [None] * len(folders)
        self._base = [0] * len(folders)
        self._filled = [0] * len(folders)
        self._written = [0] * len(folders)   # the log's bytes on disk (from its start)
        self._synced = [0] * len(folders)    # ... and made durable
        self._lock = threading.Lock()
        try:
            for path, size in zip(self.paths, sizes):
                try:
                    fd, _ = open_direct(path, create=create, size=size,
                                        ranges=None if reserve else [])
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"offload_adam: the redo log {path} of the compact optimizer state in "
                        f"{os.path.dirname(path)!r} is missing (removed or not copied with the "
                        "other state files): the state cannot be trusted. Restore it, or "
                        "remove the state's files to start afresh") from None
                self.fds.append(fd)
                if create:
                    # its size and its name durable now: a power loss after the first
                    # commit must not leave a state whose log is missing or short (the
                    # commits fsync only the first directory; found from outside)
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path))
        except BaseException:
            self.close()
            raise

    def reserve(self) -> None:
        """Reserves every log's blocks (made sparse: `reserve=False`); an OSError (a full
        disk) raises, the logs as they were."""
        for fd, size in zip(self.fds, self.sizes):
            if size:
                os.posix_fallocate(fd, 0, size)

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())
        for b in self._bufs:
            if b is not None:
                b.close()
        self._bufs = [None] * len(self._bufs)

    def reset(self) -> None:
        """The next step's records start again at each log's start."""
        with self._lock:
            self._base = [0] * len(self.fds)
            self._filled = [0] * len(self.fds)
            self._written = [0] * len(self.fds)
            self._synced = [0] * len(self.fds)

    def append(self, f: int, record: Record) -> List[int]:
        """Adds `record` after the step's records so far in file f's log: on disk once
        CHUNK bytes are pending, durable at `sync`; its [offset, nbytes, crc32c]."""
        meta, tensors = record
        head = json.dumps({"meta": meta, "tensors": [
            [n, str(t.dtype).replace("torch.", ""), list(t.shape)] for n, t in tensors]}
        ).encode()
        head += b" " * (-(len(MAGIC) + _LEN.size + len(head)) % TENSOR_ALIGN)
        # (copied with memoryviews, not torch: a memcpy on this thread, where torch's
        # copy_ would wait for intra-op threads busy with the step's kernels)
        parts = [memoryview(MAGIC + _LEN.pack(len(head)) + head)]
        parts += [_bytes_of(t) for _, t in tensors]
        with self._lock:
            if self._bufs[f] is None:
                self._bufs[f] = AlignedBuffer(CHUNK, pin=False)
            buf = self._bufs[f]
            start = round_up(self._base[f] + self._filled[f], TENSOR_ALIGN)
            buf.view[self._filled[f]:start - self._base[f]] = bytes(start - self._base[f]
                                                                    - self._filled[f])
            self._filled[f] = start - self._base[f]
            crc = 0
            for part in parts:   # through the buffer, a CHUNK a write
                done = 0
                while done < len(part):
                    at = self._filled[f]
                    n = min(len(part) - done, CHUNK - at)
                    buf.view[at:at + n] = part[done:done + n]
                    crc = direct_io.crc32(buf.view[at:at + n], crc)
                    self._filled[f], done = at + n, done + n
                    if self._filled[f] == CHUNK:
                        self._write(f)
                        self._base[f] += CHUNK
                        self._filled[f] = 0
            return [start, self._base[f] + self._filled[f] - start, crc]

    def _write(self, f: int) -> None:
        """Writes file f's pending bytes, in whole blocks (zeros after them); they stay in
        the buffer, which goes on filling from there (its blocks written again)."""
        n = self._filled[f]
        padded = round_up(n, ALIGN)
        if not padded:
            return
        view = self._bufs[f].view
        view[n:padded] = bytes(padded - n)
        try:
            direct_io._full(os.pwritev, self.fds[f], view[:padded], self._base[f])
        except OSError as e:
            raise self._error(f, e, "writing") from e
        self._written[f] = self._base[f] + n

    def sync(self) -> None:
        """The records appended so far are on disk and durable."""
        with self._lock:
            for f, fd in enumerate(self.fds):
                if self._base[f] + self._filled[f] > self._written[f]:
                    self._write(f)
                if self._written[f] > self._synced[f]:
                    try:
                        os.fdatasync(fd)
                    except OSError as e:
                        raise self._error(f, e, "flushing") from e
                    self._synced[f] = self._written[f]

    def _error(self, f: int, e: OSError, what: str) -> NvmeError:
        hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        return NvmeError(e.errno, f"offload_adam: {what} the redo log {self.paths[f]} failed: "
                         f"{e.strerror or e}{hint}. Nothing of this step was written to the "
                         "state: the files hold the last completed step", self.paths[f])

    def read(self, f: int, offset: int, nbytes: int, crc: int, bucket: int
             ) -> Tuple[dict, Dict[str, torch.Tensor]]:
        """Record of `bucket` at `offset` in file f's log, checked against `crc`:
        (meta, {name: tensor}; the tensors share one buffer)."""
        with self._lock:   # (one appended since the last write: on disk first, once)
            if offset + nbytes > self._written[f]:
                self._write(f)
        lo = offset - offset % ALIGN   # (direct I/O: whole aligned blocks around it)
        buf = AlignedBuffer(offset - lo + nbytes, pin=False)
        try:
            got = direct_io._upto(os.preadv, self.fds[f], buf.view, lo) - (offset - lo)
        except OSError as e:
            raise self._error(f, e, "reading") from e
        data = buf.tensor[offset - lo:offset - lo + max(0, min(got, nbytes))]
        view = buf.view[offset - lo:offset - lo + data.numel()]
        buf.close()   # (the memory stays while `data` and its views do)
        if (data.numel() != nbytes or direct_io.crc32(view, 0) != crc
                or bytes(view[:len(MAGIC)]) != MAGIC):
            raise NvmeError(errno.EIO, f"offload_adam: the redo record of bucket {bucket} in "
                            f"{self.paths[f]} is damaged or missing ({data.numel()} of {nbytes} "
                            "bytes, checksum mismatch): the step that was cut short cannot be "
                            "finished and its buckets already written cannot go back. The "
                            "file was changed outside offload_adam, or the disk returned "
                            "wrong data", self.paths[f])
        (length,) = _LEN.unpack_from(view, len(MAGIC))
        at = len(MAGIC) + _LEN.size
        head = json.loads(bytes(view[at:at + length]))
        at += length
        out = {}
        for name, dtype, shape in head["tensors"]:
            dt = _DTYPES[dtype]
            n = dt.itemsize * math.prod(shape)
            raw = data[at:at + n]
            if (offset + at) % dt.itemsize:   # (a record of an older version: unaligned)
                raw = raw.clone()
            out[name] = raw.view(dt).view(shape)
            at += n
        return head["meta"], out
