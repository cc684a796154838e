"""step_in_backward with the state in files (offload_adam/engine/disk_early.py): the files'
pass starts in backward, on the asynchronous simulated device (copies land late and read
their source when they run: a param written before the files commit, or a ring buffer
reused before its copy ran, fails here).

It must equal the default (the step at step(), state in RAM) bit for bit, with kernels
running during backward; every error step_in_backward has in RAM is an error here too, and
leaves nothing stepped: the params, the files and what state_dict() shows are those of the
last completed step, and training goes on from there as if that iteration never ran."""
import io
import threading
import time

import pytest
import torch

import offload_adam
from offload_adam.testing import settle, state_files
from conftest import sim_path
from models import (BF16, Boom, Sometimes, decay_groups, fp32_head, halve_grad, kernels_that,
                    loss_of)
from nvme_model import assert_same

FORMATS = ["float32", "bfloat16", "8bit"]
OPTS = dict(lr=3e-3, bucket_mb=0.01)


def model(seed=0):
    """bf16 with an fp32 head (both kinds of engine param), a layer that gets a grad every
    other step (its file bucket completes in one backward of two) and one that never does
    (`unused`: its bucket never completes)."""
    torch.manual_seed(seed)
    return fp32_head(Sometimes().to(BF16))


groups = decay_groups


def params_of(m):
    return [p for g in groups(m) for p in g["params"]]


def backward(m, it):
    m.odd = it % 2 == 1
    loss_of(m, it).float().backward()


class KernelCalls:
    """Counts the kernel calls made on threads other than the caller's (the engine's
    worker: during backward, the early pass's; at step(), the caller runs the pass)."""

    def __init__(self, monkeypatch):
        self.main, self.lock, self.off_main = threading.get_ident(), threading.Lock(), 0
        kernels_that(monkeypatch, self._seen)

    def _seen(self, args):
        if threading.get_ident() != self.main:
            with self.lock:
                self.off_main += 1


def snapshot(m, opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return [p.detach().clone() for p in params_of(m)], buf.getvalue()


def assert_snapshot(m, opt, snap):
    params, saved = snap
    assert all(torch.equal(p, q) for p, q in zip(params_of(m), params))
    now = snapshot(m, opt)[1]
    a, b = (torch.load(io.BytesIO(x), weights_only=True) for x in (saved, now))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["sim-seed0", "sim-latest"])
def test_the_pass_in_backward_is_bitwise_the_plain_step(kernels, tmp_path, monkeypatch,
                                                        fmt, where):
    a, b = model(), model()
    calls = KernelCalls(monkeypatch)
    with sim_path(where):
        ram = offload_adam.AdamW(groups(a), state_dtype=fmt, **OPTS)
        disk = offload_adam.AdamW(groups(b), state_dtype=fmt, state_dirs=tmp_path,
                                  step_in_backward=True, state_budget_mb=0.2, **OPTS)
        assert len(state_files(disk).spec.buckets) >= 8
        early = train_counting(a, b, ram, disk, calls, 6)
        assert_same(params_of(a), params_of(b), ram, disk)
    # the first backward learns the order; then kernels run in backward in every one
    assert early[0] == 0 and all(n > 0 for n in early[1:]), early
    assert disk.step_count == 6


def train_counting(a, b, ram, disk, calls, iterations):
    """Trains a with ram and b with disk; returns how many kernels ran during each of
    b's backwards (KernelCalls `calls`)."""
    early = []
    for it in range(iterations):
        backward(a, it)
        ram.step()
        ram.zero_grad()
        before = calls.off_main
        backward(b, it)
        settle(disk)
        early.append(calls.off_main - before)
        disk.step()
        disk.zero_grad()
    return early


@pytest.mark.parametrize("where", ["sim-seed0", "sim-seed1", "sim-latest"])
def test_a_hook_registered_after_the_optimizer_edits_the_grad_it_steps(kernels, tmp_path,
                                                                      monkeypatch, where):
    """A user's post-accumulate-grad hook registered after the optimizer edits the
    grads in place in backward: the engine copies them only once autograd is past it,
    so the files' pass in backward steps the edited grads, bit for bit as the plain
    step in RAM with the same hook, kernels still running during backward."""
    a, b = model(), model()
    calls = KernelCalls(monkeypatch)
    with sim_path(where):
        ram, disk = in_ram_and_on_disk(a, b, tmp_path)
        for p in params_of(a)[::2] + params_of(b)[::2]:   # some params, not the others
            p.register_post_accumulate_grad_hook(halve_grad)
        early = train_counting(a, b, ram, disk, calls, 5)
        assert_same(params_of(a), params_of(b), ram, disk)
    assert early[0] == 0 and all(n > 0 for n in early[1:]), early


def in_ram_and_on_disk(a, b, tmp_path):
    """The error tests' pair: model a's optimizer in RAM (the default), b's on disk with
    step_in_backward, bf16 moments, a ring of a few buckets."""
    ram = offload_adam.AdamW(groups(a), state_dtype="bfloat16", **OPTS)
    disk = offload_adam.AdamW(groups(b), state_dtype="bfloat16", state_dirs=tmp_path,
                              step_in_backward=True, state_budget_mb=0.2, **OPTS)
    return ram, disk


def train_both(a, b, ram, disk, iterations):
    for it in iterations:
        for m, opt in ((a, ram), (b, disk)):
            backward(m, it)
            opt.step()
            opt.zero_grad()


def goes_on_as_if_never_ran(a, b, ram, disk, snap, monkeypatch, iterations):
    """After an error at iteration 2: b's params, files and state_dict() are as at `snap`
    (step 2); with the test's patches undone and the grads cleared, training both over
    `iterations` ends bitwise the same."""
    assert_snapshot(b, disk, snap)
    assert disk.step_count == 2
    monkeypatch.undo()
    disk.zero_grad()
    train_both(a, b, ram, disk, iterations)
    assert_same(params_of(a), params_of(b), ram, disk)


def test_a_pass_that_steps_every_bucket_in_backward_commits_nothing_before_step(
        kernels, tmp_path, monkeypatch):
    """Every file bucket complete in backward (no `unused` layer, `sometimes` in every
    step): the pass steps them all there, but the last one is not written, as that would
    commit the step. The files stay at the last step until step(), and an error then
    leaves nothing stepped."""
    b = model()
    del b.unused
    with sim_path("sim-seed1"):
        disk = offload_adam.AdamW(groups(b), state_dtype="bfloat16", state_dirs=tmp_path,
                                  step_in_backward=True, state_budget_mb=0.2, **OPTS)
        for it in (1, 3):
            backward(b, it)
            disk.step()
            disk.zero_grad()
        snap = snapshot(b, disk)
        calls = KernelCalls(monkeypatch)
        backward(b, 5)
        settle(disk)
        assert calls.off_main > 0
        assert disk.step_count == 2
        with pytest.raises(RuntimeError, match="Nothing was stepped: the state files"):
            disk.zero_grad()
        assert_snapshot(b, disk, snap)
        assert disk.step_count == 2


def test_an_error_while_the_pass_runs_waits_for_it_to_stop(kernels, tmp_path, monkeypatch):
    """zero_grad() right after backward, while the worker is inside a kernel of the pass
    (held there for a moment): the pass is stopped only once the worker is out of it, so
    no kernel runs on a ring buffer the pipeline has let go; nothing is stepped, and
    training goes on bitwise as in RAM."""
    a, b = model(), model()
    with sim_path("sim-seed1"):
        ram, disk = in_ram_and_on_disk(a, b, tmp_path)
        train_both(a, b, ram, disk, range(2))
        snap = snapshot(b, disk)
        main, held = threading.get_ident(), threading.Event()

        def hold(args):
            if threading.get_ident() != main and not held.is_set():
                held.set()
                time.sleep(0.3)
        kernels_that(monkeypatch, hold)
        backward(b, 2)
        assert held.wait(10)   # the worker is in (or past) the pass's first kernel
        with pytest.raises(RuntimeError, match="Nothing was stepped: the state files"):
            disk.zero_grad()
        goes_on_as_if_never_ran(a, b, ram, disk, snap, monkeypatch, range(3, 5))


@pytest.mark.parametrize("change", ["clip", "zero_grad", "accumulate", "load_state_dict",
                                    "lr", "grad_scaler", "kernel_error", "refused_lr"])
def test_an_error_leaves_nothing_stepped_and_training_goes_on(kernels, tmp_path,
                                                              monkeypatch, change):
    """Each of step_in_backward's errors, raised after kernels ran in backward: the
    params, the files and state_dict() are those of the step before, and the run goes
    on bitwise as one that never had that iteration."""
    a, b = model(), model()
    with sim_path("sim-seed1"):
        ram, disk = in_ram_and_on_disk(a, b, tmp_path)
        train_both(a, b, ram, disk, range(2))
        snap = snapshot(b, disk)
        calls = KernelCalls(monkeypatch)
        if change == "kernel_error":   # the first kernel of the pass in backward fails
            main = threading.get_ident()

            def fail_off_main(args):
                if threading.get_ident() != main:
                    raise Boom("kernel failed")
            kernels_that(monkeypatch, fail_off_main)
        if change == "load_state_dict":
            saved = disk.state_dict()
        backward(b, 2)
        if change == "accumulate":
            with pytest.raises(RuntimeError, match="step_in_backward=True forbids this"):
                backward(b, 3)
        if change != "kernel_error":
            settle(disk)
            assert calls.off_main > 0
        raises = pytest.raises(RuntimeError, match="Nothing was stepped: the state files")
        if change == "clip":
            with raises:
                disk.clip_grad_norm_(0.5)
        elif change == "zero_grad":
            with raises:
                disk.zero_grad()
        elif change == "kernel_error":
            with pytest.raises(Boom, match="kernel failed"):
                disk.step()
        elif change == "refused_lr":
            # step()'s checks refuse it before its pass; zero_grad() then drops the pass,
            # nothing stepped (found from outside: it raised "zero_grad() was called after
            # steps started during backward, before step()", step() having been called)
            disk.param_groups[0]["lr"] = 1e39
            with pytest.raises(ValueError, match=r"lr=1e\+39"):
                disk.step()
            disk.param_groups[0]["lr"] = OPTS["lr"]
        else:
            if change == "load_state_dict":
                disk.load_state_dict(saved)
            elif change == "lr":
                disk.param_groups[0]["lr"] = 1e-3
            elif change == "grad_scaler":
                disk.grad_scale, disk.found_inf = torch.tensor(1.0), torch.tensor(0.0)
            with raises:
                disk.step()
            disk.__dict__.pop("grad_scale", None)
            disk.__dict__.pop("found_inf", None)
            disk.param_groups[0]["lr"] = OPTS["lr"]
        goes_on_as_if_never_ran(a, b, ram, disk, snap, monkeypatch, range(3, 6))
    assert disk.step_count == 5


def test_a_step_the_files_refuse_ends_the_pass_begun_in_backward(kernels, tmp_path,
                                                                monkeypatch):
    """A param frozen when the optimizer was built and unfrozen since has a grad: step()
    refuses it by name, after the pass in backward began, with nothing stepped; that ends
    the pass (zero_grad() raises no second error), and once the param is frozen again
    training goes on bitwise as if that iteration never ran."""
    a, b = model(), model()
    frozen = [params_of(m)[0] for m in (a, b)]
    for p in frozen:
        p.requires_grad_(False)
    with sim_path("sim-seed1"):
        ram, disk = in_ram_and_on_disk(a, b, tmp_path)
        train_both(a, b, ram, disk, range(2))
        snap = snapshot(b, disk)
        calls = KernelCalls(monkeypatch)
        frozen[1].requires_grad_(True)
        backward(b, 2)
        settle(disk)
        assert calls.off_main > 0   # (the pass had begun)
        with pytest.raises(RuntimeError, match=r"param 0 .* has a grad, but it was frozen"):
            disk.step()
        disk.zero_grad()
        frozen[1].requires_grad_(False)
        goes_on_as_if_never_ran(a, b, ram, disk, snap, monkeypatch, range(3, 5))

