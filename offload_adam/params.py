"""What every path says about a param: the dtypes it may have, how an error
names it, the one device of an optimizer's params, whether a master still rounds to
its param, the refusal of sparse grads (in place, the engine and the NVMe
tier raise the same words), and where a streamed param's values live between uses
(`home_of`: param_stream.py registers them, the engine reads and writes them)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional, Tuple

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)   # these params get an fp32 master
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION


def param_label(group: dict, group_index: int, index: int, p: torch.Tensor) -> str:
    """How error messages name a param: its name when the group has names."""
    names = group.get("param_names")
    # (a param appended by hand to a named group has no name: its place then)
    where = (repr(names[index]) if names and index < len(names)
             else f"group {group_index}, param {index}")
    return f"{where} (shape {tuple(p.shape)})"


def check_grad_dtypes(param_groups) -> None:
    """A TypeError naming the first param with a grad whose dtype no kernel steps (an
    integer param given a grad by hand, a param cast to float64 after construction), or
    whose grad's dtype is not the param's (torch 2.13's `p.grad_dtype` allows an fp32
    grad for a bf16 param: the kernels read a grad of the param's dtype); a RuntimeError
    for a grad whose shape is not the param's (`p.data = ...` of another shape after
    the grad was made); before anything is stepped (torch's optimizers fail on an
    integer one part way)."""
    for gi, g in enumerate(param_groups):
        for i, p in enumerate(g["params"]):
            grad = p.grad
            if grad is None:
                continue
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"offload_adam steps float32, bfloat16 and float16 params; param "
                    f"{param_label(g, gi, i, p)} is {p.dtype} and has a grad "
                    f"({grad.dtype}): set its grad to None, or leave it out of the optimizer")
            if grad.dtype is not p.dtype:
                # (torch 2.13's p.grad_dtype, the param's by default, allows grads of
                # another dtype when set to one, or to None: any)
                allowed = getattr(p, "grad_dtype", p.dtype)
                hint = ("cast the grad to it" if allowed is p.dtype else
                        f"p.grad_dtype is {allowed}: set it back to {p.dtype}, or cast the grad")
                raise TypeError(
                    f"offload_adam: param {param_label(g, gi, i, p)} is {p.dtype} and its "
                    f"grad {grad.dtype}; the kernels step a grad of the param's dtype "
                    f"({hint})")
            if grad.shape != p.shape:
                raise RuntimeError(
                    f"offload_adam: param {param_label(g, gi, i, p)} has shape "
                    f"{tuple(p.shape)} and its grad {tuple(grad.shape)} (p.data set to "
                    "another shape after the grad was made?): set its grad to None")


def one_device(params) -> torch.device:
    """The one device all `params` live on; a ValueError for a mix (one optimizer,
    and one engine, per device)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"offload_adam: the params live on several devices ({names}); one "
            "optimizer steps params of one device (use one optimizer per device)")
    (device,) = devices
    return device


def _memory(p: torch.Tensor) -> Optional[tuple]:
    """(the storage's device and address, p's first byte, its end byte in it), or None
    for a param that holds no memory of its own to share (meta, empty, a DTensor, whose
    shards are their own, a sparse one)."""
    if (type(p).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__   # (a DTensor)
            or p.numel() == 0):
        return None
    try:
        storage = p.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if p.device.type == "meta":
        return None
    return ((p.device, storage.data_ptr()),) + byte_span(p)


def byte_span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage a non-empty tensor's elements lie in: [first, end)."""
    size = t.element_size()
    first = t.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return first * size, (last + 1) * size


def _share_bytes(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether views a and b of one storage, both inside its bytes [lo, hi), write a
    byte in common (strided views may interleave without one)."""
    if a.is_contiguous() and b.is_contiguous():
        return True   # (their spans overlap: the caller knows)
    mask = torch.zeros(hi - lo, dtype=torch.uint8)

    def elements(t: torch.Tensor) -> torch.Tensor:
        size = t.element_size()
        return mask.as_strided(tuple(t.shape) + (size,),
                               tuple(s * size for s in t.stride()) + (1,),
                               t.storage_offset() * size - lo)
    elements(a).fill_(1)
    return bool(elements(b).any())


def check_no_overlap(param_groups, index: int, among: Optional[set] = None) -> None:
    """A ValueError naming two params of which one is in group `index` that share
    memory (views of one tensor that overlap): torch's optimizers step them one after
    the other, each step seeing the other's update; here each has a master and moments
    of its own, and the last one written would win silently. Views that do not overlap
    (a flat buffer's params) are fine. `among`: the ids of the only params of the other
    groups that may share memory with group `index`'s (Addresses.check_group; None: any)."""
    mine = {}
    for i, p in enumerate(param_groups[index]["params"]):
        span = _memory(p)
        if span is not None:
            mine.setdefault(span[0], []).append((index, i, p) + span[1:])
    if not mine:
        return
    seen = {}
    for gi, group in enumerate(param_groups if among is None or among else ()):
        for i, p in enumerate(group["params"]):
            if among is not None and id(p) not in among:
                continue
            span = _memory(p) if gi != index else None
            if span is not None and span[0] in mine:
                seen.setdefault(span[0], []).append((gi, i, p) + span[1:])
    for key, views in mine.items():
        views = sorted(seen.get(key, []) + views, key=lambda v: v[3])
        for k, (gi, i, p, lo, hi) in enumerate(views):
            for gj, j, q, lo2, hi2 in views[k + 1:]:
                if lo2 >= hi:
                    break
                if q is p or not _share_bytes(p, q, min(lo, lo2), max(hi, hi2)):
                    continue
                raise ValueError(
                    f"offload_adam: params {param_label(param_groups[gi], gi, i, p)} and "
                    f"{param_label(param_groups[gj], gj, j, q)} share memory (overlapping "
                    "views of one tensor): each would be stepped from a master of its own "
                    "and one update lost where they overlap. Give the optimizer the tensor "
                    "they view, or views that do not overlap")


class Addresses:
    """Where each param's values were when last checked for shared memory (construction,
    then each step): `b.data = a.data` after the optimizer was built (a tie made late)
    puts two params on one memory, which check_no_overlap refuses at construction; each
    would be stepped from its own master and one update lost, silently. One data_ptr
    per param a step; the groups of a param that moved are checked again."""

    def __init__(self):
        self._at: dict = {}   # id(param) -> its data_ptr (params the groups hold alive)
        # (device, storage address) -> ids of the params recorded on it: a group added
        # is checked against those only (check_no_overlap over every param of every
        # group at each add_param_group made building O(groups x params))
        self._storages: Dict[tuple, set] = {}

    @staticmethod
    def _of(p: torch.Tensor):
        # None where _memory is (a DTensor, meta, empty, sparse) and for a streamed param;
        # else the address alone (_memory's storage and span cost ~5 us a param a step)
        if (type(p).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
                or p.layout is not torch.strided or p.is_meta or p.numel() == 0
                or home_of(p) is not None):
            return None
        return p.data_ptr()

    def record(self, params) -> None:
        for p in params:
            self._at[id(p)] = self._of(p)
            span = _memory(p)
            if span is not None:
                self._storages.setdefault(span[0], set()).add(id(p))

    def check_group(self, param_groups, index: int) -> None:
        """check_no_overlap of a group just added (and recorded), against the params
        recorded on the storages its params are on. One that moved since it was recorded
        is not looked for on its new storage here: the next step's check sees it moved."""
        keys = {span[0] for span in map(_memory, param_groups[index]["params"])
                if span is not None}
        mine = {id(p) for p in param_groups[index]["params"]}
        among = {i for k in keys for i in self._storages.get(k, ())} - mine
        check_no_overlap(param_groups, index, among)

    def check(self, param_groups) -> None:
        """A RuntimeError naming two params that share memory now, if a param moved."""
        moved = []
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                now = self._of(p)   # (once a param a step: this is step()'s path)
                if self._at.get(id(p), now) != now:
                    moved.append((gi, p))
        for gi in sorted({gi for gi, _ in moved}):
            try:
                check_no_overlap(param_groups, gi)
            except ValueError as e:
                raise RuntimeError(
                    f"{e} (their memory changed after the optimizer was built: p.data = "
                    "another param's, a tie made after it?); nothing was stepped") from None
        self.record(p for _, p in moved)


def check_listed_once(param_groups) -> None:
    """A ValueError naming a param listed twice in param_groups (appended by hand since
    the optimizer was built: torch steps it twice a step, the engine and the state files
    would once; the constructor and add_param_group refuse it too)."""
    seen: dict = {}
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if seen.setdefault(id(p), (gi, i)) != (gi, i):
                g0, i0 = seen[id(p)]
                raise ValueError(
                    f"offload_adam: param {param_label(group, gi, i, p)} is the same tensor "
                    f"as param {param_label(param_groups[g0], g0, i0, p)}: listed twice in "
                    "param_groups (appended by hand since the optimizer was built?); list "
                    "each param once. Nothing was stepped")


def rounds_to(master: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether fp32 `master` rounds to the CPU tensor `t` bit for bit (NaN to NaN):
    a loaded master that does not is stale and is started again from the param."""
    rounded = master.detach().to(t.dtype)
    bits = torch.int16 if t.element_size() == 2 else torch.int32
    return bool(((rounded.view(bits) == t.view(bits)) | (rounded.isnan() & t.isnan())).all())


def check_dense(grad: torch.Tensor, label: str) -> None:
    """A RuntimeError for a sparse grad; `label` names its param ("param ...")."""
    if grad.is_sparse or grad.layout is not torch.strided:
        raise RuntimeError(
            f"offload_adam does not support sparse gradients ({label}, grad layout "
            f"{grad.layout}); consider torch.optim.SparseAdam")


# id(param) -> (weak references to it and to its Home): by identity. The Home is held by
# its streamer (the model's hooks hold that): a model and streamer dropped without close()
# are collected, the Home holding the param (its block's) through the streamer's blocks.
_homes: dict = {}


def home_of(p: torch.Tensor):
    """The `Home` of a streamed param (param_stream.py): its values in host memory, which
    the optimizer reads and steps instead of the device copy; None for any other."""
    if not _homes:
        return None
    entry = _homes.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def set_home(p: torch.Tensor, home) -> None:
    """Registers (or, with None, forgets) the home of streamed param p."""
    key = id(p)
    if home is None:
        _homes.pop(key, None)
        return

    def gone(ref, key=key):
        if _homes.get(key, (None,))[0] is ref:
            del _homes[key]
    _homes[key] = (weakref.ref(p, gone), weakref.ref(home))


def param_values(p: torch.Tensor) -> torch.Tensor:
    """The tensor that holds param p's values, detached, to read now: a streamed param's
    host copy, any other's local tensor (a DTensor's shard). To write: write_values."""
    from .distributed import local
    home = home_of(p)
    if home is None:
        return local(p).detach()
    return home.values()


def write_values(p: torch.Tensor, values: torch.Tensor, start: Optional[int] = None) -> None:
    """Writes `values` (any dtype: cast) into param p's values (param_values), a streamed
    param's host copy included (in files: marked to go back to its file); with `start`,
    into its flat elements from `start` on (a part of it: values.numel() of them)."""
    home = home_of(p)
    # (no copy to the device still reads a host copy written; only these elements are)
    with (contextlib.nullcontext() if home is None else
          home.writing(None if start is None else [(start, start + values.numel())])):
        t = param_values(p) if home is None else home.tensor
        if start is not None:
            t = t.view(-1)[start:start + values.numel()]
            values = values.reshape(-1)
        t.copy_(values.to(t.dtype))


def groups_now(param_groups, group_of, split_error) -> tuple:
    """Where a store's params are in `param_groups` as the user may have edited them
    (deleted, reordered, popped: torch.optim steps whatever they hold now), for a store
    that steps each group it was given with one group's hyperparameters: (group number
    the store knows -> (the group dict holding its params now, that group's index), the
    ids of the params found). `group_of(p)`: p's group number in the store (None: not
    the store's). Params of one number now in two groups cannot be followed: the
    RuntimeError of `split_error(p, index now, the other group's index)`."""
    now: dict = {}
    present = set()
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            number = group_of(p)
            if number is None:
                continue
            present.add(id(p))
            first = now.setdefault(number, (g, gi))
            if first[0] is not g:
                raise RuntimeError(split_error(p, gi, first[1]))
    return now, present
