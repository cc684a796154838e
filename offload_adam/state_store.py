"""Where the optimizer's state lives: one interface, two stores. The seam, in one picture:

    params --routing.py--> a store (per optimizer) and a stepper (per param)
    step():  for each bucket of a store pass (`pass_`), in the store's order:
                 the store lends the bucket's state (`Lent`): its masters follow their
                 params first (master_rule.py)
                 the CPU stepper steps its in-place params (cpu_step.step_on_cpu)
                 the engine steps its params over the lent state (`Lent.engine`)
             the pass's end commits (files: written back, the step committed)

    RamStore                              FileStore (nvme_tier.py)
    optimizer.state / the engine's        every param's state in files under state_dirs=,
    host arenas, lent in place: a         in RAM one bucket at a time: the pass reads
    bucket per param group for the        ahead, lends each file bucket's ring buffer,
    CPU params, then one for the          writes it back and commits the step
    engine (it pipelines its own
    transfer buckets)

Both answer the optimizer and its mixins (optimizer.py, torch_state_dict.py,
grad_scaling.py) through the same methods: `pass_`, `grads` (clipping's norm of the
in-place params), `add_state` / `check_load` / `load` (the state dict), `take_edits`
(optimizer.state edited where it does not hold the state), `add_group`, `reset`,
`step_count`, `host_bytes`, `pinned`, `close`, `interrupt_note`, `after_pass` (the engine, a
stepper, answers for its own memory). Nothing outside the stores asks which one it is. `open_store` builds the
one the routing names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import distributed
from .cpu_step import CpuCall
from .inplace import InPlace
from .kernel_state import kernel_state
from .kernel_step import Hyper
from .master_rule import MasterMarks
from .routing import Routing
from .state_format import MASTER_KEY, MOMENT_KEYS, SCALE_KEYS, state_format, stored_state

# A loaded param: its id in the state dict, the param, its group.
Loaded = Tuple[object, torch.Tensor, dict]
# The state put back from a loaded dict (the rest torch's load_state_dict keeps).
_KEPT = MOMENT_KEYS + tuple(SCALE_KEYS.values()) + (MASTER_KEY, "step")


@dataclass
class Lent:
    """One bucket of a store pass: `calls`, the CPU stepper's kernel calls over the
    lent states of its in-place params (each with its grads), with `hyper`; `engine`,
    what steps its engine params over the lent state (None: it has none)."""

    hyper: Optional[Hyper] = None
    calls: List[Tuple[CpuCall, List[torch.Tensor]]] = field(default_factory=list)
    engine: Optional[Callable[[], None]] = None


class RamStore:
    """The state in host RAM: a CPU param's in optimizer.state (inplace.py), an engine
    param's in the engine's host arenas (optimizer.state shows views of them)."""

    # A second Ctrl-C in step() gives up the buckets not started: each param's state
    # and value move together, so each param is stepped or not, never half.
    interrupt_note = None

    def __init__(self, routing: Routing, marks: MasterMarks, engine=None):
        self._routing, self._marks, self.engine = routing, marks, engine
        self._inplace = InPlace(routing.in_place, marks)

    def pass_(self, param_groups, state, grad_scale: float) -> Iterator[Lent]:
        # The engine first: what it refuses (a param cast or replaced, a torn state:
        # engine.torn) it refuses before the params stepped in place have moved
        if self.engine is not None:
            yield Lent(engine=lambda: self.engine.step(param_groups, state, grad_scale))
        for index, group in enumerate(param_groups):
            calls = self._inplace.lend(index, group, state)
            if calls:
                yield Lent(Hyper.of(group, index), calls)

    def grads(self, param_groups) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return self._inplace.grads(param_groups)

    def after_pass(self, error) -> None:
        pass   # (a step in RAM has no I/O to fail on one rank alone)

    def add_state(self, sd: dict) -> dict:
        if self.engine is not None and self.engine.torn is not None:
            raise RuntimeError(self.engine.torn)   # (saved, it would resume wrong)
        return sd   # optimizer.state holds it all

    def take_edits(self, state) -> bool:
        return False   # optimizer.state is the state: an edit is seen where it is made

    def add_group(self, index: int, group: dict) -> None:
        pass   # the in-place plans are per group: made at its first step

    def check_load(self, pairs) -> None:
        pass   # optimizer.state takes any param's state (nvme_tier.FileStore.check_load)

    def reset(self) -> None:
        """The state was replaced (load_state_dict): the kernel calls are built again."""
        self._inplace = InPlace(self._routing.in_place, self._marks)

    def load(self, loaded: Sequence[Loaded], saved_state: dict, state) -> None:
        """Puts each loaded param's moments, scales, master and step back into `state`
        (torch's load_state_dict left them out: it would cast them), as CPU copies,
        converted to its group's state format (kernel_state.py); the moments the dict
        holds (a missing one is made at the param's first step, as in torch)."""
        for saved_id, p, group in loaded:
            saved = saved_state.get(saved_id)
            if saved is None:
                continue
            label = f"{saved_id} (shape {tuple(p.shape)})"
            st = state[p]
            saved = stored_state(saved, f" of param {label}")
            for key in _KEPT:  # copies: the kernels update them in place
                value = saved.get(key)
                if isinstance(value, torch.Tensor):
                    if distributed.is_dtensor(p) and key in MOMENT_KEYS + (MASTER_KEY,):
                        value = distributed.local_value(value, p, key, lambda: label)
                    st[key] = value.detach().to("cpu", copy=True).contiguous()
            present = [k for k in MOMENT_KEYS if k in st]
            # (an fp32 CPU param stepped in place is its own master)
            has_master = p.dtype is not torch.float32 or self._routing.in_engine(p)
            got = kernel_state(st, distributed.local(p).shape,
                               state_format(group["state_dtype"]), "max_exp_avg_sq" in st,
                               has_master, f"param {label}")
            for key in MOMENT_KEYS + tuple(SCALE_KEYS.values()) + (MASTER_KEY,):
                st.pop(key, None)
            moment_of = {scale: key for key, scale in SCALE_KEYS.items()}
            st.update({k: v for k, v in got.moments.items() if moment_of.get(k, k) in present})
            if got.master is not None:
                st[MASTER_KEY] = got.master
        if self.engine is not None:   # a whole state again (EngineStep: torn)
            self.engine.torn = None

    def step_count(self, state) -> int:
        """The largest step count of a param's state (a param without a grad in some
        steps counts fewer)."""
        return int(max((float(st["step"]) for st in state.values()
                        if isinstance(st, dict) and "step" in st), default=0))

    def host_bytes(self, param_groups, state) -> int:
        """The in-place params' state tensors (the engine counts its own)."""
        return sum(t.numel() * t.element_size()
                            for g in param_groups for p in g["params"]
                            if self._routing.in_place(p)
                            for t in state.get(p, {}).values()
                            if isinstance(t, torch.Tensor))

    @property
    def pinned(self) -> bool:
        return True   # (the engine's own memory: engine.pinned())

    def close(self) -> None:
        pass   # nothing held beyond optimizer.state (the engine closes its own)


def open_store(routing: Routing, param_groups, state, marks: MasterMarks, engine, options,
               resume: bool = False, enroll=None, pickled_step: Optional[int] = None):
    """The store `routing` names for the optimizer's groups and `state` (options.py's
    `options`; `resume`: as state_resume=True, for an unpickled copy that reopens its
    files, `pickled_step` the files' step when it was pickled; `enroll`: the optimizer's
    call that has the engine take more params, see FileStore)."""
    if routing.store == "ram":
        return RamStore(routing, marks, engine)
    from .nvme_tier import FileStore
    params = [p for g in param_groups for p in g["params"]]
    dirs = distributed.rank_dirs(options.state_dirs, params, options.process_group)
    return FileStore(param_groups, [g["params"] for g in param_groups], dirs,
                     options.bucket_mb, options.state_budget_mb,
                     options.state_resume or resume, engine=engine,
                     process_group=options.process_group, marks=marks, state=state,
                     compact=getattr(options, "state_footprint", "") == "compact",
                     enroll=enroll, pickled_step=pickled_step)
