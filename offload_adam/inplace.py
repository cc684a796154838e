"""CPU params stepped in place with their state in optimizer.state: one fused kernel
call per param group and dtype, lent by the RAM store (state_store.py) to the one CPU
stepper (cpu_step.py).

The bf16/fp16 params' fp32 masters are kept in the state as "master_param". This is
how the optimizer steps every CPU param, unless an engine option needs the pipeline
(step_in_backward, free_grads_after_copy), test support (offload_adam.testing.simulated)
asks for the GPU's path, or the state lives in files (state_dirs=, nvme_tier.py).

A group's kernel calls (`_Plan`, cpu_step.CpuCall) are built once and reused while the
same params have grads; only the grads are gathered per step.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .cpu_step import CpuCall, contiguous_grad
from .distributed import local
from .kernel_state import kernel_state
from .master_rule import PLAIN, MasterMarks, take_from_param
from .param_state import ParamState
from .params import check_dense, param_label, rounds_to
from .state_format import MASTER_KEY, StateFormat, state_format


class _Plan:
    """A group's calls for one pattern of which params have grads."""

    __slots__ = ("group", "key", "route", "calls", "ptrs", "states")
    NO_GRAD = -1    # route of a param that had no grad when the plan was built
    ELSEWHERE = -2  # route of a param stepped by the engine

    def __init__(self, group, key, route, calls, ptrs, states):
        self.group, self.key, self.route, self.calls = group, key, route, calls
        self.ptrs = ptrs   # per param, the address of the data its call steps (or None)
        self.states = states   # per param, _identity of the state its call steps (or None)


class InPlace:
    """Steps the in-place params of an optimizer's groups."""

    def __init__(self, is_mine: Callable[[torch.Tensor], bool], marks: MasterMarks):
        self._is_mine = is_mine
        self._marks = marks
        self._plans: Dict[int, _Plan] = {}

    def lend(self, index: int, group: dict, state) -> List[Tuple[CpuCall, List[torch.Tensor]]]:
        """The group's kernel calls over its in-place params' states, each with its
        grads (the calls of params with a grad), once every master follows its param
        (master_rule.py): the RAM store's bucket of the group (state_store.py)."""
        plan = self._plans.get(id(group))
        grads = self._gather(index, group, plan, state) if plan is not None else None
        if grads is None:  # no plan yet, or the grads or states no longer fit it
            plan = self._build(index, group, state)
            grads = self._gather(index, group, plan, state)
        self._follow(group, plan, state)
        return [(call, g) for call, g in zip(plan.calls, grads) if g]

    def _follow(self, group: dict, plan: _Plan, state) -> None:
        """The master rule (master_rule.py) for the group's bf16/fp16 params, stepped
        now or not: a master whose param was changed since they last agreed starts again
        from the param unless the param is still its rounding."""
        for p, c in zip(group["params"], plan.route):
            if c == _Plan.ELSEWHERE or p.dtype is torch.float32 or self._marks.current(p):
                continue
            master = state[p].get(MASTER_KEY) if p in state else None
            if master is not None:
                t = local(p).detach()
                if take_from_param(float(state[p].get("step") or 0), False,
                                   lambda: not rounds_to(master, t)):
                    master.copy_(t)
                self._marks.agree([p])

    def grads(self, param_groups) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(param, its local grad) for each param stepped here that has a grad."""
        return [(p, local(p.grad)) for g in param_groups for p in g["params"]
                if p.grad is not None and self._is_mine(p)]

    def _gather(self, index, group, plan, state) -> Optional[List[List[torch.Tensor]]]:
        """Per call, the grads to pass, or None when the plan no longer fits
        (a param gained or lost its grad, changed dtype, or has new data: p.data = ...;
        or its state was replaced or cleared: opt.state.clear(), a moment set anew)."""
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
            plain = type(p) in PLAIN   # (per param per step: the common case kept short)
            if (p if plain else local(p)).data_ptr() != plan.ptrs[i]:
                return None
            st = state.get(p)
            if st is None or _identity(st) != plan.states[i]:
                return None
            if g.layout is not torch.strided:   # (the label only for the error)
                check_dense(g, f"param {param_label(group, index, i, p)}")
            grads[c].append((g if g.is_contiguous() else g.contiguous()) if plain
                            else contiguous_grad(p))
        return grads

    @staticmethod
    def _key(group) -> tuple:
        # Things that invalidate a plan without passing through our methods.
        return (id(group["params"]), len(group["params"]), bool(group["amsgrad"]),
                group.get("state_dtype"))

    def _build(self, index, group, state) -> _Plan:
        calls: List[CpuCall] = []
        by_dtype: Dict[torch.dtype, int] = {}
        route, ptrs, states = [], [], []
        amsgrad = bool(group["amsgrad"])
        fmt = state_format(group.get("state_dtype", "float32"))
        for i, p in enumerate(group["params"]):
            ptrs.append(None)
            states.append(None)
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
            if c == len(calls):   # (an fp32 param is its own master: none to follow it)
                calls.append(CpuCall(p.dtype, followed=p.dtype is not torch.float32))
            route.append(c)
            ptrs[-1] = t.data_ptr()
            states[-1] = _identity(st)
            calls[c].add(p, ParamState.in_dict(st))
        plan = _Plan(group, self._key(group), route, calls, ptrs, states)
        self._plans[id(group)] = plan
        return plan


def _identity(st: dict) -> tuple:
    """Which state a plan steps: its dict and the tensors in it (the kernels update them
    in place; a dict cleared or replaced, or a tensor set anew, is another state)."""
    return id(st), tuple(id(v) for v in st.values())


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
