"""The GradScaler and clipping protocol: what the step multiplies the grads by.

A grad reaches the kernel as it is in p.grad (or its host copy); the kernel
multiplies it by one factor, folded into its single pass:
  * 1 / loss scale, when torch.cuda.amp.GradScaler.step hands the optimizer
    `grad_scale` and `found_inf` instead of unscaling the grads itself (the
    optimizer says it can: `_step_supports_amp_scaling`); a found inf skips the
    whole step;
  * the clip coefficient, from max_grad_norm= (every step) or from
    opt.clip_grad_norm_ (this step): computed from the norm of the host copies
    (engine) and of the in-place params' grads, never by a pass over the grads
    on the device.
The optimizer class (optimizer.py) mixes this in; it provides `_engine` (the
offload engine, the stepper that streams grads), `_join_trained()` (brings into it
the params that have a grad and are not in it yet), `_store` (state_store.py: the
in-place params' grads), `_options`, `_params()` and `_inplace_threads()`.
"""

from __future__ import annotations

import math
from typing import Optional

from . import distributed
from .kernel_step import clip_coefficient, grad_sq_sums
from .params import check_grad_dtypes


class GradScaling:
    """clip_grad_norm_, and the factor step() gives the kernels."""

    _clip_coef: Optional[float] = None   # set by clip_grad_norm_, used by the next step

    def _total_norm(self):
        """2-norm of all grads: the engine's from its host copies, the in-place
        params' by the kernel, each of the local shard of a DTensor, summed over
        the ranks that hold the other shards (distributed.py). Double
        accumulation; inf/NaN propagate."""
        check_grad_dtypes(self.param_groups)
        self._join_trained()   # (a param unfrozen since the last step: its grad counts)
        sums = self._engine.grad_sq_sums() if self._engine is not None else []
        pairs = self._store.grads(self.param_groups)
        by_dtype = {}   # one kernel call per grad dtype (fp32 and bf16 params in one group)
        for p, g in pairs:
            by_dtype.setdefault(g.dtype, []).append((p, g))
        for same in by_dtype.values():
            grads = [g if g.is_contiguous() else g.contiguous() for _, g in same]
            sums += zip([p for p, _ in same], grad_sq_sums(grads, self._inplace_threads()))
        total = distributed.global_sq_sum(sums, self._params(), self._options.process_group)
        return math.sqrt(total)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ for this optimizer's params, without a
        pass over the grads on the device: the norm comes from the host copies
        and the coefficient is applied inside the next step's kernel (p.grad is
        left as it is). Returns the total norm (a float32 tensor on the params'
        device). Only the 2-norm. DTensor params (FSDP2): the norm over all
        shards, the same on every rank; every rank must call it."""
        if float(norm_type) != 2.0:
            raise NotImplementedError(
                "offload_adam's clip_grad_norm_ computes the 2-norm only; use "
                "torch.nn.utils.clip_grad_norm_ for other norms")
        if self._engine is not None and self._engine.step_in_backward:
            self._engine.early.fail(
                "opt.clip_grad_norm_ was called: clipping scales every grad by a "
                "coefficient known only after the whole backward")
        norm = self._total_norm()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale "
                "the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
        self._clip_coef = clip_coefficient(norm, max_norm)
        return distributed.norm_tensor(norm, self._params())

    def _step_scale(self) -> Optional[float]:
        """The factor this step multiplies the grads by, or None when GradScaler
        found inf/NaN and the step is skipped. Uses up the clip coefficient."""
        # Set by GradScaler.step (as for torch's fused Adam): skip the whole step
        # when it found inf/NaN; otherwise the grads are still scaled by grad_scale.
        found_inf = getattr(self, "found_inf", None)
        if (found_inf is not None and self._engine is not None
                and self._engine.step_in_backward):
            self._engine.early.fail(
                "GradScaler.step was used: the loss scale and found_inf are known "
                "only at step(), and a skipped step cannot be undone")
        if found_inf is not None and float(found_inf) != 0.0:
            self._clip_coef = None
            return None
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if found_inf is not None and grad_scale is None and self._engine is not None:
            # GradScaler.unscale_ ran: it divides the grads in place without
            # bumping their version counters, so the host copies are stale.
            self._engine.invalidate_copies()
            if self._clip_coef is not None and not self._engine.sees_in_place_edits:
                raise RuntimeError(
                    "offload_adam: opt.clip_grad_norm_ was called after "
                    "GradScaler.unscale_(opt), which changes grads invisibly to it; "
                    "use max_grad_norm= or torch.nn.utils.clip_grad_norm_ with GradScaler")

        scale = inv_scale
        if self.max_grad_norm is not None:
            # The norm of the unscaled grads (GradScaler may not have unscaled).
            scale *= clip_coefficient(self._total_norm() * inv_scale, self.max_grad_norm)
        elif self._clip_coef is not None:
            scale *= self._clip_coef
        self._clip_coef = None
        return scale
