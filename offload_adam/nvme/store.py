"""The optimizer state in files: open (or create) it, read and write buckets, commit a step.

    state = NvmeState.open(["/nvme0/run1", "/nvme1/run1"], spec)   # spec: layout.StateSpec
    req = state.read(i, buf)           # bucket i's current slot into an AlignedBuffer
    state.finish(req)                  # waits; an I/O error or a damaged slot raises
    state.tensors(i, buf)              # {name: tensor} views of the buffer, as the spec says
    req = state.write(i, buf)          # into bucket i's other slot
    state.commit([i, ...])             # fsync the files, then the manifest names the new slots
    state.finish_head(state.read_head(i, buf))   # bucket i's head region alone (BucketSpec.head)
    state.views(i)                     # read-only (copy-on-write) mmap views of the committed slot

The pipeline (pipeline.py) drives these; nothing here keeps state in RAM.

What is never done: overwrite a user's state without being asked. A state is created only
in directories that hold none of its files; a directory with data files or a spec but no
manifest, the state's manifest in another directory than the first, a data file of another
state, one too short or with a damaged header, are refused with what was found and what to
give instead. The only state opened over is one that was created and never committed (no
pass, no load: nothing of value), which a construction refused later, or a crash while
creating, can leave; a compact one is made anew then (its first pass writes in place, so
one cut short leaves buckets stepped under a manifest that says nothing was).

Checksums: every bucket slot has one (layout.slot_checksum: the CRC32 of the CRC32Cs of its
requests of `sum_bytes`, the manifest's "sum_algo"), computed by the I/O threads as they
write it, recorded in the manifest when the step commits, and verified whenever the slot is
read: by the pipeline's read-ahead, by `views` (state_dict(), a resume), and before a
rollback. A flipped bit in the files is an error naming the bucket and the file, never a
silently wrong state. A manifest whose checksums are of another algorithm is refused.

Head regions (layout.BucketSpec.head): a bucket's first tensors (the params of a streamed
block, kept in their state's bucket) can be read alone (`read_head`), by a forward on
another thread while a pass steps the state: their requests are the slot's first, so the
manifest keeps their checksum too ("head_sums"), and the range a head read has in flight
is pinned: a write into it (compact: room a commit freed meanwhile) waits for the read.

Two generations: a new state reserves on disk only the slots its first pass writes (one
of each bucket); the others once that pass committed ("unreserved", `_reserve_rest`), at the
latest as the next pass reads or writes its first bucket, so that a disk without room for
them says so before a step runs, the last one intact. By then the param files of the blocks
kept as heads gave back their room (nvme_heads.py), which the free-space check at creation
counts (`credit`). The manifest keeps both slots' checksums and the step the other slot held
when it was last current (`previous`), so that a state can be set back one step
(`rollback`) while that slot is intact: the ranks of a sharded run that died between their
commits agree on the older step that way (nvme_tier.py).

Compact (`compact=True`): one copy of each bucket in a ring per file with a few spare
extents (circular.py), and a redo log (redo.py) of what steps the buckets: ~1 x the state
plus the log on disk instead of 2 x. A step first writes the log of every bucket and
commits an intent naming it (`begin`); then each bucket is written somewhere free and
committed a few at a time (`commit_some`), its old copy free from then on. Killed at any
instant, the files hold step t whole (no intent), or step t+1's intent with each bucket
at t+1 or at t with its log record whole: `pending` names the latter, which the caller
steps again from their records (a step is a pure function of the bucket, its record and
the hyperparameters it holds), and the state is step t+1 whole. No previous step is kept:
`previous` is None. A load_state_dict into a committed compact state is not atomic: one
cut short leaves a manifest marked `loading`, refused at open with what to do. A new
compact state's first pass (nothing committed) has no log and writes in place: a crash in
it makes the state anew at the next open, and an error in it once a bucket is written
leaves files that hold no whole state, so every later pass and views() are refused until
the optimizer is built anew (abandon_pass), unless its caller sets the buckets it wrote back
to step 0 (restart_first_pass: a pass started in backward and abandoned, its params put
back). Its redo logs are made sparse, since that pass writes no record, and reserved once
it committed ("log_unreserved", `_reserve_rest`), at the latest as the next step logs.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import shutil
import threading
import uuid
import warnings
import weakref
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import direct_io, manifest
from .direct_io import (AlignedBuffer, IOPool, NvmeError, address_of, bytes_of, fixed_maps,
                        map_at, map_copy, map_file, open_direct, wait, warn_buffered)
from . import redo
from .circular import SPARES, Circular
from ..engine.worker import interrupts_deferred
from .fd_limit import open_fd
from .layout import (ALIGN, HEADER_BYTES, RENAMED, SLOTS, SUM_BYTES, Extent, StateSpec,
                     differences, param_names, place, round_up, slot_checksum)

DATA_FILE = "offload_adam_state.bin"
_HEADER_MAGIC = b"OFFLOAD_ADAM_NVME_STATE_1\n"
FORMAT = 2   # the manifest's: 2 adds the slots' checksums, `previous` and `written`
# What the requests' checksums are (direct_io.crc32): the standard CRC32C (csrc/crc32c.h).
SUM_ALGO = "crc32c"
OPEN_HELD = ("offload_adam: Ctrl-C held until the state files are open (a moment: they "
              "are being locked and opened, or created). To stop at once, kill the process")
# The tier's files in a directory (the lock is not state: any open makes one).
STATE_FILES = (DATA_FILE, manifest.MANIFEST, manifest.SPEC, redo.LOG_FILE)


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
        os.close(open_fd(probe, os.O_RDWR | os.O_CREAT))
    except PermissionError as e:
        raise PermissionError(f"offload_adam: the NVMe state directory {folder!r} is not "
                              f"writable by this process ({e.strerror})") from None
    return folder


def size_text(n: int) -> str:
    """Bytes in the unit that shows them (a 4 MB disk is not "0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


class OtherState(ValueError):
    """The files hold the state of other params (or of these under other names)."""


class Request(NamedTuple):
    """A bucket's read or write in flight: its futures give each SUM_BYTES chunk's CRC32C."""
    kind: str        # "reading" or "writing"
    bucket: int
    slot: int
    futures: list


class HeadRead(NamedTuple):
    """A read of a bucket's head region in flight (read_head)."""
    bucket: int
    want: Optional[int]   # its committed checksum (None: a state never written)
    futures: list
    pin: int              # its key in the pins (NvmeState._pins)


class NvmeState:
    """The state files of one optimizer (one rank): see the module's docstring."""

    def __init__(self, folders: List[str], spec: StateSpec, body: dict, fds: List[int],
                 locks: manifest.DirLocks, io: IOPool, buffered: List[str], created: bool):
        self.folders, self.spec = folders, spec
        self.buffered = buffered   # the folders that refused O_DIRECT (warned about once)
        self.paths = [os.path.join(f, DATA_FILE) for f in folders]
        self.extents, self.file_sizes = place(spec, len(folders))
        self._body, self._fds, self._locks, self._io = body, fds, locks, io
        self._created = created    # by this open: removed again by close(discard=True)
        # why nothing may read or write the files (the manifest on disk may not be _body,
        # a compact step or load cut short), and what to do then (None: resume from them)
        self._unsure: Optional[str] = None
        self._hint: Optional[str] = None
        self._moved_on: Optional[str] = None   # why no pass may run: params moved (two slots)
        # called with the buckets each commit made current (whole or some), once the
        # manifest is stored: the file store's heads (nvme_tier._HeadLink)
        self.on_commit: Optional[Callable[[List[int]], None]] = None
        self._sums: Dict[int, int] = {}      # checksums of the slots written, to commit
        self._head_sums: Dict[int, int] = {}   # (and of their head regions)
        # Head reads in flight (read_head, on another thread than the pass): key -> (file,
        # offset, bytes, futures). A write into a range one reads waits for it; the lock
        # makes "which copy is committed" and "pinned" one fact for both threads.
        self._pins: Dict[int, tuple] = {}
        self._pin_keys = itertools.count()
        self._lock = threading.Lock()
        # manifests written by this open: the committed bytes change only with one (a
        # write goes to a slot or extent no manifest names until it commits)
        self.commits = 0
        # the params whose masters the next commit holds as made from the params (a load
        # of a state dict without them): recorded in it, so that a resume does not take
        # them for the step's params (`from_params`)
        self.from_params_next: List[str] = []
        self.compact = body.get("layout") == "compact"
        self._log: Optional[redo.RedoLog] = None
        if self.compact:
            self.ring = Circular(spec, [e.file for e in self.extents], len(folders),
                                 body["spares"])
            self.file_sizes = self.ring.file_sizes()
            self._live: Dict[int, int] = {}   # written this pass, not committed: new offsets
            # A new state's first pass (nothing committed) writes in place, with no redo
            # log: the buckets it wrote, kept past an error (the files then hold no whole
            # state, and no later pass may read them), and whether that pass is a load
            self._in_place: List[int] = []
            self._in_place_load = False
            self._cut_first = False   # a first step cut short, restart_first_pass may undo
            self._new_pass()
            self._log = redo.RedoLog(folders, body["log_sizes"])
            self._logged: Dict[int, List[int]] = {}   # this step's records written so far
            # records being read ahead of the pass (record_ahead), by bucket: the future
            # and where it reads, so that it serves only the record it was asked for
            self._ahead: Dict[int, Tuple[tuple, object]] = {}
        # dropped unclosed (a construction interrupted once this was open), its files and
        # locks are let go when it is collected, not held to the process's end
        self._let_go = weakref.finalize(self, _let_go, io, fds, self._log, locks)
        self._let_go.atexit = False   # (at exit as before: the process's end lets go)

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, folders: Sequence[str], spec: StateSpec, io_threads: int = 4,
             compact: bool = False, log_bytes: Optional[Sequence[int]] = None,
             spares: int = SPARES, rank: Optional[int] = None,
             credit: Optional[Dict[int, int]] = None) -> "NvmeState":
        """The state in `folders` (one file each), created (all zero, step 0) where the
        directories hold none of its files; refused when they hold another spec's state,
        a state that cannot be trusted (module docstring), or are locked. `compact`: one
        copy and a redo log (module docstring), whose records of bucket i take about
        log_bytes[i] (the space reserved for them at creation; a larger record grows the
        log); a state of the other layout is refused with what to give. `rank`: the
        rank of a sharded run that opens it (None: one process), kept in a new state's
        manifest; a state another rank made is refused (_check_rank). `credit`: the bytes
        that the first commit gives back to each filesystem (st_dev), the param files'
        extents of the blocks kept as heads (nvme_heads.given_back): a new two-generation
        state, whose second slots are reserved only after that commit (`_reserve_rest`),
        is checked for free space against its peak with them."""
        if isinstance(folders, (str, os.PathLike)):
            folders = [folders]
        if not folders:
            raise ValueError("offload_adam: no NVMe state directory given")
        folders = [_check_folder(os.fspath(f)) for f in folders]
        if len(set(folders)) != len(folders):
            raise ValueError(f"offload_adam: an NVMe state directory is named twice: {folders}")
        direct_io.load_checksum()   # here: a failed build raises now, not in an I/O thread
        # Ctrl-C held while the files are locked and opened (a moment): one between a
        # descriptor's open and its keeping leaked it, and a lock file's kept the state
        # locked by this process until it ended (found from outside)
        state = None
        try:
            with interrupts_deferred(hold_all=OPEN_HELD):
                state = cls._open(folders, spec, io_threads, compact, log_bytes, spares,
                                  rank, credit or {})
        except BaseException:   # (a Ctrl-C held: raised once the state is open)
            if state is not None:
                state.close(discard=True)
            raise
        return state

    @classmethod
    def _open(cls, folders, spec, io_threads, compact, log_bytes, spares, rank, credit):
        locks = manifest.DirLocks(folders)
        fds: List[int] = []
        io = None
        fresh = False   # the directories held none of its files: a refusal removes them again
        try:
            body = _upgraded(manifest.read(folders[0]), folders[0])
            _check_rank(folders[0], body, rank)
            buffered: List[str] = []
            # A state never committed is opened over only in the two-slot layout, whose
            # first pass writes the other slots: a compact one's first pass writes in
            # place, so a crash in it leaves buckets stepped under a manifest of step 0.
            created = body is None or not _reusable(folders, body, spec) or (
                not body["written"] and (compact or body.get("layout") == "compact"))
            if body is None:
                _check_nothing_there(folders)
                fresh = True
            if created:
                layout = (compact, list(log_bytes or [0] * len(spec.buckets)), spares)
                body, fds = _create(folders, spec, buffered, layout, rank, credit)
            else:
                _check_layout(folders[0], body, compact)
                fds = _open_files(folders, body, buffered)
            warn_buffered(buffered)
            io = IOPool(io_threads, body["sum_bytes"])
            return cls(folders, spec, body, fds, locks, io, buffered, created)
        except BaseException:
            for fd in fds:
                os.close(fd)
            if io is not None:
                io.close()
            if fresh:
                _remove_state_files(folders)
            locks.release()
            raise

    def close(self, discard: bool = False) -> None:
        """Closes the files and drops the lock (the state stays as last committed).
        `discard`: a state this open created and nothing committed since is removed
        again (a refused construction leaves the directories as it found them)."""
        if self._io is None:
            return
        self._let_go.detach()
        self._io.close()
        for fd in self._fds:
            os.close(fd)
        if self._log is not None:
            self._log.close()
        if discard and self._created and not self._body["written"] \
                and self._locks.lost() is None:   # (else they may be another's now)
            _remove_state_files(self.folders)
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
    def uuid(self) -> str:
        """The state's identity, made with its files (the same across resumes)."""
        return self._body["uuid"]

    @property
    def run(self) -> Optional[str]:
        """The run whose ranks made these files: the first rank's uuid, agreed on by the
        ranks of a sharded run when they first opened them (nvme_tier._same_run), or None
        (one process, or files made before it was kept)."""
        return self._body.get("run")

    def join_run(self, run: str) -> None:
        """Records `run` (see `run`), in the manifest from the next commit on."""
        self._body["run"] = run

    @property
    def slots(self) -> List[int]:
        return list(self._body["slots"])

    @property
    def from_params(self) -> List[str]:
        """The params whose masters the last commit holds as the params were then, not
        as a step or a state dict made them: a load_state_dict of a dict without them
        (torch's, or an fp32 param's), not stepped since. The params a resume would set
        from them are what the model was at that load, not the step's."""
        return list(self._body.get("from_params") or [])

    @property
    def previous(self) -> Optional[int]:
        """The step the other slots held when they were last current (the commit before
        the last one), or None: a rollback target while those slots are intact (a pass
        started since overwrites them; `rollback` verifies them first)."""
        return self._body["previous"]

    # -- bucket I/O ----------------------------------------------------------------------

    def tensors(self, i: int, buf: AlignedBuffer) -> Dict[str, torch.Tensor]:
        """Bucket i's tensors as views of `buf` (which holds, or will hold, its extent)."""
        b = self.spec.buckets[i]
        return {t.name: buf.tensor[o:o + t.nbytes].view(t.dtype).view(t.shape)
                for t, o in zip(b.tensors, b.offsets())}

    def _at(self, i: int, slot: Optional[int] = None) -> int:
        """Where bucket i's committed copy (or `slot`, two-slot layout) is in its file."""
        if self.compact:
            return HEADER_BYTES + self._body["offsets"][i]
        return self.extents[i].at(self.slots[i] if slot is None else slot)

    def where(self, i: int) -> Extent:
        """Bucket i's committed copy: its file, offset and size."""
        return Extent(self.extents[i].file, self._at(i), self.extents[i].nbytes)

    def _runs(self, i: int) -> List[Tuple[int, int]]:
        """Bucket i's extent as the runs [a, b) its requests are cut from (each into chunks
        of sum_bytes): a head region on its own first, so that the checksums of its
        chunks are its own too (read_head checks it alone)."""
        n, head = self.extents[i].nbytes, self.spec.buckets[i].head_bytes
        return [(0, head), (head, n)] if 0 < head < n else [(0, n)]

    def _submit(self, how, i: int, buf: AlignedBuffer, at: int) -> list:
        fd = self._fds[self.extents[i].file]
        return [f for a, b in self._runs(i) for f in how(fd, buf.view[a:b], at + a)]

    def read(self, i: int, buf: AlignedBuffer) -> Request:
        """Starts reading bucket i's committed copy into `buf`."""
        self._check_stepping()
        self._reserve_rest()
        slot = 0 if self.compact else self.slots[i]
        return Request("reading", i, slot, self._submit(self._io.read, i, buf, self._at(i)))

    def read_head(self, i: int, buf: AlignedBuffer) -> HeadRead:
        """Starts reading the head region of bucket i's committed copy (BucketSpec.head: a
        streamed block's params, without their state) into `buf`; finish_head checks it.
        Safe beside a pass on another thread: the range read is pinned until the read is
        done, and a write into it (compact: its room freed by a commit meanwhile; two
        slots: the next pass's) waits for the read first (`_wait_pins`)."""
        self._check_sure()
        n = self.spec.buckets[i].head_bytes
        if not n:
            raise RuntimeError(f"offload_adam: internal error: bucket {i} has no head region")
        e = self.extents[i]
        with self._lock:
            at = self._at(i)
            slot = 0 if self.compact else self.slots[i]
            sums = self._body.get("head_sums", {}).get(str(i))
            futures = self._io.read(self._fds[e.file], buf.view[:n], at)
            key = next(self._pin_keys)
            self._pins[key] = (e.file, at, n, futures)
        return HeadRead(i, sums[slot] if sums else None, futures, key)

    def finish_head(self, req: HeadRead) -> None:
        """Waits for `req`; an I/O error, or bytes that do not match the head's committed
        checksum, raise naming the bucket and the file."""
        path = self.paths[self.extents[req.bucket].file]
        try:
            self._raise(wait(req.futures), f"reading the params of bucket {req.bucket}", path)
        finally:
            with self._lock:
                self._pins.pop(req.pin, None)
        got = slot_checksum([f.result() for f in req.futures])
        if req.want is not None and got != req.want:
            raise NvmeError(errno.EIO, f"offload_adam: the params kept in bucket {req.bucket} "
                            f"of the optimizer state in {path} are damaged: their bytes do "
                            f"not match the checksum committed with them ({SUM_ALGO} "
                            f"{got:#010x}, {req.want:#010x} expected). The file was changed "
                            "outside offload_adam, or the disk returned wrong data"
                            f"{self._stale_hint(path)}; the state cannot be trusted", path)

    def _wait_pins(self, file: int, at: int, nbytes: int) -> None:
        """Waits for the head reads in flight of any of [at, at + nbytes) of `file`."""
        with self._lock:
            for key in [k for k, pin in self._pins.items() if all(f.done() for f in pin[3])]:
                del self._pins[key]   # (done: finish_head may never be called for them)
            busy = [f for file_, start, n, futures in self._pins.values()
                    if file_ == file and start < at + nbytes and at < start + n
                    for f in futures]
        wait(busy)

    def write(self, i: int, buf: AlignedBuffer) -> Optional[Request]:
        """Starts writing `buf` as bucket i's next copy: into its other slot, or (compact)
        where the ring has room; None when that room is held by writes not committed yet
        (commit_some them, then ask again)."""
        self._check_stepping()
        e = self.extents[i]
        if not self.compact:
            self._reserve_rest()
            slot = 1 - self.slots[i]
            self._wait_pins(e.file, e.at(slot), e.nbytes)
            return Request("writing", i, slot, self._submit(self._io.write, i, buf, e.at(slot)))
        if not self._body["written"]:
            at = self._body["offsets"][i]   # a new state: in place (a crash makes it anew)
            self._in_place.append(i)
        else:
            if self._body["intent"] is None and not self._body["loading"]:
                raise RuntimeError("offload_adam: internal error: a bucket of a compact "
                                   "state written before its step's redo log (begin)")
            at = self.ring.allocate(i, self._body["offsets"], self._heads, self._live)
            if at is None:
                return None
            self._heads[e.file] = at + e.nbytes
        self._live[i] = at
        self._wait_pins(e.file, HEADER_BYTES + at, e.nbytes)
        return Request("writing", i, 0, self._submit(self._io.write, i, buf, HEADER_BYTES + at))

    def finish(self, req: Request) -> None:
        """Waits for `req`. An I/O error becomes an NvmeError naming the bucket, the file,
        and that the last completed step is intact; a slot read that does not match its
        committed checksum is one too. A write's checksum is kept for the commit."""
        path = self.paths[self.extents[req.bucket].file]
        self._raise(wait(req.futures), f"{req.kind} bucket {req.bucket}", path)
        crcs = [f.result() for f in req.futures]
        got = slot_checksum(crcs)
        if req.kind == "writing":
            self._sums[req.bucket] = got
            head = self.spec.buckets[req.bucket].head_bytes
            if head:
                self._head_sums[req.bucket] = slot_checksum(
                    crcs[:-(-head // self._body["sum_bytes"])])
        else:
            self._verify(req.bucket, req.slot, got, path)

    @staticmethod
    def wait(req: Optional[Request]) -> None:
        """Waits for `req` to be done, whatever its outcome (an error path's cleanup)."""
        if req is not None:
            wait(req.futures)

    def _verify(self, i: int, slot: int, got: int, path: str) -> None:
        want = self._body["sums"][i][slot]
        if want is not None and got != want:
            raise NvmeError(errno.EIO, f"offload_adam: bucket {i} of the optimizer state in "
                            f"{path} is damaged: its bytes (slot {slot}, "
                            f"{self.extents[i].nbytes} bytes at offset "
                            f"{self._at(i, slot)}) do not match the checksum committed "
                            f"with them ({SUM_ALGO} {got:#010x}, {want:#010x} expected). The file "
                            "was changed outside offload_adam, or the disk returned wrong "
                            f"data{self._stale_hint(path)}; the state cannot be trusted", path)

    def _stale_hint(self, path: str) -> str:
        """A file of a directory other than the first one checked against the manifest
        there: the manifest's directory may be the one put back from another time (a
        stripe restored alone), the file intact; said, not only the file blamed (found
        from outside)."""
        first = self.folders[0]
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(first):
            return ""
        return (f", or the first directory ({first}), whose manifest holds the checksums, "
                "was put back from another step than this one (the directories of a state "
                "are restored together)")

    def _raise(self, e: Optional[BaseException], what: str, path: str) -> None:
        if e is None:
            return
        if not isinstance(e, OSError):
            raise e
        hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        intent = self._body.get("intent")
        if intent is not None:   # compact: the step cannot go back, a resume finishes it
            left = (f"The files hold step {self.step} and the redo log of step "
                    f"{intent['step']}, which state_resume=True finishes (build the optimizer "
                    "again with it once the disk works)")
        elif self.compact and not self._body["written"] and self._in_place:
            cut = self._first_pass_cut()
            left = f"{cut[0].upper()}{cut[1:]}. {self._first_pass_hint()}"
        else:
            left = f"The state of step {self.step} (the last completed one) is intact on disk"
        raise NvmeError(e.errno, f"offload_adam: {what} of the optimizer state in {path} "
                        f"failed: {e.strerror or e}{hint}. {left}", path) from e

    def _flush(self, written: List[int]) -> None:
        missing = [i for i in written if i not in self._sums]
        if missing:
            raise RuntimeError(f"offload_adam: internal error: buckets {missing} committed "
                               "before their writes finished")
        for fd, path in zip(self._fds, self.paths):
            try:
                os.fsync(fd)
            except OSError as e:
                self._raise(e, "flushing", path)

    def commit(self, written: Iterable[int], step: Optional[int] = None) -> None:
        """Makes the slots just written (and finished) current: fsync every file, then the
        manifest, with their checksums. `step`: the completed step count to record
        (default: one more; compact: the intent's). Compact: the pass is whole, its intent
        and redo records done with."""
        written = list(written)
        if self.compact:   # (those not committed as the pass went)
            written = [i for i in written if i in self._live]
        self._flush(written)
        if self.compact:
            body = self._moved(written)
            if step is None:
                step = (body["intent"]["step"] if body["intent"] is not None
                        else self.step + 1)
            body.update(written=True, step=int(step), intent=None, done=[], loading=False,
                        from_params=self.from_params_next)
            self._store(body, "committing the step")
            self.from_params_next = []
            self._live = {}
            self._in_place, self._in_place_load = [], False
            self.forget_log()
            self._committed(written)
            try:   # (after the heads gave the param files' extents back: their room)
                self._reserve_rest()
            except NvmeError:
                pass   # (the step is committed; the next step tries again, and says why)
            return
        body = dict(self._body)
        slots = list(body["slots"])
        sums = [list(s) for s in body["sums"]]
        for i in written:
            slots[i] = 1 - slots[i]
            sums[i][slots[i]] = self._sums.pop(i)
        self._add_head_sums(body, {i: slots[i] for i in written})
        # the old slots are a whole earlier step only when every bucket moved on, and
        # only a committed one with checksums (not the zeros of a new state)
        whole = (len(set(written)) == len(slots) and self._body["written"]
                 and all(s[1 - c] is not None for s, c in zip(sums, slots)))
        body.update(slots=slots, sums=sums, written=True,
                    step=self.step + 1 if step is None else int(step),
                    previous=self.step if whole else None, from_params=self.from_params_next)
        self._store(body, "committing the step")
        self.from_params_next = []
        self._committed(written)
        try:   # (after the heads gave the param files' extents back: their room)
            self._reserve_rest()
        except NvmeError:
            pass   # (the step is committed; the next pass tries again, and says why)

    def _reserve_rest(self) -> None:
        """Two generations: a state made with only its first pass's slots reserved
        ("unreserved": _create) reserves the rest once that pass committed, at the latest
        as the next pass reads or writes its first bucket, before it steps anything: a
        full disk is said then, the last completed step intact, never mid-pass. Compact:
        so its redo logs ("log_unreserved"), at the latest as the next step logs."""
        if not self._body["written"]:
            return
        if self._body.get("log_unreserved"):
            self._reserving(self._log.reserve, f"the redo logs {self._log.paths} of the "
                            f"compact optimizer state ({size_text(sum(self._log.sizes))} in "
                            "all)", self._log.paths[0])
            with self._lock:
                self._body = dict(self._body, log_unreserved=False)
        if not self._body.get("unreserved"):
            return
        for fd, path, size in zip(self._fds, self.paths, self.file_sizes):
            self._reserving(lambda: os.posix_fallocate(fd, 0, size), f"the second generation "
                            f"of the optimizer state file {path} ({size_text(size)} in all)",
                            path)
        with self._lock:   # (written to the manifest by the next commit)
            self._body = dict(self._body, unreserved=False)

    def _reserving(self, reserve: Callable[[], None], what: str, path: str) -> None:
        """reserve(); an OSError (a full disk) is said as `what` not reserved, with the
        last completed step intact and nothing of the next one written."""
        try:
            reserve()
        except OSError as e:
            hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
            raise NvmeError(e.errno, f"offload_adam: reserving {what} failed: "
                            f"{e.strerror or e}{hint}. The state of step {self.step} (the "
                            "last completed one) is intact on disk, and nothing of the next "
                            "step was written: make room and step again", path) from e

    def _committed(self, written: List[int]) -> None:
        if self.on_commit is not None and written:
            self.on_commit(written)

    # -- compact: the redo log, committing as the pass goes -------------------------------

    def _moved(self, written: List[int]) -> dict:
        """The manifest with buckets `written` (finished) at their new copies."""
        body = dict(self._body)
        offsets, heads = list(body["offsets"]), list(body["heads"])
        sums = [list(s) for s in body["sums"]]
        done = set(body["done"])
        for i in sorted(written):   # (in the pass's order: the last one is the head)
            offsets[i] = self._live.pop(i)
            sums[i][0] = self._sums.pop(i)
            heads[self.extents[i].file] = offsets[i] + self.extents[i].nbytes
            done.add(i)
        self._add_head_sums(body, {i: 0 for i in written})
        body.update(offsets=offsets, heads=heads, sums=sums, done=sorted(done))
        return body

    def _add_head_sums(self, body: dict, slots: Dict[int, int]) -> None:
        """Into manifest `body`: the head checksums of the buckets written (bucket -> the
        slot it was written to), kept only where buckets have heads."""
        head_sums = {k: list(v) for k, v in body.get("head_sums", {}).items()}
        for i, slot in slots.items():
            if i in self._head_sums:
                head_sums.setdefault(str(i), [None] * SLOTS)[slot] = self._head_sums.pop(i)
        if head_sums:
            body["head_sums"] = head_sums

    def commit_some(self, written: Iterable[int]) -> None:
        """Compact: buckets `written` (finished) are at their new copies from now on, and
        their old ones free; the step stays the intent's to finish."""
        written = list(written)
        if not self._body["written"]:
            return   # a new state's first pass: in place, committed whole at its end
        self._flush(written)
        self._store(self._moved(written), "committing buckets")
        self._committed(written)

    def log_record(self, i: int, record: "redo.Record") -> None:
        """Compact: writes bucket i's redo record of the coming step now (step_in_backward:
        as its grads complete), durable at `begin`; `record(i)` reads it back."""
        self._check_stepping()
        self._reserve_rest()
        self._logged[i] = self._log.append(self.extents[i].file, record)

    def forget_log(self) -> None:
        """The records written for a step that will not run (its pass abandoned)."""
        if self._log is not None:
            self._logged = {}
            self._ahead = {}   # (a read still in flight finishes unused)
            self._log.reset()

    def begin(self, step: int, records: Dict[int, "redo.Record"],
              meta: Optional[dict] = None) -> None:
        """Compact: writes the redo records (redo.py: what steps each bucket to `step`)
        of the buckets not logged yet, makes them all durable and commits the intent
        naming them, with `meta` (what every record is stepped with); until then nothing
        of the step is written. A new state (nothing committed) needs no intent (a crash
        makes it anew), but a record logged stays readable for the pass."""
        self._check_stepping()
        if not self._body["written"]:
            return
        self._reserve_rest()
        if sorted(set(records) | set(self._logged)) != list(range(len(self.spec.buckets))):
            raise RuntimeError("offload_adam: internal error: a step's redo log must have "
                               "a record for every bucket")
        for i in sorted(records):
            self.log_record(i, records[i])
        self._log.sync()
        body = dict(self._body)
        body.update(intent={"step": int(step), "meta": meta or {},
                            "log": {str(i): v for i, v in sorted(self._logged.items())}},
                    done=[])
        self._store(body, "committing the redo log")
        self._new_pass()

    def _new_pass(self) -> None:
        """Compact: no write of a pass yet; the ring's head where the manifest has it."""
        self._live = {}
        self._heads = list(self._body["heads"])

    @property
    def moved(self) -> bool:
        """Compact: whether a bucket of the step begun is committed at its new copy (from
        then on the step can only be finished, not dropped)."""
        return bool(self.compact and self._body["intent"] is not None and self._body["done"])

    def drop_intent(self) -> None:
        """Compact: forgets a step begun and not moved (its records written, no bucket
        committed): the files stay the whole step before it."""
        if self.moved:
            raise RuntimeError("offload_adam: internal error: a step whose buckets moved "
                               "cannot be dropped")
        if self.compact and self._body["intent"] is not None:
            body = dict(self._body)
            body.update(intent=None, done=[])
            self._store(body, "dropping a step begun")

    @property
    def intent_meta(self) -> dict:
        """Compact: the meta the step's intent was committed with (`begin`)."""
        return self._body["intent"]["meta"]

    def begin_load(self) -> None:
        """Compact: a whole new state is written next (load_state_dict), with no way back:
        marked so, a load cut short is refused at open (not taken for a step)."""
        self._check_stepping()
        if self._body["written"] and not self._body["loading"]:
            body = dict(self._body)
            body.update(loading=True, intent=None, done=[])
            self._store(body, "starting to load a state")
        self._in_place_load = not self._body["written"]
        self._new_pass()

    @property
    def logs_steps(self) -> bool:
        """Whether a step must `begin` with its redo log (compact, once committed)."""
        return self.compact and self._body["written"]

    @property
    def pending(self) -> List[int]:
        """Compact: the buckets of a step cut short still to step from their records
        (none when the files hold a whole step)."""
        if not self.compact or self._body["intent"] is None:
            return []
        done = set(self._body["done"])
        return [i for i in range(len(self.spec.buckets)) if i not in done]

    @property
    def intent_step(self) -> Optional[int]:
        """Compact: the step the buckets `pending` are to be brought to, or None."""
        intent = self._body["intent"] if self.compact else None
        return None if intent is None else intent["step"]

    def record(self, i: int) -> Tuple[dict, Dict[str, torch.Tensor]]:
        """Bucket i's redo record of the step cut short: (meta, {name: tensor}); read
        by record_ahead(i) before, if it was asked, its error raised here."""
        where = self._where_logged(i)
        ahead = self._ahead.pop(i, None)
        if ahead is not None and ahead[0] == where:
            return ahead[1].result()
        return self._log.read(*where)

    def record_ahead(self, i: int) -> None:
        """Starts reading bucket i's record (and checking its checksum) on an I/O thread,
        for record(i) to take: the pass reads the grads logged in backward a few buckets
        ahead, as the state's slots, instead of one at a time between its kernels."""
        where = self._where_logged(i)
        if self._ahead.get(i, (None,))[0] != where:   # (not started, or for another record)
            self._ahead[i] = (where, self._io.call(self._log.read, *where))

    def _where_logged(self, i: int) -> tuple:
        if i in self._logged:
            offset, nbytes, crc = self._logged[i]
        else:
            offset, nbytes, crc = self._body["intent"]["log"][str(i)]
        return self.extents[i].file, offset, nbytes, crc, i

    def abandon_pass(self, lent: bool = True) -> None:
        """A pass stopped by an error: its writes not committed are forgotten (their room
        is free again). Compact: a step begun is finished by a resume once it `lent` a
        bucket to be stepped (params moved) or committed one; one that did neither is
        dropped (nothing of it ran: the files hold the step before, the next step logs
        again). A load cut short is said to be one. A new state's first pass (step or
        load) that wrote a bucket in place has nothing to finish it from: every later
        pass, and state_dict(), is refused until the optimizer is built anew."""
        self._sums, self._head_sums = {}, {}
        if self.compact:
            self._ahead = {}
            self._new_pass()
            if not self._body["written"] and self._in_place:
                # No redo log to finish it from, and the manifest's step 0 is not what
                # the buckets written hold any more: a next pass would step those twice
                # (unless they are set back to it: restart_first_pass)
                self._cut_first = self._unsure is None and not self._in_place_load
                self._unsure = self._unsure or self._first_pass_cut()
                self._hint = self._hint or self._first_pass_hint()
            elif self._body["loading"]:
                self._unsure = self._unsure or (
                    "a load_state_dict into the compact state files was cut short by an "
                    "error: they hold part of the loaded state and part of the one before")
                self._hint = ("The state dict you loaded is unchanged: remove these files, "
                              "build the optimizer without state_resume and load it again")
            elif self._body["intent"] is not None and (lent or self.moved):
                self._unsure = self._unsure or (
                    "a step of the compact state files was cut short by an error after its "
                    "redo log was written")
            elif self._body["intent"] is not None and not self._unsure:
                try:
                    self.drop_intent()
                except OSError:
                    return   # (_store said so: _unsure, as a resume finishes it)
                self.forget_log()

    def restart_first_pass(self) -> None:
        """A new state's first step cut short (abandon_pass) whose buckets written in place
        are set back to step 0, zeros (what a new state's files hold: its masters start
        from the params, marks.forget, its moments at zero), so that the next step runs it
        again: a pass started in backward and abandoned (step_in_backward: disk_early.py,
        as two generations' other slots are left unused). Nothing to do, or the files
        unsure for another reason: as they are. An error writing them: they stay unsure."""
        if not self.compact or not self._cut_first:
            return
        self._cut_first = False
        largest = max(self.extents[i].nbytes for i in self._in_place)
        zeros = AlignedBuffer(largest, pin=False)
        try:
            zeros.view[:] = bytes(largest)
            for i in sorted(set(self._in_place)):
                e = self.extents[i]
                at = HEADER_BYTES + self._body["offsets"][i]
                self._raise(wait(self._io.write(self._fds[e.file], zeros.view[:e.nbytes], at)),
                            f"setting bucket {i} back to step 0", self.paths[e.file])
        finally:
            zeros.close()
        self._in_place = []
        self._unsure = self._hint = None

    def _first_pass_cut(self) -> str:
        """Why a new compact state cut short in its first pass holds no state."""
        what = "load_state_dict into" if self._in_place_load else "first step of"
        return (f"the {what} the new compact state files in {self.folders} was cut short "
                "by an error after it had begun writing buckets "
                f"{sorted(set(self._in_place))} in place (a new state's first pass has no "
                "redo log, and nothing is committed before it ends): the files hold no "
                "whole state, neither step 0 nor step 1")

    def _first_pass_hint(self) -> str:
        if self._in_place_load:
            return ("The state dict you loaded is unchanged: build the optimizer anew over "
                    "these directories (a state never committed is made anew) and load it "
                    "again")
        return ("No step was completed: set the params again (load the model; those of the "
                "buckets stepped moved) and build the optimizer anew over these directories "
                "(a state never committed is made anew)")

    def params_ahead(self, cause=None) -> None:
        """A pass that had stepped some params failed (its caller says so: the params it
        stepped moved, the files did not), with `cause`, what stopped it (an error or its
        message), named in the refusals after (a GradScaler used with step_in_backward read
        as a disk's failure without it: found from outside). No step may run on them: a
        resume sets them from the files, or (no step completed) they are the user's to set.
        (A compact state once committed needs nothing here: its step is finished by a
        resume, from its redo log, abandon_pass; a new one's first pass has no log.)"""
        if (self.compact and self._body["written"]) or self._moved_on:
            return
        why = ""
        if cause is not None:
            first = (str(cause).splitlines() or [""])[0]
            first = first[:300] + ("..." if len(first) > 300 else "")
            why = (f" ({first})" if isinstance(cause, str)
                   else f" ({type(cause).__name__}: {first})")
        self._moved_on = (
            f"offload_adam: a step of the state files failed{why} after it had stepped some "
            f"params, which are now ahead of the files (they hold step {self.step}). " + (
                f"Build the optimizer again with state_resume=True to continue from step "
                f"{self.step}: it sets the params from the files" if self.step else
                "No step was completed: set the params again (load the model) and build "
                "the optimizer anew over these directories"))

    def _check_stepping(self) -> None:
        """Before a pass reads or writes a bucket (its state dict's views may be read)."""
        self._check_sure()
        if self._moved_on:
            raise RuntimeError(self._moved_on)
        if not self._sums and not (self.compact and self._live):
            self._check_held()   # a pass (or its part since a commit) not writing yet

    def rollback(self) -> None:
        """Makes the previous generation current again (step `previous`), after checking
        that every slot of it is intact; raises NvmeError naming a damaged one."""
        if self.previous is None or self.compact:
            raise RuntimeError("offload_adam: internal error: no previous step to go back to")
        self._check_sure()
        for i in range(len(self.spec.buckets)):
            self._verify_slot(i, 1 - self.slots[i])
        body = dict(self._body)
        body.update(slots=[1 - s for s in body["slots"]], step=body["previous"],
                    previous=None)   # the generation left is a later step, not an earlier
        self._store(body, "going back to the previous step")

    def _store(self, body: dict, what: str) -> None:
        self._check_held()
        self._check_in_place()
        path = os.path.join(self.folders[0], manifest.MANIFEST)
        try:
            manifest.commit(self.folders[0], body)
        except OSError as e:
            # the rename may or may not have happened: which slots are current is unknown
            # here, and writing either could overwrite the committed ones
            self._unsure = f"{what} to {path} failed ({e.strerror or e})"
            self._raise(e, what, path)
        with self._lock:   # (read_head: which copy is committed, and its checksum)
            self._body = body
        self.commits += 1

    def _check_in_place(self) -> None:
        """The data files at their paths are the ones open here: a manifest committed
        beside another file (the directory removed and made again, its files replaced)
        would name slots this state never wrote, and the steps written into the open,
        unlinked files would be lost at the process's end, each reported as committed."""
        for path, fd in zip(self.paths, self._fds):
            held = os.fstat(fd)
            try:
                there = os.stat(path)
                same = (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)
            except FileNotFoundError:
                same = False
            if not same or held.st_nlink == 0:
                self._unsure = (f"{path} is no longer the state file this optimizer opened "
                                "(its directory was removed or emptied, or the file replaced, "
                                "since the optimizer was built)")
                self._hint = ("Build the optimizer again: over the directory's files put "
                              "back, or over an empty directory to start over")
                raise NvmeError(errno.ESTALE, f"offload_adam: {self._unsure}: step "
                                f"{self.step + 1} was not committed, and no step can be. The "
                                "state this optimizer stepped is lost with the files; put "
                                "back the directory's files to resume from them, or build "
                                "the optimizer again over an empty directory to start over",
                                path)

    def _check_held(self) -> None:
        """The lock files are still the ones this optimizer locked: one removed under it
        (a cleanup of "stale" locks) lets another process lock a new one and step these
        files; ours, written after, would commit a manifest of our step over its own and
        lose both (manifest.DirLocks). Refused before anything more is written: a stat
        per folder, as a pass starts and at each commit."""
        lost = self._locks.lost()
        if lost is None:
            return
        self._check_in_place()   # (the state files gone with it, or replaced: that says more)
        folder, why = lost
        self._unsure = why
        self._hint = (f"This optimizer stopped before committing step {self.step + 1} and "
                      f"writes nothing more there. Make sure no other process uses "
                      f"{folder!r} (a cleanup must not remove the lock file of a live run), "
                      "then build the optimizer again with state_resume=True to continue "
                      "from the step on disk")
        raise NvmeError(errno.ESTALE, f"offload_adam: {self._unsure}. {self._hint}",
                        os.path.join(folder, manifest.LOCK))

    def _check_sure(self) -> None:
        if self._unsure:
            if self._hint:
                raise RuntimeError(f"offload_adam: {self._unsure}. {self._hint}")
            raise RuntimeError(f"offload_adam: {self._unsure}, so which step the files hold "
                               "is not known here. Build the optimizer again with "
                               "state_resume=True to continue from the step on disk")

    # -- reading without the pipeline ----------------------------------------------------

    def _verify_slot(self, i: int, slot: int) -> None:
        """Reads bucket i's `slot` (through the page cache) and checks its checksum."""
        e = self.extents[i]
        path = self.paths[e.file]
        chunk = self._body["sum_bytes"]
        crcs = []
        start = self._at(i, slot)
        with open(path, "rb", buffering=0) as f:
            for a, b in self._runs(i):
                for at in range(a, b, chunk):
                    data = os.pread(f.fileno(), min(chunk, b - at), start + at)
                    if len(data) != min(chunk, b - at):
                        self._raise(OSError(errno.EIO, "unexpected end of file"),
                                    f"reading bucket {i}", path)
                    crcs.append(direct_io.crc32(data))
        self._verify(i, slot, slot_checksum(crcs), path)

    def views(self, i: int, previous: bool = False) -> Dict[str, torch.Tensor]:
        """Bucket i's committed tensors memory-mapped from its file, copy-on-write: writes to
        them stay in this process and never reach the files. Each tensor has its own
        storage, so torch.save writes just its bytes, paged in as it goes. The slot is
        checked against its checksum first (a read of the extent, which the page cache
        then serves to the mappings). They keep these values through the next step; the
        step after it rewrites their slot: save them before then (compact: its one copy
        moves at the next step, which may write over them). `previous`: the other
        slot, the bucket at step `previous` (while it is whole)."""
        self._check_sure()
        if self.compact and previous:
            raise RuntimeError("offload_adam: internal error: a compact state keeps no "
                               "previous step")
        slot = 0 if self.compact else self.slots[i] if not previous else 1 - self.slots[i]
        self._verify_slot(i, slot)
        e = self.extents[i]
        b = self.spec.buckets[i]
        out = {}
        first = self._at(i, slot)
        with open(self.paths[e.file], "rb") as f:
            # The bucket mapped once, into a range of our own: no descriptor kept and one
            # mapping a bucket, not a tensor (Python's mmap keeps a descriptor each: a dict
            # of many params, an MoE with a Linear per expert, passed the open files'
            # limit, and at 13,000 params of 5 tensors, 8-bit moments, the kernel's 65,530
            # mappings a process). Each tensor has a storage of its own.
            got = map_copy(f.fileno(), first, e.nbytes)
            if got is not None:
                region, at = got
                for t, o in zip(b.tensors, b.offsets()):
                    out[t.name] = (torch.frombuffer(bytes_of(region, at + o, t.nbytes),
                                                    dtype=t.dtype).view(t.shape)
                                   if t.nbytes else torch.empty(t.shape, dtype=t.dtype))
                return out
            for t, o in zip(b.tensors, b.offsets()):
                start = first + o
                page = start - start % mmap.ALLOCATIONGRANULARITY
                if t.nbytes == 0:
                    out[t.name] = torch.empty(t.shape, dtype=t.dtype)
                    continue
                m = map_file(f.fileno(), start - page + t.nbytes, page)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")   # "non-writable buffer": it is writable
                    out[t.name] = torch.frombuffer(m, dtype=t.dtype, count=t.numel,
                                                   offset=start - page).view(t.shape)
        return out

    def joined(self, parts: Sequence[Tuple[int, str]],
               verified: bool = False) -> Optional[torch.Tensor]:
        """The committed tensors `parts` ((bucket, tensor name) each, of one dtype) side by
        side as one flat tensor, memory-mapped copy-on-write as views() maps them, with no
        copy: each part's pages mapped into one range (a param in parts, nvme_tier.py: its
        parts' masters and moments start on a page, layout.TensorSpec.align). None where
        they cannot be (not Linux; a part not on a page, or one but the last of a length
        not whole pages): the caller joins copies then. `verified`: the caller has just
        checked the parts' slots (views() of their buckets), so they are not read again."""
        if not parts or not fixed_maps():
            return None
        self._check_sure()
        page, places, total, dtype = mmap.PAGESIZE, [], 0, None
        for k, (i, name) in enumerate(parts):
            slot = 0 if self.compact else self.slots[i]
            if not verified:
                self._verify_slot(i, slot)
            b = self.spec.buckets[i]
            index = [t.name for t in b.tensors].index(name)
            t, start = b.tensors[index], self._at(i, slot) + b.offsets()[index]
            dtype = dtype or t.dtype
            if (start % page or total % page or t.dtype != dtype
                    or (k < len(parts) - 1 and t.nbytes % page)):
                return None
            places.append((self.extents[i].file, start, total, t.nbytes))
            total += t.nbytes
        region = mmap.mmap(-1, -(-total // page) * page,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = address_of(region)
        for file, start, at, nbytes in places:
            with open(self.paths[file], "rb") as f:
                map_at(base + at, -(-nbytes // page) * page, f.fileno(), start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "non-writable buffer": it is writable
            return torch.frombuffer(region, dtype=dtype,
                                    count=total // torch.empty((), dtype=dtype).element_size())


# -- finding, creating and checking the files ---------------------------------------------

def _upgraded(body: Optional[dict], folder: str) -> Optional[dict]:
    """A manifest of an earlier version in this version's form: its slots have no
    checksums yet (each gets one when it is next written), no previous step is known,
    and it was committed. One with checksums of another algorithm than SUM_ALGO is
    refused: they cannot be verified here."""
    if body is None:
        return None
    if body.get("format") == FORMAT:
        algo = body.get("sum_algo", "crc32 (zlib, before sum_algo was recorded)")
        if algo != SUM_ALGO:
            raise ValueError(f"offload_adam: the optimizer state in {folder!r} was checksummed "
                             f"with {algo}; this version of offload_adam computes and verifies "
                             f"{SUM_ALGO} and cannot check it. Resume it with the version that "
                             "wrote it and save a state_dict(), or remove its files "
                             f"({', '.join(STATE_FILES)}) to start afresh")
        return body
    n = len(body["slots"])
    return {**body, "format": FORMAT, "sums": [[None] * SLOTS for _ in range(n)],
            "previous": None, "written": True, "sum_bytes": SUM_BYTES, "sum_algo": SUM_ALGO}


def _reusable(folders: List[str], body: dict, spec: StateSpec) -> bool:
    """Whether the state of manifest `body` (in folders[0]) is this spec's; False for a
    state created and never committed (it is made anew); a committed state of another
    spec, or one whose files do not fit its manifest, is refused (raises)."""
    stored = manifest.read(folders[0], manifest.SPEC)
    fits = stored is not None and StateSpec.from_json(stored).digest() == body["spec_sha256"]
    if not body["written"]:
        # nothing was ever committed here: a different spec, or files a crash while
        # creating left unfinished, are made anew; but never over a data file of another
        # state (one with a header of its own)
        for folder in folders:
            head = _read_header(os.path.join(folder, DATA_FILE))
            if head == "damaged" or (isinstance(head, dict) and head["uuid"] != body["uuid"]):
                raise ValueError(f"offload_adam: {_header_problem(folder, 0, body)}; the "
                                 f"manifest in {folders[0]!r} is of a state never "
                                 "committed. Give the directories of one state, or remove "
                                 f"their state files ({', '.join(STATE_FILES)}) to start "
                                 "afresh")
        return fits and differences(StateSpec.from_json(stored), spec) == [] and all(
            _header_problem(f, k, body) is None for k, f in enumerate(folders)) and len(
            folders) == len(body["folders"])
    if not fits:
        raise manifest.ManifestError(f"offload_adam: {os.path.join(folders[0], manifest.SPEC)}"
                                     " is missing or is not the one its manifest names")
    diff = differences(StateSpec.from_json(stored), spec)
    if diff and diff[0].startswith(RENAMED):
        raise OtherState(f"offload_adam: {folders[0]!r} holds the optimizer state of "
                         f"{diff[0]}; nothing was changed")
    if diff:
        raise OtherState(f"offload_adam: {folders[0]!r} holds the optimizer state of another "
                         f"model or optimizer: {'; '.join(diff)}"
                         f"{_bucket_mb_hint(StateSpec.from_json(stored), spec)}. "
                         "Point the optimizer at a "
                         "directory without state (that state stays as it is), or, if it is "
                         f"no longer wanted, remove its files ({', '.join(STATE_FILES)}) to "
                         "start afresh")
    return True


def _bucket_mb_hint(found: StateSpec, wanted: StateSpec) -> str:
    """Why the buckets may differ where the model does not: bucket_mb lays them out."""
    if (found.state_format != wanted.state_format or found.extra != wanted.extra
            or set(param_names(found)) != set(param_names(wanted))):
        return ""
    tensors = [[t for b in s.buckets for t in b.tensors] for s in (found, wanted)]
    if tensors[0] == tensors[1]:
        return (" (the same tensors, in other buckets: this optimizer's bucket_mb is not "
                "the one the state was made with; give that one)")
    if len(found.buckets) != len(wanted.buckets):
        return (" (if the model is the same, was bucket_mb changed? It lays out the buckets: "
                "give the one the state was made with)")
    return ""


def _check_nothing_there(folders: List[str]) -> None:
    """Before creating a state: none of the directories holds any of a state's files.
    A manifest found in another one than the first means the directories were given in
    another order; data files or a spec without a manifest are a state that cannot be
    trusted. Either is refused: creating would overwrite it."""
    for k, folder in enumerate(folders[1:], 1):
        body = manifest.read(folder)
        if body is not None:
            raise ValueError(
                f"offload_adam: the optimizer state's manifest ({manifest.MANIFEST}) is in "
                f"{folder!r}, directory {k} of those given, and must be in the first: give "
                f"the directories in the order the state was made with: {body['folders']}")
    for folder in folders:
        found = [n for n in STATE_FILES if os.path.exists(os.path.join(folder, n))]
        if not found:
            continue
        head = _read_header(os.path.join(folder, DATA_FILE))
        made = (f"; it is file {head['file']} of a state striped over {head['files']} "
                f"directories" + (f", made as {head['folders']}" if "folders" in head else "")
                if isinstance(head, dict) else "")
        raise ValueError(
            f"offload_adam: {folder!r} holds optimizer state files ({', '.join(found)}) but "
            f"no manifest ({manifest.MANIFEST}) in the first directory given{made}. A state "
            "is never overwritten by a new one: give its directories in the order it was "
            "made (the first holds the manifest), restore a manifest that was deleted or "
            "not copied, or remove these files to start afresh")


def _header(body: dict, index: int) -> bytes:
    head = {"uuid": body["uuid"], "file": index, "files": len(body["folders"]),
            "spec_sha256": body["spec_sha256"], "folders": body["folders"]}
    data = _HEADER_MAGIC + json.dumps(head).encode()
    if len(data) > HEADER_BYTES:   # (the folders are a hint for errors only)
        del head["folders"]
        data = _HEADER_MAGIC + json.dumps(head).encode()
    return data


def _unmark(path: str) -> None:
    """Zeroes the header of data file `path`, durably, where there is one (a state never
    committed, about to be made anew: _create's callers refuse any other state's)."""
    try:
        fd = open_fd(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size:
            os.pwrite(fd, bytes(min(HEADER_BYTES, size)), 0)
            os.fsync(fd)
    except OSError as e:
        raise NvmeError(e.errno, f"offload_adam: could not make the optimizer state file "
                        f"{path} anew: {e.strerror or e}", path) from e
    finally:
        os.close(fd)


def _read_header(path: str):
    """The header of data file `path` as a dict, "damaged" when it is not one,
    "unwritten" when it is all zero (reserved by a creation cut short), or None when
    there is no file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        return None
    if not raw.strip(b"\0"):
        return "unwritten"   # reserved, its header not yet written: a creation cut short
    if not raw.startswith(_HEADER_MAGIC):
        return "damaged"
    try:
        head = json.loads(raw[len(_HEADER_MAGIC):].rstrip(b"\0"))
    except ValueError:
        return "damaged"
    return head if isinstance(head, dict) and {"uuid", "file"} <= set(head) else "damaged"


def _header_problem(folder: str, k: int, body: dict) -> Optional[str]:
    """Why the data file in `folder` is not file k of the state of `body`, or None."""
    path = os.path.join(folder, DATA_FILE)
    head = _read_header(path)
    if head is None:
        return (f"{path} (file {k} of the state whose manifest is in "
                f"{body['folders'][0]!r}) is missing")
    if head in ("damaged", "unwritten"):
        return (f"{path} is damaged: its header is not an offload_adam state file's. The "
                "state cannot be trusted")
    if head["uuid"] != body["uuid"]:
        return (f"{path} belongs to another optimizer state than the manifest in the first "
                "directory given (a file copied or swapped from another run?)")
    if head["file"] != k:
        return (f"{path} is file {head['file']} of the state, given as directory {k}: give "
                f"the directories in the order the state was made with: {body['folders']}")
    return None


def _remove_state_files(folders: Sequence[str]) -> None:
    for folder in folders:
        for name in STATE_FILES:
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass


def _check_rank(folder: str, body: Optional[dict], rank: Optional[int]) -> None:
    """A rank's state is its shards': a state that rank M made, opened by rank R (the
    rank<R> folders renamed or copied across, with shards of one shape: uneven ones fail
    the spec's check), would step rank R's shards with rank M's moments. Refused, naming
    both; a state made before the rank was kept, or by one process, is not checked."""
    made = None if body is None else body.get("rank")
    if made is None or rank is None or made == rank:
        return
    raise ValueError(
        f"offload_adam: the optimizer state in {folder!r} was made by rank {made} of a "
        f"sharded run, and rank {rank} opened it: each rank resumes the state of its own "
        f"shards, in the folder rank<R> of its rank R. Were the rank folders renamed, or "
        f"copied from one rank's to another's? Put rank {made}'s state back in a folder "
        f"rank{made}. Nothing was changed")


def _create(folders: List[str], spec: StateSpec, buffered: List[str], layout,
            rank: Optional[int] = None, credit: Optional[Dict[int, int]] = None):
    """A new state: the spec and a manifest that says nothing was committed yet go first
    (a crash before the data files are whole leaves a state that is made anew), then the
    data files, reserved whole (compact: and the redo logs). `layout`: (compact, the
    redo bytes of each bucket, spares). Two generations: only the slots the first pass
    writes are reserved now ("unreserved"), the others after its commit (_reserve_rest),
    which gives back the param files' extents of the blocks the heads keep (`credit`, per
    st_dev): the state's second generation takes their room, not room beside them."""
    compact, log_bytes, spares = layout
    extents, sizes = place(spec, len(folders))
    body = {"format": FORMAT, "uuid": uuid.uuid4().hex, "folders": folders,
            "spec_sha256": spec.digest(), "step": 0, "slots": [0] * len(spec.buckets),
            "file_sizes": sizes, "sums": [[None] * SLOTS for _ in spec.buckets],
            "previous": None, "written": False, "sum_bytes": SUM_BYTES, "sum_algo": SUM_ALGO,
            "rank": rank}
    logs = [0] * len(folders)
    if compact:
        ring = Circular(spec, [e.file for e in extents], len(folders), spares)
        sizes = ring.file_sizes()
        logs = redo.log_sizes([e.file for e in extents], log_bytes, len(folders))
        # (the logs sparse until the first pass committed: it writes no record)
        body.update(layout="compact", spares=spares, file_sizes=sizes,
                    offsets=ring.first_offsets(), heads=ring.first_heads(), log_sizes=logs,
                    intent=None, done=[], loading=False, log_unreserved=True)
        ranges = None
    else:   # (the first pass writes slot 1 of each bucket: 1 - slots[i])
        body["unreserved"] = True
        ranges = [[(0, HEADER_BYTES)] for _ in folders]
        for e in extents:
            ranges[e.file].append((e.at(1), e.nbytes))
    # the free space of each filesystem against what all its directories need (two
    # directories on one drive share its free bytes). The first also holds the spec and
    # the manifest, which a commit writes anew beside the old one before the rename, and
    # whose checksums and (compact) intent grow it by up to ~96 B a bucket (a disk with
    # room for the data files but not those failed the first step's commit; found from
    # outside)
    meta = (2 * round_up(len(manifest.pack(body)) + 96 * len(spec.buckets), ALIGN)
            + round_up(len(manifest.pack(spec.to_json())), ALIGN))
    drives: Dict[int, list] = {}
    for k, (folder, size, log) in enumerate(zip(folders, sizes, logs)):
        later = size - sum(n for _, n in ranges[k]) if ranges is not None else log
        drives.setdefault(os.stat(folder).st_dev, []).append(
            (folder, size + log + (meta if k == 0 else 0), later))
    for dev, on_drive in drives.items():
        folder = on_drive[0][0]
        usage = shutil.disk_usage(folder)
        if usage.total == 0:   # a filesystem that says nothing of its size (ramfs, some
            continue           # FUSE ones): a full one fails at the reservation below
        free = usage.free
        for other, _, _ in on_drive:
            for name in (DATA_FILE, redo.LOG_FILE):
                old = os.path.join(other, name)
                free += os.path.getsize(old) if os.path.exists(old) else 0
        # (at its peak: before the first commit the slots (compact: the logs) not
        # reserved, after it the param files' extents it gave back)
        need = sum(n for _, n, _ in on_drive)
        back = min(sum(later for _, _, later in on_drive), (credit or {}).get(dev, 0))
        need -= back
        if need > free:
            what = (f"one copy and {spares} spares" if compact else f"{SLOTS} slots each")
            where = (repr(folder) if len(on_drive) == 1 else
                     f"{[f for f, _, _ in on_drive]} (one filesystem)")
            raise NvmeError(errno.ENOSPC, f"offload_adam: the optimizer state needs "
                            f"{size_text(need)} in {where} ({len(spec.buckets)} "
                            f"buckets, {what}"
                            + (f", at its peak: less the {size_text(back)} of the param "
                               "files given back after the first step" if back else "")
                            + f"), only {size_text(free)} is free", folder)
    # a state never committed, made anew here: its data files' headers go first, so that
    # a crash after the new manifest and before the new headers leaves files that are
    # unwritten (made anew at the next open), not another state's (refused at every open
    # since: found from outside, a power loss simulated at that instant)
    for folder in folders:
        _unmark(os.path.join(folder, DATA_FILE))
    # the manifest (nothing committed) first: a crash before the spec is down leaves a
    # state never committed that does not fit its spec, made anew at the next open
    for name, what in ((manifest.MANIFEST, body), (manifest.SPEC, spec.to_json())):
        try:
            manifest.commit(folders[0], what, name)
        except OSError as e:
            path = os.path.join(folders[0], name)
            raise NvmeError(e.errno, f"offload_adam: could not create the optimizer state "
                            f"file {path}: {e.strerror or e}", path) from e
    fds = _open_all(folders, body, buffered, create=True, ranges=ranges)
    if compact:
        try:
            redo.RedoLog(folders, logs, create=True, reserve=False).close()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            raise NvmeError(e.errno, f"offload_adam: could not create the redo logs in "
                            f"{folders} ({logs} bytes): {e.strerror}", folders[0]) from e
    return body, fds


def _let_go(io: IOPool, fds: List[int], log, locks: manifest.DirLocks) -> None:
    """What close() lets go of, for a state collected unclosed (its finalizer)."""
    io.close()
    for fd in fds:
        os.close(fd)
    if log is not None:
        log.close()
    locks.release()


def _check_layout(folder: str, body: dict, compact: bool) -> None:
    """The files' layout is the one asked for; a compact state whose load_state_dict was
    cut short holds no step and is refused."""
    found = body.get("layout") == "compact"
    if found != compact:
        names = {True: "compact (state_footprint=\"compact\")",
                 False: "two generations (state_footprint=\"two_generations\")"}
        raise ValueError(f"offload_adam: the optimizer state in {folder!r} is laid out as "
                         f"{names[found]}, and {names[compact]} was asked for: give the "
                         "footprint the files were made with")
    if found and body["loading"]:
        raise ValueError(f"offload_adam: a load_state_dict into the optimizer state in "
                         f"{folder!r} was cut short (the process died while it wrote the "
                         "files): they hold part of the loaded state and part of the one "
                         "before, no step. The state dict you loaded is unchanged: remove "
                         f"these files ({', '.join(STATE_FILES)}), build the optimizer "
                         "without state_resume and load it again")


def _open_files(folders: List[str], body: dict, buffered: List[str]) -> List[int]:
    if len(body["folders"]) != len(folders):
        raise ValueError(f"offload_adam: the state in {folders[0]!r} is striped over "
                         f"{len(body['folders'])} directories ({body['folders']}), "
                         f"{len(folders)} given")
    for k, folder in enumerate(folders):
        problem = _header_problem(folder, k, body)
        if problem is not None:
            error = FileNotFoundError if problem.endswith("is missing") else ValueError
            raise error(f"offload_adam: {problem}")
    return _open_all(folders, body, buffered, create=False)


def _open_all(folders: List[str], body: dict, buffered: List[str], create: bool,
              ranges: Optional[List[list]] = None) -> List[int]:
    """The data files' fds: created (reserved whole, or each only over its `ranges`;
    header written) or checked (size); the folders that refused O_DIRECT are added to
    `buffered`."""
    fds: List[int] = []
    buf = AlignedBuffer(HEADER_BYTES, pin=False)
    try:
        for k, (folder, size) in enumerate(zip(folders, body["file_sizes"])):
            path = os.path.join(folder, DATA_FILE)
            try:
                fd, direct = open_direct(path, create=create, size=size,
                                         ranges=ranges[k] if ranges is not None else None)
            except OSError as e:
                what = "create" if create else "open"
                raise NvmeError(e.errno, f"offload_adam: could not {what} the optimizer state "
                                f"file {path} ({size} bytes): {e.strerror}", path) from e
            fds.append(fd)
            if not direct:
                buffered.append(folder)
            if create:
                head = _header(body, k)
                buf.view[:] = bytes(HEADER_BYTES)
                buf.view[:len(head)] = head
                try:
                    os.pwritev(fd, [buf.view], 0)
                    os.fsync(fd)
                    manifest.fsync_dir(folder)
                except OSError as e:
                    raise NvmeError(e.errno, f"offload_adam: could not write the header of "
                                    f"the optimizer state file {path}: {e.strerror or e}",
                                    path) from e
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"offload_adam: {path} is shorter than the state it holds "
                                 f"({os.fstat(fd).st_size} < {size} bytes): the file was "
                                 "truncated or replaced; the state cannot be trusted")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        buf.close()
    return fds
