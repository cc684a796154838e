"""A param's state brought into the form the kernels step: one function for every path.

A state arrives as torch's optimizers keep it ("step", "exp_avg", "exp_avg_sq",
"max_exp_avg_sq", "master_param"): empty at a param's first step, or loaded from a
state dict in any form (fp32 moments from torch, bf16, 8-bit codes with their scales,
a master cast to bf16 by torch). `kernel_state` gives its values as the kernels want
them: the step count, each moment in the group's format (state_format.py), the fp32
master. Each stepper stores them where its state lives: in optimizer.state itself (CPU
params stepped in place, inplace.py), in the engine's host buffers (engine/state.py),
in a bucket of the NVMe tier's files (nvme_tier.py); load_state_dict
(torch_state_dict.py) converts a loaded state with it too, keeping the moments the
dict holds (a missing one is made at the first step, as above).

The master: a bf16/fp16 param has one, and so has every param of the engine (its fp32
values on the host) and of the NVMe tier but the fp32 ones stepped in place, which are
their own master. A state without one (a fresh param, or a state dict saved by torch)
starts it from the param, which each stepper reads its own way; afterwards it follows
the param by the one rule of master_rule.py (a loaded one is checked at the next step).
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional

import torch

from .state_format import MASTER_KEY, MOMENT_KEYS, StateFormat


class KernelState(NamedTuple):
    step: float                       # steps taken
    moments: Dict[str, torch.Tensor]  # each moment (and 8-bit scale) key in the format
    master: Optional[torch.Tensor]    # fp32 of the param's shape, or None: see has_master


def kernel_state(st: dict, shape, fmt: StateFormat, amsgrad: bool, has_master: bool,
                 label: str, zeros: bool = True) -> KernelState:
    """The values of state `st` of a param of `shape` in format `fmt`: the state's own
    tensors where they already are in that form (contiguous, on the CPU), else new ones;
    missing moments are zeros. amsgrad adds max_exp_avg_sq. `has_master`: the param has
    a master apart from itself (False: an fp32 param stepped in place); master is None
    when it has none, or when `st` holds none and it starts from the param. `label`
    names the param in errors ("param ..."). `zeros=False`: a missing moment is left out
    of `moments`, for a caller that zeroes its own buffer (the engine's host arenas: no
    temporary the moment's size, faulted in and copied, at a param's first step). Raises
    ValueError for a state that does not fit, before anything is stored."""
    fmt.check_amsgrad(amsgrad, label)
    step = st.get("step")
    numel = math.prod(shape)
    moments: Dict[str, torch.Tensor] = {}
    for key in MOMENT_KEYS if amsgrad else MOMENT_KEYS[:2]:
        moments.update(fmt.convert(st, key, shape, numel, f" of {label}", zeros))
    master = st.get(MASTER_KEY) if has_master else None
    return KernelState(0.0 if step is None else float(step), moments,
                       as_fp32_like(master, shape, MASTER_KEY, label)
                       if isinstance(master, torch.Tensor) else None)


def as_fp32_like(t: torch.Tensor, shape, key: str, label: str) -> torch.Tensor:
    """`t` as a contiguous fp32 CPU tensor of `shape` (itself when it is one)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"optimizer state {key!r} of {label} has shape {tuple(t.shape)}, "
                         f"expected {tuple(shape)}")
    if t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        return t
    out = torch.empty(shape, dtype=torch.float32)
    out.copy_(t)
    return out
