"""CPU params stepped in place: one fused kernel call per param group and dtype.

A CPU param has nothing to transfer: the kernel reads its live grad and writes
the param itself, fp32 in place, bf16/fp16 rounded from an fp32 master (kept
in the state as "master_param") in the same pass. This is how the optimizer
steps every CPU param, unless an engine option needs the pipeline
(step_in_backward, free_grads_after_copy) or test support
(offload_adam.testing.simulated) asks for the GPU's path.

The arguments of a group's kernel calls (`_Plan`, kernel_step.KernelArgs) are
built once and reused while the same params have grads; only the grads are
gathered per step.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version

from .distributed import local
from .kernel_state import kernel_state
from .kernel_step import Hyper, KernelArgs
from .param_state import ParamState
from .params import check_dense, param_label
from .state_format import MASTER_KEY, StateFormat, state_format


class _Call:
    """One kernel call: a group's params of one dtype that have grads, and its
    arguments (kernel_step.KernelArgs). Everything but the grads is cached
    between steps."""

    __slots__ = ("dtype", "params", "args", "copy_back")

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.params: List[torch.Tensor] = []
        self.args = KernelArgs()
        self.copy_back: List[int] = []           # non-contiguous params: stepped via a copy


class _Plan:
    """A group's calls for one pattern of which params have grads."""

    __slots__ = ("group", "key", "route", "calls")
    NO_GRAD = -1    # route of a param that had no grad when the plan was built
    ELSEWHERE = -2  # route of a param stepped by the engine

    def __init__(self, group, key, route, calls):
        self.group, self.key, self.route, self.calls = group, key, route, calls


class InPlace:
    """Steps the in-place params of an optimizer's groups."""

    def __init__(self, is_mine: Callable[[torch.Tensor], bool]):
        self._is_mine = is_mine
        self._plans: Dict[int, _Plan] = {}

    def step_group(self, index: int, group: dict, state, grad_scale: float,
                   num_threads: int) -> None:
        plan = self._plans.get(id(group))
        grads = self._gather(index, group, plan) if plan is not None else None
        if grads is None:  # no plan yet, or the grads no longer fit it
            plan = self._build(index, group, state)
            grads = self._gather(index, group, plan)
        hyper = Hyper.of(group)
        for call, call_grads in zip(plan.calls, grads):
            if not call_grads:
                continue
            work, lp_params = call.args.work, call.args.lp_params
            if call.copy_back:
                work, lp_params = list(work), list(lp_params)
                for j in call.copy_back:
                    p = call.params[j]
                    if lp_params:
                        lp_params[j] = torch.empty(p.shape, dtype=p.dtype)
                    else:
                        work[j] = p.contiguous()
            call.args.run(call_grads, hyper, grad_scale, num_threads, work, lp_params)
            for j in call.copy_back:
                local(call.params[j]).copy_(lp_params[j] if lp_params else work[j])
            # The kernel wrote the params through their pointers: tell autograd,
            # as torch's in-place step does (a backward of an older forward raises).
            for p in call.params:
                increment_version(p)

    def grads(self, param_groups) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(param, its local grad) for each param stepped here that has a grad."""
        return [(p, local(p.grad)) for g in param_groups for p in g["params"]
                if p.grad is not None and self._is_mine(p)]

    def _gather(self, index, group, plan) -> Optional[List[List[torch.Tensor]]]:
        """Per call, the grads to pass, or None when the plan no longer fits
        (a param gained or lost its grad, or changed dtype)."""
        if plan.group is not group or plan.key != self._key(group):
            return None
        grads: List[List[torch.Tensor]] = [[] for _ in plan.calls]
        for i, (p, c) in enumerate(zip(group["params"], plan.route)):
            if c == _Plan.ELSEWHERE:
                continue
            g = p.grad
            if g is None:
                if c >= 0:
                    return None
                continue
            if c < 0 or g.dtype is not plan.calls[c].dtype or p.dtype is not plan.calls[c].dtype:
                return None
            check_dense(g, f"param {param_label(group, index, i, p)}")
            g = local(g)
            grads[c].append(g if g.is_contiguous() else g.contiguous())
        return grads

    @staticmethod
    def _key(group) -> tuple:
        # Things that invalidate a plan without passing through our methods.
        return (id(group["params"]), len(group["params"]), bool(group["amsgrad"]),
                group.get("state_dtype"))

    def _build(self, index, group, state) -> _Plan:
        calls: List[_Call] = []
        by_dtype: Dict[torch.dtype, int] = {}
        route = []
        amsgrad = bool(group["amsgrad"])
        fmt = state_format(group.get("state_dtype", "float32"))
        for i, p in enumerate(group["params"]):
            if not self._is_mine(p):
                route.append(_Plan.ELSEWHERE)
                continue
            if p.grad is None:
                route.append(_Plan.NO_GRAD)
                continue
            check_dense(p.grad, f"param {param_label(group, index, i, p)}")
            t = local(p)   # a DTensor's shard: its state is the shard's (distributed.py)
            st = ready_state(state[p], t, amsgrad, fmt, f"param {param_label(group, index, i, p)}")
            c = by_dtype.setdefault(p.dtype, len(calls))
            if c == len(calls):
                calls.append(_Call(p.dtype))
            call = calls[c]
            route.append(c)
            if not t.is_contiguous():
                call.copy_back.append(len(call.params))
            call.params.append(p)
            call.args.add(ParamState.in_dict(st), t)
        plan = _Plan(group, self._key(group), route, calls)
        self._plans[id(group)] = plan
        return plan


def ready_state(st: dict, p: torch.Tensor, amsgrad: bool, fmt: StateFormat, label: str) -> dict:
    """Creates p's state `st` on its first step (as torch does, lazily) or brings a
    loaded one into the kernels' format (kernel_state.py), stored in `st` itself: the
    moments, step as a float32 0-dim tensor, and the fp32 master of a low-precision
    param (an fp32 param is its own master)."""
    low = p.dtype is not torch.float32
    got = kernel_state(st, p.shape, fmt, amsgrad, low, label)
    step = st.get("step")
    if not (isinstance(step, torch.Tensor) and step.dtype is torch.float32
            and step.dim() == 0 and step.device.type == "cpu"):
        st["step"] = torch.tensor(got.step, dtype=torch.float32)
    st.update(got.moments)
    fmt.drop_scales(st)
    if got.master is not None:
        st[MASTER_KEY] = got.master
    elif low:   # a fresh param, or a state dict saved by torch: start from the param
        st[MASTER_KEY] = torch.empty(p.shape, dtype=torch.float32).copy_(p.detach())
    else:
        st.pop(MASTER_KEY, None)
    return st
