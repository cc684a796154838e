"""Shared pytest setup: the kernels, and the two ways the optimizer steps a param.

`path` runs a test both ways: "in-place" (CPU params stepped by the kernel
directly, reading the live p.grad) and through the offload engine on the
asynchronous simulated device (offload_adam.testing.AsyncSimDevice: the GPU's
path, with copies that land late and CUDA's ordering rules checked), with
several seeds of random latency and once with every copy held as late as
CUDA allows. The device's violations fail the test.

A name ending in "+files" keeps the state in files instead of host RAM
(offload_adam.testing.state_in_files: each optimizer built with
state_dirs=None gets a new directory of the test's own), so that the NVMe tier
is held to the same contract: `path.files` says so. path.outside() builds the
reference in RAM, in place.

OFFLOAD_ADAM_SIM_SEEDS=N sets how many random seeds (default 1: with "latest", two
orderings per test; each run's random latencies differ with the threads' timing anyway);
a long soak is `OFFLOAD_ADAM_SIM_SEEDS=50 bash scripts/run_tests.sh tests/test_engine.py`.
`SIMS` (the seeds and "latest") is also the streaming tests' `device` fixture.
"""
import contextlib
import errno
import os

import pytest

try:
    from hypothesis import settings

    # Property tests: a modest number of examples, no per-example deadline (the
    # first example may wait for the kernel build).
    settings.register_profile("offload_adam", max_examples=30, deadline=None)
    # HYPOTHESIS_PROFILE=thorough for a longer search (minutes, not for every run).
    settings.register_profile("thorough", max_examples=500, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "offload_adam"))
except ImportError:  # hypothesis is optional; test_properties.py skips without it
    pass

SIM_SEEDS = int(os.environ.get("OFFLOAD_ADAM_SIM_SEEDS", "1"))
SIMS = [f"sim-seed{s}" for s in range(SIM_SEEDS)] + ["sim-latest"]
FILES_PATHS = ["in-place+files", "sim-latest+files"]


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in the main thread during the test, as in an
    interactive Python, whatever the suite was started under: a background job
    (`bash scripts/run_tests.sh &`) or nohup starts it with SIGINT ignored, and then
    _thread.interrupt_main() does nothing. The tests of ^C set the handler they rely on."""
    import signal
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)
PATHS = ["in-place"] + SIMS + FILES_PATHS


@pytest.fixture(scope="session")
def kernels():
    """The compiled module, built once per session (a JIT build takes ~1 min)."""
    from offload_adam._build import load_kernels

    return load_kernels()


class Path:
    """Where the test's optimizers run; `sim` is the simulated device or None;
    `files`: their state in files (state_dirs=) instead of host RAM."""

    def __init__(self, name, sim=None, files=False):
        self.name, self.sim, self.files = name, sim, files

    @property
    def engine(self) -> bool:
        return self.sim is not None

    @contextlib.contextmanager
    def outside(self):
        """Builds optimizers the normal way inside it (a reference run)."""
        from offload_adam.testing import simulated, state_in_files

        with simulated(None), state_in_files(None):
            yield


def disk_full_at(monkeypatch, module, n):
    """module.open_direct (the state store's, the param files') raises ENOSPC at its n-th
    call, as a disk that fills up; returns the list of the paths it was asked for."""
    import errno
    real, opened = module.open_direct, []

    def open_direct(path, create=False, size=0, ranges=None):
        opened.append(path)
        if len(opened) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, create=create, size=size, ranges=ranges)
    monkeypatch.setattr(module, "open_direct", open_direct)
    return opened


def writes_fail_on(monkeypatch, fds):
    """direct_io._write raises ENOSPC for the descriptors `fds` (a disk full for those
    files alone); returns the real _write, to put back."""
    from offload_adam.nvme import direct_io
    real = direct_io._write

    def full(fd, view, offset):
        if fd in fds:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, view, offset)
    monkeypatch.setattr(direct_io, "_write", full)
    return real


def holes_supported(tmp_path) -> bool:
    """Whether tmp_path's file system gives back a punched range (direct_io.punch_hole)."""
    from offload_adam.nvme.direct_io import allocated_bytes, punch_hole
    path = tmp_path / "probe"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        return punch_hole(fd, 0, 65536) and allocated_bytes(str(path)) < 65536
    finally:
        os.close(fd)
        path.unlink()


def sim_path(name, files_root=None):
    """A context yielding a Path for `name` (one of PATHS); a "+files" name keeps
    the state in new directories under `files_root`."""
    from offload_adam.testing import AsyncSimDevice, simulated, state_in_files

    @contextlib.contextmanager
    def run():
        base, files = name.removesuffix("+files"), name.endswith("+files")
        with state_in_files(files_root if files else None):
            if base == "in-place":
                yield Path(name, files=files)
                return
            latest = base == "sim-latest"
            sim = AsyncSimDevice(seed=0 if latest else int(base[len("sim-seed"):]),
                                 latency="latest" if latest else "random")
            try:
                with simulated(sim), sim.watch():
                    yield Path(name, sim, files)
                sim.check()
            finally:
                sim.close()
    return run()


@pytest.fixture(params=PATHS)
def path(request, kernels, tmp_path_factory):
    root = tmp_path_factory.mktemp("state") if request.param.endswith("+files") else None
    with sim_path(request.param, root) as p:
        yield p


@pytest.fixture
def sim(kernels):
    """An engine-only test: on the simulated device (random latency, seed 0)."""
    with sim_path("sim-seed0") as p:
        yield p
