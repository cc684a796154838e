"""A float64 reference Adam/AdamW, written from the formula (not from torch.optim),
and the yardstick the kernel tests use: our fp32 error against this reference may
be no worse than torch's own fp32 AdamW error against it.

Per element, at step t (1 on the first step):
    g = grad * grad_scale;  if maximize: g = -g
    AdamW (decoupled): p = p * (1 - lr*wd)        Adam (L2): g = g + wd*p
    m = beta1*m + (1-beta1)*g
    v = beta2*v + (1-beta2)*g*g ;  amsgrad: vmax = max(vmax, v), used in place of v
    p = p - lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
"""
import math

import torch

F32_EPS = torch.finfo(torch.float32).eps


class ReferenceAdam:
    """Adam/AdamW on one tensor, in float64."""

    def __init__(self, param, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=True, amsgrad=False, maximize=False):
        self.p = param.detach().to(torch.float64).clone()
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)
        self.vmax = torch.zeros_like(self.p) if amsgrad else None
        self.lr, self.eps, self.wd = lr, eps, weight_decay
        self.beta1, self.beta2 = betas
        self.decoupled, self.maximize = decoupled, maximize
        self.t = 0

    def step(self, grad, lr=None, grad_scale=1.0):
        lr = self.lr if lr is None else lr
        self.t += 1
        g = grad.detach().to(torch.float64) * grad_scale
        if self.maximize:
            g = -g
        if self.decoupled:
            self.p = self.p * (1.0 - lr * self.wd)
        else:
            g = g + self.wd * self.p
        self.m = self.beta1 * self.m + (1.0 - self.beta1) * g
        self.v = self.beta2 * self.v + (1.0 - self.beta2) * g * g
        v = self.v
        if self.vmax is not None:
            self.vmax = torch.maximum(self.vmax, self.v)
            v = self.vmax
        bc1 = 1.0 - self.beta1 ** self.t
        bc2 = 1.0 - self.beta2 ** self.t
        self.p = self.p - (lr / bc1) * self.m / (v.sqrt() / math.sqrt(bc2) + self.eps)
        return self.p


def max_abs_err(values, refs):
    """Largest |value - ref| over a list of tensors (values of any float dtype)."""
    err = 0.0
    for x, r in zip(values, refs):
        if x.numel():
            err = max(err, (x.detach().to(torch.float64) - r).abs().max().item())
    return err


def assert_no_worse_than_torch(ours, theirs, refs, factor=1.5, what=""):
    """Our error vs the float64 reference is at most `factor` times torch's fp32
    error, plus a few fp32 ulps of the largest value (torch can be exact)."""
    scale = max([1.0] + [r.abs().max().item() for r in refs if r.numel()])
    tiny = 4 * F32_EPS * scale
    ours_err, torch_err = max_abs_err(ours, refs), max_abs_err(theirs, refs)
    assert ours_err <= factor * torch_err + tiny, (
        f"{what}: our error {ours_err:.3e} > {factor} x torch's {torch_err:.3e} + {tiny:.1e}")


def assert_lp_matches_master(lp, master):
    """A bf16/fp16 param equals its fp32 master rounded to nearest even: bitwise
    on the non-NaN elements, and NaN in the same places."""
    expected = master.to(lp.dtype)
    lp_nan, exp_nan = torch.isnan(lp), torch.isnan(expected)
    assert torch.equal(lp_nan, exp_nan), "NaN positions differ"
    bits = torch.int16
    assert torch.equal(lp[~lp_nan].view(bits), expected[~exp_nan].view(bits)), (
        "low-precision param is not master.to(dtype) bitwise")
