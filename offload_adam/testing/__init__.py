"""Test support, not part of the optimizer: the asynchronous simulated device
(sim_device.py), the switch that runs optimizers on it, and one that keeps
their state in files.

    from offload_adam.testing import AsyncSimDevice, simulated

    sim = AsyncSimDevice(seed=0)
    with simulated(sim), sim.watch():
        opt = offload_adam.AdamW(cpu_params)   # every param through the engine
        ...                                    # train as usual
    sim.check()                                # raises the ordering violations seen
    sim.close()

    from offload_adam.testing import state_in_files

    with state_in_files(tmp_dir):
        opt = offload_adam.AdamW(params)   # as if given state_dirs=<a new folder in tmp_dir>

state_in_files(root) gives every optimizer built inside it with state_dirs=None
a new directory of its own under `root` (an existing directory) as its
state_dirs (each its own: two optimizers on one directory refuse each other).
Nested in simulated(), the engine steps over the files' buckets.

settle(opt) waits for the CPU steps an optimizer has queued (step_in_backward
starts them during backward), for tests that read its state before step().
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from ..engine.device import host_stand_in
from ..options import state_root
from .sim_device import AsyncSimDevice, SimEvent

__all__ = ["AsyncSimDevice", "SimEvent", "settle", "simulated", "state_in_files"]


@contextlib.contextmanager
def simulated(device: Optional[AsyncSimDevice]) -> Iterator[Optional[AsyncSimDevice]]:
    """Optimizers built inside this block step their CPU params the way they
    step CUDA params (every param in the engine, every transfer through
    `device`): the GPU's path, on CPU. simulated(None) builds them the normal
    way again inside an outer block (a reference run)."""
    with host_stand_in(device):
        yield device


@contextlib.contextmanager
def state_in_files(root) -> Iterator[Optional[str]]:
    """Optimizers built inside this block with state_dirs=None keep their state in
    files, each in a new directory under `root`. state_in_files(None) builds them
    the normal way again inside an outer block (a reference run)."""
    with state_root(None if root is None else os.fspath(root)) as where:
        yield where


def settle(optimizer) -> None:
    """Waits until every CPU step `optimizer` has queued has run: with
    step_in_backward, those started during backward. A test may then read or
    save the state between backward and step() and find it whole. (The one
    place test support looks inside an optimizer: its engine is not public.)"""
    engine = getattr(optimizer, "_engine", None)
    if engine is not None:
        engine.drain()
