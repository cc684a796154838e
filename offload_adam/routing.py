"""Where each param is stepped and where its state lives: decided once, here, when an
optimizer is built.

    stepper   "cpu": the fused kernel in place on the live param and grad (cpu_step.py), or
              "engine": the offload engine's pipeline (engine/), which streams grads to
              the host and params back: every CUDA param; a bf16/fp16 CPU param when an
              option needs the pipeline (step_in_backward, free_grads_after_copy); every
              param of an optimizer built inside offload_adam.testing.simulated() (the
              tests' asynchronous CPU device, the GPU's path)
    store     "ram": optimizer.state (in place) and the engine's host arenas
              (state_store.RamStore), or "files": every param's state in the files
              under state_dirs= (nvme_tier.FileStore), whichever its stepper

The optimizer builds the store the routing names, and the store hands each bucket of
state to the stepper each param's routing names.
"""

from __future__ import annotations

import torch

from .engine.device import current_host_stand_in, make_device
from .params import one_device


class Routing:
    """The routing of one optimizer's params (see above). `pipeline`: an option needs the
    engine's pipeline; `files`: the state lives in files (state_dirs=)."""

    def __init__(self, pipeline: bool, files: bool = False):
        self.pipeline = bool(pipeline)
        self.files = bool(files)
        self.stand_in = current_host_stand_in()

    @classmethod
    def of(cls, options) -> "Routing":
        """The routing options.py's `options` ask for."""
        return cls(options.needs_pipeline, options.state_dirs is not None)

    @property
    def store(self) -> str:
        """Where every param's state lives: "ram" or "files"."""
        return "files" if self.files else "ram"

    def in_engine(self, p: torch.Tensor) -> bool:
        """Whether the engine steps p (else the CPU stepper, in place)."""
        if p.device.type != "cpu" or self.stand_in is not None:
            return True
        return self.pipeline and p.dtype is not torch.float32

    def in_place(self, p: torch.Tensor) -> bool:
        return not self.in_engine(p)

    def device(self, params):
        """The device interface for the engine's `params` (all on one device)."""
        return make_device(one_device(params), self.stand_in)
