"""One transfer of a list of tensors between host and device: which bytes move
through which temporary (the plan), and the copies that do it.

A pack of small tensors (norms, biases) costs one DMA instead of one each: on
the way to the host their device tensors are gathered into a temporary on the
device and the temporary is copied in one go; on the way back the temporary is
filled in one copy and scattered. `plan_copy` decides which pairs share which
temporary, a pure function of the tensors; `run_plan` issues the copies.
CudaDevice runs them on its side streams, and the simulated device
(offload_adam.testing) runs the very same two with copies that land late, so
the bytes the tests see moved are the bytes a GPU moves.

The copy of a temporary writes (D2H) or reads (H2D) one contiguous host span,
all of it. So a temporary is shared only by host views that abut, each ending
where the next begins: a gap in the span would be another buffer (another
param's grad, copied by its own copy and maybe already stepped on), onto
which the temporary's uninitialised bytes would land after it, and on the way
back it would be moved and allocated on the device for nothing.
layout.allocate_transfers lays a bucket's packed buffers side by side, so that
a bucket's pack is one such run.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, List, Optional, Sequence, Tuple

import torch

# Pieces smaller than this travel packed (layout.cut). A pair at least this
# large always goes straight: its DMA is long enough on its own, and a gather
# would cost device memory and a device copy of it for nothing.
PACK_BELOW_BYTES = 1 << 18


@dataclass(frozen=True)
class Run:
    """One copy of a plan. `items`: the pairs it moves (indices into the
    planned lists). `host`: the host bytes the copy reads or writes, all of
    them: the one pair's host tensor (`offsets` None: a straight copy), or a
    1-D view through a temporary of its size on the device, in which pair
    items[k] has its slot at offsets[k]."""

    items: Tuple[int, ...]
    host: torch.Tensor
    offsets: Optional[Tuple[int, ...]] = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None


def plan_copy(host: Sequence[torch.Tensor], device: Sequence[torch.Tensor]) -> List[Run]:
    """The copies that move host[i] <-> device[i] for every i: one through a
    temporary per run of small host views that abut, in address order; a
    straight copy for every other pair."""
    if len(host) != len(device):
        raise ValueError(f"{len(host)} host tensors for {len(device)} device tensors")
    runs: List[List[int]] = []
    for i in sorted(range(len(host)), key=lambda i: host[i].data_ptr()):
        if runs and _abuts(host[runs[-1][-1]], host[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return [_run(host, items) for items in runs]


def _packable(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.numel() * t.element_size() < PACK_BELOW_BYTES


def _abuts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's bytes begin where a's end, in one buffer, both packable."""
    return (_packable(a) and _packable(b) and a.dtype == b.dtype
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def _run(host: Sequence[torch.Tensor], items: List[int]) -> Run:
    first = host[items[0]]
    if len(items) == 1:
        return Run((items[0],), first)
    sizes = [host[i].numel() for i in items]
    span = first.as_strided((sum(sizes),), (1,), first.storage_offset())
    return Run(tuple(items), span, tuple(accumulate(sizes[:-1], initial=0)))


def run_plan(runs: Sequence[Run], host: Sequence[torch.Tensor], device: Sequence[torch.Tensor],
             to_host: bool, empty: Callable[[torch.Tensor], torch.Tensor],
             non_blocking: bool) -> None:
    """Issues the copies of `runs` (plan_copy(host, device)), device to host when
    `to_host`, else host to device. `empty(like)`: an uninitialised device
    tensor of like's shape and dtype, a temporary dropped once its copies are
    issued."""
    for run in runs:
        if not run.packed:
            (i,) = run.items
            dst, src = (host[i], device[i]) if to_host else (device[i], host[i])
            dst.copy_(src, non_blocking=non_blocking)
            continue
        tmp = empty(run.host)
        pairs = [device[i] for i in run.items]
        slots = [tmp[o:o + t.numel()].view(t.shape) for o, t in zip(run.offsets, pairs)]
        if to_host:
            torch._foreach_copy_(slots, pairs)
            run.host.copy_(tmp, non_blocking=non_blocking)
        else:
            tmp.copy_(run.host, non_blocking=non_blocking)
            torch._foreach_copy_(pairs, slots)
