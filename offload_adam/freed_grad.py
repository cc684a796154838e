"""What p.grad holds once free_grads_after_copy=True sent it to the host.

Setting `p.grad = None` would free the device memory, but code that runs
between backward and step() reads None as "this param has no grad" and goes on
silently: torch.nn.utils.clip_grad_norm_ (and so Hugging Face Trainer's and
Accelerate's clipping and grad-norm logging) finds no grads, returns a norm of
0 and clips nothing, and GradScaler finds no inf. So p.grad is instead a
`FreedGrad`: a tensor of the grad's shape, dtype and device that owns no
memory. It answers, from the grad's host copy, what clipping and GradScaler
ask of a grad:
  * its 2-norm (torch.linalg.vector_norm, what clip_grad_norm_ computes per grad);
  * multiplication by a scalar in place (clip_grad_norm_'s coefficient), which
    the optimizer applies inside its next step's kernel, each product rounded
    to the grad's dtype as torch's multiplication would have rounded it on the
    device (the norm is the one bound: options.py, free_grads_after_copy);
  * GradScaler's inf check (unscaling by 1, what GradScaler.step does before it
    hands the optimizer its scale), so that a step with inf/NaN grads is
    skipped and the scale lowered, as without the option;
  * autograd's `p.grad += new` when another micro-batch's backward accumulates
    into it: `new` is sent to the host and added to the host copy there
    (the engine's accumulation ring), so the device holds no grad between
    micro-batches;
and refuses everything else (reading values, GradScaler.unscale_) with an
error that says why and what to do. After step() the host copy is let go, and
until zero_grad() the FreedGrad answers nothing (`Stepped`): a second step(),
or a backward adding to it, raises where torch would use the stepped grad again.

A DTensor param's FreedGrad is a DTensor of the param's layout around one, so
that the clipping norm's reduction (distributed.py) still sees the layout.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten

from .distributed import is_dtensor

_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_NORM = torch.ops.aten.linalg_vector_norm.default
_MUL_ = (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar)
_ADD_ = torch.ops.aten.add_.Tensor
_ZERO_ = torch.ops.aten.zero_.default
# clip_grad_norm_'s foreach path (foreach=True; the default for DTensor grads, FSDP2)
_FOREACH_NORM = torch.ops.aten._foreach_norm.Scalar
_FOREACH_MUL_ = (torch.ops.aten._foreach_mul_.Tensor, torch.ops.aten._foreach_mul_.Scalar)
_ALIASES = (torch.ops.aten.view.default, torch.ops.aten.alias.default,
            torch.ops.aten.detach.default)   # DTensor.from_local and to_local make these


class HostCopy(Protocol):
    """What a FreedGrad knows of its grad (the engine's record of the copy)."""

    def sq_sum(self) -> float: ...          # sum of squares (inf/NaN propagate)

    def scale(self, factor: float) -> None: ...   # multiply it, in the next step

    def accumulate(self, new: torch.Tensor) -> None: ...   # add another micro-batch's grad


class FreedGrad(torch.Tensor):
    """A freed grad: shape, dtype and device, no data; `host` answers for it."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, label: str, host: HostCopy):
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device,
            requires_grad=False)
        t.label, t.host = label, host
        return t

    def __repr__(self):
        return f"FreedGrad({self.label}: sent to the host and freed)"

    @classmethod
    @torch.compiler.disable   # (run as is under a compiled step function: engine/core.py)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _UNSCALE:
            return _inf_check(*args, **kwargs)
        if func is _NORM:
            return _norm(*args, **kwargs)
        if func is _FOREACH_NORM:
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            dtype = kwargs.get("dtype")
            return [_norm(t, order, dtype=dtype) if isinstance(t, FreedGrad)
                    else torch.linalg.vector_norm(t, order, dtype=dtype) for t in args[0]]
        if func in _FOREACH_MUL_ and not isinstance(args[1], FreedGrad):
            for t in args[0]:
                if isinstance(t, FreedGrad):
                    t.host.scale(float(args[1]))
                else:
                    t.mul_(args[1])
            return None
        if func in _MUL_ and isinstance(args[0], FreedGrad) and not isinstance(args[1], FreedGrad):
            args[0].host.scale(float(args[1]))
            return args[0]
        if (func is _ADD_ and isinstance(args[0], FreedGrad) and len(args) == 2
                and isinstance(args[1], torch.Tensor) and not isinstance(args[1], FreedGrad)
                and kwargs.get("alpha", 1) == 1 and args[1].shape == args[0].shape
                and args[1].dtype == args[0].dtype):
            args[0].host.accumulate(args[1])   # autograd accumulating a micro-batch
            return args[0]
        if func in _ALIASES and (len(args) < 2 or tuple(args[1]) == tuple(args[0].shape)):
            return FreedGrad(args[0], args[0].label, args[0].host)   # the same grad
        freed = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, FreedGrad))
        if func is _ZERO_:
            raise RuntimeError(
                f"offload_adam: the grad of {freed.label} was sent to the host and freed in "
                "backward (free_grads_after_copy=True): it has no memory to zero in place "
                "(model.zero_grad(set_to_none=False), p.grad.zero_()). Call the optimizer's "
                "zero_grad(set_to_none=False), which leaves zero grads as torch does, or "
                "zero_grad() with set_to_none=True (the default)")
        raise RuntimeError(
            f"offload_adam: the grad of {freed.label} was sent to the host and freed in "
            f"backward (free_grads_after_copy=True), so {func} cannot use it: only its "
            "norm, a multiplication by a scalar (clipping), GradScaler's inf check and "
            "the accumulation of another micro-batch's grad are answered from the host "
            "copy. Do not read grads between backward and step() with this option; or "
            "use free_grads_after_copy=False. (If another library's optimizer steps these "
            "params now, close() the offload_adam one: while it lives its hooks take "
            "their grads)" + _replicas_hint())


def _replicas_hint() -> str:
    """Under DDP (replicas) the option is refused when the optimizer is built; one built
    before the process group was not: DDP's reducer then reads the freed grads."""
    from .distributed import replicated
    if not replicated(()):
        return ""
    return (". Under DistributedDataParallel, whose reducer averages the grads after "
            "backward, free_grads_after_copy is refused: this optimizer was built before "
            "torch.distributed's process group. Build it after init_process_group (after "
            "TrainingArguments or Accelerator)")


def _inf_check(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's `_amp_foreach_non_finite_check_and_unscale_` over a list
    holding freed grads: only the check, which GradScaler.step makes with a
    scale of 1 (unscale_ with a real scale raises, the grads being gone)."""
    freed = [g for g in grads if isinstance(g, FreedGrad)]
    if float(inv_scale) != 1.0:
        raise RuntimeError(
            f"offload_adam: GradScaler.unscale_ cannot unscale the grad of {freed[0].label}: "
            "free_grads_after_copy=True sent it to the host and freed it in backward. "
            "Let GradScaler.step unscale (do not call unscale_) and clip with max_grad_norm=")
    rest = [g for g in grads if not isinstance(g, FreedGrad)]
    if rest:
        torch._amp_foreach_non_finite_check_and_unscale_(rest, found_inf, inv_scale)
    if not all(math.isfinite(g.host.sq_sum()) for g in freed):
        found_inf.fill_(1.0)


def _norm(g: FreedGrad, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
    """torch.linalg.vector_norm of a whole freed grad (the 2-norm only)."""
    if float(ord) != 2.0 or dim is not None or keepdim:
        raise RuntimeError(
            f"offload_adam: the grad of {g.label} was freed in backward "
            f"(free_grads_after_copy=True); only its whole 2-norm can be computed "
            f"(asked: ord={ord}, dim={dim}, keepdim={keepdim})")
    return torch.tensor(math.sqrt(g.host.sq_sum()), dtype=dtype or g.dtype, device=g.device)


def freed_grad(param: torch.Tensor, local_grad: torch.Tensor, label: str,
               host: HostCopy) -> torch.Tensor:
    """The FreedGrad to put in param.grad for a freed grad like `local_grad`."""
    placeholder = FreedGrad(local_grad, label, host)
    if not is_dtensor(param):
        return placeholder
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(placeholder, param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


class Stepped:
    """The host copy of a freed grad once a completed step() consumed it (the engine lets
    it go): the FreedGrad left in p.grad until zero_grad() answers nothing. torch keeps a
    stepped grad until zero_grad(), so a second step() steps it again and the next
    backward adds to it; here both would go on silently from no grad, so both raise."""

    def __init__(self, label: str):
        self.label = label

    def refuse(self, what: str):
        raise RuntimeError(
            f"offload_adam: the grad of {self.label} was freed in backward "
            "(free_grads_after_copy=True) and its host copy let go after the last step() "
            f"stepped it, so {what}. Call zero_grad() after step(), before the next "
            "backward or step(): the optimizer's, or the model's with set_to_none=True "
            "(the default)")

    def sq_sum(self) -> float:
        self.refuse("its norm is gone")

    def scale(self, factor: float) -> None:
        self.refuse("it cannot be scaled")

    def accumulate(self, new: torch.Tensor) -> None:
        self.refuse("this backward cannot add its grad to it (torch would)")


def check_freed_grads(param_groups, engine) -> None:
    """step() refuses a param whose grad the last step() consumed (Stepped), and one
    whose grad another optimizer freed (its host copy is that optimizer's: read as no
    grad, the param would silently not be stepped). `engine`: this optimizer's (None:
    it has none, the grads it steps are on the device)."""
    for g in param_groups:
        for p in g["params"]:
            grad = p.grad
            if grad is not None and is_freed(grad):
                local = grad._local_tensor if is_dtensor(grad) else grad
                if isinstance(local.host, Stepped):
                    local.host.refuse("step() cannot step it again")
                mine = getattr(local.host, "engine_ref", lambda: None)()
                if engine is None or mine is not engine:
                    raise RuntimeError(
                        f"offload_adam: the grad of {local.label} was freed in backward by "
                        "another optimizer (free_grads_after_copy=True): its values were in "
                        "that optimizer's host copy, which this one cannot read (and which "
                        "that one let go when this one took its params over). Call "
                        "zero_grad() and run the backward again; nothing was stepped")


def is_freed(grad) -> bool:
    """Whether a grad (or a DTensor's local part) is a FreedGrad."""
    if is_dtensor(grad):
        grad = grad._local_tensor
    return isinstance(grad, FreedGrad)
