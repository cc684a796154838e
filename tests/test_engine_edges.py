"""The offload engine's less travelled branches, all on CPU: constructor checks
reachable only by building OffloadEngine directly, num_threads, close(),
hooks that find no grad, step_in_backward with amsgrad / a dead owner / a
grad scale / a failing kernel, sparse and non-contiguous inputs, GradScaler
with freed or unverified grads, and the host-memory and device helpers (pin
bookkeeping, /proc/meminfo, Transfer timing). The goal is that every line of
the pipeline that is not a CUDA call runs in the CPU tests."""
import gc
import io
import weakref

import pytest
import torch

import offload_adam
from small_mlp import loss_of, make_model
from offload_adam import engine as engine_module
from offload_adam import engine_host_memory as host_memory
from offload_adam.engine_device import HostDevice, Transfer, make_device
from offload_adam.engine_host_memory import HostArenas, available_host_bytes, check_host_memory

BF16 = torch.bfloat16
# bucket_mb this small puts every param in a bucket of its own; eps this large
# makes a grad left scaled change Adam's update.
OPTS = dict(lr=3e-3, weight_decay=0.1, eps=1e-2, bucket_mb=0.0001)


def train(model, opt, iters, start=0):
    for it in range(start, start + iters):
        loss_of(model, it).backward()
        opt.step()
        opt.zero_grad()


def steps_of(opt, model):
    return [float(opt.state[p]["step"]) if opt.state.get(p) else 0.0
            for p in model.parameters()]


def assert_param_is_master_rounded(opt, model):
    for p in model.parameters():
        if opt.state.get(p):
            assert torch.equal(p, opt.state[p]["master_param"].to(BF16))


def assert_same_run(a, b, keys=("master_param", "exp_avg", "exp_avg_sq")):
    (m1, o1), (m2, o2) = a, b
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        for key in keys:
            assert torch.equal(o1.state[p][key], o2.state[q][key]), key


class RecordingKernels:
    """The real kernels; records the thread count of every call and can make
    the n-th adam_step call raise (`fail_at`, counted from 1)."""

    def __init__(self, inner, fail_at=None):
        self.inner, self.fail_at = inner, fail_at
        self.calls = 0
        self.threads = []

    def adam_step(self, *args):
        self.calls += 1
        self.threads.append(args[-1])
        if self.calls == self.fail_at:
            raise Boom("kernel failed")
        return self.inner.adam_step(*args)

    def grad_sq_sums(self, grads, threads):
        self.threads.append(threads)
        return self.inner.grad_sq_sums(grads, threads)


class Boom(ValueError):
    pass


# ---- construction and lifetime ---------------------------------------------------

def test_engine_rejects_step_in_backward_without_overlap_or_owner():
    """The optimizer checks overlap itself; the engine repeats both checks for
    anyone building it directly (the owner gives the early step its groups)."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=BF16))
    with pytest.raises(ValueError, match="step_in_backward=True needs overlap=True"):
        engine_module.OffloadEngine([[p]], [False], decoupled=True, overlap=False,
                                    step_in_backward=True)
    with pytest.raises(ValueError, match="needs the owning optimizer"):
        engine_module.OffloadEngine([[p]], [False], decoupled=True, step_in_backward=True)


def test_num_threads_option_reaches_every_kernel_call(kernels, grad_path):
    """num_threads is what the step and norm kernels get (not
    torch.get_num_threads()), and the result does not depend on it."""
    option = torch.get_num_threads() + 1  # differs from the default anywhere
    runs = []
    for threads in (option, None):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), num_threads=threads, **OPTS)
        rec = RecordingKernels(kernels)
        opt._engine._kernels = lambda rec=rec: rec
        for it in range(2):
            loss_of(model, it).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        expected = threads or torch.get_num_threads()
        assert rec.threads and set(rec.threads) == {expected}
        runs.append((model, opt))
    assert_same_run(*runs)


def test_close_removes_hooks_and_ends_the_worker(kernels, monkeypatch):
    """close() does what dropping the optimizer does: no hook fires afterwards
    and the worker thread exits. A second close() is a no-op."""
    monkeypatch.setattr(HostDevice, "aliases_grads", False)  # the GPU's path has a worker
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    engine = opt._engine
    thread = engine._worker._thread
    engine.close()
    assert all(s.hook is None for s in engine.slots)
    thread.join(timeout=10)
    assert not thread.is_alive()
    loss_of(model, 0).backward()  # the hooks are gone: nothing is copied
    assert all(s.copy_token == 0 for s in engine.slots)
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="engine was closed"):  # not a hang
        opt.step()
    engine.close()


def test_hook_that_finds_no_grad_does_nothing(kernels, grad_path):
    """A post-accumulate-grad hook registered before the optimizer's may free
    the grad (an optimizer-in-backward pattern): the engine's hook then has
    nothing to copy, and step() leaves that param alone."""
    model = make_model()
    dropped = model[2].weight
    before = dropped.detach().clone()
    dropped.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    loss_of(model, 0).backward()
    slot = opt._engine._by_param[dropped]
    assert dropped.grad is None and slot.copy_token == 0
    assert all(s.copy_token for s in opt._engine.slots if s is not slot)
    opt.step()
    assert not opt.state.get(dropped)
    assert torch.equal(dropped, before)
    assert steps_of(opt, model) == [1.0, 1.0, 0.0, 1.0]


# ---- step_in_backward ----------------------------------------------------------------
# (step_in_backward always copies the grads: both grad paths are the same one)

def test_dead_owner_starts_no_early_step(kernels):
    """The engine's hooks outlive the optimizer while someone holds the
    engine; with the owner gone (no groups, no state) they only copy the grads
    and start nothing. The engine still steps when driven directly."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
    train(model, opt, 1)
    engine, groups, state = opt._engine, opt.param_groups, opt.state
    owner = weakref.ref(opt)
    del opt
    gc.collect()
    assert owner() is None
    loss_of(model, 1).backward()
    assert all(s.copy_token and not s.early_token for s in engine.slots)
    engine.step(groups, state)
    assert [float(state[p]["step"]) for p in model.parameters()] == [2.0] * 4
    for p in model.parameters():
        assert torch.equal(p, state[p]["master_param"].to(BF16))


@pytest.mark.parametrize("when", ["from the start", "turned on after step 1"])
def test_amsgrad_early_start_is_bitwise_equal_to_the_default(kernels, when):
    """amsgrad with steps started in backward, also when amsgrad is switched on
    later (its max_exp_avg_sq buffers are then added by the early start)."""
    runs = []
    for early in (False, True):
        model = make_model()
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=early,
                                 amsgrad=when == "from the start", **OPTS)
        started = []
        for it in range(4):
            if it == 1:
                for g in opt.param_groups:
                    g["amsgrad"] = True
            loss_of(model, it).backward()
            started.append(sum(1 for s in opt._engine.slots if s.early_token))
            opt.step()
            opt.zero_grad()
        assert started == ([0, 4, 4, 4] if early else [0, 0, 0, 0])
        runs.append((model, opt))
    assert_same_run(*runs, keys=("master_param", "exp_avg", "exp_avg_sq",
                                 "max_exp_avg_sq", "step"))
    # amsgrad really ran: max_exp_avg_sq is not exp_avg_sq
    m, o = runs[1]
    assert any(not torch.equal(o.state[p]["max_exp_avg_sq"], o.state[p]["exp_avg_sq"])
               for p in m.parameters())


def test_grad_scale_after_early_steps_is_an_error(kernels):
    """The early steps used the grads unscaled: a step() that asks for a scale
    (clipping coefficient, 1/loss scale) cannot be honoured and says so."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
    train(model, opt, 1)
    loss_of(model, 1).backward()
    assert any(s.early_token for s in opt._engine.slots)
    with pytest.raises(RuntimeError, match=r"scales the grads by 0\.5 .*stepped unscaled"
                       r".*The Adam step of 4 params already ran"):
        opt._engine.step(opt.param_groups, opt.state, grad_scale=0.5)
    assert steps_of(opt, model) == [2.0] * 4
    assert_param_is_master_rounded(opt, model)


def test_failing_early_kernel_leaves_stepped_params_consistent(kernels):
    """An early step whose kernel raises: step() re-raises that exception, the
    bucket stepped before it has its param written (param == master rounded),
    the failed and the skipped ones are not stepped, and training goes on."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
    train(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    rec = RecordingKernels(kernels, fail_at=2)  # the first bucket runs, the second fails
    opt._engine._kernels = lambda: rec
    loss_of(model, 1).backward()
    with pytest.raises(Boom, match="kernel failed"):
        opt.step()
    steps = steps_of(opt, model)
    assert sorted(steps) == [1.0, 1.0, 1.0, 2.0]
    assert_param_is_master_rounded(opt, model)
    for p, b, n in zip(model.parameters(), before, steps):
        assert torch.equal(p, b) == (n == 1.0)
    opt.zero_grad()
    train(model, opt, 2, start=2)
    assert sorted(steps_of(opt, model)) == [3.0, 3.0, 3.0, 4.0]
    assert_param_is_master_rounded(opt, model)


# ---- inputs the engine refuses ---------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False])
def test_sparse_grad_is_a_clear_error(kernels, grad_path, overlap):
    """A bf16 sparse embedding: refused naming the param's shape, from the hook
    (overlap) or from step()."""
    emb = torch.nn.Embedding(10, 4, sparse=True).to(BF16)
    opt = offload_adam.AdamW(emb.parameters(), overlap=overlap)
    match = r"param of shape \[10, 4\] has a sparse grad"
    if overlap:
        with pytest.raises(RuntimeError, match=match):
            emb(torch.tensor([1, 2])).float().sum().backward()
    else:
        emb(torch.tensor([1, 2])).float().sum().backward()
        with pytest.raises(RuntimeError, match=match):
            opt.step()
    assert not opt.state.get(emb.weight)


def test_param_made_non_contiguous_is_a_clear_error(kernels, grad_path):
    """A bf16 CPU param is written by the kernel in place (it must stay
    contiguous); replacing p.data by a non-contiguous tensor is an error
    naming the shape, not a silently wrong write."""
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    w = model[0].weight
    w.data = w.detach().t().contiguous().t()
    assert not w.is_contiguous()
    original = w.detach().clone()
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"shape \[16, 8\] became non-contiguous"):
        opt.step()
    assert torch.equal(w, original)


# ---- GradScaler with grads the engine cannot re-read ------------------------------------

def _scaled_backward(model, scaler, it):
    scaler.scale(loss_of(model, it)).backward()


def test_unscale_after_freed_grads_is_an_error(kernels, grad_path):
    """free_grads_after_copy dropped the grads in backward, so GradScaler.unscale_
    had nothing to unscale: step() must not step with the scaled copies."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=True, **OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _scaled_backward(model, scaler, 0)
    assert all(p.grad is None for p in model.parameters())
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="after free_grads_after_copy=True freed them"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _unverified_scaler_run(monkeypatch, kernels, overlap):
    """GradScaler with unscale_ on the copy path without fingerprints: only
    invalidate_copies makes step() copy the unscaled grads again."""
    monkeypatch.setattr(HostDevice, "aliases_grads", False)
    model = make_model()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, verify_grads=False, **OPTS)
    assert not opt._engine.sees_in_place_edits
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it in range(3):
        _scaled_backward(model, scaler, it)
        scaler.unscale_(opt)
        tokens = [s.copy_token for s in opt._engine.slots]
        scaler.step(opt)
        scaler.update()
        if overlap:  # copied in backward, then once more in step()
            assert all(t and s.copy_token != t for s, t in zip(opt._engine.slots, tokens))
        opt.zero_grad()
    return model, opt


def test_unscale_without_verify_grads_copies_again(kernels, monkeypatch):
    assert_same_run(_unverified_scaler_run(monkeypatch, kernels, True),
                    _unverified_scaler_run(monkeypatch, kernels, False))


def test_opt_clip_after_unscale_without_verify_grads_is_an_error(kernels, monkeypatch):
    """Without fingerprints opt.clip_grad_norm_ after unscale_ computed its norm
    from the stale (scaled) host copies: refused, nothing stepped."""
    monkeypatch.setattr(HostDevice, "aliases_grads", False)
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = offload_adam.AdamW(model.parameters(), verify_grads=False, **OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _scaled_backward(model, scaler, 0)
    scaler.unscale_(opt)
    opt.clip_grad_norm_(0.5)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called after "
                       r"GradScaler.unscale_\(opt\)"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not any(opt.state.get(p) for p in model.parameters())


# ---- host memory ----------------------------------------------------------------------

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


def _fake_pinning(monkeypatch, fail_on=None):
    """Replaces cudaHostRegister/Unregister: records pointers; the `fail_on`-th
    registration (from 1) raises."""
    registered, unregistered = [], []

    def register(t):
        if len(registered) + 1 == fail_on:
            raise RuntimeError("cudaHostRegister failed with error 2")
        registered.append(t.data_ptr())
        return True

    monkeypatch.setattr(host_memory, "_register", register)
    monkeypatch.setattr(host_memory, "_unregister", unregistered.append)
    return registered, unregistered


def _arenas():
    arenas = HostArenas(pin=True)
    offsets = (arenas.reserve("state", torch.float32, 10),
               arenas.reserve("transfer", BF16, 5),
               arenas.reserve("transfer", torch.float16, 0))  # empty: nothing to pin
    return arenas, offsets


def test_pinning_registers_each_arena_and_unpins_all(monkeypatch):
    registered, unregistered = _fake_pinning(monkeypatch)
    arenas, (a, b, _) = _arenas()
    arenas.allocate()
    assert arenas.pinned
    assert sorted(registered) == sorted(t.data_ptr() for t in arenas._arenas.values()
                                        if t.numel())
    assert len(registered) == 2
    v = arenas.view("state", torch.float32, a, (2, 5))
    v.fill_(2.0)
    assert float(arenas.view("state", torch.float32, a, (10,)).sum()) == 20.0
    assert arenas.view("transfer", BF16, b, (5,)).dtype == BF16
    arenas.unpin()
    assert sorted(unregistered) == sorted(registered) and not arenas.pinned
    arenas.unpin()  # nothing left to unregister
    assert len(unregistered) == 2


def test_failed_pinning_unregisters_what_was_pinned(monkeypatch):
    registered, unregistered = _fake_pinning(monkeypatch, fail_on=2)
    arenas, (a, _, _) = _arenas()
    with pytest.warns(RuntimeWarning, match=r"could not pin .*error 2.*pageable"):
        arenas.allocate()
    assert not arenas.pinned
    assert len(registered) == 1 and unregistered == registered
    arenas.view("state", torch.float32, a, (10,)).fill_(1.0)  # pageable, still usable


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
    t = torch.empty(6, dtype=BF16)
    ok = FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: ok)
    assert host_memory._register(t) is True
    host_memory._unregister(t.data_ptr())
    assert ok.calls == [("register", t.data_ptr(), 12, 0), ("unregister", t.data_ptr())]
    assert ok.cleared == 0
    bad = FakeCudart(3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: bad)
    with pytest.raises(RuntimeError, match="cudaHostRegister failed with error 3"):
        host_memory._register(t)
    assert bad.cleared == 1

    def gone():
        raise RuntimeError("interpreter shutting down")

    monkeypatch.setattr(torch.cuda, "cudart", gone)
    host_memory._unregister(t.data_ptr())  # swallowed


# ---- device helpers -----------------------------------------------------------------

def test_transfer_seconds_is_computed_once():
    cpu = Transfer(1.0, 3.5)
    assert cpu.seconds() == 2.5
    cpu.host_end = 10.0
    assert cpu.seconds() == 2.5  # cached

    class Event:
        syncs = 0

        def synchronize(self):
            Event.syncs += 1

        def elapsed_time(self, end):
            return 250.0  # ms, as torch.cuda.Event

    timed = Transfer(0.0, start=Event(), end=Event())
    assert timed.seconds() == 0.25 and timed.seconds() == 0.25
    assert Event.syncs == 1  # waited for once, then remembered


def test_make_device_rejects_other_device_types():
    assert isinstance(make_device(torch.device("cpu")), HostDevice)
    with pytest.raises(ValueError, match="params on meta are not supported"):
        make_device(torch.device("meta"))
