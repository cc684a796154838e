"""The asynchronous simulated device (offload_adam/testing/sim_device.py) has teeth.

Three layers: each of CUDA's ordering rules, broken on purpose against the bare
device, is caught; the engine with one wait or fence removed (a deliberately
broken variant) fails on it; and the four ordering faults found in engine v1
each have a scenario here that v1 failed (see the closing note of issue 8) and
the engine passes, on every seed and with every copy held as late as CUDA allows.
"""
import gc
import threading

import pytest
import torch

import offload_adam
from offload_adam.engine import OffloadEngine
from offload_adam.engine import core as engine_module
from offload_adam.testing import AsyncSimDevice, SimEvent, simulated
from models import BF16, OPTS, make_mlp, make_pair, mlp_loss, run


@pytest.fixture
def dev():
    sim = AsyncSimDevice(seed=0, latency="latest")
    yield sim
    sim.close()


def _violations(sim):
    with pytest.raises(AssertionError, match="violations") as err:
        sim.check()
    return str(err.value)


# ---- the rules, one by one ----------------------------------------------------------------

def test_a_copy_runs_late_and_reads_its_source_when_it_runs(dev):
    grad, host = torch.ones(4), torch.zeros(4)
    t = dev.d2h(host, grad)
    assert host.isnan().all()  # undefined until it lands: poisoned
    dev.wait_host(t)
    assert torch.equal(host, grad)
    dev.check()


def test_a_copy_that_raises_is_reported_and_its_waiters_go_on(dev):
    """A copy raising on its stream's thread (a CUDA copy raises when queued) killed the
    thread, and every wait for it hung (found from outside: a test run hung): reported
    at check() instead."""
    host = torch.zeros(4)
    t = dev.d2h(host, torch.ones(5))   # (shapes that cannot be copied)
    done = threading.Event()
    threading.Thread(target=lambda: (dev.wait_host(t), done.set()), daemon=True).start()
    assert done.wait(30)
    assert "device->host copy #1 (4 elements) raised RuntimeError" in _violations(dev)


def test_a_forked_child_is_refused_the_device_not_hung(dev):
    """A child forked while a copy was in flight (its stream's thread the parent's)
    waited for it for good, in an op under the watch or at wait_host (found from
    outside). The device's calls are refused instead, as CUDA refuses a forked child,
    and the child's ops run unwatched (a DataLoader's worker); the parent goes on."""
    from forked import in_child
    grad, host = torch.ones(4), torch.zeros(4)
    with dev.watch():
        t = dev.d2h(host, grad)
        said = in_child([lambda: str(float(grad.add(1).sum())), lambda: dev.wait_host(t),
                         lambda: dev.d2h(host, grad), dev.synchronize])
        assert said[0] == "ran: 8.0", said
        assert len(said) == 4
        for line in said[1:]:
            assert "AsyncSimDevice: this simulated device is process" in line, line
            assert "it cannot be used in a forked child" in line, line
        dev.wait_host(t)
    assert torch.equal(host, grad)
    dev.check()


def test_host_read_before_the_copy_landed_sees_poison(dev):
    host = torch.zeros(4)
    dev.d2h(host, torch.ones(4))
    assert host.sum().isnan()  # what a kernel reading it now would get


def test_compute_write_to_a_source_in_flight_is_caught(dev):
    grad, host = torch.ones(4), torch.zeros(4)
    with dev.watch():
        t = dev.d2h(host, grad)
        grad.mul_(3)  # the user edits the grad after backward, nothing ordered
    dev.wait_host(t)
    assert "nothing ordering the two" in _violations(dev)


def test_a_published_copy_orders_later_compute_work(dev):
    grad, host = torch.ones(4), torch.zeros(4)
    with dev.watch():
        t = dev.d2h(host, grad)
        dev.publish([t])
        grad.mul_(3)  # waits for the copy, as the compute stream would
    dev.wait_host(t)
    assert torch.equal(host, torch.ones(4))
    dev.check()


def test_host_rewriting_a_source_in_flight_is_caught(dev):
    param, staging = torch.zeros(4), torch.ones(4)
    dev.pin(staging)
    with dev.watch():
        t = dev.h2d(param, staging, dev.fence())
        dev.publish([t])
        staging.fill_(2)  # the host did not wait for the copy
    dev.wait_host(t)
    found = _violations(dev)
    assert "the host wrote a buffer" in found and "changed between queueing" in found


def test_an_h2d_copy_without_a_fence_is_caught(dev):
    param = torch.zeros(4)
    with dev.watch():
        early = dev.fence()
        param.add_(1)  # backward reads/writes the param after that fence
        dev.wait_host(dev.h2d(param, torch.ones(4), early))
    assert "missing fence" in _violations(dev)


def test_unpinning_a_buffer_in_use_is_caught(dev):
    host = torch.zeros(4)
    dev.pin(host)
    dev.d2h(host, torch.ones(4))
    dev.unpin(host)
    assert "unpinned/freed while" in _violations(dev)


def test_a_finalizer_that_waits_inside_an_ops_check_is_put_off(dev):
    """A streamer dropped without close() unpins its buffers from a finalizer that first
    waits for the copies in flight (unpin_when_dropped). The garbage collector ran it
    inside an op's check, which holds the simulated device's lock, and the wait for the
    stream threads, which need it, never ended (a test run hung). Put off until the lock
    is let go, then done: the copy landed, the buffer unpinned."""
    from offload_adam.engine.host_memory import unpin_when_dropped
    host = torch.zeros(4)
    dev.pin(host)
    t = dev.d2h(host, torch.ones(4))   # ("latest": it runs only once waited for)
    pinned = [host]
    done = threading.Event()

    def check():   # as an op's check: the lock held while the finalizer runs
        with dev.lock:
            unpin_when_dropped(dev, pinned)
        done.set()
    threading.Thread(target=check, daemon=True).start()
    assert done.wait(10), "the finalizer waited under the lock"
    assert pinned == [host] and dev.pinned()   # not yet
    dev.synchronize()   # (or the next op's check, or close())
    assert pinned == [] and not dev.pinned() and torch.equal(host, torch.ones(4))
    dev.wait_host(t)
    dev.check()


def test_a_finalizer_run_on_a_copy_stream_is_put_off(dev):
    """The same finalizer run by the garbage collector on a copy stream's own thread,
    inside a copy (its checksum's bytes): its wait for the copies in flight waited for
    the copy running it, and every thread waiting for that copy hung (a CI run, in
    test_nvme_crash). Put off to a thread of the model's, then done."""
    from offload_adam.engine.host_memory import unpin_when_dropped
    host, other = torch.zeros(4), torch.zeros(4)
    dev.pin(host)
    dev.pin(other)
    pinned = [other]
    execute = dev._execute

    def collected(op):   # (the collector, inside the copy)
        dev._execute = execute
        unpin_when_dropped(dev, pinned)
        execute(op)
    dev._execute = collected
    t = dev.d2h(host, torch.ones(4))
    done = threading.Event()
    threading.Thread(target=lambda: (dev.wait_host(t), done.set()), daemon=True).start()
    assert done.wait(10), "the finalizer on the copy's thread waited for that copy"
    assert pinned == [other]   # not yet
    dev.synchronize()
    assert pinned == [] and torch.equal(host, torch.ones(4))
    dev.check()


def test_latest_holds_a_copy_until_it_is_needed(dev):
    host = torch.zeros(4)
    t = dev.d2h(host, torch.ones(4))
    threading.Event().wait(0.05)
    assert not t.sim_copy.executed.is_set()
    dev.wait_host(t)
    assert t.sim_copy.executed.is_set()


def test_a_packed_copy_writes_only_its_pieces_host_bytes(dev):
    """Two packed grads with another grad's host copy between them, as a
    bucket interleaved them before (issue 25): the pack's copy, through its
    temporary as on a GPU, leaves that copy alone. A copy of the span from the
    first piece to the last would poison it here, and land the temporary's
    uninitialised bytes on it on a GPU."""
    host = torch.zeros(12)
    a, other, c = host[:4], host[4:8], host[8:]
    dev.wait_host(dev.d2h(other, torch.full((4,), 7.0)))
    t = dev.d2h([c, a], [torch.full((4,), 2.0), torch.ones(4)])
    assert torch.equal(other, torch.full((4,), 7.0))
    dev.wait_host(t)
    assert torch.equal(host, torch.tensor([1.0] * 4 + [7.0] * 4 + [2.0] * 4))
    dev.check()


def test_a_packed_copy_reads_only_its_pieces_host_bytes(dev):
    """The H2D side: the host may write a buffer lying between two packed
    sources while their copy is in flight (another bucket's update), since
    that copy neither reads it nor moves it."""
    host = torch.ones(12)
    dev.pin(host)
    a, c = torch.zeros(4), torch.zeros(4)
    with dev.watch():
        t = dev.h2d([a, c], [host[:4], host[8:]], dev.fence())
        host[4:8].fill_(3.0)
    dev.wait_host(t)
    assert torch.equal(a, torch.ones(4)) and torch.equal(c, torch.ones(4))
    dev.check()


# ---- the engine with a wait or a fence removed ----------------------------------------------

def _train(sim, model_fn=make_mlp, loss=mlp_loss, steps=3, **options):
    with simulated(sim), sim.watch():
        model = model_fn()
        opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "bucket_mb": 0.0001, **options})
        run(model, opt, steps, loss=loss)
        params = [p.detach().clone() for p in model.parameters()]
    return params


def _reference(**options):
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "bucket_mb": 0.0001, **options})
    run(model, opt, 3, loss=mlp_loss)
    return [p.detach().clone() for p in model.parameters()]


def _skip_waits(sim, monkeypatch, kind, thread="any"):
    """The device forgets the host waits on `kind` copies ("d2h"/"h2d") made
    from the worker or the main thread: the engine without those waits."""
    real = sim.wait_host

    def wait_host(*transfers):
        here = threading.current_thread().name
        skip = thread == "any" or (thread == "worker") == (here == "offload_adam-worker")
        real(*[t for t in transfers
               if not (skip and getattr(t, "sim_copy", None) and t.sim_copy.kind == kind)])
    monkeypatch.setattr(sim, "wait_host", wait_host)


def test_the_intact_engine_passes(dev, kernels):
    assert all(torch.equal(a, b) for a, b in zip(_train(dev), _reference()))
    dev.check()


@pytest.mark.parametrize("synchronized", [False, True])
def test_a_model_built_on_one_thread_and_trained_on_another(dev, kernels, synchronized):
    """The device gives each thread a compute stream of its own (as CUDA does to
    threads on streams of their own): the model and optimizer made on the main thread
    are another stream's work to the training thread, and the engine's first copies
    are ordered after it only once the host waited for every stream (synchronize(), as
    torch.cuda.synchronize() waits for every stream); so are the main thread's reads of
    the params after the other's last step. Found from outside: the device's
    synchronize() waited for its copies only, so that no call the user could make
    ordered the two threads' work, and such a run reported violations however written."""
    with simulated(dev), dev.watch():
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "bucket_mb": 0.0001})
        errors = []

        def train():
            try:
                with dev.watch():
                    if synchronized:
                        dev.synchronize()
                    run(model, opt, 3, loss=mlp_loss)
            except BaseException as e:   # (reported below, not lost with the thread)
                errors.append(e)
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
        assert not errors, errors
        if synchronized:   # (and back: the main thread reads what the other's step wrote)
            dev.synchronize()
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(params, _reference()))
    if synchronized:
        dev.check()
    else:
        assert "is not ordered after the compute work that produced its source" in (
            _violations(dev))


def test_without_waiting_for_the_grads_the_kernel_reads_poison(dev, kernels, monkeypatch):
    # (without verify_grads, nor the check of the params' bits (engine/param_check.py):
    # waiting for either's result also waits, through the compute stream, for the copies
    # of the backward published before it)
    from offload_adam.engine.param_check import ParamCheck
    monkeypatch.setattr(ParamCheck, "start", lambda self, params: None)
    _skip_waits(dev, monkeypatch, "d2h", "worker")
    params = _train(dev, verify_grads=False)
    assert any(p.isnan().any() for p in params)


def test_without_publishing_the_steps_copies_the_next_forward_races_them(dev, kernels,
                                                                         monkeypatch):
    real = dev.publish
    monkeypatch.setattr(dev, "publish", lambda ts: real(
        [t for t in ts if t.sim_copy.kind != "h2d"]))
    _train(dev)
    assert "read a device tensor that host->device copy" in _violations(dev)


@pytest.mark.parametrize("dropped", ["fence", "h2d's after"])
def test_without_the_fence_the_h2d_races_backward(dev, kernels, monkeypatch, dropped):
    """`fence`: the device's fence gives no event. "h2d's after": a call site that drops
    its fence (h2d(..., None)) is ordered after nothing, as on CUDA, where the copy then
    waits for no event (the sim ordered such a copy after the last fence anyone took,
    which hid it: the mutation audit removed the write-back's and the streamer's fetch's
    fence, and no test failed)."""
    if dropped == "fence":
        monkeypatch.setattr(dev, "fence", lambda: SimEvent([], -1))
    else:
        real = dev.h2d
        monkeypatch.setattr(dev, "h2d", lambda dsts, srcs, after=None: real(dsts, srcs, None))
    # (nor the check of the params' bits, whose result, waited for by the host, covers
    # the compute work queued before step() as the fence does)
    from offload_adam.engine.param_check import ParamCheck
    monkeypatch.setattr(ParamCheck, "start", lambda self, params: None)
    # Backward reads a param after its grad's hook: a branch built before the
    # model's forward (so run last in backward) uses it detached. Every other
    # read of a param comes before its own grad is final, and the bucket job's
    # host wait for that grad would order the H2D after it as a fence does.
    side = torch.ones(3, 16, requires_grad=True)

    def loss(model, seed):
        branch = (side.to(BF16) @ model[0].weight.detach()).float().sum()
        return branch + mlp_loss(model, seed)
    _train(dev, loss=loss, verify_grads=False)
    assert "missing fence" in _violations(dev)


def test_without_publishing_a_backwards_copies_an_edit_races_them(dev, kernels, monkeypatch):
    real = dev.publish
    monkeypatch.setattr(dev, "publish", lambda ts: real(
        [t for t in ts if t.sim_copy.kind != "d2h"]))

    def edit(model, opt):
        model[0].weight.grad.mul_(0.5)

    with simulated(dev), dev.watch():
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        run(model, opt, 2, edit=edit, loss=mlp_loss)
    assert "nothing ordering the two" in _violations(dev)


# ---- the four faults of engine v1 (issue 8) -----------------------------------------------

@pytest.mark.parametrize("latency", ["latest", "random"])
def test_fault_a_early_steps_are_not_torn_by_an_edit_after_backward(kernels, latency):
    """(a) step_in_backward: the early kernel waits for the grad's D2H copy, and
    the copy must be ordered before what the user does after backward. Here the
    user scales a grad after backward: step() refuses, and every param is
    either stepped from the grads as they were at backward, or not at all."""
    sim = AsyncSimDevice(seed=3, latency=latency)
    with simulated(sim), sim.watch():
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
        run(model, opt, 1, loss=mlp_loss)
        twin = make_mlp()
        twin.load_state_dict(model.state_dict())
        mlp_loss(model, 10).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad.mul_(0.5)
        with pytest.raises(RuntimeError, match="changed after it was copied"):
            opt.step()
        stepped = [p.detach().clone() for p in model.parameters()]
    sim.check()
    sim.close()
    # the plain step from the backward's own grads
    ref = make_mlp()
    ropt = offload_adam.AdamW(ref.parameters(), **OPTS)
    run(ref, ropt, 1, loss=mlp_loss)
    before = [p.detach().clone() for p in ref.parameters()]
    for p, g in zip(ref.parameters(), grads):
        p.grad = g
    ropt.step()
    for now, plain, old in zip(stepped, ref.parameters(), before):
        assert torch.equal(now, plain) or torch.equal(now, old)


def _fault_b(sim, after_step):
    """(b) deleting the optimizer after a backward without step() (D2H copies in
    flight) or right after a step (H2D copies in flight) must wait for them
    before unpinning and freeing host memory."""
    with simulated(sim), sim.watch():
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        run(model, opt, 1, loss=mlp_loss)
        mlp_loss(model, 1).backward()
        if after_step:
            opt.step()
        del opt
        gc.collect()


def _fault_c(sim):
    """(c) fp32 params: an unpacked one's master is its H2D source (a packed
    one's update goes from staging); loading a state dict rewrites it at the
    next step, which must first wait for the last H2D."""
    def loss(model, seed):
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(seed))
        return model(x).pow(2).sum()

    with simulated(sim), sim.watch():
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)   # a weight of 256 KiB: unpacked
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        run(model, opt, 1, loss=loss)
        sd = opt.state_dict()
        loss(model, 1).backward()
        opt.step()
        opt.load_state_dict(sd)
        opt.step()  # the same grads again, from the loaded state


def _fault_d(sim):
    """(d) add_param_group re-lays the buckets and their transfer buffers: the
    H2D copies of the last step still read the old ones."""
    with simulated(sim), sim.watch():
        model, _ = make_pair()
        opt = offload_adam.AdamW(list(model.body.parameters()), **OPTS)
        run(model, opt, 1)
        opt.add_param_group({"params": list(model.head.parameters())})
        run(model, opt, 1, start=1)


def _no_host_waits_on_h2d(sim, monkeypatch):
    real = sim.wait_host
    monkeypatch.setattr(sim, "wait_host", lambda *ts: real(
        *[t for t in ts if t is None or t.sim_copy.kind != "h2d"]))


FAULTS = {
    # name: (scenario, how the v1 engine went wrong, what the device then says)
    "b: del after backward": (lambda sim: _fault_b(sim, False),
                              lambda sim, mp: mp.setattr(engine_module, "_transfers_of",
                                                         lambda recs, buckets: []),
                              "unpinned/freed while"),
    "b: del after step": (lambda sim: _fault_b(sim, True),
                          lambda sim, mp: mp.setattr(engine_module, "_transfers_of",
                                                     lambda recs, buckets: []),
                          "unpinned/freed while"),
    "c: load between steps": (_fault_c, _no_host_waits_on_h2d, "the host wrote a buffer"),
    "d: rebucketing": (_fault_d, lambda sim, mp: mp.setattr(OffloadEngine, "_wait_all",
                                                            lambda self: None),
                       "unpinned/freed while"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("broken", [False, True], ids=["engine", "v1's mistake"])
def test_faults_b_c_d(kernels, monkeypatch, fault, broken):
    """Each scenario passes on the engine; with the wait that v1 lacked
    removed again, the device reports the race."""
    scenario, break_it, message = FAULTS[fault]
    sim = AsyncSimDevice(seed=1, latency="latest")
    try:
        if broken:
            break_it(sim, monkeypatch)
        scenario(sim)
        if broken:
            assert message in _violations(sim)
        else:
            sim.check()
    finally:
        monkeypatch.undo()
        sim.close()


def test_copies_the_host_waited_for_are_let_go(sim):
    """A copy keeps the copies it was ordered after until the host waited for it; then it
    drops them: each step's copies held the last step's, a chain as long as the run (a
    long soak grew by ~0.3 MB a step)."""
    from offload_adam.testing.sim_device import _Copy
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)

    def alive():
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is _Copy)
    run(model, opt, 3, loss=mlp_loss)
    early = alive()
    run(model, opt, 30, start=3, loss=mlp_loss)
    assert alive() <= early + 2
    opt.close()


def test_its_record_of_compute_accesses_stays_bounded_over_a_long_run(dev):
    """The device kept each storage's last compute accesses, and compute's temporaries
    (freed by torch, unseen by it) piled up there without end, ~65 a step of a small
    model (found from outside). Accesses the host has waited past are forgotten (no copy
    can conflict with them): over 12,000 new storages, synced every 100, the record stays
    bounded; an access not waited past is still checked."""
    kept = []
    with dev.watch():
        for i in range(12000):
            kept.append(torch.ones(8) * i)   # (kept: every storage a new address)
            if i % 100 == 99:
                dev.synchronize()
        assert len(dev._last_access) < 9000
        param = torch.zeros(4)
        early = dev.fence()
        param.add_(1)
        dev.wait_host(dev.h2d(param, torch.ones(4), early))
    assert "missing fence" in _violations(dev)
