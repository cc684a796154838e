"""The one call into the fused kernels, and the hyperparameters it takes.

Every way a param is stepped goes through `adam_step`, its arguments built as a
`KernelArgs`: CPU params in place (inplace.py), offloaded params in the engine's
bucket jobs (engine/core.py), and the NVMe tier's buckets (nvme_tier.py).
`Hyper` is a param group's hyperparameters as the kernel receives them,
compared as a whole by step_in_backward (engine/early.py).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .warn import warn

_FLOAT32_MAX = torch.finfo(torch.float32).max

if TYPE_CHECKING:   # (param_state imports state_format, which imports this module)
    from .param_state import ParamState


def kernels():
    """The compiled kernels (offload_adam/_build.py). Imported here, not at module
    level: importing the package must not compile anything."""
    from ._build import load_kernels
    return load_kernels()


def check_hyperparameters(lr, betas, eps, weight_decay, where: str = "",
                          at_step: bool = False) -> None:
    """The checks torch.optim.Adam's constructor makes, with its messages, in its order
    (less its foreach restrictions: foreach is ignored here), and the types it assumes
    (a string lr, betas that are no pair: a TypeError of its comparison, or none);
    `where` ends each message. `at_step`: the checks of step(), where betas of a float and
    an int, which the constructor refuses as torch's does, step as torch's step does."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element{where}")
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"lr must be a float or a 1-element tensor, not "
                        f"{type(lr).__name__} {lr!r}{where}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}{where}")
    if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, torch.Tensor)):
        raise TypeError(f"eps must be a float, not {type(eps).__name__} {eps!r}{where}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}{where}")
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), not {betas!r}{where}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, (numbers.Real, torch.Tensor)):
            raise TypeError(f"betas[{i}] must be a float or a 1-element tensor, not "
                            f"{type(b).__name__} {b!r}{where}")
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element{where}")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}{where}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay,
                                                        (numbers.Real, torch.Tensor)):
        raise TypeError(f"weight_decay must be a float, not {type(weight_decay).__name__} "
                        f"{weight_decay!r}{where}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}{where}")
    both_floats = all(isinstance(b, float) for b in betas)
    both_tensors = all(isinstance(b, torch.Tensor) for b in betas)
    if not (both_floats or both_tensors or at_step):
        raise ValueError(f"betas must be either both floats or both Tensors{where}")


def refuse_modes(group: dict, where: str) -> None:
    """capturable and differentiable, in the constructor's arguments, a group added or one
    set since: the kernels run on the host, outside autograd and CUDA graphs."""
    for key in ("capturable", "differentiable"):
        if group.get(key, False):
            raise ValueError(f"offload_adam does not support {key}=True ({where}); "
                             f"use torch.optim.Adam/AdamW for {key} mode")


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool
    amsgrad: bool

    @classmethod
    def of(cls, group: dict, index: Optional[int] = None) -> "Hyper":
        """The group's values for the kernel, refused as torch's constructor would refuse
        them (a scheduler's NaN lr, a beta set to 1: every param NaN, and with state files
        committed so), or as the kernel cannot take them."""
        where = f"param group {index}" if index is not None else "a param group"
        check_hyperparameters(group["lr"], group["betas"], group["eps"],
                              group["weight_decay"], f" ({where}, at step())", at_step=True)
        refuse_modes(group, f"{where}, at step()")
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        # The kernel's step size, lr / (1 - beta1^t), is a float32, largest at the first
        # step: past float32's range every param would become inf (torch's AdamW raises
        # "value cannot be converted to type float without overflow" there)
        if abs(lr) > _FLOAT32_MAX * max(1.0 - float(beta1), 0.0):
            raise ValueError(f"offload_adam: lr={lr!r} with betas[0]={float(beta1)!r}: the "
                             "step size lr / (1 - beta1) overflows float32 (the kernel's); "
                             "give a smaller lr")
        return cls(lr, float(beta1), float(beta2), float(group["eps"]),
                   float(group["weight_decay"]),
                   bool(group.get("decoupled_weight_decay", False)),
                   bool(group.get("maximize", False)), bool(group.get("amsgrad", False)))

    def changes(self, now: "Hyper") -> List[str]:
        """'name old -> new' for every field that differs in `now` (a NaN kept is no
        change: a diverged schedule's NaN lr was said to have changed at every step with
        step_in_backward, where torch steps it to NaN params; found from outside)."""
        def differ(a, b):
            return a != b and not (a != a and b != b)
        return [f"{f.name} {getattr(self, f.name)!r} -> {getattr(now, f.name)!r}"
                for f in fields(self) if differ(getattr(self, f.name), getattr(now, f.name))]


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
              max_exp_avg_sqs: Sequence[torch.Tensor], lp_params: Sequence[torch.Tensor],
              steps: Sequence[torch.Tensor], hyper: Hyper, grad_scale: float,
              num_threads: int, exp_avg_scales: Sequence[torch.Tensor] = (),
              exp_avg_sq_scales: Sequence[torch.Tensor] = (),
              first_indices: Sequence[int] = (), grad_mul: float = 1.0,
              master_los: Sequence[torch.Tensor] = (),
              master_ties: Sequence[torch.Tensor] = ()) -> None:
    """One fused Adam/AdamW step of a list of tensors (csrc/binding.cpp).

    params: fp32 tensors updated in place (a param, or the master of a bf16/fp16
    one); lp_params: where the kernel writes those masters rounded to bf16/fp16
    ([] for fp32 params); max_exp_avg_sqs: [] unless hyper.amsgrad; steps: torch's
    0-dim float32 step counts, incremented by the call; grad_scale multiplies
    every grad (1/loss scale times a clipping coefficient); grad_mul multiplies
    it first, the product rounded to the grad's dtype as torch rounds a bf16/fp16
    multiplication (a factor torch's clip applied to a grad freed after its copy
    to the host: csrc/adam_math.h). The moments' dtype is
    their format (state_format.py): 8-bit ones come with their block scales;
    first_indices: where each tensor starts in its param (a piece of a param cut
    in ranges), so that stochastic rounding draws the same bits however a param
    is cut. master_los, master_ties: split masters (split_master.py), params then empty
    and lp_params the bf16 halves, read and written. The GIL is released."""
    kernels().adam_step(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
        list(max_exp_avg_sqs) if hyper.amsgrad else [], list(lp_params), list(steps),
        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
        hyper.decoupled_weight_decay, hyper.maximize, float(grad_scale), int(num_threads),
        exp_avg_scales=list(exp_avg_scales), exp_avg_sq_scales=list(exp_avg_sq_scales),
        first_indices=[int(i) for i in first_indices], grad_mul=float(grad_mul),
        master_los=list(master_los), master_ties=list(master_ties))
    _say_threads_refused()


_said_refused = [False]


def _say_threads_refused() -> None:
    """Once a process: the kernels asked for threads the system refused to start, and
    ran on those there were (csrc/thread_pool.h: the same results, more slowly)."""
    if not _said_refused[0] and kernels().threads_refused():
        _said_refused[0] = True
        warn("offload_adam: the system refused to start some of the CPU step's threads (a "
             "limit on processes, threads or memory: ulimit -u, -v or -s, a cgroup's "
             "pids.max); the step ran on those there were, with the same results, more "
             "slowly. Ask for fewer with num_threads=", RuntimeWarning)


class KernelArgs:
    """The argument lists of one adam_step call but the grads, built tensor by tensor:
    what every stepper hands the kernel (inplace.py, the engine's bucket jobs, the NVMe
    tier), so that the call is written once. `add` one tensor's state; `run` with the
    grads, in the same order."""

    __slots__ = ("work", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "lp_params", "steps",
                 "exp_avg_scales", "exp_avg_sq_scales", "first_indices", "master_los",
                 "master_ties")

    def __init__(self):
        self.work: List[torch.Tensor] = []    # fp32, updated: a param, or a param's master
        self.exp_avgs: List[torch.Tensor] = []
        self.exp_avg_sqs: List[torch.Tensor] = []
        self.max_exp_avg_sqs: List[torch.Tensor] = []   # amsgrad only
        self.lp_params: List[torch.Tensor] = []   # bf16/fp16 params written from the masters
        self.steps: List[torch.Tensor] = []
        self.exp_avg_scales: List[torch.Tensor] = []   # 8-bit moments' block scales
        self.exp_avg_sq_scales: List[torch.Tensor] = []
        self.first_indices: List[int] = []
        self.master_los: List[torch.Tensor] = []    # split masters (all or none of a call)
        self.master_ties: List[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, state: ParamState, out: Optional[torch.Tensor] = None,
            first_index: int = 0) -> None:
        """One tensor's state (param_state.py): the kernel steps its master (or, without
        one, `out`: an fp32 param that is its own master), with its moments and step
        count, and writes the master rounded into `out` when it has both (a bf16/fp16
        param or its staging: all or none of a call's); `first_index`: where it starts
        in its param (a piece of a param cut in ranges). A split master (master_lo and
        master_tie) steps with `out` as its high half: its bf16 param, read and written."""
        split = state.master_lo is not None
        if len(self) and split != bool(self.master_los):
            raise ValueError("offload_adam: internal error: the masters of one kernel call "
                             "are all split or none")
        if split:
            if out is None or out.dtype != torch.bfloat16 or state.master is not None:
                raise ValueError("offload_adam: internal error: a split master steps with "
                                 "its bf16 param as its high half")
            self.master_los.append(state.master_lo)
            self.master_ties.append(state.master_tie)
            self.lp_params.append(out)
        else:
            work = state.master if state.master is not None else out
            if work is None:
                raise ValueError("offload_adam: internal error: a state without a master "
                                 "needs the param it steps")
            self.work.append(work)
        self.exp_avgs.append(state.exp_avg)
        self.exp_avg_sqs.append(state.exp_avg_sq)
        self.steps.append(state.step)
        if state.max_exp_avg_sq is not None:
            self.max_exp_avg_sqs.append(state.max_exp_avg_sq)
        if state.master is not None and out is not None:
            self.lp_params.append(out)
        if state.exp_avg_scale is not None:
            self.exp_avg_scales.append(state.exp_avg_scale)
            self.exp_avg_sq_scales.append(state.exp_avg_sq_scale)
        self.first_indices.append(int(first_index))

    def run(self, grads: Sequence[torch.Tensor], hyper: Hyper, grad_scale: float,
            num_threads: int, work: Optional[Sequence[torch.Tensor]] = None,
            lp_params: Optional[Sequence[torch.Tensor]] = None, grad_mul: float = 1.0) -> None:
        """adam_step over the tensors added, with `grads` in their order; `work` and
        `lp_params` replace the lists added (stepping some through copies; not split
        masters, whose param is their high half)."""
        if self.master_los and (work is not None or lp_params is not None):
            raise ValueError("offload_adam: internal error: split masters step in place")
        adam_step(self.work if work is None else work, grads, self.exp_avgs, self.exp_avg_sqs,
                  self.max_exp_avg_sqs, self.lp_params if lp_params is None else lp_params,
                  self.steps, hyper, grad_scale, num_threads, self.exp_avg_scales,
                  self.exp_avg_sq_scales,
                  self.first_indices if any(self.first_indices) else (), grad_mul,
                  self.master_los, self.master_ties)


def grad_sq_sums(grads: Sequence[torch.Tensor], num_threads: int) -> List[float]:
    """Per-tensor sum of squares (double accumulation; inf/NaN propagate)."""
    sums = list(kernels().grad_sq_sums(list(grads), int(num_threads)))
    _say_threads_refused()
    return sums


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s multiplier, computed as it does (fp32)."""
    total = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(float(max_norm), dtype=torch.float32) / (total + 1e-6)
    return float(torch.clamp(coef, max=1.0))
