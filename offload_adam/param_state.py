"""One param's Adam state as the kernels step it, wherever it lives: a typed record.

The state of a param (or of a piece of one) is a few tensors, each with a role:

    step              0-dim fp32, the steps taken (the kernel increments it)
    exp_avg           the first moment, in the group's state format (state_format.py)
    exp_avg_sq        the second moment, likewise
    master            fp32 values the kernel steps; None: the param is its own master
                      (an fp32 CPU param stepped in place)
    max_exp_avg_sq    amsgrad only
    exp_avg_scale,    8-bit moments only: one fp32 scale per block of 256
    exp_avg_sq_scale
    master_lo,        a split master (split_master.py): its low 16 bits (int16) and tie
    master_tie,       bits (uint8, 8 per byte), the high half being the bf16 param the
    head              kernel is given as its output, read and written: in the files the
                      bucket's head (adam_bucket(split=True), the file tensor
                      "<name>.param"), the values the param is restored from; master is
                      None. (The NVMe tier lays them out for params streamed from param
                      files: nvme_tier.HEADS.)

Every store holds them its own way: optimizer.state[p] (a dict under torch's keys,
inplace.py), the engine's host arenas (a piece's slices of them, engine/layout.py), a
bucket of the NVMe tier's files (named "<param name>.<role>", `file_key`). Each makes a
`ParamState` of its tensors, and kernel_step.KernelArgs.add maps a record to the kernel's
arguments: the one place that knows which tensor goes where.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Mapping, Optional, Sequence

import torch

from .state_format import MASTER_KEY, SCALE_KEYS, state_format

# The roles besides "step", in the order a bucket of the files lays them out.
ROLES = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_scale",
         "exp_avg_sq_scale")
# A role's key in optimizer.state[p] and in a state dict, where it is not the role's name
# (None: a role no dict holds); its name in a bucket of the files, likewise.
_DICT_KEY = {"master": MASTER_KEY, "master_lo": None, "master_tie": None, "head": None}
FILE_ROLE = {"head": "param"}
# A split master's roles besides the moments (an engine record's attributes when lent).
SPLIT_ROLES = ("master_lo", "master_tie", "head")


@dataclass
class ParamState:
    """The tensors of one param's state (see the module's docstring)."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: Optional[torch.Tensor] = None
    max_exp_avg_sq: Optional[torch.Tensor] = None
    exp_avg_scale: Optional[torch.Tensor] = None
    exp_avg_sq_scale: Optional[torch.Tensor] = None
    master_lo: Optional[torch.Tensor] = None
    master_tie: Optional[torch.Tensor] = None
    head: Optional[torch.Tensor] = None

    @property
    def rounded(self) -> Optional[torch.Tensor]:
        """What the param is the rounding of: the master, or a split master's head (the
        bf16 value itself); None for an fp32 param stepped in place."""
        return self.master if self.master is not None else self.head

    def restart(self, values: torch.Tensor) -> None:
        """The master started again from the param's `values` (any shape of its
        elements): a split one as the bf16 value with zero low half and tie bits (the
        value exactly, as an fp32 master copied from a bf16 param is)."""
        if self.master is not None:
            self.master.copy_(values.reshape(self.master.shape))
        else:
            self.head.copy_(values.reshape(self.head.shape))
            self.master_lo.zero_()
            self.master_tie.zero_()

    def exported_master(self) -> Optional[torch.Tensor]:
        """The fp32 master as a state dict shows it: the master itself, or a split
        one decoded (a copy, shaped as the head)."""
        if self.master is not None or self.head is None:
            return self.master
        from .split_master import decode
        return decode(self.head, self.master_lo, self.master_tie)

    @classmethod
    def of(cls, get: Callable[[str], Optional[torch.Tensor]]) -> "ParamState":
        """The record of the tensors `get(role)` gives ("step" and every role; None
        where a role has no tensor)."""
        return cls(*[get(name) for name in _FIELDS])

    @classmethod
    def in_dict(cls, st: Mapping[str, torch.Tensor]) -> "ParamState":
        """The record of optimizer.state[p] as inplace.ready_state leaves it."""
        return cls(*[st.get(key) if key is not None else None for key in _DICT_KEYS])

    @classmethod
    def in_bucket(cls, views: Mapping[str, torch.Tensor], name: str) -> "ParamState":
        """The record of param `name` in a bucket of the NVMe tier's files (its
        tensors `views`, by file_key)."""
        return cls(*[views.get(file_key(name, FILE_ROLE.get(f, f))) for f in _FIELDS])


# (its fields in order, and their keys in optimizer.state: a step builds many records)
_FIELDS = tuple(f.name for f in fields(ParamState))
_DICT_KEYS = tuple(_DICT_KEY.get(name, name) for name in _FIELDS)


def file_key(name: str, role: str) -> str:
    """The name of param `name`'s `role` tensor in a bucket of the NVMe tier's files."""
    return f"{name}.{role}"


def adam_bucket(prefix_shapes: Sequence[tuple], fmt_name: str, amsgrad: bool = False,
                split: bool = False):
    """The layout (nvme.layout.BucketSpec) of a bucket of the NVMe tier's files holding
    the states of the params named and shaped as given ((name, shape), or (name, shape,
    part): True for a part of a param, whose master and moments start on a page, so
    that its parts map side by side), in format `fmt_name` (state_format.py): per param
    its fp32 master, the moments in the format (+ max_exp_avg_sq), the 8-bit block
    scales, and its step (fp32, 0-dim as torch's). `split` (bf16 params whose values the
    files keep: streamed blocks'): the params' values first, as the bucket's head (read
    alone by a forward: layout.BucketSpec.head), and in each master's place its low half
    (int16) and tie bits (uint8, 8 a byte): the master split (split_master.py), stepped
    with its param as the high half (kernel_step.KernelArgs.add), 4.125 B beside the
    state instead of 2 + 4 in param and master files."""
    from .nvme.layout import ALIGN, TENSOR_ALIGN, BucketSpec, TensorSpec
    from .state_format import scale_len
    fmt = state_format(fmt_name)
    out, head = [], []
    for name, shape, *part in prefix_shapes:
        shape = tuple(int(s) for s in shape)
        numel = TensorSpec("", torch.float32, shape).numel
        align = ALIGN if part and part[0] else TENSOR_ALIGN
        if split:
            head.append(TensorSpec(file_key(name, "param"), torch.bfloat16, shape, align))
            out += [TensorSpec(file_key(name, "master_lo"), torch.int16, shape, align),
                    TensorSpec(file_key(name, "master_tie"), torch.uint8, ((numel + 7) // 8,))]
        else:
            out.append(TensorSpec(file_key(name, "master"), torch.float32, shape, align))
        for role in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            out.append(TensorSpec(file_key(name, role), fmt.moment_dtype, shape, align))
        if fmt.blockwise:
            out += [TensorSpec(file_key(name, SCALE_KEYS[k]), torch.float32, (scale_len(numel),))
                    for k in ("exp_avg", "exp_avg_sq")]
        out.append(TensorSpec(file_key(name, "step"), torch.float32, ()))
    return BucketSpec(tuple(head + out), head=len(head))
