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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Run:
    """One copy of a plan. `items`: the pairs it moves (indices into the
    planned lists). `host`: the host bytes the copy reads or writes, all of
    them: the one pair's host tensor (`offsets` None: a straight copy), or a
    1-D view through a temporary of its size on the device, in which pair
    items[k] has its slot at offsets[k]."""

    items: Tuple[int, ...]
    host: torch.Tensor
    offsets: Tuple[int, ...] = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None


def plan_copy(host: Sequence[torch.Tensor], device: Sequence[torch.Tensor]) -> List[Run]:
    """The copies that move host[i] <-> device[i] for every i."""
    if len(host) != len(device):
        raise ValueError(f"{len(host)} host tensors for {len(device)} device tensors")
    if len(host) == 1:
        return [Run((0,), host[0])]
    starts = [v.storage_offset() for v in host]
    lo = min(starts)
    hi = max(s + v.numel() for s, v in zip(starts, host))
    flat = host[0].as_strided((hi - lo,), (1,), lo)
    return [Run(tuple(range(len(host))), flat, tuple(s - lo for s in starts))]


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
