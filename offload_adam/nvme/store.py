"""The optimizer state in files: open (or create) it, read and write buckets, commit a step.

    state = NvmeState.open(["/nvme0/run1", "/nvme1/run1"], spec)   # spec: layout.StateSpec
    futures = state.read(i, buf)       # bucket i's current slot into an AlignedBuffer
    state.tensors(i, buf)              # {name: tensor} views of the buffer, as the spec says
    futures = state.write(i, buf)      # into bucket i's other slot
    state.commit([i, ...])             # fsync the files, then the manifest names the new slots
    state.views(i)                     # read-only (copy-on-write) mmap views of the committed slot

The pipeline (pipeline.py) drives these; nothing here keeps state in RAM. On open the files
are checked against the spec (the fingerprint, layout.py) and created when there are none:
fallocate'd whole up front, so that a full disk shows at open and not mid-step.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import uuid
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import manifest
from .direct_io import AlignedBuffer, IOPool, NvmeError, open_direct, wait, warn_buffered
from .layout import HEADER_BYTES, SLOTS, StateSpec, differences, place

DATA_FILE = "offload_adam_state.bin"
_HEADER_MAGIC = b"OFFLOAD_ADAM_NVME_STATE_1\n"


def folder_problem(folder: str) -> Optional[Tuple[type, str]]:
    """What keeps `folder` from holding state files (the error type and the words that
    follow its name), or None. The optimizer's options check with it too."""
    if not os.path.exists(folder):
        return FileNotFoundError, "does not exist"
    if not os.path.isdir(folder):
        return NotADirectoryError, "is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return PermissionError, "is not writable by this process"
    return None


def _check_folder(folder: str) -> str:
    folder = os.path.abspath(folder)
    problem = folder_problem(folder)
    if problem is not None:
        error, what = problem
        hint = ("; create it (one per drive) before building the optimizer"
                if error is FileNotFoundError else "")
        raise error(f"offload_adam: the NVMe state directory {folder!r} {what}{hint}")
    probe = os.path.join(folder, manifest.LOCK)
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT, 0o644))
    except PermissionError as e:
        raise PermissionError(f"offload_adam: the NVMe state directory {folder!r} is not "
                              f"writable by this process ({e.strerror})") from None
    return folder


class NvmeState:
    """The state files of one optimizer (one rank): see the module's docstring."""

    def __init__(self, folders: List[str], spec: StateSpec, body: dict, fds: List[int],
                 locks: manifest.DirLocks, io: IOPool, buffered: List[str]):
        self.folders, self.spec = folders, spec
        self.buffered = buffered   # the folders that refused O_DIRECT (warned about once)
        self.paths = [os.path.join(f, DATA_FILE) for f in folders]
        self.extents, self.file_sizes = place(spec, len(folders))
        self._body, self._fds, self._locks, self._io = body, fds, locks, io
        self._unsure: Optional[str] = None   # why the manifest on disk may not be _body

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, folders: Sequence[str], spec: StateSpec, io_threads: int = 4) -> "NvmeState":
        """The state in `folders` (one file each), created (all zero, step 0) when it has
        no manifest yet; refused when it holds another spec's state or is locked."""
        if isinstance(folders, (str, os.PathLike)):
            folders = [folders]
        if not folders:
            raise ValueError("offload_adam: no NVMe state directory given")
        folders = [_check_folder(os.fspath(f)) for f in folders]
        if len(set(folders)) != len(folders):
            raise ValueError(f"offload_adam: an NVMe state directory is named twice: {folders}")
        locks = manifest.DirLocks(folders)
        fds: List[int] = []
        io = None
        try:
            body = manifest.read(folders[0])
            buffered: List[str] = []
            if body is None:
                body, fds = _create(folders, spec, buffered)
            else:
                _check_spec(folders[0], body, spec)
                fds = _open_files(folders, body, buffered)
            warn_buffered(buffered)
            io = IOPool(io_threads)
            return cls(folders, spec, body, fds, locks, io, buffered)
        except BaseException:
            for fd in fds:
                os.close(fd)
            if io is not None:
                io.close()
            locks.release()
            raise

    def close(self) -> None:
        """Closes the files and drops the lock (the state stays as last committed)."""
        if self._io is None:
            return
        self._io.close()
        for fd in self._fds:
            os.close(fd)
        self._locks.release()
        self._io = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- what is committed ---------------------------------------------------------------

    @property
    def step(self) -> int:
        """The number of completed (committed) steps."""
        return self._body["step"]

    @property
    def slots(self) -> List[int]:
        return list(self._body["slots"])

    # -- bucket I/O ----------------------------------------------------------------------

    def tensors(self, i: int, buf: AlignedBuffer) -> Dict[str, torch.Tensor]:
        """Bucket i's tensors as views of `buf` (which holds, or will hold, its extent)."""
        b = self.spec.buckets[i]
        return {t.name: buf.tensor[o:o + t.nbytes].view(t.dtype).view(t.shape)
                for t, o in zip(b.tensors, b.offsets())}

    def read(self, i: int, buf: AlignedBuffer):
        """Starts reading bucket i's committed slot into `buf`; its futures."""
        self._check_sure()
        e = self.extents[i]
        return self._io.read(self._fds[e.file], buf.view[:e.nbytes], e.at(self.slots[i]))

    def write(self, i: int, buf: AlignedBuffer):
        """Starts writing `buf` into bucket i's other slot; its futures."""
        self._check_sure()
        e = self.extents[i]
        return self._io.write(self._fds[e.file], buf.view[:e.nbytes], e.at(1 - self.slots[i]))

    def check(self, futures, what: str, i: int) -> None:
        """Waits for `futures`; an I/O error becomes an NvmeError naming the bucket, the
        file, and that the last completed step is intact."""
        self._raise(wait(futures), f"{what} bucket {i}", self.paths[self.extents[i].file])

    def _raise(self, e: Optional[BaseException], what: str, path: str) -> None:
        if e is None:
            return
        if not isinstance(e, OSError):
            raise e
        hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        raise NvmeError(e.errno, f"offload_adam: {what} of the optimizer state in {path} "
                        f"failed: {e.strerror or e}{hint}. The state of step {self.step} (the "
                        "last completed one) is intact on disk", path) from e

    def commit(self, written: Iterable[int], step: Optional[int] = None) -> None:
        """Makes the slots just written current: fsync every file, then the manifest.
        `step`: the completed step count to record (default: one more)."""
        for fd, path in zip(self._fds, self.paths):
            try:
                os.fsync(fd)
            except OSError as e:
                self._raise(e, "flushing", path)
        body = dict(self._body)
        slots = list(body["slots"])
        for i in written:
            slots[i] = 1 - slots[i]
        body["slots"] = slots
        body["step"] = self.step + 1 if step is None else int(step)
        path = os.path.join(self.folders[0], manifest.MANIFEST)
        try:
            manifest.commit(self.folders[0], body)
        except OSError as e:
            # the rename may or may not have happened: which slots are current is unknown
            # here, and writing either could overwrite the committed ones
            self._unsure = f"committing a step to {path} failed ({e.strerror or e})"
            self._raise(e, "committing the step", path)
        self._body = body

    def _check_sure(self) -> None:
        if self._unsure:
            raise RuntimeError(f"offload_adam: {self._unsure}; close and reopen the NVMe "
                               "state (NvmeState.open) to continue from the step on disk")

    # -- reading without the pipeline ----------------------------------------------------

    def views(self, i: int) -> Dict[str, torch.Tensor]:
        """Bucket i's committed tensors memory-mapped from its file, copy-on-write: writes to
        them stay in this process and never reach the files. Each tensor has its own
        storage, so torch.save writes just its bytes, paged in as it goes. They keep these
        values through the next step; the step after it rewrites their slot: save them
        before then."""
        e = self.extents[i]
        b = self.spec.buckets[i]
        out = {}
        with open(self.paths[e.file], "rb") as f:
            for t, o in zip(b.tensors, b.offsets()):
                start = e.at(self.slots[i]) + o
                page = start - start % mmap.ALLOCATIONGRANULARITY
                if t.nbytes == 0:
                    out[t.name] = torch.empty(t.shape, dtype=t.dtype)
                    continue
                m = mmap.mmap(f.fileno(), start - page + t.nbytes, access=mmap.ACCESS_COPY,
                              offset=page)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")   # "non-writable buffer": it is writable
                    out[t.name] = torch.frombuffer(m, dtype=t.dtype, count=t.numel,
                                                   offset=start - page).view(t.shape)
        return out


# -- creating and checking the files -------------------------------------------------------

def _header(body: dict, index: int) -> bytes:
    data = _HEADER_MAGIC + json.dumps({"uuid": body["uuid"], "file": index,
                                       "files": len(body["folders"]),
                                       "spec_sha256": body["spec_sha256"]}).encode()
    if len(data) > HEADER_BYTES:
        raise ValueError("offload_adam: NVMe state header too long")
    return data


def _create(folders: List[str], spec: StateSpec, buffered: List[str]):
    _, sizes = place(spec, len(folders))
    body = {"uuid": uuid.uuid4().hex, "folders": folders, "spec_sha256": spec.digest(),
            "step": 0, "slots": [0] * len(spec.buckets), "file_sizes": sizes}
    for folder, size in zip(folders, sizes):
        free = shutil.disk_usage(folder).free
        if size > free:
            raise NvmeError(errno.ENOSPC, f"offload_adam: the optimizer state needs "
                            f"{size / 2**30:.2f} GiB in {folder!r} ({len(spec.buckets)} "
                            f"buckets, {SLOTS} slots each), only {free / 2**30:.2f} GiB is "
                            "free", folder)
    fds = _open_all(folders, body, buffered, create=True)
    try:
        manifest.commit(folders[0], spec.to_json(), manifest.SPEC)
        manifest.commit(folders[0], body)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return body, fds


def _check_spec(folder: str, body: dict, spec: StateSpec) -> None:
    stored = manifest.read(folder, manifest.SPEC)
    if stored is None or StateSpec.from_json(stored).digest() != body["spec_sha256"]:
        raise manifest.ManifestError(f"offload_adam: {os.path.join(folder, manifest.SPEC)} "
                                     "is missing or is not the one its manifest names")
    diff = differences(StateSpec.from_json(stored), spec)
    if diff:
        raise ValueError(f"offload_adam: {folder!r} holds the optimizer state of another "
                         f"model or optimizer: {'; '.join(diff)}. Point the optimizer at an "
                         "empty directory, or remove that state")


def _open_files(folders: List[str], body: dict, buffered: List[str]) -> List[int]:
    if len(body["folders"]) != len(folders):
        raise ValueError(f"offload_adam: the state in {folders[0]!r} is striped over "
                         f"{len(body['folders'])} directories ({body['folders']}), "
                         f"{len(folders)} given")
    for k, folder in enumerate(folders):
        path = os.path.join(folder, DATA_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"offload_adam: {path} (file {k} of the state whose "
                                    f"manifest is in {folders[0]!r}) is missing")
    return _open_all(folders, body, buffered, create=False)


def _open_all(folders: List[str], body: dict, buffered: List[str], create: bool) -> List[int]:
    """The data files' fds: created (reserved whole, header written) or checked (size and
    header); the folders that refused O_DIRECT are added to `buffered`."""
    fds: List[int] = []
    buf = AlignedBuffer(HEADER_BYTES, pin=False)
    try:
        for k, (folder, size) in enumerate(zip(folders, body["file_sizes"])):
            path = os.path.join(folder, DATA_FILE)
            try:
                fd, direct = open_direct(path, create=create, size=size)
            except OSError as e:
                what = "create" if create else "open"
                raise NvmeError(e.errno, f"offload_adam: could not {what} the optimizer state "
                                f"file {path} ({size} bytes): {e.strerror}", path) from e
            fds.append(fd)
            if not direct:
                buffered.append(folder)
            head = _header(body, k)
            if create:
                buf.view[:] = bytes(HEADER_BYTES)
                buf.view[:len(head)] = head
                os.pwritev(fd, [buf.view], 0)
                os.fsync(fd)
                manifest.fsync_dir(folder)
                continue
            if os.fstat(fd).st_size < size:
                raise ValueError(f"offload_adam: {path} is shorter than the state it holds "
                                 f"({os.fstat(fd).st_size} < {size} bytes)")
            os.preadv(fd, [buf.view], 0)
            if bytes(buf.view[:len(head)]) != head:
                raise ValueError(f"offload_adam: {path} is not file {k} of the state whose "
                                 f"manifest is in {folders[0]!r} (give the directories in the "
                                 f"order they were created: {body['folders']})")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        buf.close()
    return fds
