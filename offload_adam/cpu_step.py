"""The one CPU stepper (`step_on_cpu`): CPU params stepped in place from their states,
whatever store lends them (state_store.py: optimizer.state for inplace.py, a bucket of
the files for nvme_tier.py).

A CPU param has nothing to transfer: the kernel reads its live grad and writes the param
itself, fp32 in place, bf16/fp16 rounded from its fp32 master in the same pass. Params of
one dtype go in one kernel call (`CpuCall`); a param made non-contiguous after the
optimizer was built (p.data = a transposed view) is stepped through a contiguous copy that
is written back. The stores differ only in where the `ParamState` records point and in how
long they live: inplace.py builds its calls once and reuses them while the same params have
grads; the NVMe tier builds them per bucket, over the ring buffer that holds it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version

from .distributed import local
from .kernel_step import Hyper, KernelArgs
from .master_rule import MasterMarks
from .param_state import ParamState


class CpuCall:
    """One kernel call: params of one dtype and their states' arguments (KernelArgs),
    built once; `run` takes the grads. `followed`: the params have masters that follow
    them (master_rule.py; not an fp32 param in RAM, its own master)."""

    __slots__ = ("dtype", "params", "args", "copy_back", "followed", "ran")

    def __init__(self, dtype: torch.dtype, followed: bool = True):
        self.dtype, self.followed = dtype, followed
        self.params: List[torch.Tensor] = []
        self.args = KernelArgs()
        self.copy_back: List[int] = []   # non-contiguous params: stepped via a copy
        self.ran = False   # run() wrote the params (the files' error path asks)

    def add(self, p: torch.Tensor, state: ParamState) -> None:
        t = local(p)   # a DTensor's shard: its state is the shard's (distributed.py)
        if not t.is_contiguous():
            self.copy_back.append(len(self.params))
        self.params.append(p)
        self.args.add(state, t.detach())

    def run(self, grads: Sequence[torch.Tensor], hyper: Hyper, grad_scale: float,
            num_threads: int) -> None:
        """The kernel over the params with `grads` (contiguous, in their order)."""
        work, lp_params = self.args.work, self.args.lp_params
        if self.copy_back:
            work, lp_params = list(work), list(lp_params)
            for j in self.copy_back:
                t = local(self.params[j]).detach()
                if lp_params:   # the kernel writes it from the master: no need to read it
                    lp_params[j] = torch.empty(t.shape, dtype=t.dtype)
                else:           # an fp32 param is its own master: stepped as a copy
                    work[j] = t.contiguous()
        self.args.run(grads, hyper, grad_scale, num_threads, work, lp_params)
        for j in self.copy_back:
            local(self.params[j]).detach().copy_(lp_params[j] if lp_params else work[j])
        # The kernel wrote the params through their pointers: tell autograd, as torch's
        # in-place step does (a backward of an older forward raises).
        for p in self.params:
            increment_version(p)
        self.ran = True


def step_on_cpu(calls: Sequence[Tuple[CpuCall, Sequence[torch.Tensor]]], hyper: Hyper,
                grad_scale: float, num_threads: int, marks: MasterMarks) -> None:
    """The CPU stepper: each lent call (state_store.Lent) over its grads. The params it
    wrote agree with their masters after it (master_rule.py; the files copy an fp32
    param into theirs)."""
    for call, grads in calls:
        call.run(grads, hyper, grad_scale, num_threads)
        if call.followed:
            marks.agree(call.params)


def calls_by_dtype(pairs: Sequence[Tuple[torch.Tensor, ParamState]]) -> List[CpuCall]:
    """A call per param dtype of (param, its state) `pairs`, in their order."""
    calls: Dict[torch.dtype, CpuCall] = {}
    for p, state in pairs:
        calls.setdefault(p.dtype, CpuCall(p.dtype)).add(p, state)
    return list(calls.values())


def contiguous_grad(p: torch.Tensor) -> torch.Tensor:
    """p's local grad as the kernel reads it."""
    g = local(p.grad)
    return g if g.is_contiguous() else g.contiguous()
