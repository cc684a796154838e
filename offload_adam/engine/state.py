"""optimizer.state[p] of an offloaded param: views of the engine's host buffers.

The state keeps torch's keys and shapes ("step", "exp_avg", "exp_avg_sq",
"max_exp_avg_sq", plus "master_param", all fp32 on the CPU), so it saves,
loads and moves to torch.optim.AdamW like torch's own. The tensors are views
into the engine's arenas. `bind_state` makes the state show them, at a param's
first step (creating it) and after load_state_dict (copying the loaded values
in), and is a no-op otherwise.

A master starts as its param: the param is copied to the host (bf16/fp16
through staging) and waited for right there, once per param, so that the
state is whole even when a step stops before this param's bucket. Afterwards
it follows its param by the one master rule (master_rule.py, `follow_masters`),
here and over the files' lent buckets (core.step_lent).
"""

from __future__ import annotations

import contextlib
from itertools import groupby
from typing import Callable, Sequence

from ..kernel_state import kernel_state
from ..master_rule import MasterMarks, take_from_param
from ..params import rounds_to
from ..state_format import MASTER_KEY, MOMENT_KEYS, SCALE_KEYS
from .layout import Entry


def bind_state(device, recs: Sequence, param_groups, state,
               allocate: Callable[[Sequence, tuple], None], marks: MasterMarks) -> None:
    """Makes state[rec.param] show rec's host buffers for each rec;
    `allocate(recs, roles)` adds host buffers (max_exp_avg_sq when amsgrad was
    turned on after the optimizer was built). A master made from its param agrees
    with it (`marks`)."""
    ams = [r for r in recs if param_groups[r.group].get("amsgrad", False)
           and r.max_exp_avg_sq is None]
    for r in ams:
        r.fmt.check_amsgrad(True, r.label())
    for _, same in groupby(sorted(ams, key=lambda r: r.fmt.name), key=lambda r: r.fmt.name):
        allocate(list(same), ("max_exp_avg_sq",))
    fresh = [rec for rec in recs if _bind(device, rec, state[rec.param])]
    if fresh:
        _masters_from_params(device, [p for rec in fresh for p in rec.pieces])
        marks.agree(rec.param for rec in fresh)


def is_bound(rec, state) -> bool:
    """Whether optimizer `state` shows rec's host buffers (rec has a state)."""
    st = state.get(rec.param)
    return st is not None and _bound(rec, st)


def _bind(device, rec, st: dict) -> bool:
    """Makes `st` show rec's host buffers, holding its values brought into the kernels'
    form (kernel_state.py). True when rec's master must start from the param."""
    if _bound(rec, st):
        return False
    amsgrad = rec.max_exp_avg_sq is not None
    got = kernel_state(st, rec.shape, rec.fmt, amsgrad, True, rec.label(), zeros=False)
    for key in MOMENT_KEYS if amsgrad else MOMENT_KEYS[:2]:
        for k in (key, SCALE_KEYS[key]) if rec.fmt.blockwise and key in SCALE_KEYS else (key,):
            view = getattr(rec, k)
            if k not in got.moments:   # none yet: zeroed where it lives (its first touch)
                view.zero_()
                st[k] = view
            elif st.get(k) is not view:
                view.copy_(got.moments[k].reshape(view.shape))
                st[k] = view
    rec.fmt.drop_scales(st)
    if st.get("step") is not rec.step_t:
        for piece in rec.pieces:   # a param cut in pieces counts its step per piece
            piece.step_t.fill_(got.step)
        st["step"] = rec.step_t
    if st.get(MASTER_KEY) is rec.master:
        return False
    st[MASTER_KEY] = rec.master
    if got.master is None:
        return True
    # The master is an fp32 param's H2D source: the last step's copies may
    # still read it. Wait for them before writing.
    device.wait_host(*[t for p in rec.pieces for t in p.bucket.h2d])
    rec.master.copy_(got.master)
    return False


def _bound(rec, st: dict) -> bool:
    """Whether `st` shows rec's buffers already: at every step but a param's first and
    the first after a load."""
    return (st.get("step") is rec.step_t and st.get(MASTER_KEY) is rec.master
            and all(st.get(key) is getattr(rec, key) for key in MOMENT_KEYS
                    if getattr(rec, key) is not None))


def read_params(device, dsts: Sequence, pieces: Sequence, after=None) -> None:
    """Copies each piece of its param into the host tensor beside it in `dsts`, and waits:
    from the device (after the caller's queued work, or event `after`: from the worker,
    one taken on the user's stream), or from a streamed param's host copy
    (param_stream.py)."""
    went = []
    for dst, p in zip(dsts, pieces):
        if p.rec.home is not None:
            if dst is None:   # its staging is its host copy itself: nothing to copy
                p.rec.live(check_only=True)
                continue
            with p.rec.home.held():   # (in files: its slot stays until copied)
                src = p.of(p.rec.live())
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        else:
            went.append(device.d2h(dst, p.of(p.rec.live()), after))
    device.wait_host(*went)


def _held(piece):
    """A streamed param's host copy kept in place while its staging (the copy itself) is
    used (param files: the cache may give the slot away otherwise)."""
    home = piece.rec.home
    return home.held() if home is not None else contextlib.nullcontext()


def _masters_from_params(device, pieces: Sequence, after=None) -> None:
    device.wait_host(*[t for p in pieces for t in p.bucket.h2d])   # staging is free
    read_params(device, [(None if p.rec.home is not None else p.staging)
                         if p.rec.low_precision else p.state("master")
                         for p in pieces], pieces, after)
    for p in pieces:
        if p.rec.low_precision:
            with _held(p):
                p.param_state().restart(p.staging)


def follow_masters(device, entries: Sequence[Entry], marks: MasterMarks, after=None) -> None:
    """The master rule (master_rule.py) for entries whose state views are bound: where a
    param changed since it last agreed with its master, the master starts again from
    it unless the param is still its rounding (bf16/fp16 params are read into their
    staging, in one batch of copies, to compare; an fp32 param's master is the param,
    so it is simply taken). `after`: read_params'. The rule is applied piece by piece (a
    piece still its master's rounding keeps it: a param edited in part keeps the masters
    of the rest), so that it gives the same masters however a store lends the pieces: a
    part of a param (layout.Entry) is an entry of its own, and the param agrees with
    its masters only once its step ends (EngineStep.end: its other parts follow too)."""
    changed = [e for e in entries if not marks.current(e.rec.param)]
    if not changed:
        return
    check = [p for e in changed if e.rec.low_precision for p in e.pieces
             if float(p.step_t) != 0]
    if check:
        device.wait_host(*[t for p in check for t in p.bucket.h2d])   # staging is free
        read_params(device, [None if p.rec.home is not None else p.staging for p in check],
                    check, after)

    def stale(p) -> bool:
        if not p.rec.low_precision:
            return True
        with _held(p):
            return not rounds_to(p.param_state().rounded, p.staging)

    take = [p for e in changed for p in e.pieces
            if take_from_param(float(p.step_t), False, lambda p=p: stale(p))]
    if take:
        _masters_from_params(device, take, after)
    marks.agree(e.rec.param for e in changed if not e.part)
