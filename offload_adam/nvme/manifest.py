"""The manifest (which slot of each bucket is current, the last completed step) and the lock.

A step writes every bucket's non-current slot, fsyncs the files, then commits: the manifest
is written whole to a temporary file, fsync'd, renamed over the old one (atomic on POSIX),
and the directory is fsync'd so that the rename itself is durable. A process killed at any
instant leaves either the old manifest or the new one, each naming slots that were complete
when it was written. The body is JSON behind a fixed header with its length and CRC32, so a
damaged manifest is an error rather than a silently wrong state. It stays small (a slot per
bucket, the step): the spec (every tensor's name, dtype and shape) is written once beside
it, in the same framing, and the manifest names its sha256.

The lock: an exclusive flock on a file in each directory, and on the directory itself, held
while the state is open, so that a second optimizer (in this process or another) gets an
error instead of interleaving its writes with ours. The kernel drops them when the process
dies, even by SIGKILL. The lock file can be removed under a live run (DirLocks): each pass
checks that it is still there before it writes (NvmeState._check_held).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import zlib
from typing import List, Optional, Tuple

from .fd_limit import open_fd

MANIFEST = "offload_adam_state.manifest"
SPEC = "offload_adam_state.spec"   # the fingerprint: written once, the manifest names its sha256
LOCK = "offload_adam_state.lock"
_MAGIC = b"OFFLOAD_ADAM_NVME_MANIFEST_1\n"
_HEAD = struct.Struct("<QI")   # body length, crc32 of the body


class ManifestError(RuntimeError):
    pass


def lock_exclusive(fd: int) -> None:
    """An exclusive flock on `fd`, not waiting. Held by this process's own garbage (an
    optimizer or a streamer dropped without close(), whose cycles through autograd's C++
    objects may take the collector a few passes to free), it is collected first: up to 3
    passes, then the lock is tried again; held by someone alive, BlockingIOError."""
    for attempt in range(4):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == 3:
                raise
            import gc
            gc.collect()


def fsync_dir(folder: str) -> None:
    fd = open_fd(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(body: dict) -> bytes:
    data = json.dumps(body, sort_keys=True).encode()
    return _MAGIC + _HEAD.pack(len(data), zlib.crc32(data)) + data


def unpack(raw: bytes, where: str) -> dict:
    if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + _HEAD.size:
        raise ManifestError(f"offload_adam: {where} is not an offload_adam NVMe state manifest")
    length, crc = _HEAD.unpack_from(raw, len(_MAGIC))
    data = raw[len(_MAGIC) + _HEAD.size:]
    if len(data) != length or zlib.crc32(data) != crc:
        raise ManifestError(f"offload_adam: {where} is damaged (its length or CRC32 does not "
                            "match its contents)")
    return json.loads(data)


def read(folder: str, name: str = MANIFEST) -> Optional[dict]:
    """The committed manifest (or spec) of `folder`, or None when there is none."""
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    return unpack(raw, path)


def commit(folder: str, body: dict, name: str = MANIFEST) -> None:
    """Replaces the manifest (or spec) atomically and durably: temp + fsync + rename +
    fsync dir."""
    path = os.path.join(folder, name)
    tmp = path + ".tmp"
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        try:
            raw = pack(body)
            done = 0
            while done < len(raw):
                done += os.write(fd, raw[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:   # (a full disk: no half-written temp file left beside the state)
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


class DirLocks:
    """Exclusive flocks on LOCK in each of `folders`, and on each folder itself; an error
    names the holder's pid.

    The folder's own flock is there because the lock file can be unlinked (a cleanup of
    "stale" *.lock files while the run is live): a second optimizer would then make a new
    one, lock it and step the same state files under this one. A cleanup of lock files
    leaves the folder, so that second optimizer is refused at the folder's flock; and
    `lost` tells this one that its lock file went, before it writes again (an optimizer
    of a version without the folder's flock is let in: this one is refused then)."""

    def __init__(self, folders: List[str]):
        self._fds: List[int] = []
        self._held: List[tuple] = []   # (folder, lock path, the lock file's (st_dev, st_ino))
        self._pid = os.getpid()
        try:
            for folder in folders:
                self._lock(folder)
        except BaseException:
            self.release()
            raise

    def _lock(self, folder: str) -> None:
        path = os.path.join(folder, LOCK)
        # kept before it is locked: whatever raises from here (a KeyboardInterrupt after
        # the flock too) finds it in _fds, unlocked and closed by release()
        self._fds.append(open_fd(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)))
        fd = self._fds[-1]
        try:
            lock_exclusive(fd)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fds.pop())
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RuntimeError(
                    f"offload_adam: the NVMe state directory {folder!r} is in use by another "
                    f"optimizer (lock {path} held by pid {holder}). To resume its files here, "
                    "close that optimizer first (opt.close(), or del opt where nothing else "
                    "holds it); to train another model, give each optimizer (and each rank) "
                    "its own directory") from None
            raise
        self._held.append((folder, path, _file_id(os.fstat(fd))))
        pid = str(os.getpid()).encode()
        try:
            # the pid over the old one, then cut to it: a lock file that held a pid has
            # its block already, so a resume on a full disk gets this far
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as e:
            raise OSError(e.errno, f"offload_adam: cannot write the lock file {path} of the "
                          f"optimizer state folder {folder!r}: {e.strerror or e}. Nothing "
                          "was written to the folder's state", path) from e
        self._lock_folder(folder)

    def _lock_folder(self, folder: str) -> None:
        """The flock on the folder itself (class docstring). Where the filesystem has no
        flock on a directory (NFS emulates flock with fcntl locks, which need a file open
        for writing), the lock file's is all there is."""
        try:
            self._fds.append(open_fd(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                                     | getattr(os, "O_CLOEXEC", 0)))
        except OSError as e:
            if e.errno == errno.EMFILE:   # (the limit, not the filesystem: not unlocked)
                raise
            return
        fd = self._fds[-1]   # (kept before it is locked, as _lock's)
        try:
            lock_exclusive(fd)
        except OSError as e:
            os.close(self._fds.pop())
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(
                    f"offload_adam: the NVMe state directory {folder!r} is in use by another "
                    f"optimizer: the directory is locked, but not its lock file "
                    f"{os.path.join(folder, LOCK)}, which was removed or replaced while that "
                    "optimizer held it (a cleanup of stale lock files?). Nothing was "
                    "changed. That optimizer is refused its next step too (it finds its "
                    "lock file gone): once it is closed or its process ended, build the "
                    "optimizer again with state_resume=True to continue from the step on "
                    "disk; to train another model, give each optimizer (and each rank) its "
                    "own directory") from None

    def lost(self) -> Optional[Tuple[str, str]]:
        """(folder, why) for a lock file held that is no longer at its path (removed, or
        replaced by another file: another process may have locked the new one and be
        using the state), or None while all are. A stat per folder."""
        for folder, path, held in self._held:
            try:
                there = _file_id(os.stat(path))
            except FileNotFoundError:
                there = None
            if there != held:
                return folder, (f"the lock file {path} of the optimizer state folder "
                                f"{folder!r} was {'removed' if there is None else 'replaced'} "
                                "while this optimizer held it: another process may be using "
                                "the state")
        return None

    def release(self) -> None:
        """Unlocks and closes. In a forked child, only closes: its descriptors share the
        parent's open files, and an unlock through one unlocks the parent's."""
        self._held = []
        while self._fds:
            fd = self._fds.pop()
            if os.getpid() == self._pid:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _file_id(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino
