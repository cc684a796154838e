"""CPU params stepped in place with their state in files: the state_dirs option.

The storage is nvme/ (files, slots, manifest, the read-ahead pipeline); this is the
optimizer's side of it. At construction the in-place params of every group are dealt, in
order, into buckets of about bucket_mb of state (a bucket never spans two groups, so one
kernel call per param dtype has one set of hyperparameters), and the files are opened (or
created, or resumed). Each step():

    for bucket i (read ahead by the pipeline):
        fused kernel on its params that have a grad: the live grad and param, the fp32
        master (bf16/fp16 params) and moments from the bucket's buffer
    -> written back, then the step is committed

The same kernel call on the same values as inplace.py, so the params come out bitwise the
same as with the state in host RAM. An fp32 param is its own master, as in RAM: its files
hold only the moments and the step. A master is taken from its param at the param's first
step (its step count is 0), and a loaded or resumed one is kept only while it still rounds
to its param (as torch_state_dict.py's _drop_stale_masters does in RAM).

optimizer.state holds nothing for these params; state_dict() shows their state as file
views (`add_state`) and load_state_dict() writes into the files bucket by bucket (`load`).

The grads are checked before the first bucket is stepped. An I/O error mid-step raises with
the files at the last completed step (nvme/pipeline.py), but the params of the buckets
already stepped have moved (they live in RAM, outside the files' crash safety): restore
them from a checkpoint, as after a crash.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version

from .params import check_dense, param_label, rounds_to
from .kernel_step import Hyper, adam_step
from .nvme import BucketSpec, NvmeState, StateSpec, StepPipeline, adam_bucket
from .state_format import MASTER_KEY, MOMENT_KEYS, SCALE_KEYS, state_format, stored_state

_MB = 2 ** 20


class _Param:
    """One param of the tier: where it is in the groups, its name in the files, and the
    dtype its files were laid out for (an fp32 param has no master there)."""
    __slots__ = ("group", "index", "param", "name", "dtype")

    def __init__(self, group: int, index: int, param: torch.Tensor, name: str):
        self.group, self.index, self.param, self.name = group, index, param, name
        self.dtype = param.dtype

    @property
    def has_master(self) -> bool:
        return self.dtype is not torch.float32


def _bucket_spec(entries: List[_Param], fmt: str, amsgrad: bool):
    """adam_bucket less the master of fp32 params (their param is their master)."""
    full = adam_bucket([(e.name, e.param.shape) for e in entries], fmt, amsgrad)
    no_master = {f"{e.name}.master" for e in entries if not e.has_master}
    return BucketSpec(tuple(t for t in full.tensors if t.name not in no_master))


class NvmeTier:
    """The state of `params` (a list per group, the in-place ones) in files under `dirs`."""

    def __init__(self, param_groups, params: List[List[torch.Tensor]], dirs, bucket_mb: float,
                 budget_mb: Optional[float], resume: bool = False):
        self.buckets: List[List[_Param]] = []
        self._ids = set()
        specs = []
        limit = bucket_mb * _MB
        for gi, (group, mine) in enumerate(zip(param_groups, params)):
            fmt = state_format(group["state_dtype"])
            amsgrad = bool(group["amsgrad"])
            names = group.get("param_names")
            keep = {id(p) for p in mine}
            bucket, size = [], 0
            for i, p in enumerate(group["params"]):
                if id(p) not in keep:
                    continue
                entry = _Param(gi, i, p, f"{gi}:{names[i] if names else i}")
                nbytes = _bucket_spec([entry], fmt.name, amsgrad).nbytes
                if bucket and size + nbytes > limit:
                    specs.append(_bucket_spec(bucket, fmt.name, amsgrad))
                    self.buckets.append(bucket)
                    bucket, size = [], 0
                bucket.append(entry)
                size += nbytes
                self._ids.add(id(p))
            if bucket:
                specs.append(_bucket_spec(bucket, fmt.name, amsgrad))
                self.buckets.append(bucket)
        self._formats = [state_format(g["state_dtype"]) for g in param_groups]
        self._amsgrad = [bool(g["amsgrad"]) for g in param_groups]
        spec = StateSpec(tuple(specs), "+".join(sorted({f.files_name for f in self._formats})),
                         extra={"amsgrad": self._amsgrad})
        largest = max((b.nbytes for b in spec.buckets), default=0)
        budget = int(budget_mb * _MB) if budget_mb is not None else 4 * largest
        self.state = NvmeState.open(list(dirs), spec)
        if self.state.step and not resume:
            step = self.state.step
            self.state.close()
            raise ValueError(
                f"state_dirs={list(dirs)} already hold this optimizer's state at step "
                f"{step} (an earlier run, or one that crashed). Pass "
                "state_resume=True to continue from it, or empty the directories to start "
                "afresh")
        try:
            self.pipeline = StepPipeline(self.state, budget)
        except ValueError as e:
            self.state.close()
            raise ValueError(f"state_budget_mb={budget_mb}: {e}") from None
        # Masters to check against their param at the next step: all of a resumed state.
        self._loaded: Dict[int, str] = ({id(e.param): "check" for b in self.buckets for e in b
                                         if e.has_master} if self.state.step else {})

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self._ids

    def grads(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(param, grad) of every param here that has one (clipping's norm)."""
        return [(e.param, e.param.grad) for b in self.buckets for e in b
                if e.param.grad is not None]

    @property
    def host_bytes(self) -> int:
        return self.pipeline.host_bytes

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.state.close()
            self.pipeline = None

    # ---- step -------------------------------------------------------------------------

    def step(self, param_groups, grad_scale: float, num_threads: int) -> None:
        with_grads = [e for b in self.buckets for e in b if e.param.grad is not None]
        if not with_grads:
            return   # as torch: a step without grads changes nothing
        for e in with_grads:   # before any bucket is stepped
            _check_grad(e, param_groups[e.group])
        for i, t in self.pipeline.buckets():
            self._step_bucket(self.buckets[i], t, param_groups, grad_scale, num_threads)
        self._loaded = {}

    def _step_bucket(self, bucket: List[_Param], t, param_groups, grad_scale, num_threads):
        gi = bucket[0].group
        group = param_groups[gi]
        fmt, amsgrad = self._formats[gi], self._amsgrad[gi]
        if (state_format(group["state_dtype"]), bool(group["amsgrad"])) != (fmt, amsgrad):
            raise ValueError(f"param group {gi}: state_dtype and amsgrad cannot change with "
                             f"state_dirs= (the files hold state_dtype={fmt.name!r}, "
                             f"amsgrad={amsgrad})")
        by_dtype: Dict[torch.dtype, List[_Param]] = {}
        for e in bucket:
            if e.param.grad is not None:
                by_dtype.setdefault(e.param.dtype, []).append(e)
        for dtype, entries in by_dtype.items():
            work, grads, lp, back = [], [], [], []
            for e in entries:
                p, g = e.param, e.param.grad
                grads.append(g if g.is_contiguous() else g.contiguous())
                out = p.detach()
                if not out.is_contiguous():   # stepped through a copy
                    out = out.contiguous()
                    back.append((p, out))
                if e.has_master:
                    master = t[f"{e.name}.master"]
                    self._ready_master(e, master, t[f"{e.name}.step"])
                    work.append(master)
                    lp.append(out)
                else:
                    work.append(out)
            names = [e.name for e in entries]
            scales = {}
            if fmt.blockwise:
                scales = {f"{k}_scales": [t[f"{n}.{SCALE_KEYS[k]}"] for n in names]
                          for k in ("exp_avg", "exp_avg_sq")}
            adam_step(work, grads, [t[f"{n}.exp_avg"] for n in names],
                      [t[f"{n}.exp_avg_sq"] for n in names],
                      [t[f"{n}.max_exp_avg_sq"] for n in names] if amsgrad else [],
                      lp, [t[f"{n}.step"] for n in names], Hyper.of(group), grad_scale,
                      num_threads, **scales)
            for p, out in back:
                p.detach().copy_(out)
            for e in entries:
                increment_version(e.param)

    def _ready_master(self, e: _Param, master: torch.Tensor, step: torch.Tensor) -> None:
        """The master of a bf16/fp16 param before its kernel call: from the param at its
        first step, or when a loaded one was absent or no longer rounds to the param."""
        how = self._loaded.get(id(e.param))
        p = e.param.detach()
        if how == "check":
            how = None if rounds_to(master, p) else "take"
        if how == "take" or float(step) == 0:
            master.copy_(p)

    # ---- state dict ----------------------------------------------------------------------

    def add_state(self, sd: dict) -> dict:
        """torch's state dict `sd` with the state of the params here, as file views, under
        the ids sd gives them, in the keys and order of the state in RAM."""
        state = dict(sd["state"])
        for i, bucket in enumerate(self.buckets):
            views = self.state.views(i)
            for e in bucket:
                step = views[f"{e.name}.step"]
                if float(step) == 0:
                    continue   # never stepped: no state, as in torch
                fmt = self._formats[e.group]
                keys = MOMENT_KEYS if f"{e.name}.max_exp_avg_sq" in views else MOMENT_KEYS[:2]
                st = {"step": step}
                for key in keys:
                    st[key] = views[f"{e.name}.{key}"]
                    if fmt.blockwise and key in SCALE_KEYS:
                        st[SCALE_KEYS[key]] = views[f"{e.name}.{SCALE_KEYS[key]}"]
                if e.has_master:
                    st[MASTER_KEY] = views[f"{e.name}.master"]
                state[sd["param_groups"][e.group]["params"][e.index]] = st
        return {**sd, "state": state}

    def load(self, saved_ids: Dict[int, object], saved_state: dict) -> None:
        """Writes a loaded state dict into the files, bucket by bucket: for each param its
        saved state converted to its group's format (state_format.py), or a fresh one.
        `saved_ids`: id(param) -> its key in `saved_state`."""
        loaded: Dict[int, str] = {}
        steps = [0]

        def fill(i, t):
            for e in self.buckets[i]:
                saved = saved_state.get(saved_ids.get(id(e.param)))
                saved = stored_state(saved or {}, f" of param {e.name}")
                self._fill_param(e, t, saved, loaded)
                steps.append(int(float(t[f"{e.name}.step"])))

        self.pipeline.load(fill, step=max(steps))
        self._loaded = loaded

    def _fill_param(self, e: _Param, t, saved: dict, loaded: Dict[int, str]) -> None:
        p = e.param
        label = f" of param {e.name} (shape {tuple(p.shape)})"
        fmt = self._formats[e.group]
        step = saved.get("step")
        t[f"{e.name}.step"].fill_(0.0 if step is None else float(step))
        for key in MOMENT_KEYS:
            if f"{e.name}.{key}" not in t:
                continue
            value = fmt.convert(saved, key, p.shape, p.numel(), label)
            t[f"{e.name}.{key}"].copy_(value[key])
            if fmt.blockwise and key in SCALE_KEYS:
                t[f"{e.name}.{SCALE_KEYS[key]}"].copy_(value[SCALE_KEYS[key]])
        if e.has_master:
            master = saved.get(MASTER_KEY)
            if isinstance(master, torch.Tensor):
                if tuple(master.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {MASTER_KEY!r}{label} has shape "
                                     f"{tuple(master.shape)}, expected {tuple(p.shape)}")
                t[f"{e.name}.master"].copy_(master)
                loaded[id(p)] = "check"
            else:
                t[f"{e.name}.master"].zero_()
                loaded[id(p)] = "take"


def _check_grad(e: _Param, group: dict) -> None:
    p, g = e.param, e.param.grad
    if p.dtype is not e.dtype:
        raise RuntimeError(f"param {param_label(group, e.group, e.index, p)} is {p.dtype}; its "
                           f"state files were laid out for {e.dtype} when the optimizer was "
                           "built: with state_dirs=, build the optimizer after casting the model")
    check_dense(g, f"param {param_label(group, e.group, e.index, p)}")
    if g.dtype is not p.dtype or tuple(g.shape) != tuple(p.shape):
        raise RuntimeError(f"param {param_label(group, e.group, e.index, p)}: its grad is "
                           f"{g.dtype} {tuple(g.shape)}, the param {p.dtype}")
