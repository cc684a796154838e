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
import weakref
from typing import List, Optional, Tuple

from . import distributed
from .kernel_step import clip_coefficient, grad_sq_sums
from .params import check_grad_dtypes, param_label


class GradScaling:
    """clip_grad_norm_, and the factor step() gives the kernels."""

    _clip_coef: Optional[float] = None   # set by clip_grad_norm_, used by the next step
    # The grads that coefficient is of: (param, its grad, the grad's version) weakly, for
    # every param of the groups; None: taken as they are now (an unpickled optimizer).
    _clip_grads: Optional[List[Tuple[weakref.ref, Optional[weakref.ref], int]]] = None

    def _mark_clipped(self, coef: float) -> None:
        """torch's clip scales the grads in place; here the coefficient waits for the
        step, and holds for the grads as they are now (no strong reference to them: a
        grad dropped is freed)."""
        self._clip_coef = coef
        self._clip_grads = [(weakref.ref(p), None if p.grad is None else weakref.ref(p.grad),
                             -1 if p.grad is None else p.grad._version)
                            for group in self.param_groups for p in group["params"]]

    def _drop_clip(self) -> None:
        self._clip_coef = self._clip_grads = None

    def _pending_clip(self) -> float:
        """The coefficient of the opt.clip_grad_norm_ calls since the last step (1.0:
        none), while the grads are the ones it was taken of. torch's clip scaled the grads it saw in
        place; a grad written since (added to by a backward, which torch would add
        unscaled to the clipped values; zeroed and made again; replaced; set) is not
        the coefficient times what p.grad holds: a RuntimeError naming the param (which
        of these it was cannot be told apart). No grad left: the clip went with them."""
        if self._clip_coef is None:
            return 1.0
        if self._clip_grads is None:
            self._mark_clipped(self._clip_coef)
        by_param = {id(ref()): (grad, version) for ref, grad, version in self._clip_grads
                    if ref() is not None}
        changed = None
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                grad, version = by_param.get(id(p), (None, -1))
                old = None if grad is None else grad()
                if p.grad is old and (old is None or old._version == version):
                    continue
                changed = changed or param_label(group, gi, i, p)
        if changed is None:
            return self._clip_coef
        if all(p.grad is None for group in self.param_groups for p in group["params"]):
            self._drop_clip()
            return 1.0
        raise RuntimeError(
            f"offload_adam: the grad of {changed} changed after opt.clip_grad_norm_ (added "
            "to by a backward, zeroed, replaced or set): the clip is applied at step() to "
            "the grads as they are then, which is not what torch.nn.utils.clip_grad_norm_ "
            "made of the grads it saw. Call opt.clip_grad_norm_ after the last backward of "
            "the step, or opt.zero_grad() to drop it")

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
        # (a clip since the last step: torch's second clip sees the grads scaled by the
        # first, and scales them again)
        pending = self._pending_clip()
        norm = self._total_norm() * pending
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale "
                "the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
        self._mark_clipped(clip_coefficient(norm, max_norm) * pending)
        return distributed.norm_tensor(norm, self._params())

    def _step_scale(self, skip: bool) -> Optional[float]:
        """The factor this step multiplies the grads by, or None when the step is skipped
        (`skip`: GradScaler found inf/NaN, on this rank or another: step() reads found_inf
        once, and distributed.agree_to_step tells the ranks). Uses up the clip
        coefficient."""
        # Set by GradScaler.step (as for torch's fused Adam): skip the whole step
        # when it found inf/NaN; otherwise the grads are still scaled by grad_scale.
        found_inf = getattr(self, "found_inf", None)
        if (found_inf is not None and self._engine is not None
                and self._engine.step_in_backward):
            self._engine.early.fail(
                "GradScaler.step was used: the loss scale and found_inf are known "
                "only at step(), and a skipped step cannot be undone")
        if skip:
            self._drop_clip()
            return None
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None and float(grad_scale) == 0.0:
            raise ValueError(
                "offload_adam: the loss scale (GradScaler's, as grad_scale) is 0: halved at "
                "each step that found inf/NaN grads until it underflowed, so the grads "
                "cannot be unscaled (torch's AdamW would step NaN into every param). "
                "Nothing was stepped; look for what makes the loss or grads inf/NaN, or "
                "give GradScaler a larger init_scale or backoff_factor")
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

        scale = inv_scale * self._pending_clip()
        if self.max_grad_norm is not None:
            # The norm of the unscaled grads (GradScaler may not have unscaled), as
            # opt.clip_grad_norm_ left them.
            scale *= clip_coefficient(self._total_norm() * scale, self.max_grad_norm)
        self._drop_clip()
        return scale
