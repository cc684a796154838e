"""An offload engine driven without an optimizer, for tests of the engine's own
API (offload_adam/engine/core.py: its recs and buckets, close(), early start).

The optimizer owns its engine and does not show it; a test that must look at
pieces, buckets, grad copies or the early start builds the engine itself and
drives it as the optimizer does: `step()` hands it the param groups and the
state, `zero_grad()` lets it forget what it freed. `BareEngine` has the
optimizer's `param_groups`, `state`, `step()` and `zero_grad()`, so the shared
training loops and checks of models.py take it where they take an optimizer.
"""
import weakref
from collections import defaultdict

import torch

from offload_adam.engine import OffloadEngine
from offload_adam.options import Options
from offload_adam.testing import state_in_files

# torch.optim.AdamW's group keys, as offload_adam.AdamW fills them.
_GROUP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
              maximize=False, decoupled_weight_decay=True, state_dtype="float32")
_HYPER = set(_GROUP)


class BareEngine:
    """OffloadEngine(params) with AdamW's groups; `params` as an optimizer takes
    them (a list of tensors or of group dicts). Keyword arguments are group
    defaults (lr, weight_decay, ...) or engine options (options.py)."""

    def __init__(self, params, **kw):
        defaults = {**_GROUP, **{k: v for k, v in kw.items() if k in _HYPER}}
        with state_in_files(None):   # the engine alone has no files (the optimizer's tier)
            options = Options(**{k: v for k, v in kw.items() if k not in _HYPER})
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state = defaultdict(dict)
        # The engine holds its owner (this object) weakly, as it holds the optimizer.
        self.engine = OffloadEngine([g["params"] for g in self.param_groups],
                                    [g["amsgrad"] for g in self.param_groups],
                                    state_dtypes=[g["state_dtype"] for g in self.param_groups],
                                    options=options, owner=weakref.ref(self))

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        self.engine.step(self.param_groups, self.state, grad_scale=grad_scale)

    def zero_grad(self) -> None:
        self.engine.drop_freed_grads()
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None
        self.engine.zero_grad()
