"""The one call into the fused kernels, and the hyperparameters it takes.

Both ways a param is stepped go through `adam_step`: CPU params in place
(inplace.py) and offloaded params in the engine's bucket jobs (engine.py).
`Hyper` is a param group's hyperparameters as the kernel receives them,
compared as a whole by step_in_backward (engine/early.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Sequence

import torch


def kernels():
    """The compiled kernels (offload_adam/_build.py). Imported here, not at module
    level: importing the package must not compile anything."""
    from ._build import load_kernels
    return load_kernels()


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
    def of(cls, group: dict) -> "Hyper":
        beta1, beta2 = group["betas"]
        return cls(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                   float(group["weight_decay"]),
                   bool(group.get("decoupled_weight_decay", False)),
                   bool(group.get("maximize", False)), bool(group.get("amsgrad", False)))

    def changes(self, now: "Hyper") -> List[str]:
        """'name old -> new' for every field that differs in `now`."""
        return [f"{f.name} {getattr(self, f.name)!r} -> {getattr(now, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(now, f.name)]


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
              max_exp_avg_sqs: Sequence[torch.Tensor], lp_params: Sequence[torch.Tensor],
              steps: Sequence[torch.Tensor], hyper: Hyper, grad_scale: float,
              num_threads: int, exp_avg_scales: Sequence[torch.Tensor] = (),
              exp_avg_sq_scales: Sequence[torch.Tensor] = (),
              first_indices: Sequence[int] = ()) -> None:
    """One fused Adam/AdamW step of a list of tensors (csrc/binding.cpp).

    params: fp32 tensors updated in place (a param, or the master of a bf16/fp16
    one); lp_params: where the kernel writes those masters rounded to bf16/fp16
    ([] for fp32 params); max_exp_avg_sqs: [] unless hyper.amsgrad; steps: torch's
    0-dim float32 step counts, incremented by the call; grad_scale multiplies
    every grad (1/loss scale times a clipping coefficient). The moments' dtype is
    their format (state_format.py): 8-bit ones come with their block scales;
    first_indices: where each tensor starts in its param (a piece of a param cut
    in ranges), so that stochastic rounding draws the same bits however a param
    is cut. The GIL is released."""
    kernels().adam_step(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
        list(max_exp_avg_sqs) if hyper.amsgrad else [], list(lp_params), list(steps),
        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
        hyper.decoupled_weight_decay, hyper.maximize, float(grad_scale), int(num_threads),
        exp_avg_scales=list(exp_avg_scales), exp_avg_sq_scales=list(exp_avg_sq_scales),
        first_indices=[int(i) for i in first_indices])


def grad_sq_sums(grads: Sequence[torch.Tensor], num_threads: int) -> List[float]:
    """Per-tensor sum of squares (double accumulation; inf/NaN propagate)."""
    return list(kernels().grad_sq_sums(list(grads), int(num_threads)))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s multiplier, computed as it does (fp32)."""
    total = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(float(max_norm), dtype=torch.float32) / (total + 1e-6)
    return float(torch.clamp(coef, max=1.0))
