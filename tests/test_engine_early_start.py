"""step_in_backward=True: the CPU step starts during backward.

It must equal the default (the step at step()) bit for bit, and everything that
would make it differ must be a clear RuntimeError that says what was stepped.
The state such an error leaves is pinned down here: every param is either
stepped once with the grads as they were at backward (equal to a plain step) or
not stepped at all, and each param equals its master rounded.
"""
import re

import pytest
import torch

import offload_adam

# Every test runs on both grad paths (conftest.grad_path).
pytestmark = pytest.mark.usefixtures("grad_path")

from test_engine import BF16, TinyTransformer, loss_of

OPTS = dict(lr=3e-3, weight_decay=0.1, bucket_mb=0.01)


class Model(TinyTransformer):
    """The tiny transformer, plus a layer that gets a grad every other step."""

    def __init__(self):
        super().__init__()
        self.sometimes = torch.nn.Linear(37, 37)
        self.odd = False

    def forward(self, tokens):
        out = super().forward(tokens)
        return self.sometimes(out) if self.odd else out


def make(step_in_backward, seed=0, **kw):
    torch.manual_seed(seed)
    model = Model().to(BF16)
    groups = [{"params": list(model.body.parameters()) + list(model.sometimes.parameters()),
               "weight_decay": 0.0},
              {"params": list(model.embed.parameters()) + list(model.head.parameters())
               + list(model.unused.parameters()), "lr": 1e-2}]
    opt = offload_adam.AdamW(groups, step_in_backward=step_in_backward, **{**OPTS, **kw})
    return model, opt


def backward(model, it):
    model.odd = it % 2 == 1
    loss_of(model, it, BF16).backward()


def early_params(opt):
    """The params whose step was queued during the last backward."""
    return [s.param for s in opt._engine.slots if s.early_token]


def test_bitwise_equal_to_the_default(kernels):
    runs = []
    for early in (False, True):
        model, opt = make(early)
        started = []
        for it in range(5):
            backward(model, it)
            if early:
                started.append(len(early_params(opt)))
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert len(runs[1][1]._engine.buckets) > 3
    # nothing starts in the first backward (the buckets are learned then), then
    # every param that got a grad before does
    n_grads = sum(1 for p in runs[0][0].parameters() if p in runs[0][1].state)
    assert started[0] == 0 and min(started[1:]) > n_grads // 2
    (m1, o1), (m2, o2) = runs
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        if o1.state.get(p):
            for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(o1.state[p][key], o2.state[q][key]), key
        else:
            assert not o2.state.get(q)
    assert not o2.state.get(m2.unused.weight)


def test_free_grads_after_copy_too(kernels):
    runs = []
    for early in (False, True):
        model, opt = make(early, free_grads_after_copy=True)
        for it in range(3):
            backward(model, it)
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


def test_bad_options():
    p = torch.nn.Parameter(torch.zeros(2, dtype=BF16))
    with pytest.raises(ValueError, match="step_in_backward=True needs overlap=True"):
        offload_adam.AdamW([p], overlap=False, step_in_backward=True)
    with pytest.raises(ValueError, match="max_grad_norm.*step_in_backward"):
        offload_adam.AdamW([p], max_grad_norm=1.0, step_in_backward=True)


def _scaled(model, opt):
    model.head.weight.grad.mul_(0.5)


def _replaced(model, opt):
    model.head.weight.grad = model.head.weight.grad.clone()


def _data_edit(model, opt):
    model.head.weight.grad.data.mul_(0.5)  # no version bump: the fingerprint sees it


def _dropped(model, opt):
    model.head.weight.grad = None


def _torch_clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _lr(model, opt):
    opt.param_groups[1]["lr"] *= 0.5  # as an LR scheduler stepped too early would


def _reloaded(model, opt):
    opt._engine._drain()  # the early steps are done: the saved state has them
    opt.load_state_dict(opt.state_dict())


CHANGES = {
    "scaled": (_scaled, "changed after it was copied"),
    "replaced": (_replaced, "changed after it was copied"),
    ".data edit": (_data_edit, "changed after it was copied"),
    "dropped": (_dropped, "was dropped"),
    "torch clip": (_torch_clip, "changed after it was copied"),
    "lr": (_lr, r"param group 1's hyperparameters changed after its step started \(lr 0.01 -> 0.005"),
    "load_state_dict": (_reloaded, "state .* was replaced"),
}


def _snapshot(opt, model):
    return {p: opt.state[p]["master_param"].clone() for p in model.parameters()
            if opt.state.get(p)}


def _in_second_backward():
    """A step_in_backward run one step in, with the second backward done (its
    early steps queued); returns the masters from before it too."""
    model, opt = make(True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _snapshot(opt, model)
    backward(model, 1)
    return model, opt, before


def _check_left_state(opt, model, before, after_plain, message):
    """Each param: stepped as by a plain step, or not stepped; as many stepped
    as the message says; param == master rounded."""
    stepped = 0
    for p in model.parameters():
        if not opt.state.get(p):  # never stepped (the unused layer)
            assert p not in before
            continue
        master = opt.state[p]["master_param"]
        assert torch.equal(p, master.to(BF16))
        if after_plain[p] is not None and torch.equal(master, after_plain[p]):
            stepped += 1
        else:
            assert torch.equal(master, before[p])
    assert stepped > 0
    assert f"The Adam step of {stepped} params already ran" in message
    assert "the other params are not" in message


def _reference_after_plain_step(it):
    """The masters after step `it` of a plain run (default mode)."""
    model, opt = make(False)
    for i in range(it + 1):
        backward(model, i)
        opt.step()
        opt.zero_grad()
    return [opt.state[p]["master_param"].clone() if opt.state.get(p) else None
            for p in model.parameters()]


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_backward_is_an_error(kernels, change):
    edit, pattern = CHANGES[change]
    model, opt, before = _in_second_backward()
    assert early_params(opt)
    edit(model, opt)
    with pytest.raises(RuntimeError, match="step_in_backward=True forbids") as err:
        opt.step()
    message = str(err.value)
    assert re.search(pattern, message), message
    after = dict(zip(model.parameters(), _reference_after_plain_step(1)))
    _check_left_state(opt, model, before, after, message)
    # training goes on: the next iterations run (and start early again)
    opt.zero_grad()
    for it in (2, 3):
        backward(model, it)
        assert early_params(opt)
        opt.step()
        opt.zero_grad()


def test_clip_grad_norm_and_grad_scaler_are_errors(kernels):
    model, opt = make(True)
    backward(model, 0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called.*Nothing was stepped"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called.*params already ran"):
        opt.clip_grad_norm_(1.0)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss_of(model, 2, BF16)).backward()
    with pytest.raises(RuntimeError, match="GradScaler.step was used.*params already ran"):
        scaler.step(opt)


def test_zero_grad_before_step_is_an_error(kernels):
    model, opt, before = _in_second_backward()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called") as err:
        opt.zero_grad()
    after = dict(zip(model.parameters(), _reference_after_plain_step(1)))
    _check_left_state(opt, model, before, after, str(err.value))
    opt.step()  # no grads: nothing happens
    _check_left_state(opt, model, before, after, str(err.value))


def test_accumulation_is_an_error(kernels):
    model, opt, before = _in_second_backward()
    with pytest.raises(RuntimeError, match="a grad arrived again.*accumulation"):
        backward(model, 11)
    with pytest.raises(RuntimeError, match="a grad arrived again") as err:
        opt.step()
    after = dict(zip(model.parameters(), _reference_after_plain_step(1)))
    _check_left_state(opt, model, before, after, str(err.value))
