"""What every path says about a param: the dtypes it may have, how an error
names it, and the refusal of sparse grads (in place, the engine and the NVMe
tier raise the same words)."""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)   # these params get an fp32 master
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION


def param_label(group: dict, group_index: int, index: int, p: torch.Tensor) -> str:
    """How error messages name a param: its name when the group has names."""
    names = group.get("param_names")
    where = repr(names[index]) if names else f"group {group_index}, param {index}"
    return f"{where} (shape {tuple(p.shape)})"


def check_dense(grad: torch.Tensor, label: str) -> None:
    """A RuntimeError for a sparse grad; `label` names its param ("param ...")."""
    if grad.is_sparse or grad.layout is not torch.strided:
        raise RuntimeError(
            f"offload_adam does not support sparse gradients ({label}, grad layout "
            f"{grad.layout}); consider torch.optim.SparseAdam")
