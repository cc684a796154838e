"""Adam and AdamW stepped by the fused C++ CPU kernels, with torch's interface.

The classes copy torch.optim.Adam/AdamW's interface: the same constructor and
defaults, the same param-group keys and the same per-param state keys ("step" as
a float32 0-dim tensor, "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), so a state
dict moves between them and torch's optimizers both ways, and LR schedulers,
GradScaler, add_param_group and named parameters work unchanged.

What differs from torch is underneath, decided once per param (routing.py) and
seen through one seam (state_store.py): a store holds the state and lends it
bucket by bucket to a stepper.
  * Steppers: CPU params are stepped in place by the fused kernel (cpu_step.py):
    one call per group and dtype; bf16/fp16 params get an fp32 master
    ("master_param" in the state) that the kernel updates and rounds into the
    param in the same pass. CUDA params go through the offload engine
    (engine/), which streams grads to the host and params back; so do
    bf16/fp16 CPU params with step_in_backward or free_grads_after_copy (the
    options that need the pipeline), and every param of an optimizer built
    inside offload_adam.testing.simulated() (the tests' asynchronous CPU device).
  * Stores: host RAM (state_store.RamStore: optimizer.state, and the engine's
    pinned host arenas), or, with state_dirs=, files (nvme_tier.FileStore):
    every param's master and moments, streamed through RAM bucket by bucket.
  * A master follows its param (master_rule.py) in every store.
The moments of low-precision params stay fp32 (torch would keep them in the
param's dtype).

When the CPU step starts: by default at step(), exact whatever the user does
between backward and step() (clip, scale, edit, accumulate, GradScaler, an LR
scheduler). step_in_backward=True starts each bucket's step during backward as
soon as its grads are on the host (engine/early.py), and refuses, with a
RuntimeError, everything that would make it differ.

This file is the class: its checks, its store and steppers, step(). Its
other ideas are files of their own: the options (options.py), torch's state
dict kept as stored (torch_state_dict.py), and the GradScaler and clipping
protocol (grad_scaling.py).
"""

from __future__ import annotations

import dataclasses
import contextlib
import os
import pickle
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Optional

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from . import distributed
from .cpu_step import step_on_cpu
from .engine import OffloadEngine, let_go_of
from .engine.host_memory import put_off
from .engine.worker import interrupts_deferred
from .grad_scaling import GradScaling
from .kernel_step import Hyper, check_hyperparameters, refuse_modes
from .master_rule import MasterMarks
from .freed_grad import check_freed_grads
from .params import (SUPPORTED_DTYPES, Addresses, check_grad_dtypes, check_listed_once,
                     home_of, one_device, param_label)
from .options import Options
from .routing import Routing
from .state_store import open_store
from .state_format import state_format
from .torch_state_dict import TorchStateDict
from .warn import warn

__all__ = ["Adam", "AdamW"]



def _format_name(value):
    """A group's state_dtype as the ranks compare it: torch.float32 and "float32" (or
    "fp32") are one format; a value no format has stays as it is (its own rank refuses it)."""
    try:
        return state_format(value).name
    except (TypeError, ValueError):
        return repr(value)


def _listed(params):
    """The constructor's params as a list where they are an iterator (a generator is read
    once, and a refused construction reads them again: _tensors_in); as given otherwise
    (a lone tensor, which torch refuses by name)."""
    if isinstance(params, (torch.Tensor, list, tuple, dict)):
        return params
    try:
        return list(params)
    except TypeError:
        return params   # (torch's constructor says what it wanted)


def _tensors_in(params) -> list:
    """The tensors among the constructor's params as given (tensors, (name, tensor) pairs,
    group dicts with a list of either), those it can tell without reading an iterator."""
    out = []
    items = params if isinstance(params, (list, tuple)) else ()
    for item in items:
        if isinstance(item, dict):
            inner = item.get("params")
            inner = [inner] if isinstance(inner, torch.Tensor) else inner
            out.extend(_tensors_in(inner) if isinstance(inner, (list, tuple)) else [])
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append(item[1])
        elif isinstance(item, torch.Tensor):
            out.append(item)
    return out


def _check_modes(group_or_defaults, where):
    refuse_modes(group_or_defaults, where)
    fmt = state_format(group_or_defaults.get("state_dtype", "float32"))
    group_or_defaults["state_dtype"] = fmt.name
    fmt.check_amsgrad(group_or_defaults.get("amsgrad", False), where)


def _untrainable(p) -> bool:
    """An integer or bool param: it can take no grad (a quantized model's packed weights,
    an index table); accepted and never stepped, as torch's optimizers do."""
    return not (p.is_floating_point() or p.is_complex())


def _check_param(p, label):
    """Raises for a param no path can step. `label()` names it."""
    if _untrainable(p):
        return
    if p.is_complex() or p.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"offload_adam supports float32, bfloat16 and float16 params; "
            f"param {label()} has dtype {p.dtype}")
    if p.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"offload_adam steps CPU and CUDA tensors; param {label()} is on {p.device}")
    # Elements sharing memory (1: yes; 2: too hard to tell, let through): torch's in-place
    # step refuses such a param at its first step, and the engine's copy back to it failed
    # on its copy stream after step() had returned. (A streamed param's placeholder is one
    # element expanded: its values are its home's.)
    if torch._debug_has_internal_overlap(p) == 1 and home_of(p) is None:
        # (one NaN expanded is what a streamed block's params hold between uses: a param
        # made from one, a parametrization registered after stream_params)
        placeholder = (p.is_floating_point() and all(s == 0 for s in p.stride())
                       and bool(p.detach().reshape(-1)[:1].isnan().all()))
        raise ValueError(
            f"offload_adam: param {label()} (strides {list(p.stride())}) has elements "
            "that share memory (an expand() or "
            "as_strided view): no optimizer can step them one by one. Give the optimizer "
            "a tensor that owns its elements (.contiguous(), or the tensor it expands)"
            + ("; its one value is NaN, as a streamed block's placeholder: was it made from "
               "a param of a block streamed by stream_params (a parametrization such as "
               "weight_norm registered after stream_params)? Parametrize before "
               "stream_params" if placeholder else ""))


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


# the options that take each rank's own grads in backward (refused for DDP's replicas)
_IN_BACKWARD = ("step_in_backward", "free_grads_after_copy")

# what the checks of a state read between backward and step() call a copy or pickle
_PICKLED = "the optimizer's __getstate__ (copy.deepcopy, pickle, torch.save of it)"


class Adam(GradScaling, TorchStateDict, Optimizer):
    """torch.optim.Adam's interface, stepped by offload_adam's fused CPU kernels.

    `foreach` and `fused` are accepted and ignored; `capturable` and
    `differentiable` are not supported. Params are float32, bfloat16 or float16,
    all on the CPU, or all on one CUDA device.

    The options beyond torch's (overlap, bucket_mb, free_grads_after_copy,
    num_threads, max_grad_norm, process_group, verify_grads, step_in_backward,
    state_dirs, state_budget_mb, state_resume, state_footprint, grad_ring_mb,
    defer_blocks)
    and the state format (state_dtype, also a param-group key) are documented
    in offload_adam/options.py, and checked there when the optimizer is built.
    """

    # (param_stream.py refuses any other optimizer's step of a streamed param)
    steps_streamed_params = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 overlap=True, bucket_mb=32.0, free_grads_after_copy=False,
                 num_threads=None, max_grad_norm=None, step_in_backward=False,
                 verify_grads=True, state_dtype=torch.float32, process_group=None,
                 state_dirs=None, state_budget_mb=None, state_resume=False,
                 state_footprint="two_generations", grad_ring_mb=None, defer_blocks=0):
        self._engine = None
        self._store = None
        params = _listed(params)   # (read again below when the constructor is refused)
        try:
            self._construct(params, lr, betas, eps, weight_decay, dict(   # (torch's order)
                amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                differentiable=differentiable, fused=fused,
                decoupled_weight_decay=decoupled_weight_decay, state_dtype=state_dtype),
                dict(overlap=overlap, bucket_mb=bucket_mb,
                     free_grads_after_copy=free_grads_after_copy, num_threads=num_threads,
                     max_grad_norm=max_grad_norm, process_group=process_group,
                     verify_grads=verify_grads, step_in_backward=step_in_backward,
                     state_dirs=state_dirs, state_budget_mb=state_budget_mb,
                     state_resume=state_resume, state_footprint=state_footprint,
                     grad_ring_mb=grad_ring_mb, defer_blocks=defer_blocks))
        except Exception as e:
            # under several ranks the others wait in _same_on_every_rank's comparison:
            # told there, they raise naming this rank's cause (found from outside: they
            # waited for the process group's timeout, then raised gloo's "Connection
            # closed by peer", naming nothing)
            groups = getattr(self, "param_groups", None)
            flat = ([p for g in groups for p in g["params"]] if groups
                    else _tensors_in(params))
            distributed.refused_on_one_rank(e, flat, process_group)
            if state_dirs and state_resume and distributed.replicated(flat, process_group):
                # (DDP's replicas that resume meet first in the files' refuse_together)
                distributed.tell_others(e, flat, process_group, replicas=True)
            raise
        self._same_on_every_rank()
        try:
            self._build()
        except Exception as e:
            if state_dirs and self._store is None:   # (the others wait in the files' first)
                flat = [p for g in self.param_groups for p in g["params"]]
                distributed.tell_others(e, flat, process_group, replicas=bool(state_resume))
            raise
        if self._options.step_in_backward and self._engine is None:
            warn("offload_adam: step_in_backward=True, but none of these params is stepped "
                 "by the offload engine, which is what steps in backward: fp32 params in "
                 "host memory are stepped in place at step(), and nothing between backward "
                 "and step() is checked (the option applies to params on a GPU and to "
                 "bf16/fp16 params in host memory)", UserWarning)
        if defer_blocks and not any(home_of(p) is not None for g in self.param_groups
                                    for p in g["params"]):
            warn(f"offload_adam: defer_blocks={defer_blocks} defers the CPU steps of blocks "
                 "streamed by stream_params, and none of these params is streamed (call "
                 "offload_adam.stream_params(model, ...) before building the optimizer): "
                 "nothing is deferred", UserWarning)
        # GradScaler then hands us grad_scale/found_inf instead of unscaling
        # the grads itself: the kernel folds 1/scale into its single pass.
        self._step_supports_amp_scaling = True

    def __getstate__(self):
        # The engine (threads, hooks, pinned memory) is not pickled: an unpickled
        # optimizer starts its own, with the same options, for its own params.
        # (Checked and locked as state_dict() is: a copy or pickle between backward and
        # step() with step_in_backward held some params' state a step ahead, even one
        # param's moments of the next step beside its step count of this one; found from
        # outside. The steps deferred past step() are waited for by `state`.)
        with self._busy("__getstate__"):
            early = self._engine.early if self.__dict__.get("_engine") is not None else None
            if early is not None:
                early.check_saving(what=_PICKLED)
                begun = early.begun
            state = self._pickled_state()
            if early is not None:
                early.check_saving(since=begun, what=_PICKLED)
            return state

    def _pickled_state(self) -> dict:
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if home_of(p) is not None:
                    raise RuntimeError(
                        f"offload_adam: param {param_label(group, gi, i, p)} is streamed "
                        "(stream_params): between uses it shows a placeholder, its values "
                        "being the streamer's host copies, which a copy or pickle of the "
                        "optimizer (copy.deepcopy, pickle, torch.save of it) does not take: "
                        "its params were NaN (found from outside). Save opt.state_dict() "
                        "with model.state_dict(), and load them into an optimizer built "
                        "over the streamed model")
        state = super().__getstate__()
        state["_options"] = self._options   # less its process group
        state.pop("_store", None)    # (files and a lock): opened again when unpickled
        state.pop("_routing", None)   # decided again when unpickled
        state.pop("_marks", None)     # every master checked at the first step
        state.pop("_group_of", None)  # (weak keys) made again from the groups
        state.pop("_addresses", None)   # (ids) likewise
        state.pop("_closed", None)    # an unpickled one is open
        state.pop("_constructing", None)
        state.pop("_busy_lock", None)
        state.pop("_busy_pid", None)
        state.pop("_passing", None)   # (a thread id of this process)
        state.pop("_clip_grads", None)   # (weak references) a clip pending holds for the
        if self._routing.store != "ram":  # grads as unpickled
            # the files' step now: an unpickled copy reopens the files, which hold only
            # their last step, and is refused if they moved on (_open_store)
            state["_files_step"] = self.step_count
        return state

    def __setstate__(self, state):
        options = state.pop("_options", None) or Options()
        files_step = state.pop("_files_step", None)
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
            self._store = None
            self._forget_groups()
            for group in self.param_groups:
                self._number_group(group)
            self._options = options
            self._routing = Routing.of(options)
            self._marks = MasterMarks()
            # its own files: it continues from them, if still at the pickled step
            self._build(resume=True, pickled_step=files_step)
            # (not in torch's pickled state: without it GradScaler unscaled the grads in
            # place after the engine's copies, which then stepped them scaled)
            self._step_supports_amp_scaling = True

    def _forget_groups(self) -> None:
        """The engine and the files know each param's group by the number it was added
        under (a group's index when it was added: the user may reorder, pop or edit
        param_groups since, and each step follows them, engine/core.py follow_groups)."""
        self._group_of = WeakIdKeyDictionary()   # param -> the number of its group
        self._groups_made = 0
        self._addresses = Addresses()   # each param's memory, checked at each step

    def _number_group(self, group: dict) -> int:
        """Numbers a group just added; its params, unless the engine holds them already
        (added before, taken out of param_groups since), are known by that number."""
        number, self._groups_made = self._groups_made, self._groups_made + 1
        has = self._engine.has if self._engine is not None else (lambda p: False)
        for p in group["params"]:
            if not has(p):
                self._group_of[p] = number
        self._addresses.record(group["params"])
        return number

    def add_param_group(self, param_group):
        self._settle_tail()   # (the engine's buckets may be laid out again)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        made, known = self._groups_made, {p: self._group_of.get(p) for p in group["params"]}
        number = self._number_group(group)
        try:
            _check_modes(group, f"param group {index}")
            first: dict = {}
            for i, p in enumerate(group["params"]):
                _check_param(p, lambda: param_label(group, index, i, p))
                if id(p) in first:   # torch steps it twice a step (and warns); the engine
                    raise ValueError(   # and the state files would not: refused, not wrong
                        f"param {param_label(group, index, i, p)} is the same tensor as param "
                        f"{first[id(p)]} of its group: list each param once")
                first[id(p)] = i
            self._addresses.check_group(self.param_groups, index)
            self._check_one_device(index)
            if self._store is not None:
                self._store.add_group(index, group)
            if getattr(self, "_engine_started", False):
                self._add_to_engine(number, index, self._engine_params(group["params"]))
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            self._groups_made = made
            for p, was in known.items():
                if was is None:
                    self._group_of.pop(p, None)
                else:
                    self._group_of[p] = was
            raise

    def _check_one_device(self, index: int):
        """All params on the CPU, or all on one CUDA device (one engine each); none is
        allowed (empty groups, as torch's). The groups before `index` were checked when
        added: group `index` against one of their params."""
        before = next((g["params"][0] for g in self.param_groups[:index] if g["params"]), None)
        params = ([before] if before is not None else []) + list(self.param_groups[index]["params"])
        if params:
            one_device(params)

    max_grad_norm = _option("max_grad_norm")
    process_group = _option("process_group")

    def _inplace_threads(self) -> int:
        """Kernel threads for the params stepped in place: the num_threads option,
        or torch.get_num_threads() as the caller sees it."""
        return self._options.num_threads or torch.get_num_threads()

    def _in_engine(self, p):
        return self._routing.in_engine(p)

    def _engine_params(self, params):
        """Of `params`, those the engine takes now: routed to it and trained (requires_grad,
        or a grad). As torch's optimizers make no state for a param until it has a grad, a
        frozen param (a LoRA model's base weights) holds no host memory until it has one
        (_join_trained). With state_dirs= too: the files hold the params that train when
        the optimizer is built, except files made before that, of every float param,
        whose frozen params the store has the engine take then (_enroll)."""
        return [p for p in params if self._in_engine(p) and not _untrainable(p)
                and (p.requires_grad or p.grad is not None)]

    def _replicas(self) -> None:
        """Each rank a replica (DistributedDataParallel: plain params over several ranks,
        no process_group): DDP averages the grads across ranks after autograd has
        accumulated them, which is where a copy during backward takes them. That copy
        was of the rank's own grads: stepped in backward, the ranks drifted apart
        (step_in_backward), or DDP's averaging read a freed grad (free_grads_after_copy),
        or the copy was made again at step() (overlap: twice the D2H bytes, and a
        race with DDP's in-place division of its buckets); found from outside. So the
        grads are copied at step() (overlap off) and the options that need them in
        backward are refused."""
        o = self._options
        if not distributed.replicated(self._params(), o.process_group):
            return
        for name in _IN_BACKWARD:
            if getattr(o, name):
                raise ValueError(
                    f"offload_adam: {name}=True with {torch.distributed.get_world_size()} "
                    "ranks whose params are plain tensors (each rank a replica, as under "
                    "DistributedDataParallel): DDP averages the grads across the ranks "
                    "after backward has made them, and this option takes each rank's own "
                    "grads in backward (the ranks would step apart). Use it with FSDP2 "
                    "(fully_shard), or leave it off; ranks that each train params of "
                    "their own (nothing averaged) pass process_group=, a group of the "
                    "rank alone (torch.distributed.new_group)")
        if o.overlap:
            self._options = dataclasses.replace(o, overlap=False)
            self._routing = Routing.of(self._options)

    def _replicas_since(self) -> None:
        """_replicas for an optimizer built before torch.distributed's process group (a
        script building it before TrainingArguments or Accelerator, which make the
        group): the options that take each rank's own grads in backward were accepted,
        and failed later with messages that named neither DDP nor the order (found from
        outside). Refused at step(), saying so."""
        o = self._options
        names = [n for n in _IN_BACKWARD if getattr(o, n)]
        if not names or not distributed.replicated(self._params(), o.process_group):
            return
        raise ValueError(
            f"offload_adam: {names[0]}=True, and the optimizer was built before "
            "torch.distributed's process group, which now has "
            f"{torch.distributed.get_world_size()} ranks whose params are plain tensors "
            "(each rank a replica, as under DistributedDataParallel). DDP averages the "
            "grads after backward has made them, and this option takes each rank's own in "
            "backward"
            + (": the steps begun in the backward just run used them, so this rank's "
               "optimizer state may differ from the others'" if names[0] == "step_in_backward"
               else "")
            + ". Build the optimizer after init_process_group (after TrainingArguments "
            "or Accelerator), where such options are refused at once; use FSDP2 "
            "(fully_shard) for them, or leave them off")

    def _construct(self, params, lr, betas, eps, weight_decay, modes: dict,
                   options: dict) -> None:
        """Everything of the constructor that one rank may refuse on its own (its
        arguments, its params) before the ranks compare their options."""
        check_hyperparameters(lr, betas, eps, weight_decay)
        self._forget_groups()
        self._options = Options(**options)
        self._routing = Routing.of(self._options)
        self._marks = MasterMarks()   # when each param last agreed with its master
        self._clip_coef = None
        defaults = {"lr": lr, "betas": tuple(_scalar_beta(b) for b in betas), "eps": eps,
                    "weight_decay": weight_decay,
                    **{k: v for k, v in modes.items() if k != "state_dtype"},
                    "state_dtype": state_format(modes["state_dtype"]).name}
        _check_modes(defaults, "constructor argument")
        super().__init__(params, defaults)
        self._replicas()

    def _same_on_every_rank(self) -> None:
        """Under several ranks (FSDP2, process_group=) the options that decide which
        collectives a step runs must be every rank's: a rank clipping (max_grad_norm=) or
        keeping its state in files alone would wait in a collective the others never
        join. Compared when the optimizers are built (every rank builds its own: a
        collective too), a difference is refused on every rank, naming it."""
        params = [p for g in self.param_groups for p in g["params"]]
        ranks = distributed.every_rank((self._rank_options(resume=True), None), params,
                                       self._options.process_group)
        if ranks is None:
            return
        distributed.refuse_refused(ranks)
        distributed.refuse_differing([o for o, _ in ranks], ": every rank's optimizer must be "
                                     "built with the same options (a step's collectives "
                                     "depend on them)")

    def _rank_options(self, resume: bool = False) -> dict:
        """The options that decide which collectives a step runs (_same_on_every_rank;
        `resume`: state_resume too, which decides the construction's)."""
        o = self._options
        return {"max_grad_norm": o.max_grad_norm, "state_dirs given": o.state_dirs is not None,
                "state_footprint": o.state_footprint,
                **({"state_resume": o.state_resume} if resume else {}),
                "step_in_backward": o.step_in_backward, "bucket_mb": o.bucket_mb,
                "the number of param groups": len(self.param_groups),
                "state_dtype": [_format_name(g["state_dtype"]) for g in self.param_groups],
                "amsgrad": [g["amsgrad"] for g in self.param_groups]}

    def _build(self, resume: bool = False, pickled_step: Optional[int] = None) -> None:
        """The engine and the store; only once both are made does the engine take the
        params over from an older live optimizer's (engine/core.py, _claim): a
        constructor refused (its state files locked by that optimizer, a resume that
        does not match) leaves it training, and what it made goes, hooks and all."""
        self._constructing = True
        try:
            self._start_engine()
            self._open_store(resume=resume, pickled_step=pickled_step)
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            raise
        finally:
            self._constructing = False
        if self._engine is not None:
            self._engine.claim()
        let_go_of([p for g in self.param_groups for p in g["params"] if not self._in_engine(p)])

    def _start_engine(self, managed=None):
        """The engine of `managed` (a list of params per group; default: _engine_params)."""
        self._engine_started = True
        if managed is None:
            managed = [self._engine_params(g["params"]) for g in self.param_groups]
        if any(managed):
            # by the number each param's group was added under (_number_group)
            by_number = [([], False, "float32", []) for _ in range(self._groups_made)]
            for gi, (g, ps) in enumerate(zip(self.param_groups, managed)):
                label = {id(p): param_label(g, gi, i, p) for i, p in enumerate(g["params"])}
                for p in ps:
                    number = self._known_group(p, gi)
                    params, _, _, names = by_number[number]
                    by_number[number] = (params, bool(g["amsgrad"]), g["state_dtype"], names)
                    params.append(p)
                    names.append(label[id(p)])   # (as _engine_names: once per group)
            params, amsgrad, formats, names = (list(x) for x in zip(*by_number))
            self._engine = OffloadEngine(
                params, amsgrad, state_dtypes=formats,
                options=self._options, owner=weakref.ref(self), routing=self._routing,
                marks=self._marks, names=names,
                claim=not getattr(self, "_constructing", False))
        if getattr(self, "_store", None) is not None:   # (a store that steps it, below)
            self._store.engine = self._engine

    def _known_group(self, p, gi: int) -> int:
        """The number p's group was added under (_number_group); a RuntimeError for a
        param put into param_groups[gi] directly, which the engine and the files cannot
        take: they lay out their memory for the params added through the optimizer."""
        number = self._group_of.get(p)
        if number is None:
            g = self.param_groups[gi]
            i = next(i for i, q in enumerate(g["params"]) if q is p)
            raise RuntimeError(
                f"offload_adam: param {param_label(g, gi, i, p)} was put into "
                f"param_groups[{gi}]['params'] directly, not through add_param_group: "
                "the offload engine cannot step it (nothing was stepped). Add new params "
                "with optimizer.add_param_group({'params': [...]})")
        return number

    def _add_to_engine(self, number: int, gi: int, params) -> None:
        """`params` of group gi (now), added under `number` (_number_group), join the
        engine (started now if there is none); those it holds already stay as they are."""
        if self._engine is not None:
            params = [p for p in params if not self._engine.has(p)]
        if not params:
            return
        if self._engine is None:
            self._start_engine()
            return
        g = self.param_groups[gi]
        self._engine.add_group(number, params, bool(g["amsgrad"]), g["state_dtype"],
                               self._engine_names(gi, params))

    def _enroll(self, params):
        """The store's call at construction (nvme_tier.FileStore, resuming files of every
        float param): group gi's `params[gi]` that the engine steps join it now, before the
        files' buckets are laid out over its records. Returns the engine (None: none)."""
        has = self._engine.has if self._engine is not None else (lambda p: False)
        more = [[p for p in ps if self._in_engine(p) and not _untrainable(p) and not has(p)]
                for ps in params]
        if self._engine is None:
            if any(more):
                self._start_engine(more)
            return self._engine
        for gi, ps in enumerate(more):
            self._add_to_engine(gi, gi, ps)   # (at construction: numbered as they are)
        return self._engine

    def _to_join(self):
        """[(number, group index, params)]: the params routed to the engine that have a
        grad and are not in it yet (frozen when they were added, unfrozen since), by the
        number their group was added under; a RuntimeError for one put into param_groups
        directly (_known_group)."""
        if self._routing.files:   # (the files refuse a grad of one they hold no state for)
            return []
        has = self._engine.has if self._engine is not None else (lambda p: False)
        found: dict = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if (p.grad is not None and self._in_engine(p) and not has(p)
                        and not _untrainable(p)):   # (step() refuses those)
                    found.setdefault((self._known_group(p, gi), gi), []).append(p)
        return [(number, gi, ps) for (number, gi), ps in found.items()]

    def _join_trained(self) -> None:
        """Before a step or a norm reads the grads: with no engine yet, one is started for
        the params that now have a grad. An engine takes them itself (_join_to_engine,
        called back from its step and its norms once what it ran in backward is done:
        its buffers are laid out again)."""
        if self._engine is None and self._to_join():
            self._start_engine()

    def _join_to_engine(self) -> None:
        """The engine's call back (see _join_trained)."""
        for number, gi, params in self._to_join():
            self._add_to_engine(number, gi, params)

    def _engine_names(self, gi: int, params):
        """How errors name group gi's `params`: as the in-place path names them."""
        g = self.param_groups[gi]
        taken = {id(p) for p in params}
        return [param_label(g, gi, i, p) for i, p in enumerate(g["params"]) if id(p) in taken]

    def _open_store(self, resume: bool = False, pickled_step: Optional[int] = None):
        """The store the routing names (state_store.py); `resume` as state_resume=True
        (an unpickled copy reopens its files: `pickled_step`, the files' step when it
        was pickled, refused if they are at another now)."""
        self._store = open_store(self._routing, self.param_groups, self.state, self._marks,
                                 self._engine, self._options, resume, enroll=self._enroll,
                                 pickled_step=pickled_step)
        weakref.finalize(self, _close_in, os.getpid(), self._store.close,
                         getattr(self._engine, "device", None))

    # ---- offload engine: profile, memory ---------------------------------------
    @property
    def last_step_profile(self):
        """The engine's profile of the last step() (see engine/profile.py), or None."""
        return self._engine.profile() if self._engine is not None else None

    def pinned(self) -> bool:
        """Whether the host memory the optimizer holds for transfers (the engine's
        buffers, the NVMe tier's ring) is page-locked; True when it holds none. A
        refused pin (a locked-memory limit) leaves pageable memory, with a warning."""
        return (self._engine is None or self._engine.pinned()) and self._store.pinned

    def close(self) -> None:
        """Lets go now (not when the optimizer is collected) of the engine's worker
        thread and hooks, unpins its host memory (the state stays readable), and closes
        the NVMe tier's ring, files and directory lock. A step after close() raises;
        the files stay, for state_resume=True. Called from another thread while a
        step() runs, it waits for that step to end (its files committed) first."""
        with self._busy("close"):
            self.__dict__["_closed"] = True
            if self._engine is not None:
                self._engine.close()
            self._store.close()

    def _busy(self, what: Optional[str] = None) -> threading.RLock:
        """Held by step() and close(): a close() from another thread (a watchdog, a
        signal handler's thread) lets a step in flight finish rather than pulling its
        files and buffers from under it (made on first use: an unpickled optimizer
        has none). `what` (close, state_dict, load_state_dict) is refused on the thread
        that runs the step's pass, inside it: a signal handler's (SIGTERM's, saving a
        checkpoint), which the lock lets in and which saved some params' state a step
        ahead of the others' (found from outside)."""
        lock = self.__dict__.setdefault("_busy_lock", threading.RLock())
        pid = self.__dict__.setdefault("_busy_pid", os.getpid())
        if pid != os.getpid():
            _refuse_held_at_fork(lock, pid, what)
        if what is not None and self.__dict__.get("_passing") == threading.get_ident():
            raise RuntimeError(
                f"offload_adam: {what}() was called inside step(), on the thread running "
                "it (from a signal handler, say SIGTERM's): the step is half done, some "
                f"params a step ahead of the others. Have the handler set a flag and call "
                f"{what}() after step() returns (from another thread, {what}() waits "
                "for the step)")
        return lock

    def host_bytes(self):
        """Host memory the optimizer's state holds: the engine's (master, moments
        and transfer buffers), the state tensors of the params stepped in place, and
        with state_dirs= the ring buffers the files are streamed through."""
        engine = self._engine.host_bytes() if self._engine is not None else 0
        return engine + self._store.host_bytes(self.param_groups, self.state)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    # torch's `state`, behind a property: with defer_blocks= a step may still be writing
    # some params' state when step() returned, so a read of it waits for that first
    # (torch's state_dict() and load_state_dict() read it here too).
    @property
    def state(self):
        self._settle_tail()
        return self.raw_state()

    def _settle_tail(self) -> None:
        """Waits for the steps defer_blocks= left running (raises what one raised)."""
        engine = self.__dict__.get("_engine")
        if engine is not None and engine.tail_pending:
            engine.settle_tail()

    @state.setter
    def state(self, value):
        self.__dict__["_state"] = value

    def raw_state(self):
        """optimizer.state without waiting for deferred steps (the engine's own reads,
        made when none can be running)."""
        d = self.__dict__
        if "state" in d:   # torch's __setstate__ (load_state_dict, unpickling) set it
            d["_state"] = d.pop("state")
        return d["_state"]

    @property
    def step_count(self) -> int:
        """The completed steps of the optimizer's state: with state_dirs=, the files' last
        committed step (what state_resume=True continued from: a resumed run sets its LR
        schedule and data position from it); otherwise the largest step count of a
        param's state (a param without a grad in some steps counts fewer; with
        step_in_backward, between backward and step(), the step that ran in backward
        counts). 0 before the first step."""
        return self._store.step_count(self.state)

    @torch.compiler.disable
    def zero_grad(self, set_to_none=True):
        self._check_behind()
        if self._engine is not None:
            self._engine.drop_freed_grads(zeros=not set_to_none)
            self._engine.after_raised_backward()   # (its copies read what is zeroed)
        super().zero_grad(set_to_none)
        self._drop_clip()
        if self._engine is not None:
            self._engine.zero_grad()

    def _check_behind(self) -> None:
        """Under several ranks with step_in_backward (state in RAM): this rank's step() was
        refused by its own edit, made before backward (so no step started in it here),
        while other ranks' steps of these grads had run in backward and stay. Dropping
        the grads left this rank's shards a step behind theirs without a word (found from
        outside); said once, the grads kept: step() again, mended, steps them here."""
        behind = self.__dict__.pop("_behind", None)
        if behind is None or not any(p.grad is not None for g in self.param_groups
                                     for p in g["params"]):
            return
        ranks, cause = behind
        raise RuntimeError(
            f"offload_adam: zero_grad() after this rank's step() was refused ({cause}), "
            f"while the step of these grads had already run during backward on rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (step_in_backward, "
            "the state in RAM: it cannot be undone there). Dropped, they would leave this "
            "rank's shards a step behind: mend the cause and call step() again on every "
            "rank, which steps them here. The grads are kept; a second zero_grad() drops "
            "them")

    # ---- step ---------------------------------------------------------------
    # (torch.compile(opt.step) runs it as it is: the step is the C++ kernel's and host
    # threads', nothing to trace, and tracing the engine's Python failed inside dynamo)
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        # (under torch.inference_mode, as torch's step may run: the buffers the step
        # makes, the engine's host state at its first step, would be inference tensors,
        # which its worker thread, outside that mode, cannot write: found from outside)
        with self._busy(), torch.inference_mode(False):
            try:
                return self._step(closure)
            except BaseException:
                self._forget_loss_scale()
                raise

    def _forget_loss_scale(self) -> None:
        """A step() that raised inside GradScaler.step: its grad_scale and found_inf go,
        as GradScaler removes them after a step that returns. Left on, the next
        GradScaler.step multiplied the old scale into the new one (the grads divided by
        the scale squared, silently), and plain step()s after it took them for a
        GradScaler's (found from outside)."""
        if "found_inf" in self.__dict__:
            del self.found_inf
            self.__dict__.pop("grad_scale", None)

    def _closure_raised(self, e: BaseException) -> None:
        """A closure that raised after its backward started steps (step_in_backward):
        the error says so, as the next zero_grad()'s would without naming the closure
        (found from outside)."""
        early = self._engine.early if self._engine is not None else None
        if early is not None and early.pending() and hasattr(e, "add_note"):
            e.add_note("offload_adam: the closure raised after its backward had started the "
                       "step of some params (step_in_backward=True); this step() stepped "
                       "nothing more. The next zero_grad() or backward says what stays of "
                       "those steps")

    def _step(self, closure):
        if self.__dict__.get("_closed"):
            raise RuntimeError("offload_adam: this optimizer was closed (close()): build a "
                               "new one to step (with state_dirs=, state_resume=True "
                               "continues from its files)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                try:
                    loss = closure()
                except BaseException as e:
                    self._closure_raised(e)
                    raise
        problem = None
        try:
            self._replicas_since()
            check_grad_dtypes(self.param_groups)
            check_listed_once(self.param_groups)
            self._addresses.check(self.param_groups)
            for index, group in enumerate(self.param_groups):   # (before any steps)
                Hyper.of(group, index)
            if self._engine is not None:
                self._engine.check_open()   # (taken over: said first, the grads are the new one's)
            check_freed_grads(self.param_groups, self._engine)   # (free_grads_after_copy=)
            self._join_trained()   # (a param unfrozen since its optimizer was built)
        except Exception as e:   # noqa: BLE001 -- raised below, after the ranks agree
            problem = e
        # (under several ranks: a rank refused, or an option set on one, would leave the
        # others waiting in the step's collectives)
        early = self._engine.early if self._engine is not None else None
        started = early.started_in_ram() if early is not None else 0
        ahead: list = []
        found_inf = getattr(self, "found_inf", None)   # (GradScaler.step's)
        skip = found_inf is not None and float(found_inf) != 0.0
        try:
            error, ahead, skip = distributed.agree_to_step(
                self._rank_options, problem, self.param_groups, self._options.process_group,
                started, skip)
            problem = problem or error
        except Exception as e:   # noqa: BLE001 -- a collective that failed: raised below
            problem = problem or e
        if problem is not None:
            if early is not None:   # (what zero_grad() does next with the steps pending)
                early.step_refused(problem)
            if ahead and not started:   # (zero_grad() says what dropping the grads does)
                self.__dict__["_behind"] = (ahead, f"{type(problem).__name__}: {problem}")
            raise problem
        self.__dict__.pop("_behind", None)
        scale = self._step_scale(skip)   # grad_scaling.py
        if scale is None:   # GradScaler found inf/NaN: the whole step is skipped
            return loss
        num_threads = self._inplace_threads()
        if self._store.take_edits(self.raw_state()):   # (state_dirs=: opt.state.clear()...)
            self.load_state_dict(self.state_dict())   # its state dict shows the edits
        # Ctrl-C: the whole step, then KeyboardInterrupt (a second one: see the store)
        self.__dict__["_passing"] = threading.get_ident()   # (see _busy)
        try:
            with interrupts_deferred(self._store.interrupt_note):
                store_pass = self._store.pass_(self.param_groups, self.state, scale)
                with contextlib.closing(store_pass):   # an error: nothing committed
                    for lent in store_pass:   # the store's order; its end commits
                        step_on_cpu(lent.calls, lent.hyper, scale, num_threads, self._marks)
                        if lent.engine is not None:
                            lent.engine()
        except Exception as e:
            self._store.after_pass(e)   # (under several ranks: the others raise, naming it)
            raise
        finally:
            self.__dict__["_passing"] = None
        self._store.after_pass(None)   # (... and this one, where another rank's failed)
        return loss


class AdamW(Adam):
    """torch.optim.AdamW's interface, stepped by offload_adam's fused CPU kernels."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, overlap=True, bucket_mb=32.0,
                 free_grads_after_copy=False, num_threads=None, max_grad_norm=None,
                 step_in_backward=False, verify_grads=True, state_dtype=torch.float32,
                 process_group=None, state_dirs=None, state_budget_mb=None,
                 state_resume=False, state_footprint="two_generations", grad_ring_mb=None,
                 defer_blocks=0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, overlap=overlap, bucket_mb=bucket_mb,
                         free_grads_after_copy=free_grads_after_copy,
                         num_threads=num_threads, max_grad_norm=max_grad_norm,
                         step_in_backward=step_in_backward, verify_grads=verify_grads,
                         state_dtype=state_dtype, process_group=process_group,
                         state_dirs=state_dirs, state_budget_mb=state_budget_mb,
                         state_resume=state_resume, state_footprint=state_footprint,
                         grad_ring_mb=grad_ring_mb, defer_blocks=defer_blocks)

    def __setstate__(self, state):
        super().__setstate__(state)
        # As torch's AdamW: whatever was loaded, AdamW decouples weight decay.
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _to_another_process(opt: Adam):
    """How multiprocessing (torch.multiprocessing's ForkingPickler: a Process's args, a
    Queue, spawn and forkserver children) sends an optimizer. torch's shares the params
    and the state tensors, moved to shared memory, so both processes train one model;
    the in-place path's state is such tensors, and goes as torch's does. The engine's
    state (pinned arenas, its threads) and the files' cannot be shared: the params went
    shared and the state copied, and each process trained on with moments of its own,
    silently (found from outside). Refused, naming why."""
    if opt.__dict__.get("_engine") is not None or opt._routing.store != "ram":
        where = ("in state files (state_dirs=)" if opt._routing.store != "ram"
                 else "in the offload engine's host memory (bf16/fp16 or GPU params)")
        raise RuntimeError(
            f"offload_adam: this optimizer was sent to another process through "
            f"multiprocessing (a Process's args, a Queue): its state lives {where}, which "
            "cannot be shared, while the params would be (moved to shared memory), so the "
            "two processes would train one model with moments of their own. Build the "
            "optimizer in the process that trains (from a state_dict() sent along, if it "
            "must go on from this one's)")
    return opt.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


for _cls in (Adam, AdamW):
    ForkingPickler.register(_cls, _to_another_process)


def _refuse_held_at_fork(lock: threading.RLock, pid: int, what: Optional[str]) -> None:
    """In a child forked from process `pid`: a step (or close, state_dict) that another
    thread of the parent was inside at the fork holds the lock for good here (os.fork
    copies the calling thread only), and left the state half stepped in the child's
    memory. Waiting for it hung (found from outside: a fork-based async checkpoint
    while a thread trained); refused instead. The lock is free once probed here."""
    if lock.acquire(blocking=False):
        lock.release()
        return
    raise RuntimeError(
        f"offload_adam: {what or 'step'}() in a child (pid {os.getpid()}) forked from "
        f"process {pid} while another thread of it was inside this optimizer's step() "
        "(or close(), state_dict()): that thread is not in the child, and the state it "
        "was stepping is half stepped in the child's copy of the memory. Fork when no "
        "thread is inside step() (say from the training thread, between steps), or save "
        "in the parent")


def _close_in(pid: int, close, device=None) -> None:
    """The store's close() when the optimizer goes, in the process that built it only: a
    forked child (its exit, its garbage) inherits the files and their locks, which are
    the parent's to let go of (an flock's unlock through the child's copy of the
    descriptor would unlock the parent's). On the simulated device, put off where its
    waits would wait for themselves (put_off)."""
    if os.getpid() != pid:
        return
    if put_off(device, lambda: _close_in(pid, close)):
        return
    try:
        close()
    except RuntimeError:
        # At the interpreter's exit (a script ending between backward and step()), the
        # I/O threads take no more work ("cannot schedule new futures after shutdown"):
        # the files stay at their last completed step, as after a kill, which they are
        # made for; no traceback for it at exit
        import concurrent.futures.thread as pools
        if not getattr(pools, "_shutdown", False):
            raise
