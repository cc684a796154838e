"""An Adam state in buckets and its step with the project's fused kernel, for the NVMe tests
and the crash worker: the same state and grads stepped on disk (offload_adam/nvme) and in
host RAM (plain tensors) must give the same bits.

Everything is a function of (seed, step, bucket): the first values and each step's grads,
so that a run resumed in another process continues exactly as an uninterrupted one.
"""
import os
from typing import Dict, List

import torch

from offload_adam.kernel_step import Hyper, adam_step
from offload_adam.nvme import StateSpec
from offload_adam.param_state import adam_bucket

HYPER = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              decoupled_weight_decay=True, maximize=False, amsgrad=False)
FORMAT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "8bit": "8bit"}


def make_spec(fmt: str, buckets: int = 4, numel: int = 20000, params: int = 2) -> StateSpec:
    """`buckets` buckets of `params` params each (sizes vary a little, odd ones included)."""
    return StateSpec(tuple(
        adam_bucket([(f"b{b}p{k}", (numel + 97 * b + 31 * k,)) for k in range(params)],
                    FORMAT_NAMES[fmt])
        for b in range(buckets)), FORMAT_NAMES[fmt])


def param_names(tensors: Dict[str, torch.Tensor]) -> List[str]:
    return [k[:-len(".master")] for k in tensors if k.endswith(".master")]


def fill_initial(seed: int):
    """fill(i, tensors): the first state of bucket i (random masters, zero moments)."""
    def fill(i, tensors):
        for k, t in tensors.items():
            t.zero_()
        for j, name in enumerate(param_names(tensors)):
            g = torch.Generator().manual_seed(seed * 7919 + i * 101 + j)
            m = tensors[name + ".master"]
            m.copy_(torch.randn(m.shape, generator=g) * 0.1)
    return fill


def grad_of(seed: int, step: int, i: int, j: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + i) * 17 + j)
    return torch.randn(shape, generator=g) * 1e-2


def adam_fn(seed: int, step: int, threads: int = 1):
    """fn(i, tensors): step `step` (0-based) of bucket i with the fused kernel."""
    def fn(i, t):
        names = param_names(t)
        scales = {}
        if names[0] + ".exp_avg_scale" in t:
            scales = dict(exp_avg_scales=[t[n + ".exp_avg_scale"] for n in names],
                          exp_avg_sq_scales=[t[n + ".exp_avg_sq_scale"] for n in names])
        adam_step([t[n + ".master"] for n in names],
                  [grad_of(seed, step, i, j, t[n + ".master"].shape)
                   for j, n in enumerate(names)],
                  [t[n + ".exp_avg"] for n in names], [t[n + ".exp_avg_sq"] for n in names],
                  [], [], [t[n + ".step"] for n in names], HYPER, 1.0, threads, **scales)
    return fn


def host_state(spec: StateSpec, seed: int) -> List[Dict[str, torch.Tensor]]:
    """The first state in host RAM (plain tensors)."""
    state = [{t.name: torch.empty(t.shape, dtype=t.dtype) for t in b.tensors}
             for b in spec.buckets]
    fill = fill_initial(seed)
    for i, tensors in enumerate(state):
        fill(i, tensors)
    return state


def host_step(state, seed: int, step: int) -> None:
    fn = adam_fn(seed, step)
    for i, tensors in enumerate(state):
        fn(i, tensors)


def snapshot(state) -> List[Dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in tensors.items()} for tensors in state]


def same_bits(a, b) -> bool:
    """Bucket lists a and b hold bitwise the same tensors."""
    return all(x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
        and torch.equal(x[k].view(torch.uint8) if x[k].dim() else x[k].reshape(1).view(torch.uint8),
                        y[k].view(torch.uint8) if y[k].dim() else y[k].reshape(1).view(torch.uint8))
        for k in x) for x, y in zip(a, b)) and len(a) == len(b)


def flip_byte(path, offset: int, mask: int = 0x40) -> None:
    """Flips bits `mask` of the byte at `offset` of file `path` (damage from outside)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1) or b"\0"
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def grads_record(seed: int, step: int, i: int, tensors_spec) -> tuple:
    """Bucket i's redo record (offload_adam/nvme/redo.py) of step `step`: its grads."""
    names = [t.name[:-len(".master")] for t in tensors_spec.tensors if t.name.endswith(".master")]
    shapes = {t.name: t.shape for t in tensors_spec.tensors}
    return ({"step": step}, [(n, grad_of(seed, step, i, j, shapes[n + ".master"]))
                             for j, n in enumerate(names)])


def redo_fn(state):
    """fn(i, tensors): bucket i stepped with the grads of its redo record."""
    def fn(i, t):
        meta, grads = state.record(i)
        names = param_names(t)
        scales = {}
        if names[0] + ".exp_avg_scale" in t:
            scales = dict(exp_avg_scales=[t[n + ".exp_avg_scale"] for n in names],
                          exp_avg_sq_scales=[t[n + ".exp_avg_sq_scale"] for n in names])
        adam_step([t[n + ".master"] for n in names], [grads[n] for n in names],
                  [t[n + ".exp_avg"] for n in names], [t[n + ".exp_avg_sq"] for n in names],
                  [], [], [t[n + ".step"] for n in names], HYPER, 1.0, 1, **scales)
    return fn


def compact_step(state, pipe, seed: int) -> None:
    """One step of a compact state: a step cut short finished from its redo records,
    else the next one begun (every bucket's record written) and stepped."""
    if state.pending:
        pipe.step(redo_fn(state))
        return
    step = state.step
    state.begin(step + 1, {i: grads_record(seed, step, i, b)
                           for i, b in enumerate(state.spec.buckets)})
    pipe.step(adam_fn(seed, step))


def fails_at(call: int, real, code: int):
    """`real` (direct_io._write or _read: (fd, view, offset)) raising OSError(code) at its
    `call`-th call, to set in its place: a disk error (ENOSPC, EIO) in the middle of a step."""
    calls = []

    def fn(fd, view, offset):
        calls.append(offset)
        if len(calls) == call:
            raise OSError(code, os.strerror(code))
        return real(fd, view, offset)
    return fn
