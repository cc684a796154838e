"""torch's state dict, kept as offload_adam stores it.

The same keys as torch's optimizers, so a state dict moves between them both
ways; what torch would do wrong to this state (round the fp32 master and
moments of a bf16 param, garble 8-bit codes, copy an offloaded param's whole
state to the GPU) is bypassed here. The optimizer class (optimizer.py) mixes
this in; it provides `_params()`, `_marks` (master_rule.py) and `_store`
(state_store.py: the store that holds the state, and puts a loaded one back).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math

import torch

from . import distributed
from .params import param_label
from .state_format import (Q8_FORMAT_KEY, SCALE_KEYS, STATE_KEYS, state_format, stored_key,
                           with_code_keys, with_float32_moments)

# The state that bypasses torch's cast when loaded (load_state_dict).
_HEAVY = STATE_KEYS - {"step"}



def _not_while_stepping(method):
    """Runs `method` under the optimizer's step lock (optimizer._busy): called from
    another thread while step() runs, it waits for the step, instead of reading state
    half stepped (a param's moments of the next step beside its step count of the last,
    a compact state's bucket in the middle of its move, found from outside); called
    inside the step on its own thread (a signal handler), refused."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._busy(method.__name__):
            return method(self, *args, **kwargs)
    return locked

class TorchStateDict:
    """state_dict and load_state_dict over torch.optim.Optimizer's."""

    @_not_while_stepping
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
        moments are saved as fp32: their block scales are the local shard's.

        With state_dirs= the state of the params there is given as tensors
        memory-mapped from its files (copy on write) instead of read into RAM:
        torch.save streams them. They hold this step's values through the next
        step(); the one after rewrites their place in the files, so save (or
        copy) them before that (with state_footprint="compact", whose step moves
        the buckets in place, before the next step(); a step that rewrites the
        place of some still alive warns)."""
        early = getattr(self._engine, "early", None) if self._engine is not None else None
        if early is not None:
            early.check_saving()
            begun = early.begun
        # The user's post hooks see (and may change) the dict as returned: after the
        # state from the files and the conversions below, not before (torch's run last)
        with _post_hooks_held(self, "_optimizer_state_dict_post_hooks") as hooks:
            sd = self._store.add_state(super().state_dict())
        sd = self._converted(sd, fp32_moments)
        if early is not None:
            early.check_saving(since=begun)
        for hook in hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _converted(self, sd: dict, fp32_moments: bool) -> dict:
        """The state as state_dict() gives it: DTensor params' as DTensors, the
        moments as fp32 (fp32_moments) or 8-bit codes under their keys."""
        params = self._params()
        dtensor_ids = {i for g, group in zip(sd["param_groups"], self.param_groups)
                       for i, p in zip(g["params"], group["params"]) if distributed.is_dtensor(p)}
        if fp32_moments or dtensor_ids:
            sd = _per_param(sd, lambda k, st: with_float32_moments(st)
                            if fp32_moments or (k in dtensor_ids and _has_scales(st)) else st)
        if dtensor_ids:
            ids = [i for g in sd["param_groups"] for i in g["params"]]
            sd["state"] = distributed.export_state(dict(zip(ids, params)), sd["state"])
        if not fp32_moments:
            sd = _per_param(sd, lambda k, st: with_code_keys(st))
        return sd

    @_not_while_stepping
    def load_state_dict(self, state_dict):
        """torch's load_state_dict, keeping the state as it was saved.

        torch casts every loaded state tensor to its param's dtype and device,
        which would round the fp32 master and moments of a bf16 param, garble
        8-bit codes and copy an offloaded param's whole state to the GPU. So the
        moments, their scales and the master bypass it: torch loads the rest,
        then the store (state_store.py) puts them back (CPU copies, as saved; with
        state_dirs= into the files) from the dict torch loaded from (seen through
        a pre-hook registered last, so it is the dict after the user's pre-hooks),
        matched to params the way torch matches them, and converted to the
        optimizer's state format (its own state_dtype, whatever
        the dict's: fp32 moments from torch, 8-bit codes...). Unlike torch's,
        nothing loaded is shared
        with the dict (not even "step"): loading a live optimizer's state_dict()
        does not tie the two together. The state of a DTensor param is kept as
        this rank's shard (distributed.local_value). A loaded master is checked
        at the next step() against its param (master_rule.py): one that no
        longer rounds to it starts again from the param. A dict that went
        through torch's optimizer has one: torch keeps "master_param" as an
        unknown key (cast to the param's dtype) and never updates it while its
        steps move the param; restoring it would move the weights back. Checked
        when the model is loaded too, in whichever order the two were (with
        step_in_backward, before the param's step starts in backward).
        """
        self._settle_tail()   # no step deferred past step() may write the state replaced
        self.__dict__.pop("_behind", None)   # (a state loaded: no rank is a step behind)
        seen = {}

        def capture(optimizer, sd):   # what can be refused, before anything changes
            _check_not_emptied(sd, self._options.state_dirs is not None)
            self._check_loaded_shapes(sd)
            self._check_loaded_modes(sd)
            self._store.check_load(
                [(sd["state"].get(saved_id), p,
                  lambda g=group, gi=gi, i=i, p=p: param_label(g, gi, i, p))
                 for gi, (saved_group, group) in enumerate(zip(sd["param_groups"],
                                                               self.param_groups))
                 for i, (saved_id, p) in enumerate(zip(saved_group["params"],
                                                       group["params"]))])
            seen["state_dict"] = sd
            state = {k: ({key: v for key, v in st.items() if key not in _HEAVY}
                         if isinstance(st, dict) else st)
                     for k, st in sd["state"].items()}
            return {**sd, "state": state}

        handle = self.register_load_state_dict_pre_hook(capture)
        formats = [g["state_dtype"] for g in self.param_groups]
        # torch's load puts a new state and new groups in place (the old ones untouched):
        # an error after it puts these back (with state_dirs= the files are written
        # bucket by bucket: their check_load refuses first)
        old_groups, old_state = self.param_groups, self.raw_state()
        # (the user's post hooks run once the state is back: below)
        with _post_hooks_held(self, "_optimizer_load_state_dict_post_hooks") as hooks:
            try:
                super().load_state_dict(state_dict)
            finally:
                handle.remove()
        try:
            # The state format is this optimizer's (how much memory it may use), not
            # the checkpoint's: the loaded moments are converted to it.
            for group, fmt in zip(self.param_groups, formats):
                group["state_dtype"] = fmt
                # (so are its execution modes: a torch dict from a capturable run keeps
                # its values, not a mode the constructor refuses and a later save repeats)
                group["capturable"] = group["differentiable"] = False
            self._store.reset()
            loaded = list(self._loaded_params(seen["state_dict"]))
            self._store.load(loaded, seen["state_dict"]["state"], self.state)
        except BaseException:
            self.param_groups, self.state = old_groups, old_state
            self._store.reset()
            raise
        # every master loaded (or not: made from the param) is checked at its next step
        self._marks.forget(p for _, p, _ in loaded)
        for hook in hooks.values():   # as torch's: they see (and may edit) the state loaded
            hook(self)

    def _loaded_params(self, state_dict):
        """(saved id, param, its group): torch's own matching, in group order."""
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for saved_id, p in zip(saved_group["params"], group["params"]):
                yield saved_id, p, group

    def _check_loaded_modes(self, state_dict):
        """Rejects groups whose loaded amsgrad this optimizer's state format cannot keep
        (the loaded moments are converted to its format, kept by the groups)."""
        for gi, (saved_group, group) in enumerate(zip(state_dict["param_groups"],
                                                      self.param_groups)):
            amsgrad = bool(saved_group.get("amsgrad", False))
            state_format(group["state_dtype"]).check_amsgrad(amsgrad, f"loaded param group {gi}")
            # (the files are laid out for their amsgrad: a group loaded with another
            # would be refused at every step after, with the state already loaded)
            if self._options.state_dirs is not None and amsgrad != bool(group["amsgrad"]):
                raise ValueError(
                    f"loaded param group {gi} has amsgrad={amsgrad}, and this optimizer's "
                    f"state files are laid out for amsgrad={bool(group['amsgrad'])} (it cannot "
                    "change with state_dirs=): build the optimizer with "
                    f"amsgrad={amsgrad}, on directories without state. Nothing was loaded")

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
                _check_complete(saved, param_label(group, gi, i, p))
                _check_tensors(saved, param_label(group, gi, i, p))
                for key, value in saved.items():
                    # (only the keys it steps with: an entry of the user's own, a count
                    # of shape (), is kept as torch keeps it)
                    if not isinstance(value, torch.Tensor) or key not in _SHAPED:
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


_CORE_KEYS = ("step", "exp_avg", "exp_avg_sq")
# The loaded keys of the param's shape ("step": one element)
_SHAPED = STATE_KEYS - set(SCALE_KEYS.values()) - {Q8_FORMAT_KEY}


@contextlib.contextmanager
def _post_hooks_held(optimizer, attr: str):
    """torch's post hooks of `attr` kept from running inside torch's method (yielded, for
    the caller to run on what it returns); the same dict put back after, so that the
    handles registered on it still remove them."""
    hooks = getattr(optimizer, attr)
    setattr(optimizer, attr, collections.OrderedDict())
    try:
        yield hooks
    finally:
        setattr(optimizer, attr, hooks)


_FLATTENED = ("torch.distributed.checkpoint's flatten_optimizer_state_dict=True rebuilds "
              "each param's state from the keys optimizer.state holds, and this "
              "optimizer's 8-bit codes and state in files are kept under others: save "
              "and load without it")


def _check_not_emptied(sd: dict, in_files: bool) -> None:
    """With the state in files optimizer.state's entries are empty (the state is not in
    RAM), so a dict unflattened by torch.distributed.checkpoint (_FLATTENED) comes with
    an empty entry for every param: loaded, it would start every param afresh. torch's
    optimizers never save an empty entry, so one for every param is refused, whatever
    the files hold."""
    state = sd.get("state")
    if (in_files and isinstance(state, dict) and state
            and all(isinstance(st, dict) and not st for st in state.values())):
        raise ValueError("offload_adam: the loaded optimizer state dict has an empty state "
                         f"for every param, and this optimizer keeps its state in files "
                         f"({_FLATTENED}; "
                         "to start afresh, build the optimizer on directories without "
                         "state). Nothing was loaded")


def _check_tensors(saved: dict, label: str) -> None:
    """The state's own keys hold tensors ("step" may be a number, as torch's): anything
    else is refused naming it, not stepped from zeros or failed on deep inside."""
    for key, value in saved.items():
        if key == "step" and (isinstance(value, (int, float)) and not isinstance(value, bool)
                              or isinstance(value, torch.Tensor) and value.numel() == 1):
            # (the kernels count whole steps: 2.5 would be taken as 2, silently)
            step = float(value)
            if not (math.isfinite(step) and step >= 0 and step == int(step)):
                raise ValueError(f"loaded optimizer state 'step' for param {label} is {step:g}: "
                                 "a step count is a whole number >= 0")
            continue
        if key not in STATE_KEYS or isinstance(value, torch.Tensor):
            continue
        hint = f" ({_FLATTENED})" if isinstance(value, dict) else ""
        raise ValueError(f"loaded optimizer state {key!r} for param {label} is a "
                         f"{type(value).__name__}, not a tensor{hint}")


def _check_complete(saved: dict, label: str) -> None:
    """A state holds all of step, exp_avg and exp_avg_sq, or none of them (a param
    never stepped). One with some only is a damaged dict: taken as it is, the
    missing ones would start again from zero and the param be stepped with wrong
    values, where torch's step raises a KeyError. A missing max_exp_avg_sq is not
    refused: amsgrad turned on after some steps starts it from zeros."""
    held = {stored_key(k) for k in saved}
    present = [k for k in _CORE_KEYS if k in held]
    if present and len(present) < len(_CORE_KEYS):
        missing = [k for k in _CORE_KEYS if k not in held]
        raise ValueError(f"loaded optimizer state for param {label} has "
                         f"{', '.join(map(repr, present))} but not {', '.join(map(repr, missing))}: "
                         f"a param's state holds all of {', '.join(map(repr, _CORE_KEYS))} or none")


def _per_param(sd: dict, convert) -> dict:
    """sd with each param's state replaced by convert(key, state). Entries that are
    not a dict of state pass through as they are, as torch's state_dict passes them
    (torch's own tests put `optimizer.state["test"] = 1` there)."""
    return {**sd, "state": {k: convert(k, st) if isinstance(st, dict) else st
                            for k, st in sd["state"].items()}}


def _has_scales(st: dict) -> bool:
    return any(key in st for key in SCALE_KEYS.values())
