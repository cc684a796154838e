"""Where each offloaded element lives: params, their pieces, buckets, host buffers.

A *piece* is a contiguous range of one param's elements and the unit of work:
one host copy of its grad, one kernel call over its master and moments, one
copy of its update back. A param larger than a bucket is cut into bucket-sized
pieces (at multiples of 32768 elements, the kernel's chunk), so that the D2H of
piece k+1 overlaps the CPU step of piece k instead of one giant bucket stalling
the pipeline. A non-contiguous param is one piece of its own shape.

A *bucket* is a run of pieces of one param group and dtype, about `bucket_mb`
of device bytes, in the order backward produces their grads: the unit of the
pipeline. Pieces smaller than PACK_BELOW_BYTES (norms, biases) are *packed*:
their grads go to the host in one copy per bucket, their updates back in one,
instead of one DMA each (packed_copy.py gathers/scatters them on the device).

Host memory (host_memory.py arenas): the state (fp32 master, exp_avg,
exp_avg_sq, max_exp_avg_sq) is laid out once per param, in registration order;
the transfer buffers (grad copies, staging of the update) are laid out per
bucket, its packed pieces' side by side, and are laid out anew when the buckets
change (`allocate_transfers`).
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..distributed import local
from ..param_state import ParamState
from ..params import LOW_PRECISION, home_of
from ..state_format import FLOAT32, QUANT_BLOCK, SCALE_KEYS, StateFormat, scale_len
from .host_memory import HostArenas
from .packed_copy import PACK_BELOW_BYTES

SPLIT_ALIGN = 32768  # also a multiple of QUANT_BLOCK: a piece owns whole 8-bit blocks


def state_roles(fmt: StateFormat, amsgrad: bool) -> tuple:
    """The host buffers of a param's state in format `fmt`."""
    roles = ("master", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    return roles + (tuple(SCALE_KEYS.values()) if fmt.blockwise else ())


class ParamRec:
    """One offloaded param: where its state lives and the state of its grad copy."""

    def __init__(self, param: torch.Tensor, group: int, position: int,
                 fmt: StateFormat = FLOAT32):
        # A streamed param (param_stream.py) is read and written in its host copy: its
        # device tensor holds its values only while its block computes.
        self.home = home_of(param)
        t = self.home.like if self.home is not None else local(param)
        self.param = param
        self.group = group
        self.position = position           # registration order
        self.fmt = fmt                     # how its moments are stored (state_format.py)
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self.numel = t.numel()
        self.low_precision = t.dtype in LOW_PRECISION
        self.flat = t.is_contiguous()       # cut into ranges and packed only then
        self.pieces: List[Piece] = []
        # whole-param host views: what optimizer.state[param] shows
        self.master = self.exp_avg = self.exp_avg_sq = self.max_exp_avg_sq = None
        self.exp_avg_scale = self.exp_avg_sq_scale = None  # 8-bit moments only
        # a split master's (param_state.py: lent by the files, nvme_tier.HEADS): its low
        # halves, tie bits and head (the bf16 value the kernel reads and writes)
        self.master_lo = self.master_tie = self.head = None
        self.step_t: Optional[torch.Tensor] = None
        self.copy = None                    # grads.GradCopy of its grad, or None
        self.freed = False                  # free_grads_after_copy dropped p.grad
        self.accumulated = False            # ... and a micro-batch was added to its copy
        self.hook = None
        self.pre_hook = None                # (before autograd adds into p.grad: core.py)
        self.name: Optional[str] = None       # params.param_label's, when the optimizer gives it

    def label(self) -> str:
        """How errors name it: as the in-place path does (params.param_label, given by the
        optimizer), or by shape and group for an engine built without names."""
        if self.name is not None:
            return f"param {self.name}"
        return f"a param of shape {list(self.shape)} in param group {self.group}"

    def live(self, check_only: bool = False) -> Optional[torch.Tensor]:
        """The param's local tensor now, checked against what it was when the
        optimizer was built (`p.data = ...` or `model.to(...)` may change it). A
        streamed param's is its host copy (`home`). `check_only`: the check alone (a
        streamed param in files is not loaded for it)."""
        home = home_of(self.param)
        if home is not self.home:
            raise RuntimeError(
                f"offload_adam: {self.label()} "
                + ("streams (stream_params) since the optimizer was built: build the "
                   "optimizer after stream_params()" if home is not None else
                   "no longer streams (its streamer was closed): build a new optimizer"))
        if home is not None:
            return None if check_only else home.tensor
        t = local(self.param).detach()
        if t.dtype != self.dtype or tuple(t.shape) != self.shape:
            raise RuntimeError(
                f"offload_adam: {self.label()} (dtype {self.dtype}) is now {t.dtype} of "
                f"shape {list(t.shape)}: it was cast or replaced after the optimizer was "
                "built. Build the optimizer after moving/casting the model (its state "
                "follows the params it was given)")
        if self.flat and not t.is_contiguous():
            raise RuntimeError(
                f"offload_adam: {self.label()} became non-contiguous after the optimizer "
                "was built (p.data replaced?); rebuild the optimizer")
        return t


class Piece:
    """Elements [start, stop) of one param, and its host buffers."""

    def __init__(self, rec: ParamRec, start: int, stop: int, packed: bool):
        self.rec, self.start, self.stop, self.packed = rec, start, stop, packed
        self.bucket: Optional[Bucket] = None
        self.grad: Optional[torch.Tensor] = None      # host copy of the grad (transfer)
        self.span = None   # the grad ring's span its grad is in, until stepped (grad_ring.py)
        self._staging: Optional[torch.Tensor] = None   # bf16/fp16 update (transfer)
        self.home_shape: Optional[tuple] = None   # a streamed param's: see `staging`
        # Its own step count: the kernel counts each piece's step, and a param
        # cut in pieces is stepped by several calls (state["step"] is the first).
        self.step_t: Optional[torch.Tensor] = None
        # A part of a param larger than a store's bucket (the files': nvme_tier.py) is lent
        # on its own: its state tensors (a ParamState over elements [lent_start, ...)),
        # which the piece's state is cut from instead of its param's whole-param views.
        self.lent = None
        self.lent_start = 0

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def staging(self) -> Optional[torch.Tensor]:
        """Where the kernel writes its bf16/fp16 update (or an fp32 param's, to copy): a
        transfer buffer, or a streamed param's host copy itself, looked up at each use (with
        param files it moves between cache slots; param_stream.Home)."""
        if self.home_shape is not None:
            return self.of(self.rec.home.tensor).view(self.home_shape)
        return self._staging

    @staging.setter
    def staging(self, t: Optional[torch.Tensor]) -> None:
        self._staging = t

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t` (a whole-param tensor: the param, its grad, a state view)."""
        if not self.rec.flat:
            return t
        # A contiguous copy made here would run on the caller's stream, unordered
        # with the side streams: a non-contiguous grad goes through
        # device.contiguous first (engine._copy), params are checked by live().
        return t.view(-1)[self.start:self.stop]

    def state(self, role: str) -> Optional[torch.Tensor]:
        """This piece of one of its param's state buffers (of an 8-bit scale
        array: the scales of the piece's blocks); None where the role has none."""
        if self.lent is not None:   # a part's own tensors, from its first element
            t = getattr(self.lent, role)
            a, b = self.start - self.lent_start, self.stop - self.lent_start
        else:
            t = getattr(self.rec, role)
            if t is not None and not self.rec.flat:
                return t
            a, b = self.start, self.stop
        return state_slice(t, role, a, b) if t is not None else None

    @property
    def split(self) -> bool:
        """Whether its master is split (lent so by the files: param_state.py)."""
        st = self.lent if self.lent is not None else self.rec
        return st.master_lo is not None

    def param_state(self) -> ParamState:
        """The piece's state as the kernel steps it (param_state.py): its slices of
        the param's buffers that exist, and its own step count."""
        blockwise = self.rec.fmt.blockwise
        split = self.split
        return ParamState(
            self.step_t, self.state("exp_avg"), self.state("exp_avg_sq"),
            None if split else self.state("master"), self.state("max_exp_avg_sq"),
            self.state("exp_avg_scale") if blockwise else None,
            self.state("exp_avg_sq_scale") if blockwise else None,
            *((self.state("master_lo"), self.state("master_tie"), self.state("head"))
              if split else ()))


class Bucket:
    def __init__(self, index: int, pieces: List[Piece]):
        self.index = index
        self.pieces = pieces
        self.group = pieces[0].rec.group
        self.low_precision = pieces[0].rec.low_precision
        self.h2d: list = []              # the last H2D copies reading its host buffers
        for p in pieces:
            p.bucket = self


def piece_length(numel: int, itemsize: int, bucket_bytes: int) -> int:
    """The elements of each piece of a contiguous param (the last one may be shorter):
    all of them if it fits a bucket, else a bucket's worth in whole SPLIT_ALIGN chunks."""
    if numel * itemsize <= bucket_bytes:
        return numel
    return max(SPLIT_ALIGN, bucket_bytes // itemsize // SPLIT_ALIGN * SPLIT_ALIGN)


def state_slice(t: torch.Tensor, role: str, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of a flat param's state tensor `t` in `role` (of an 8-bit scale
    array: the scales of their blocks; `a` starts a block; of a split master's tie bits:
    their bytes)."""
    if role == "master_tie":   # eight elements a byte (`a` starts a piece: a multiple)
        return t[a // 8:(b + 7) // 8]
    if role not in SCALE_KEYS.values():
        return t.view(-1)[a:b]
    return t[a // QUANT_BLOCK:scale_len(b)]


class Entry(NamedTuple):
    """A param as a store's bucket holds it (the files': nvme_tier.py): its record, its
    name in the bucket (param_state.py), and the pieces the bucket holds: all of them, or
    a run of them, a *part* of a param larger than the store's buckets, whose state
    tensors there are flat from its first piece's start."""
    rec: ParamRec
    name: Optional[str]
    pieces: Tuple[Piece, ...]

    @classmethod
    def whole(cls, rec: ParamRec, name: Optional[str] = None) -> "Entry":
        return cls(rec, name, tuple(rec.pieces))

    @property
    def part(self) -> bool:
        return len(self.pieces) != len(self.rec.pieces)

    @property
    def start(self) -> int:
        return self.pieces[0].start

    @property
    def stop(self) -> int:
        return self.pieces[-1].stop


def cut(rec: ParamRec, bucket_bytes: int) -> List[Piece]:
    """rec's pieces: one, or bucket-sized ranges of a large contiguous param."""
    size = rec.dtype.itemsize
    if not rec.flat or rec.numel * size <= bucket_bytes:
        return [Piece(rec, 0, rec.numel, rec.flat and rec.numel * size < PACK_BELOW_BYTES)]
    per = piece_length(rec.numel, size, bucket_bytes)
    return [Piece(rec, a, min(a + per, rec.numel), False) for a in range(0, rec.numel, per)]


def make_buckets(pieces: Sequence[Piece], bucket_bytes: int) -> List[Bucket]:
    """Runs of `pieces` (in the order their grads arrive) of one group and dtype,
    up to bucket_bytes each, ordered by their first piece."""
    runs: Dict[tuple, List[List[Piece]]] = {}
    filled: Dict[tuple, int] = {}   # bytes in each run's last chunk
    for p in pieces:
        key = (p.rec.group, p.rec.dtype)
        chunks = runs.setdefault(key, [[]])
        size = p.numel * p.rec.dtype.itemsize
        if chunks[-1] and filled[key] + size > bucket_bytes:
            chunks.append([p])
            filled[key] = size
        else:
            chunks[-1].append(p)
            filled[key] = filled.get(key, 0) + size
    rank = {id(p): i for i, p in enumerate(pieces)}
    chunks = sorted((c for cs in runs.values() for c in cs if c), key=lambda c: rank[id(c[0])])
    return [Bucket(i, c) for i, c in enumerate(chunks)]


def allocate_state(recs: Sequence[ParamRec], device, available: Optional[int],
                   roles: Sequence[str]) -> HostArenas:
    """Host buffers of `roles` for each rec (whole-param views; recs of one
    state format): the fp32 master, the moments in the format's dtype, 8-bit
    block scales. The masters are pinned when the recs are fp32 params (all of
    one precision: the caller splits them): such a master is the source of the
    param's copy to the device and the target of its copy back (state.py's master
    rule); the rest only the CPU kernel reads (host_memory.py: why that matters)."""
    arenas = HostArenas(device)
    plans = []
    for r in recs:
        plan = {}
        for role in roles:
            if role in SCALE_KEYS.values():
                dtype, shape = torch.float32, (scale_len(r.numel),)
            else:
                dtype = torch.float32 if role == "master" else r.fmt.moment_dtype
                shape = r.shape
            plan[role] = (arenas.reserve(role, dtype, math.prod(shape)), shape)
        plans.append(plan)
    if len({r.low_precision for r in recs}) > 1:
        raise ValueError("allocate_state: recs of one precision (fp32, or bf16/fp16)")
    arenas.allocate(available, pin=["master"] if recs and not recs[0].low_precision else [])
    for r, plan in zip(recs, plans):
        for role, (off, shape) in plan.items():
            setattr(r, role, arenas.view(role, off, shape))
    return arenas


def allocate_transfers(buckets: Sequence[Bucket], device, available: Optional[int],
                       stage_fp32: bool = False, grads: bool = True) -> HostArenas:
    """Grad and staging buffers of every piece, bucket after bucket.

    A bucket's packed pieces lie side by side, with no padding between them,
    so that its pack is one copy of exactly their bytes each way
    (packed_copy.py); they are small, so their kernel calls lose nothing to
    starting off a cache line. Their updates are staged whatever the dtype (an
    fp32 one copied from its master after the kernel), so the pack goes back
    from there and not from masters spread over the state arenas.
    An unpacked bf16/fp16 piece's update is staged (the kernel writes it
    there); an fp32 one's is its master, copied from there, unless
    `stage_fp32`: with the state in files and step_in_backward the master is
    gone (its file bucket written, the buffer reused) before step() writes the
    params, so its value waits in staging (core.step_lent).
    A streamed param's staging is its host copy itself (param_stream.py): the
    kernel writes its update where the next forward fetches it, so it costs no
    host memory and no copy (BucketJob.kernel first waits until no fetch reads it).
    grads=False: the grads land in a ring (grad_ring.py), only staging is laid out here."""
    arenas = HostArenas(device)
    offsets = []
    for b in buckets:
        packed = [p for p in b.pieces if p.packed]
        if packed:
            dtype = b.pieces[0].rec.dtype   # a bucket holds one dtype
            grad = (arenas.reserve(f"grad {dtype}", dtype, sum(p.numel for p in packed))
                    if grads else 0)
            staged = [p for p in packed if p.rec.home is None]
            staging = (arenas.reserve(f"staging {dtype}", dtype, sum(p.numel for p in staged))
                       if staged else 0)
            at = dict(zip(map(id, staged), accumulate((p.numel for p in staged[:-1]),
                                                      initial=0)))
            offsets += [(p, grad + o, staging + at[id(p)] if id(p) in at else None)
                        for p, o in zip(packed, accumulate((p.numel for p in packed[:-1]),
                                                           initial=0))]
        for p in b.pieces:
            if not p.packed:
                dtype = p.rec.dtype
                staged = (p.rec.low_precision or stage_fp32) and p.rec.home is None
                offsets.append((p, arenas.reserve(f"grad {dtype}", dtype, p.numel)
                                if grads else 0,
                                arenas.reserve(f"staging {dtype}", dtype, p.numel)
                                if staged else None))
    arenas.allocate(available)
    for p, g, s in offsets:
        shape = (p.numel,) if p.rec.flat else p.rec.shape
        if grads:
            p.grad = arenas.view(f"grad {p.rec.dtype}", g, shape)
        if p.rec.home is not None:
            p.home_shape = shape
        else:
            p.staging = None if s is None else arenas.view(f"staging {p.rec.dtype}", s, shape)
    return arenas
