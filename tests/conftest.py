"""Shared pytest setup for the optimizer tests."""
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


@pytest.fixture(scope="session")
def kernels():
    """The compiled module, built once per session (a JIT build takes ~1 min)."""
    from offload_adam._build import load_kernels

    return load_kernels()


@pytest.fixture(params=["live-grad", "copied-grad"])
def grad_path(request, monkeypatch):
    """The two ways the engine gets a grad. bf16/fp16 CPU params hand the kernel
    the live p.grad; a GPU copies each grad to the host during backward and
    checks the copy (version, identity, fingerprint) when it is reused. Forcing
    the copy on CPU runs the GPU's logic without one."""
    from offload_adam.engine_device import HostDevice

    monkeypatch.setattr(HostDevice, "aliases_grads", request.param == "live-grad")
    return request.param
