"""Test support, not part of the optimizer: the asynchronous simulated device
(sim_device.py) and the switch that runs optimizers on it.

    from offload_adam.testing import AsyncSimDevice, simulated

    sim = AsyncSimDevice(seed=0)
    with simulated(sim), sim.watch():
        opt = offload_adam.AdamW(cpu_params)   # every param through the engine
        ...                                    # train as usual
    sim.check()                                # raises the ordering violations seen
    sim.close()

settle(opt) waits for the CPU steps an optimizer has queued (step_in_backward
starts them during backward), for tests that read its state before step().
state_files(opt) and ring_buffers(opt) show an optimizer's state files
(state_dirs=) to the tests that check or damage them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ..engine.device import host_stand_in
from .sim_device import AsyncSimDevice, SimEvent

__all__ = ["AsyncSimDevice", "SimEvent", "ring_buffers", "settle", "simulated", "state_files"]


@contextlib.contextmanager
def simulated(device: Optional[AsyncSimDevice]) -> Iterator[Optional[AsyncSimDevice]]:
    """Optimizers built inside this block step their CPU params the way they
    step CUDA params (every param in the engine, every transfer through
    `device`): the GPU's path, on CPU. simulated(None) builds them the normal
    way again inside an outer block (a reference run)."""
    with host_stand_in(device):
        yield device


def settle(optimizer) -> None:
    """Waits until every CPU step `optimizer` has queued has run: with
    step_in_backward, those started during backward. A test may then read or
    save the state between backward and step() and find it whole. (The one
    place test support looks inside an optimizer: its engine is not public.)"""
    engine = getattr(optimizer, "_engine", None)
    if engine is not None:
        engine.drain()


def _file_store(optimizer):
    store = getattr(optimizer, "_store", None)
    files = getattr(store, "state", None)
    if files is None:
        raise ValueError("offload_adam.testing: this optimizer keeps its state in RAM "
                         "(it was built without state_dirs=)")
    return store


def state_files(optimizer):
    """The state files of an optimizer built with state_dirs= (nvme.NvmeState: its
    layout `spec`, one bucket per `spec.buckets` entry; the committed `step`; the slots
    and extents, to find a byte in the files)."""
    return _file_store(optimizer).state


def ring_buffers(optimizer) -> list:
    """The ring buffers (nvme.AlignedBuffer) its state files stream through: all the
    host memory its state holds (the engine's transfer buffers aside)."""
    pipeline = _file_store(optimizer).pipeline
    return list(pipeline.buffers) if pipeline is not None else []
