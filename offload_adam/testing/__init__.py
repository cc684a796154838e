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
state_files(opt) and ring_buffers(opt) show an optimizer's state files
(state_dirs=) to the tests that check or damage them; in_files(opt) says whether
it has them, files_stepped_early(opt) how many params its files' pass stepped
during the backward just run (step_in_backward: nothing shows in its state
before step() commits).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from ..engine.device import host_stand_in
from ..options import state_root
from .sim_device import AsyncSimDevice, SimEvent

__all__ = ["AsyncSimDevice", "SimEvent", "files_stepped_early", "in_files", "ring_buffers",
           "settle", "simulated", "state_files", "state_in_files"]


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


def in_files(optimizer) -> bool:
    """Whether the optimizer keeps its state in files (state_dirs=)."""
    return getattr(getattr(optimizer, "_store", None), "state", None) is not None


def files_stepped_early(optimizer) -> int:
    """How many params the files' pass stepped during the backward just run
    (step_in_backward with state_dirs=), once the steps it queued have run."""
    settle(optimizer)
    early = _file_store(optimizer)._early
    return len({id(rec.param) for rec in (early.stepped if early is not None else ())})


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
