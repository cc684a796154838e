"""The device interface (offload_adam/engine/device.py): the host device, the
Python side of CudaDevice that runs without a GPU, and choosing the device."""
import pytest
import torch

import offload_adam
from offload_adam.engine import device as engine_device
from offload_adam.engine.device import HostDevice, Transfer, current_host_stand_in, make_device
from offload_adam.params import one_device
from offload_adam.testing import AsyncSimDevice, simulated


def test_host_device_copies_on_the_spot():
    dev = HostDevice(torch.device("cpu"))
    a, b = torch.zeros(3), torch.zeros(2)
    t = dev.d2h([a, b], [torch.ones(3), torch.full((2,), 2.0)])
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((2,), 2.0))
    assert t.seconds() >= 0 and dev.fence() is None
    result, done = dev.fetch(torch.tensor([True, False]))
    assert result() == [True, False] and done is None


def test_transfer_seconds_is_computed_once():
    cpu = Transfer(1.0, 3.5)
    assert cpu.seconds() == 2.5
    calls = []
    timed = Transfer(0.0, waiter=lambda: calls.append(1) or 0.25)
    assert timed.seconds() == 0.25 and timed.seconds() == 0.25
    assert calls == [1]  # waited for once, then remembered


class FakeCudart:
    def __init__(self, error):
        self.error, self.calls, self.cleared = error, [], 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.error

    def cudaGetLastError(self):
        self.cleared += 1

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))


def test_register_and_unregister_call_cudart(monkeypatch):
    """The Python side of page-locking (the calls themselves need a GPU): the
    exact byte count, and a failure clears CUDA's last error before raising."""
    t = torch.empty(6, dtype=torch.bfloat16)
    ok = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: ok)
    engine_device._register(t)
    engine_device._unregister(t)
    assert ok.calls == [("register", t.data_ptr(), 12, 0), ("unregister", t.data_ptr())]
    assert ok.cleared == 0
    bad = FakeCudart(3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: bad)
    with pytest.raises(RuntimeError, match="cudaHostRegister failed with error 3"):
        engine_device._register(t)
    assert bad.cleared == 1

    def gone():
        raise RuntimeError("interpreter shutting down")

    monkeypatch.setattr(torch.cuda, "cudart", gone)
    engine_device._unregister(t)  # swallowed


def test_make_device_and_one_device():
    assert isinstance(make_device(torch.device("cpu")), HostDevice)
    with pytest.raises(ValueError, match="params on meta are not supported"):
        make_device(torch.device("meta"))
    with pytest.raises(ValueError, match="several devices"):
        one_device([torch.zeros(2), torch.zeros(2, device="meta")])
    # (a CUDA + CPU mix is checked in tests/cuda; meta is refused even earlier)
    with pytest.raises((ValueError, NotImplementedError), match="devices|meta"):
        offload_adam.AdamW([torch.nn.Parameter(torch.zeros(2)),
                            torch.nn.Parameter(torch.zeros(2, device="meta"))])


def test_simulated_sends_cpu_params_to_the_engine(kernels):
    sim = AsyncSimDevice(seed=0)
    try:
        assert current_host_stand_in() is None
        with simulated(sim):
            assert current_host_stand_in() is sim
            assert make_device(torch.device("cpu"), current_host_stand_in()) is sim
            opt = offload_adam.AdamW([torch.nn.Parameter(torch.zeros(3))])
        assert current_host_stand_in() is None
        # the engine's host memory is pinned on sim, and it profiles its steps
        pinned = sim.pinned()
        assert pinned and opt.host_bytes() > 0
        plain = offload_adam.AdamW([torch.nn.Parameter(torch.zeros(3))])
        for o in (opt, plain):
            o.param_groups[0]["params"][0].grad = torch.ones(3)
            o.step()
        assert opt.last_step_profile is not None
        # fp32 CPU params: in place (nothing pinned, no profile)
        assert plain.last_step_profile is None and sim.pinned() == pinned
    finally:
        sim.close()
