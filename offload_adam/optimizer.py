"""Adam and AdamW stepped by the fused C++ CPU kernels, with torch's interface.

The classes copy torch.optim.Adam/AdamW's interface: the same constructor and
defaults, the same param-group keys and the same per-param state keys ("step" as
a float32 0-dim tensor, "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), so a state
dict moves between them and torch's optimizers both ways, and LR schedulers,
GradScaler, add_param_group and named parameters work unchanged.

What differs from torch is underneath, and decided in one place
(engine/device.py's `Routing`):
  * CPU params are stepped in place (inplace.py): one kernel call per group and
    dtype; bf16/fp16 params get an fp32 master ("master_param" in the state)
    that the kernel updates and rounds into the param in the same pass;
  * CUDA params go through the offload engine (engine/), which keeps fp32
    master and moments in pinned host memory and streams grads and params. So
    do bf16/fp16 CPU params with step_in_backward or free_grads_after_copy (the
    options that need the pipeline), and every param of an optimizer built
    inside offload_adam.testing.simulated() (the tests' asynchronous CPU device).
The moments of low-precision params stay fp32 (torch would keep them in the
param's dtype).

When the CPU step starts: by default at step(), exact whatever the user does
between backward and step() (clip, scale, edit, accumulate, GradScaler, an LR
scheduler). step_in_backward=True starts each bucket's step during backward as
soon as its grads are on the host (engine/early.py), and refuses, with a
RuntimeError, everything that would make it differ.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.optim import Optimizer

from . import distributed
from .engine import OffloadEngine, Routing
from .engine.worker import interrupts_deferred
from .options import Options
from .inplace import InPlace, param_label
from .kernel_step import clip_coefficient, grad_sq_sums
from .state_format import (CODE_KEYS, MASTER_KEY, MOMENT_KEYS, SCALE_KEYS, state_format,
                           stored_key, with_code_keys, with_float32_moments)

__all__ = ["Adam", "AdamW"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED_DTYPES = (torch.float32,) + _LOW_PRECISION
# The state that bypasses torch's cast when loaded (load_state_dict).
_HEAVY = MOMENT_KEYS + tuple(SCALE_KEYS.values()) + tuple(CODE_KEYS.values()) + (MASTER_KEY,)


def _check_hyperparameters(lr, betas, eps, weight_decay):
    """The checks torch.optim.Adam's constructor makes, with its messages, in its
    order (less its foreach restrictions: foreach is ignored here)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    both_floats = isinstance(betas[0], float) and isinstance(betas[1], float)
    both_tensors = isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor)
    if not (both_floats or both_tensors):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")


def _check_modes(group_or_defaults, where):
    # The kernels run on the host outside autograd and CUDA graphs.
    for key in ("capturable", "differentiable"):
        if group_or_defaults.get(key, False):
            raise ValueError(
                f"offload_adam does not support {key}=True ({where}); "
                f"use torch.optim.Adam/AdamW for {key} mode"
            )
    fmt = state_format(group_or_defaults.get("state_dtype", "float32"))
    group_or_defaults["state_dtype"] = fmt.name
    fmt.check_amsgrad(group_or_defaults.get("amsgrad", False), where)


def _check_param(p, label):
    """Raises for a param no path can step. `label()` names it."""
    if p.is_complex() or p.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"offload_adam supports float32, bfloat16 and float16 params; "
            f"param {label()} has dtype {p.dtype}")
    if p.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"offload_adam steps CPU and CUDA tensors; param {label()} is on {p.device}")


def _option(name: str) -> property:
    """An option of the record (options.py) as an attribute; assigning it checks it again."""
    def get(self):
        return getattr(self._options, name)

    def set(self, value):
        self._options = self._options.replace(**{name: value})
    return property(get, set, doc=f"The {name} option (options.py).")


def _scalar_beta(b):
    # torch stores a tensor beta as a 0-dim tensor (its _to_scalar); do the same.
    return b.reshape(()) if isinstance(b, torch.Tensor) else b


class Adam(Optimizer):
    """torch.optim.Adam's interface, stepped by offload_adam's fused CPU kernels.

    `foreach` and `fused` are accepted and ignored; `capturable` and
    `differentiable` are not supported. Params are float32, bfloat16 or float16,
    all on the CPU, or all on one CUDA device.

    The options beyond torch's (overlap, bucket_mb, free_grads_after_copy,
    num_threads, max_grad_norm, process_group, verify_grads, step_in_backward)
    and the state format (state_dtype, also a param-group key) are documented
    in offload_adam/options.py, and checked there when the optimizer is built.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 overlap=True, bucket_mb=32.0, free_grads_after_copy=False,
                 num_threads=None, max_grad_norm=None, step_in_backward=False,
                 verify_grads=True, state_dtype=torch.float32, process_group=None):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        self._engine = None
        self._options = Options(
            overlap=overlap, bucket_mb=bucket_mb, free_grads_after_copy=free_grads_after_copy,
            num_threads=num_threads, max_grad_norm=max_grad_norm, process_group=process_group,
            verify_grads=verify_grads, step_in_backward=step_in_backward)
        self._routing = Routing(self._options.needs_pipeline)
        self._clip_coef = None
        defaults = {
            "lr": lr,
            "betas": tuple(_scalar_beta(b) for b in betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
            "state_dtype": state_format(state_dtype).name,
        }
        _check_modes(defaults, "constructor argument")
        self._reset_caches()
        super().__init__(params, defaults)
        self._start_engine()
        # GradScaler then hands us grad_scale/found_inf instead of unscaling
        # the grads itself: the kernel folds 1/scale into its single pass.
        self._step_supports_amp_scaling = True

    def _reset_caches(self):
        # The routing is not self: an optimizer in a reference cycle lives (its
        # hooks too) until the cyclic GC runs.
        self._inplace = InPlace(self._routing.in_place)
        self._loaded_masters = []   # masters load_state_dict brought in, to check

    def __getstate__(self):
        # The engine (threads, hooks, pinned memory) is not pickled: an unpickled
        # optimizer starts its own, with the same options, for its own params.
        state = super().__getstate__()
        state["_options"] = self._options   # less its process group
        state.pop("_inplace", None)
        state.pop("_routing", None)   # decided again when unpickled
        return state

    def __setstate__(self, state):
        options = state.pop("_options", None) or Options()
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("state_dtype", "float32")
        if not hasattr(self, "_engine"):  # unpickling (load_state_dict keeps its engine)
            self._engine = None
            self._options = options
            self._routing = Routing(options.needs_pipeline)
            self._clip_coef = None
            self._reset_caches()
            self._start_engine()
        else:
            self._reset_caches()

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            _check_modes(group, f"param group {index}")
            for i, p in enumerate(group["params"]):
                _check_param(p, lambda: param_label(group, index, i, p))
            self._check_one_device()
            if getattr(self, "_engine_started", False):
                managed = [p for p in group["params"] if self._in_engine(p)]
                if managed and self._engine is None:
                    self._start_engine()
                elif managed:
                    self._engine.add_group(index, managed, bool(group["amsgrad"]),
                                           group["state_dtype"])
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def _check_one_device(self):
        """All params on the CPU, or all on one CUDA device (one engine each)."""
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            names = ", ".join(sorted(str(d) for d in devices))
            raise ValueError(
                f"offload_adam: the params live on several devices ({names}); one "
                "optimizer steps params of one device (use one optimizer per device)")

    max_grad_norm = _option("max_grad_norm")
    process_group = _option("process_group")

    def _inplace_threads(self) -> int:
        """Kernel threads for the params stepped in place: the num_threads option,
        or torch.get_num_threads() as the caller sees it."""
        return self._options.num_threads or torch.get_num_threads()

    def _in_engine(self, p):
        return self._routing.in_engine(p)

    def _start_engine(self):
        self._engine_started = True
        managed = [[p for p in g["params"] if self._in_engine(p)] for g in self.param_groups]
        if any(managed):
            self._engine = OffloadEngine(
                managed, [bool(g["amsgrad"]) for g in self.param_groups],
                state_dtypes=[g["state_dtype"] for g in self.param_groups],
                options=self._options, owner=weakref.ref(self), routing=self._routing)

    # ---- offload engine: profile, memory, clipping ---------------------------
    @property
    def last_step_profile(self):
        """The engine's profile of the last step() (see engine/profile.py), or None."""
        return self._engine.profile() if self._engine is not None else None

    def host_bytes(self):
        """Host memory the optimizer's state holds: the engine's (master, moments
        and transfer buffers) and the state tensors of the params stepped in place."""
        engine = self._engine.host_bytes() if self._engine is not None else 0
        return engine + sum(t.numel() * t.element_size()
                            for g in self.param_groups for p in g["params"]
                            if not self._in_engine(p)
                            for t in self.state.get(p, {}).values()
                            if isinstance(t, torch.Tensor))

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _total_norm(self):
        """2-norm of all grads: the engine's from its host copies, the in-place
        params' by the kernel, each of the local shard of a DTensor, summed over
        the ranks that hold the other shards (distributed.py). Double
        accumulation; inf/NaN propagate."""
        sums = self._engine.grad_sq_sums() if self._engine is not None else []
        pairs = self._inplace.grads(self.param_groups)
        if pairs:
            grads = [g if g.is_contiguous() else g.contiguous() for _, g in pairs]
            sums += zip([p for p, _ in pairs], grad_sq_sums(grads, self._inplace_threads()))
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
                f"The total norm of order 2.0 for gradients from `parameters` is "
                f"non-finite, so it cannot be clipped. To disable this error and scale "
                f"the gradients by the non-finite norm anyway, set "
                f"`error_if_nonfinite=False`")
        self._clip_coef = clip_coefficient(norm, max_norm)
        return distributed.norm_tensor(norm, self._params())

    def zero_grad(self, set_to_none=True):
        if self._engine is not None:
            self._engine.drop_freed_grads()
        super().zero_grad(set_to_none)
        self._clip_coef = None
        if self._engine is not None:
            self._engine.zero_grad()

    # ---- step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

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
            return loss
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

        if self._loaded_masters:
            self._drop_stale_masters()
        num_threads = self._inplace_threads()
        with interrupts_deferred():  # Ctrl-C: the whole step, then KeyboardInterrupt
            for index, group in enumerate(self.param_groups):
                self._inplace.step_group(index, group, self.state, scale, num_threads)
            if self._engine is not None:
                self._engine.step(self.param_groups, self.state, grad_scale=scale)
        return loss

    # ---- state dict ---------------------------------------------------------
    def state_dict(self, *, fp32_moments: bool = False):
        """torch's state_dict. The moments are saved as stored (state_dtype): a
        checkpoint resumes bit for bit. 8-bit codes are saved under their own
        keys ("exp_avg_codes", "exp_avg_sq_codes", beside the scales), so that
        torch's optimizers, which would take them for moments, fail on the
        missing "exp_avg" instead of stepping garbage. fp32_moments=True gives
        every moment as fp32 and drops the 8-bit scales: torch.optim.AdamW/Adam
        load that.

        The state of a DTensor param (FSDP2) is shown as DTensors of the param's
        mesh and placements, as torch's optimizers keep it, so that
        torch.distributed.checkpoint saves and reshards every rank's shard
        (optimizer.state itself holds the local shard's tensors). Its 8-bit
        moments are saved as fp32: their block scales are the local shard's."""
        sd = super().state_dict()
        params = self._params()
        dtensor_ids = {i for g, group in zip(sd["param_groups"], self.param_groups)
                       for i, p in zip(g["params"], group["params"]) if distributed.is_dtensor(p)}
        if fp32_moments or dtensor_ids:
            sd = {**sd, "state": {k: with_float32_moments(st)
                                  if fp32_moments or (k in dtensor_ids and _has_scales(st)) else st
                                  for k, st in sd["state"].items()}}
        if dtensor_ids:
            ids = [i for g in sd["param_groups"] for i in g["params"]]
            sd["state"] = distributed.export_state(dict(zip(ids, params)), sd["state"])
        if not fp32_moments:
            sd = {**sd, "state": {k: with_code_keys(st) for k, st in sd["state"].items()}}
        return sd

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, keeping the state as it was saved.

        torch casts every loaded state tensor to its param's dtype and device,
        which would round the fp32 master and moments of a bf16 param, garble
        8-bit codes and copy an offloaded param's whole state to the GPU. So the
        moments, their scales and the master bypass it: torch loads the rest,
        then they are put back (CPU copies, as saved) from the dict torch loaded
        from (seen through a pre-hook registered last, so it is the dict after
        the user's pre-hooks), matched to params the way torch matches them, and
        converted to the optimizer's state format (its own state_dtype, whatever
        the dict's: fp32 moments from torch, 8-bit codes...). Unlike torch's,
        nothing loaded is shared
        with the dict (not even "step"): loading a live optimizer's state_dict()
        does not tie the two together. The state of a DTensor param is kept as
        this rank's shard (distributed.local_value). A loaded master is checked
        at the next step() against its param (`_drop_stale_masters`).
        """
        seen = {}

        def capture(optimizer, sd):
            self._check_loaded_shapes(sd)
            seen["state_dict"] = sd
            state = {k: ({key: v for key, v in st.items() if key not in _HEAVY}
                         if isinstance(st, dict) else st)
                     for k, st in sd["state"].items()}
            return {**sd, "state": state}

        handle = self.register_load_state_dict_pre_hook(capture)
        formats = [g["state_dtype"] for g in self.param_groups]
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        # The state format is this optimizer's (how much memory it may use), not
        # the checkpoint's: the loaded moments are converted to it.
        for group, fmt in zip(self.param_groups, formats):
            group["state_dtype"] = fmt
        self._reset_caches()
        for saved_id, p, group in self._loaded_params(seen["state_dict"]):
            saved = seen["state_dict"]["state"].get(saved_id)
            if saved is None:
                continue
            state = self.state[p]
            local_p = distributed.local(p)
            for saved_key in _HEAVY + ("step",):  # copies: the kernels update them in place
                value, key = saved.get(saved_key), stored_key(saved_key)
                if isinstance(value, torch.Tensor):
                    if distributed.is_dtensor(p) and key in MOMENT_KEYS + (MASTER_KEY,):
                        value = distributed.local_value(
                            value, p, key, lambda: f"{saved_id} (shape {tuple(p.shape)})")
                    state[key] = value.detach().to("cpu", copy=True).contiguous()
            fmt = state_format(group["state_dtype"])
            for key in MOMENT_KEYS:
                if key in state:
                    state.update(fmt.convert(state, key, local_p.shape, local_p.numel()))
            fmt.drop_scales(state)
            if MASTER_KEY in state:
                if p.dtype is torch.float32 and not self._in_engine(p):
                    del state[MASTER_KEY]  # the param is its own master
                else:
                    state[MASTER_KEY] = state[MASTER_KEY].to(torch.float32)
                    self._loaded_masters.append(p)
        early = self._engine.early if self._engine is not None else None
        if early is not None:
            # Its next steps start in backward: check now. (Loaded in the middle
            # of an iteration, step() raises instead, leaving the state as loaded.)
            if not early.stepped():
                self._drop_stale_masters()
            self._loaded_masters = []

    def _drop_stale_masters(self):
        """Drops each loaded fp32 master that no longer rounds to its param, so
        that the param's master starts from the param. A dict that went through
        torch's optimizer has one: torch keeps "master_param" as an unknown key
        (cast to the param's dtype) and never updates it while its steps move
        the param; restoring it would move the weights back. Checked at the
        first step after loading, when the model is loaded too (in whichever
        order the two were); with step_in_backward, whose steps start in the
        next backward, at loading (load the model first)."""
        for p in self._loaded_masters:
            st = self.state.get(p)
            master = st.get(MASTER_KEY) if st else None
            if master is None:
                continue
            t = distributed.local(p).detach().to("cpu")
            rounded = master.detach().to(t.dtype)   # an fp32 param's (engine) is itself
            bits = torch.int16 if t.element_size() == 2 else torch.int32
            same = (rounded.view(bits) == t.view(bits)) | (rounded.isnan() & t.isnan())
            if not bool(same.all()):
                del st[MASTER_KEY]
        self._loaded_masters = []

    def _loaded_params(self, state_dict):
        """(saved id, param, its group): torch's own matching, in group order."""
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for saved_id, p in zip(saved_group["params"], group["params"]):
                yield saved_id, p, group

    def _check_loaded_shapes(self, state_dict):
        """Rejects state whose tensors do not fit their params (torch does not check)."""
        for gi, (saved_group, group) in enumerate(zip(state_dict["param_groups"],
                                                      self.param_groups)):
            if len(saved_group["params"]) != len(group["params"]):
                return  # torch raises its own error for this
            for i, (saved_id, p) in enumerate(zip(saved_group["params"], group["params"])):
                saved = state_dict["state"].get(saved_id)
                if not isinstance(saved, dict):
                    continue
                for key, value in saved.items():
                    if not isinstance(value, torch.Tensor) or key in SCALE_KEYS.values():
                        continue
                    expected = () if key == "step" else p.shape
                    if key == "step" and value.numel() == 1:
                        continue
                    if value.shape != expected:
                        raise ValueError(
                            f"loaded optimizer state {key!r} for param "
                            f"{param_label(group, gi, i, p)} has shape {tuple(value.shape)}, "
                            f"expected {tuple(expected)}"
                        )


def _has_scales(st: dict) -> bool:
    return any(key in st for key in SCALE_KEYS.values())


class AdamW(Adam):
    """torch.optim.AdamW's interface, stepped by offload_adam's fused CPU kernels."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, overlap=True, bucket_mb=32.0,
                 free_grads_after_copy=False, num_threads=None, max_grad_norm=None,
                 step_in_backward=False, verify_grads=True, state_dtype=torch.float32,
                 process_group=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, overlap=overlap, bucket_mb=bucket_mb,
                         free_grads_after_copy=free_grads_after_copy,
                         num_threads=num_threads, max_grad_norm=max_grad_norm,
                         step_in_backward=step_in_backward, verify_grads=verify_grads,
                         state_dtype=state_dtype, process_group=process_group)

    def __setstate__(self, state):
        super().__setstate__(state)
        # As torch's AdamW: whatever was loaded, AdamW decouples weight decay.
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
