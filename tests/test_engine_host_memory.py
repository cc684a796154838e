"""Host buffers (offload_adam/engine/host_memory.py): the free-memory check, and
pinning through the device with its failure path."""
import io

import pytest
import torch

from offload_adam.engine import host_memory
from offload_adam.engine.host_memory import HostArenas, available_host_bytes, check_host_memory


def test_host_memory_check_names_both_numbers():
    with pytest.raises(MemoryError, match=r"needs .*\(1000 bytes\).*only .*\(10 bytes\)"):
        check_host_memory(1000, available=10)
    check_host_memory(10, available=1000)


def test_available_host_bytes_unreadable_or_missing(monkeypatch):
    """No /proc/meminfo (or no MemAvailable line): unknown, so no check."""
    def unreadable(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(host_memory, "open", unreadable, raising=False)
    assert available_host_bytes() is None
    check_host_memory(1 << 62)  # unknown: not refused
    monkeypatch.setattr(host_memory, "open", lambda *a, **k: io.StringIO("MemTotal: 1 kB\n"),
                        raising=False)
    assert available_host_bytes() is None
    monkeypatch.setattr(host_memory, "open",
                        lambda *a, **k: io.StringIO("MemTotal: 9 kB\nMemAvailable: 3 kB\n"),
                        raising=False)
    assert available_host_bytes() == 3 * 1024
    with pytest.raises(MemoryError, match=r"\(3072 bytes\) is available"):
        check_host_memory(4096)


class PinningDevice:
    """Records pin/unpin; the `fail_on`-th pin (from 1) raises."""

    pins_memory = True

    def __init__(self, fail_on=None):
        self.fail_on, self.pinned, self.unpinned = fail_on, [], []

    def pin(self, t):
        if len(self.pinned) + 1 == self.fail_on:
            raise RuntimeError("cudaHostRegister failed with error 2")
        self.pinned.append(t.data_ptr())
        return True

    def unpin(self, t):
        self.unpinned.append(t.data_ptr())


def _arenas(device):
    arenas = HostArenas(device)
    offsets = (arenas.reserve("state", torch.float32, 10),
               arenas.reserve("grad", torch.bfloat16, 5),
               arenas.reserve("empty", torch.float16, 0))  # nothing to pin
    return arenas, offsets


def test_pinning_registers_each_arena_and_releases_all():
    device = PinningDevice()
    arenas, (a, b, _) = _arenas(device)
    arenas.allocate()
    assert arenas.pinned and len(device.pinned) == 2
    v = arenas.view("state", a, (2, 5))
    v.fill_(2.0)
    assert float(arenas.view("state", a, (10,)).sum()) == 20.0
    assert arenas.view("grad", b, (5,)).dtype == torch.bfloat16
    arenas.release()
    assert sorted(device.unpinned) == sorted(device.pinned) and not arenas.pinned
    arenas.release()  # nothing left to unpin
    assert len(device.unpinned) == 2


def test_failed_pinning_falls_back_to_pageable_with_a_warning():
    device = PinningDevice(fail_on=2)
    arenas, (a, _, _) = _arenas(device)
    with pytest.warns(RuntimeWarning, match=r"could not pin .*error 2.*pageable"):
        arenas.allocate()
    assert not arenas.pinned
    assert len(device.pinned) == 1 and device.unpinned == device.pinned
    arenas.view("state", a, (10,)).fill_(1.0)  # pageable, still usable


def test_arenas_refuse_two_dtypes_in_one_role():
    arenas = HostArenas(PinningDevice())
    arenas.reserve("state", torch.float32, 4)
    with pytest.raises(ValueError, match="holds torch.float32"):
        arenas.reserve("state", torch.bfloat16, 4)


def test_every_view_is_a_whole_number_of_cache_lines_apart():
    arenas = HostArenas(PinningDevice())
    offsets = [arenas.reserve("x", torch.bfloat16, n) for n in (1, 33, 32, 100)]
    assert offsets == [0, 32, 96, 128]  # 33 elements take two lines
    arenas.allocate()
    assert all(arenas.view("x", o, (1,)).data_ptr() % 64 == 0 for o in offsets)
