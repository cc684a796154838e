"""The one rule for a param's fp32 master, asked by every store and stepper.

A bf16/fp16 param has an fp32 master that the kernel steps (the param is its rounding),
and so has every param of the engine and of the NVMe tier's files (an fp32 param stepped
in place in RAM is its own master). The master is hidden from the user, so it must never
win over the param, as torch's optimizers, which keep no master, would not:

    the master follows the param. A master the optimizer wrote is current while the
    param is as the optimizer left it. Once the param was changed by anything else (a
    model checkpoint loaded, an in-place edit, p.data = ...), or when the master came
    from load_state_dict, or it has none (a param's first step), the master is checked
    at the next step(): kept while the param is still its rounding (a checkpoint of the
    same step resumes bit for bit), else started again from the param.

The engine asks it of each piece of a param (engine/state.py follow_masters; a piece is at
most bucket_mb): a param edited in part keeps the masters of its pieces left as they were,
wherever their state lives (the files lend a param larger than a bucket in parts).

A param without a grad in a step is not stepped, but its master follows it all the
same, in RAM as in the files (which hold the params for state_resume): its next
stepped value, or the params a resume restores, start from what the user left.

What tells that a param changed: its `Mark`, its data's version counters (torch bumps
them at every in-place write, a model's load_state_dict included), its storage, and for a
param in host memory a CRC32C of its bytes: a write through `p.data` (`p.data.clamp_()`,
`p.data.copy_(ema)`) bumps the counter of the tensor `.data` made, not the param's, so
only the bytes show it. (The CPU's CRC instruction, ~11 GB/s a core: a bf16 param's 2
bytes are read twice per step, when it agrees and when asked, against the ~28 B/param the
step moves; measured +0.4 ns/param on a 2-core VM whose step is 0.65 ns/param. Fused
into the kernel, the first read would go. A param on the device is not read back, which
would cost PCIe bytes: the device sums its bits, engine/param_check.py, `hidden_edit`.) The
optimizer records a param's mark each time the param and its master agree: after it
wrote the param, or made the master follow it (`MasterMarks.agree`);
a mark that differs now costs one comparison of the master with the param (the param
read from the device for the engine's CUDA params), only then.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from .distributed import local
from .params import home_of

Mark = Tuple[int, ...]


def mark(p: torch.Tensor) -> Mark:
    """How param p is now: the version counters of the param and of its local data (a
    DTensor's shard: either may be the one a write bumps), the data's address and, in
    host memory, a checksum of its bytes (writes through `p.data` bump no counter of p)."""
    if home_of(p) is not None:   # streamed: its values are its host copy's
        # written through the host copy itself, or through the param while it shows the
        # host copy (load_state_dict copies into p: p's own counter, not the copy's)
        return (p._version,) + home_of(p).mark()
    if type(p) in PLAIN:   # (the common case, asked per param per step: kept short)
        v = p._version
        return v, v, p.data_ptr(), bytes_sum(p)
    t = local(p)
    return p._version, t._version, t.data_ptr(), bytes_sum(t)


def written_since(now: Mark, then: Mark) -> bool:
    """Whether a param whose mark was `then` and is `now` was written with other values
    since: a param in host memory whose address and bytes' checksum are as then was
    written with the same ones (DDP's first broadcast of rank 0's params bumps every
    rank's version counters); one on a device (no checksum) or streamed, whenever its
    mark moved."""
    if now == then:
        return False
    summed = len(now) == len(then) == 4 and now[3] != -1   # (plain or DTensor, on the host)
    return not (summed and now[2:] == then[2:])


def bytes_sum(t: torch.Tensor):
    """A checksum of tensor t's bytes in host memory: their CRC32C, on the calling
    thread (~12-17 GB/s; a pool of Python threads over pieces of it was slower on
    2-core VMs, bench/mark_cost.py); -1 on a device (not read back), and under test
    support's simulated device, whose host tensors stand in for a device's."""
    from .engine.device import current_host_stand_in   # (the engine imports this module)
    if t.device.type != "cpu" or t.numel() == 0 or current_host_stand_in() is not None:
        return -1
    t = t.detach()
    if not t.is_contiguous():   # (p.data = a transposed view: rare, copied)
        t = t.contiguous()
    from .byte_view import byte_view
    from .nvme.direct_io import crc32
    return crc32(byte_view(t))


# Tensors that are their own local data (not a DTensor): a fast path where a step asks
# something of every param.
PLAIN = (torch.Tensor, torch.nn.Parameter)


class MasterMarks:
    """Per param, its mark when it last agreed with its master."""

    def __init__(self) -> None:
        self._marks: Dict[int, Mark] = {}
        # Edits that no mark shows, of params on a device (engine/param_check.py,
        # set by the engine there): p -> whether p was edited since it last agreed.
        self.hidden_edit: Optional[Callable[[torch.Tensor], bool]] = None

    def agree(self, params: Iterable[torch.Tensor]) -> None:
        """These params and their masters agree now (the optimizer has just written the
        params, or made the masters follow them)."""
        for p in params:
            self._marks[id(p)] = mark(p)

    def forget(self, params: Iterable[torch.Tensor]) -> None:
        """Their masters were replaced (load_state_dict): checked at the next step."""
        for p in params:
            self._marks.pop(id(p), None)

    def current(self, p: torch.Tensor) -> bool:
        """Whether p is as the optimizer left it, with its master."""
        return self._marks.get(id(p)) == mark(p) and not (
            self.hidden_edit is not None and self.hidden_edit(p))


def take_from_param(step: float, current: bool, stale: Callable[[], bool]) -> bool:
    """Whether a master starts (again) from its param before a step: at the param's first
    step (`step` 0: there is no master yet), or when the param is not as the optimizer
    left it (`current` False) and the master no longer rounds to it (`stale()`, which
    each store answers from its own copy of the param; called only then)."""
    return step == 0 or (not current and stale())
