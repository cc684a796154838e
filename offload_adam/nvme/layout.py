"""What the state files hold and where: the buckets' tensors, their extents, the fingerprint.

A state is a list of buckets, each a few named tensors (for the optimizer: every param's
fp32 master, moments, 8-bit block scales and step count, param_state.adam_bucket; nothing
here knows what they are), stepped one bucket at a time. On disk a bucket is one extent per slot, read and written whole:

  file k (one per directory): [header, 4096 B][bucket a slot 0][bucket a slot 1][bucket b slot 0]...

- A bucket's tensors lie end to end in its extent, each at a 64-byte offset (the kernels split
  work on cache lines); the extent is rounded up to 4096 B, so that every request is aligned
  for O_DIRECT and one bucket is one large sequential read and one write.
- Two slots (generations) per bucket: a step reads the current slot and writes the other;
  the manifest (manifest.py) names the current one, so a crash mid-step leaves the last
  completed step whole.
- Striping: whole buckets are dealt over the directories (one file each), each to the file
  with the fewest bytes so far. A bucket stays contiguous in one file (its tensors can be
  memory-mapped as they are), and the pipeline's read-ahead of several buckets keeps every
  drive busy.

The fingerprint is the whole spec (every tensor's name, dtype and shape, the state format,
and what the caller adds in `extra`); a directory holding another model's or optimizer's
state is refused with the first difference named (`differences`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

ALIGN = 4096        # every extent and request: O_DIRECT's alignment on any common drive
TENSOR_ALIGN = 64   # a tensor's offset inside its bucket: a cache line
HEADER_BYTES = ALIGN
SLOTS = 2
SUM_BYTES = 4 << 20   # a slot's checksum is over chunks of this size (an I/O request each)

_DTYPES = {str(d).replace("torch.", ""): d
           for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64,
                     torch.int16, torch.int32, torch.int64)}


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    # where it may start in its bucket: TENSOR_ALIGN, or ALIGN (a page) for a tensor that
    # is one part of a larger one, so that the parts map side by side (NvmeState.joined)
    align: int = TENSOR_ALIGN

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> list:
        out = [self.name, str(self.dtype).replace("torch.", ""), list(self.shape)]
        return out + [self.align] if self.align != TENSOR_ALIGN else out

    @classmethod
    def from_json(cls, v) -> "TensorSpec":
        return cls(v[0], _DTYPES[v[1]], tuple(v[2]), *v[3:4])


@dataclass(frozen=True)
class BucketSpec:
    tensors: Tuple[TensorSpec, ...]
    # The first `head` tensors are a region of their own, read alone (store.read_head)
    # and checked by a checksum of their own: the params of a streamed block kept in
    # their state's bucket, which a forward reads without the state. It starts the
    # extent and ends on ALIGN (O_DIRECT), so that its requests are the slot's first.
    head: int = 0

    def offsets(self) -> List[int]:
        """Byte offset of each tensor in the bucket's extent."""
        out, at = [], 0
        for k, t in enumerate(self.tensors):
            at = round_up(at, ALIGN if self.head and k == self.head else t.align)
            out.append(at)
            at = round_up(at + t.nbytes, TENSOR_ALIGN)
        return out

    @property
    def head_bytes(self) -> int:
        """The head region's bytes (0: none)."""
        if not self.head:
            return 0
        if self.head >= len(self.tensors):
            return self.nbytes
        return self.offsets()[self.head]

    def to_json(self):
        """(A bucket without a head as before heads existed: its fingerprint unchanged.)"""
        tensors = [t.to_json() for t in self.tensors]
        return {"head": self.head, "tensors": tensors} if self.head else tensors

    @classmethod
    def from_json(cls, v) -> "BucketSpec":
        if isinstance(v, dict):
            return cls(tuple(TensorSpec.from_json(t) for t in v["tensors"]), int(v["head"]))
        return cls(tuple(TensorSpec.from_json(t) for t in v))

    @functools.cached_property   # (frozen: computed once; the planner asks it millions of times)
    def nbytes(self) -> int:
        """The extent of one slot: the tensors, padded, rounded up to ALIGN."""
        last = self.tensors[-1]
        return round_up(self.offsets()[-1] + last.nbytes, ALIGN) if self.tensors else 0


@dataclass(frozen=True)
class StateSpec:
    """The whole state: its buckets, the moments' format ("float32", "bfloat16", "8bit"),
    and anything else the files must match (`extra`, e.g. amsgrad; JSON values)."""
    buckets: Tuple[BucketSpec, ...]
    state_format: str
    extra: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"state_format": self.state_format, "extra": self.extra,
                "buckets": [b.to_json() for b in self.buckets]}

    @classmethod
    def from_json(cls, v: dict) -> "StateSpec":
        return cls(tuple(BucketSpec.from_json(b) for b in v["buckets"]), v["state_format"],
                   dict(v["extra"]))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        """Bytes of one generation of the state on disk (the bytes a step reads and writes)."""
        return sum(b.nbytes for b in self.buckets)


def _extra_differs(key: str, found, wanted) -> str:
    """One `extra` value that differs. A list of another length (amsgrad: one per param
    group) said only "amsgrad = [False, False] in the files, [False] here" when the run
    had two groups and the resume one (found from outside): the count is said first."""
    said = f"{key} = {found!r} in the files, {wanted!r} here"
    if isinstance(found, list) and isinstance(wanted, list) and len(found) != len(wanted):
        return (f"{len(found)} param groups in the files, {len(wanted)} here (one {key} "
                f"each: {said})")
    return said


def differences(found: StateSpec, wanted: StateSpec, limit: int = 3) -> List[str]:
    """What differs between the files' spec (`found`) and this optimizer's, first ones first."""
    out = []
    if found.state_format != wanted.state_format:
        out.append(f"state format {found.state_format!r} in the files, "
                   f"{wanted.state_format!r} here")
    if found.extra != wanted.extra:
        keys = sorted(set(found.extra) | set(wanted.extra))
        out += [_extra_differs(k, found.extra.get(k), wanted.extra.get(k))
                for k in keys if found.extra.get(k) != wanted.extra.get(k)]
    if out:
        return out[:limit]
    params = [param_names(s) for s in (found, wanted)]
    if set(params[0]) != set(params[1]):
        # (named first: each bucket's count of tensors said nothing of which param; the
        # same params in another order: the buckets' tensors below say where)
        shapes = [[(t.dtype, t.shape) for b in s.buckets for t in b.tensors]
                  for s in (found, wanted)]
        if shapes[0] == shapes[1] and not set(params[0]) & set(params[1]):
            how = ["named" if any(not n.partition(":")[2].isdigit() for n in names)
                   else "unnamed (by position)" for names in params]
            return [f"{RENAMED}: {_first_other(params[0], params[1])}. The state was "
                    f"made with params "
                    f"{how[0]}, and these are {how[1]}: give them as that run did "
                    "(model.named_parameters() names them)"]
        for side, mine, theirs in (("in the files, not here", *params),
                                   ("here, not in the files", params[1], params[0])):
            other = set(theirs)
            only = [n for n in mine if n not in other]
            if only:
                more = f" and {len(only) - 3} more" if len(only) > 3 else ""
                out.append(f"params {side}: {', '.join(map(shown, only[:3]))}{more}")
        if out:
            return out[:limit]
    if len(found.buckets) != len(wanted.buckets):
        out.append(f"{len(found.buckets)} buckets in the files, {len(wanted.buckets)} here")
    for i, (a, b) in enumerate(zip(found.buckets, wanted.buckets)):
        if len(a.tensors) != len(b.tensors):
            out.append(f"bucket {i}: {len(a.tensors)} tensors in the files, "
                       f"{len(b.tensors)} here")
            continue
        if a.head != b.head:
            out.append(f"bucket {i}: its first {a.head} tensors kept apart (params in their "
                       f"state's files) in the files, {b.head} here")
        for x, y in zip(a.tensors, b.tensors):
            if x != y:
                out.append(f"bucket {i}: {x.name} {str(x.dtype)[6:]} {list(x.shape)} in the "
                           f"files, {y.name} {str(y.dtype)[6:]} {list(y.shape)} here")
        if len(out) >= limit:
            break
    return out[:limit]


RENAMED = "the same params in number, shape and order under other names"


def param_names(spec: StateSpec) -> List[str]:
    """The params a spec holds the state of, in order ("group:name", the name a
    position where the params were given unnamed; a param in parts once)."""
    out: List[str] = []
    for b in spec.buckets:
        for t in b.tensors:
            name = t.name.rsplit(".", 1)[0]
            if not out or out[-1] != name:
                out.append(name)
    return list(dict.fromkeys(out))


def _first_other(found: List[str], wanted: List[str]) -> str:
    a, b = next(((a, b) for a, b in zip(found, wanted) if a != b), (found[0], wanted[0]))
    return f"{shown(a)} in the files, {shown(b)} here"


def shown(name: str) -> str:
    """A param's spec name ("group:name", or "group:position" where given unnamed) as said."""
    group, colon, rest = name.partition(":")
    if not colon:
        return name
    return f"group {group}'s param {rest}" if rest.isdigit() else f"{rest} (group {group})"


@dataclass(frozen=True)
class Extent:
    """Where one bucket lives: file `file`, slot s at offset + s * nbytes."""
    file: int
    offset: int
    nbytes: int

    def at(self, slot: int) -> int:
        return self.offset + slot * self.nbytes


def place(spec: StateSpec, files: int) -> Tuple[List[Extent], List[int]]:
    """Each bucket's extent (dealt to the file with the fewest bytes so far) and each
    file's size."""
    sizes = [HEADER_BYTES] * files
    extents = []
    for b in spec.buckets:
        k = min(range(files), key=lambda i: (sizes[i], i))
        extents.append(Extent(k, sizes[k], b.nbytes))
        sizes[k] += SLOTS * b.nbytes
    return extents, sizes


def slot_checksum(chunk_crcs: Sequence[int]) -> int:
    """A slot's checksum: the CRC32 (zlib) of its chunks' checksums (CRC32C, store.SUM_ALGO,
    each of SUM_BYTES from the extent's start, the last one shorter; as little-endian
    uint32s), so that the I/O threads checksum their own requests in parallel and a slot
    still has one number to keep in the manifest."""
    return zlib.crc32(struct.pack(f"<{len(chunk_crcs)}I", *chunk_crcs))
