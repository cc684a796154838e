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
