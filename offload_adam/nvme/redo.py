"""The redo log of a compact state: what steps each bucket, written before any bucket moves.

A compact state (store.py) keeps one copy of each bucket, so a step cut short cannot go
back: it goes forward. Before the first bucket of step t+1 is overwritten, every bucket's
record is on disk: the grads its params are stepped with (as the kernel reads them), the
param values its masters start again from, and the hyperparameters: all a bucket still at
step t needs to be stepped to t+1 again, bitwise. The records cost the grads' bytes (2 B
per bf16 param) of disk and of writes per step; they are read only after a crash.

One file per directory (LOG_FILE), holding the records of the buckets whose data are in
that directory's data file, end to end from its start each step (the last step's records
are dead once it is whole). It is buffered I/O (records are built from the caller's
tensors, unaligned) made durable by fdatasync before the intent names them, and reserved
at creation to what the records take (a larger record, a param's values beside its
grads, grows it: a full disk then fails the step before anything moved).

A record: MAGIC, the JSON length (u64 LE), the JSON ({"meta": the caller's, "tensors":
[[name, dtype, shape], ...]}), the tensors' bytes end to end. Its CRC32C is in the intent,
checked before it is used.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from typing import Dict, List, Sequence, Tuple

import torch

from . import direct_io
from .direct_io import NvmeError
from .layout import _DTYPES

LOG_FILE = "offload_adam_state.redo"
MAGIC = b"OAREDO1\n"
_LEN = struct.Struct("<Q")

Record = Tuple[dict, List[Tuple[str, torch.Tensor]]]   # (meta, [(name, tensor), ...])


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


RECORD_HEAD = 1024   # a record's reserve beyond its tensors' bytes: MAGIC, the JSON's
PARAM_HEAD = 256     # fixed part (the hyperparameters), and this per param (its names)


def record_reserve(grad_bytes: Sequence[int]) -> int:
    """The log's reserve for a bucket's record: the grads' bytes of its params (one
    entry each) and the heads. (A record that outgrows it, the values of edited params
    logged beside their grads, grows the log.)"""
    return RECORD_HEAD + sum(PARAM_HEAD + int(b) for b in grad_bytes)


class RedoLog:
    """The log files of `folders`; `sizes`: the bytes each reserves (`create`: made so;
    else a missing one is refused: a state whose files were removed in part is not
    trusted, and nothing is made over it)."""

    def __init__(self, folders: Sequence[str], sizes: Sequence[int], create: bool = False):
        self.paths = [os.path.join(f, LOG_FILE) for f in folders]
        self.fds: List[int] = []
        self.at = [0] * len(folders)   # where the step's next record goes, per file
        try:
            for path, size in zip(self.paths, sizes):
                flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
                try:
                    fd = os.open(path, flags, 0o644)
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"offload_adam: the redo log {path} of the compact optimizer state in "
                        f"{os.path.dirname(path)!r} is missing (removed or not copied with the "
                        "other state files): the state cannot be trusted. Restore it, or "
                        "remove the state's files to start afresh") from None
                self.fds.append(fd)
                if create and size:
                    os.posix_fallocate(fd, 0, size)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def reset(self) -> None:
        """The next step's records start again at each log's start."""
        self.at = [0] * len(self.fds)

    def append(self, f: int, record: Record) -> List[int]:
        """Writes `record` after the step's records so far in file f's log (not yet
        durable: `sync`); its [offset, nbytes, crc32c]."""
        meta, tensors = record
        head = json.dumps({"meta": meta, "tensors": [
            [n, str(t.dtype).replace("torch.", ""), list(t.shape)] for n, t in tensors]}
        ).encode()
        parts = [memoryview(MAGIC + _LEN.pack(len(head)) + head)]
        parts += [_bytes_of(t) for _, t in tensors]
        start, crc = self.at[f], 0
        for part in parts:
            crc = direct_io.crc32(part, crc)
            self._full_write(f, part, self.at[f])
            self.at[f] += len(part)
        return [start, self.at[f] - start, crc]

    def sync(self) -> None:
        """The records appended so far are durable."""
        for f, fd in enumerate(self.fds):
            if self.at[f]:
                try:
                    os.fdatasync(fd)
                except OSError as e:
                    raise self._error(f, e, "flushing") from e

    def _full_write(self, f: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fds[f], view[done:], offset + done)
            except OSError as e:
                raise self._error(f, e, "writing") from e

    def _error(self, f: int, e: OSError, what: str) -> NvmeError:
        hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        return NvmeError(e.errno, f"offload_adam: {what} the redo log {self.paths[f]} failed: "
                         f"{e.strerror or e}{hint}. Nothing of this step was written to the "
                         "state: the files hold the last completed step", self.paths[f])

    def read(self, f: int, offset: int, nbytes: int, crc: int, bucket: int
             ) -> Tuple[dict, Dict[str, torch.Tensor]]:
        """Record of `bucket` at `offset` in file f's log, checked against `crc`:
        (meta, {name: tensor})."""
        data = os.pread(self.fds[f], nbytes, offset)
        if len(data) != nbytes or direct_io.crc32(data) != crc or not data.startswith(MAGIC):
            raise NvmeError(errno.EIO, f"offload_adam: the redo record of bucket {bucket} in "
                            f"{self.paths[f]} is damaged or missing ({len(data)} of {nbytes} "
                            "bytes, checksum mismatch): the step that was cut short cannot be "
                            "finished and its buckets already written cannot go back. The "
                            "file was changed outside offload_adam, or the disk returned "
                            "wrong data", self.paths[f])
        (length,) = _LEN.unpack_from(data, len(MAGIC))
        at = len(MAGIC) + _LEN.size
        head = json.loads(data[at:at + length])
        at += length
        buf = bytearray(data[at:])
        out, pos = {}, 0
        for name, dtype, shape in head["tensors"]:
            t = torch.empty(shape, dtype=_DTYPES[dtype])
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(buf, dtype=torch.uint8,
                                                                count=n, offset=pos)
                                               if n else torch.empty(0, dtype=torch.uint8))
            out[name] = t
            pos += n
        return head["meta"], out
