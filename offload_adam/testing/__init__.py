"""Test support, not part of the optimizer: the asynchronous simulated device
(sim_device.py) and the switch that runs optimizers on it.

    from offload_adam.testing import AsyncSimDevice, simulated

    sim = AsyncSimDevice(seed=0)
    with simulated(sim), sim.watch():
        opt = offload_adam.AdamW(cpu_params)   # every param through the engine
        ...                                    # train as usual
    sim.check()                                # raises the ordering violations seen
    sim.close()
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ..engine.device import host_stand_in
from .sim_device import AsyncSimDevice, SimEvent

__all__ = ["AsyncSimDevice", "SimEvent", "simulated"]


@contextlib.contextmanager
def simulated(device: Optional[AsyncSimDevice]) -> Iterator[Optional[AsyncSimDevice]]:
    """Optimizers built inside this block step their CPU params the way they
    step CUDA params (every param in the engine, every transfer through
    `device`): the GPU's path, on CPU. simulated(None) builds them the normal
    way again inside an outer block (a reference run)."""
    with host_stand_in(device):
        yield device
