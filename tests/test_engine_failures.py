"""The offload engine when things go wrong: worker errors, interrupts, a backward
that raises halfway, too little host memory, failed pinning, mixed devices."""
import _thread
import signal
import threading
import time
import warnings

import pytest
import torch

import offload_adam
from small_mlp import loss_of, make_model
from offload_adam import engine as engine_module
from offload_adam.engine_device import device_for
from offload_adam.engine_host_memory import HostArenas, check_host_memory
from offload_adam.engine_worker import Worker

# Every test runs on both grad paths (conftest.grad_path).
pytestmark = pytest.mark.usefixtures("grad_path")

BF16 = torch.bfloat16


class Boom(ValueError):
    pass


class FailingKernels:
    """Delegates to the real kernels, but adam_step raises once when armed."""

    def __init__(self, inner):
        self.inner, self.armed = inner, False

    def adam_step(self, *args):
        if self.armed:
            self.armed = False
            raise Boom("kernel failed")
        return self.inner.adam_step(*args)

    def grad_sq_sums(self, *args):
        return self.inner.grad_sq_sums(*args)


def test_worker_error_surfaces_with_the_original_exception(kernels, monkeypatch):
    failing = FailingKernels(kernels)
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.0001)
    opt._engine._kernels = lambda: failing
    loss_of(model, 0).backward()
    failing.armed = True
    with pytest.raises(Boom, match="kernel failed"):
        opt.step()
    # the engine is usable afterwards
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()
    for p in model.parameters():
        assert torch.equal(p, opt.state[p]["master_param"].to(BF16))


def test_worker_drain_survives_keyboard_interrupt():
    w = Worker()
    ran = []
    w.submit(lambda: time.sleep(0.5) or ran.append(1))
    w.submit(lambda: ran.append(2))  # cancelled by the interrupt
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        w.drain()
    assert ran == [1]
    w.submit(lambda: ran.append(3))  # no deadlock: the next drain works
    w.drain()
    assert ran == [1, 3]
    w.close()


def _slow_kernels(opt, seconds):
    real = opt._engine._kernels

    class Slow:
        def adam_step(self, *args):
            time.sleep(seconds)
            return real().adam_step(*args)

        def grad_sq_sums(self, *args):
            return real().grad_sq_sums(*args)

    opt._engine._kernels = lambda: Slow()
    return real


def _interrupt_main(*delays):
    for d in delays:
        threading.Timer(d, _thread.interrupt_main).start()


@pytest.mark.parametrize("interrupts", [1, 2])
def test_keyboard_interrupt_in_step_then_training_goes_on(kernels, interrupts):
    """One ^C in step(): every bucket is still stepped, then KeyboardInterrupt
    (the step is all or nothing). A second ^C gives up on the buckets not
    started; each param is then stepped or not, never half. Either way the
    next iteration runs."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.0001)
    real = _slow_kernels(opt, 0.3)
    loss_of(model, 0).backward()
    _interrupt_main(*[0.1, 0.5][:interrupts])
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    steps = [float(opt.state[p]["step"]) if opt.state.get(p) else 0.0
             for p in model.parameters()]
    if interrupts == 1:
        assert steps == [1.0] * len(steps)
    else:
        assert 0 < sum(steps) < len(steps) and set(steps) <= {0.0, 1.0}
    for p in model.parameters():
        if opt.state.get(p) and float(opt.state[p]["step"]) == 1.0:
            assert torch.equal(p, opt.state[p]["master_param"].to(BF16))
    opt._engine._kernels = real
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()  # returns: nothing left waiting


class FailHalfway(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("backward failed")


def test_backward_that_raises_halfway(kernels):
    """Hooks fired for the last layer only; the next iteration is exact."""
    results = []
    for broken in (True, False):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.0001)
        if broken:
            x = torch.randn(5, 8).to(BF16)
            h = FailHalfway.apply(model[1](model[0](x)))
            with pytest.raises(Boom):
                model[2](h).float().sum().backward()
            assert model[2].weight.grad is not None and model[0].weight.grad is None
            opt.zero_grad()
        for it in range(2):
            loss_of(model, it).backward()
            opt.step()
            opt.zero_grad()
        results.append(model)
    for p, q in zip(*(m.parameters() for m in results)):
        assert torch.equal(p, q)


def test_host_memory_check_names_both_numbers():
    with pytest.raises(MemoryError, match=r"needs .*\(1000 bytes\).*only .*\(10 bytes\)"):
        check_host_memory(1000, available=10)
    check_host_memory(10, available=1000)
    model = make_model()
    with pytest.raises(MemoryError, match="available"):
        engine_module.OffloadEngine([list(model.parameters())], [False], decoupled=True,
                                    available_host_bytes=100)


def test_failed_pin_falls_back_to_pageable_with_a_warning():
    arenas = HostArenas(pin=True)
    off = arenas.reserve("state", torch.float32, 10)
    with pytest.warns(RuntimeWarning, match="could not pin .*pageable"):
        arenas.allocate()  # no CUDA here: cudaHostRegister fails
    assert not arenas.pinned
    v = arenas.view("state", torch.float32, off, (2, 5))
    v.fill_(1.0)
    assert v.sum() == 10


def test_engine_with_pinning_requested_still_trains(kernels, monkeypatch):
    from offload_adam import engine_device
    monkeypatch.setattr(engine_device.HostDevice, "pins_memory", True)
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = offload_adam.AdamW(model.parameters())
    assert any("pageable" in str(w.message) for w in caught)
    loss_of(model, 0).backward()
    opt.step()
    assert not opt._engine.pinned()


def test_mixed_devices_are_a_clear_error():
    a = torch.zeros(2)
    b = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="several devices"):
        device_for([a, b])
    # (a CUDA + CPU mix is checked in tests/cuda/test_engine_cuda.py; meta is
    # refused even earlier, as an unsupported device)
    with pytest.raises((ValueError, NotImplementedError), match="devices|meta"):
        offload_adam.AdamW([torch.nn.Parameter(a), torch.nn.Parameter(b)])


def test_bad_engine_options():
    p = torch.nn.Parameter(torch.zeros(2, dtype=BF16))
    with pytest.raises(ValueError, match="bucket_mb"):
        offload_adam.AdamW([p], bucket_mb=0)
    with pytest.raises(ValueError, match="num_threads"):
        offload_adam.AdamW([p], num_threads=0)
    with pytest.raises(ValueError, match="overlap=True"):
        offload_adam.AdamW([p], overlap=False, free_grads_after_copy=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        offload_adam.AdamW([p], max_grad_norm=-1.0)
    with pytest.raises(NotImplementedError, match="2-norm"):
        offload_adam.AdamW([p]).clip_grad_norm_(1.0, norm_type=1.0)


def test_interrupts_deferred_holds_the_first_and_nests():
    """The mechanism behind an all-or-nothing step() under Ctrl-C."""
    from offload_adam.engine_worker import interrupts_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred() as deferring:
            assert deferring
            _thread.interrupt_main()
            time.sleep(0.05)  # the handler runs here and holds it
            with interrupts_deferred() as inner:  # nested: shares the hold
                assert inner
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # a second one is raised at once
        with interrupts_deferred():
            _thread.interrupt_main()
            time.sleep(0.05)
            _thread.interrupt_main()
            time.sleep(0.05)
            reached.append("not reached")
    assert reached == ["end of block"]
    off_main = []
    t = threading.Thread(target=lambda: off_main.append(interrupts_deferred().__enter__()))
    t.start()
    t.join()
    assert off_main == [False]  # no signals there: nothing to defer
