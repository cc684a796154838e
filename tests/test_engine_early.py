"""step_in_backward=True (offload_adam/engine/early.py): the CPU step starts
during backward.

It must equal the default (the step at step()) bit for bit, and everything that
would make it differ must be a clear RuntimeError that says what was stepped.
The state such an error leaves is pinned down here: every param is either
stepped once with the grads as they were at backward (equal to a plain step) or
not stepped at all, and each param equals its master rounded. Every test runs
on the host device (CPU params, copies on the spot) and on the asynchronous
simulated device (conftest.path). With the state in files (path.files) nothing
is committed before step() (options.py, engine/disk_early.py): an error leaves
no param stepped, and says so.
"""
import copy
import gc
import pickle
import re
import weakref

import pytest
import torch

import offload_adam
from offload_adam.testing import settle
from bare_engine import BareEngine
from conftest import FILES_PATHS, sim_path
from engine_watch import buckets_of
from models import (BF16, MLP_OPTS, OPTS, Boom, Sometimes, assert_param_is_master_rounded,
                    assert_same, early_steps, kernels_that, loss_of, make_mlp, mlp_loss, run,
                    states, steps_of)


def make(step_in_backward, seed=0, **kw):
    torch.manual_seed(seed)
    model = Sometimes().to(BF16)
    groups = [{"params": list(model.body.parameters()) + list(model.sometimes.parameters()),
               "weight_decay": 0.0},
              {"params": list(model.embed.parameters()) + list(model.head.parameters())
               + list(model.unused.parameters()), "lr": 1e-2}]
    opt = offload_adam.AdamW(groups, step_in_backward=step_in_backward, **{**OPTS, **kw})
    return model, opt


def backward(model, it):
    model.odd = it % 2 == 1
    loss_of(model, it).backward()


def test_bitwise_equal_to_the_default(path):
    runs = []
    for early in (False, True):
        model, opt = make(early)
        started = []
        for it in range(5):
            before = steps_of(opt, model)
            backward(model, it)
            if early:
                started.append(early_steps(opt, model, before))
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert len(buckets_of(runs[1][1].last_step_profile)) > 3
    # the first backward starts what the guess completes (every hooked param is expected,
    # in host RAM in the buckets as first laid out, in files in the file buckets), then
    # every param that got a grad before does
    held = states(runs[0][1])
    n_grads = sum(1 for p in runs[0][0].parameters() if p in held)
    assert started[0] > 0 or path.files, started   # (in files: as far as the guess held)
    assert min(started[1:]) > n_grads // 2
    assert_same(*runs)
    assert not states(runs[1][1]).get(runs[1][0].unused.weight)


def test_free_grads_after_copy_too(path):
    runs = []
    for early in (False, True):
        model, opt = make(early, free_grads_after_copy=True)
        for it in range(3):
            backward(model, it)
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same(*runs)


def test_grads_in_one_flat_buffer(path):
    """Grads that are views of one buffer (DDP's gradient_as_bucket_view, a grad arena;
    zero_grad(set_to_none=False) keeps them) share one version counter, which each
    sibling's accumulation bumps: not an edit while the values are as copied. Bit for
    bit the default; a grad of the buffer edited after its copy is still refused."""
    runs = []
    for early in (False, True):
        model, opt = make(early)
        params = [p for g in opt.param_groups for p in g["params"]]
        flat = torch.zeros(sum(p.numel() for p in params), dtype=BF16)
        at = 0
        for p in params:
            p.grad = flat[at:at + p.numel()].view_as(p)
            at += p.numel()
        for it in range(4):
            opt.zero_grad(set_to_none=False)
            backward(model, it)
            opt.step()
        runs.append((model, opt))
    assert_same(*runs)
    model, opt = runs[1]
    opt.zero_grad(set_to_none=False)
    backward(model, 5)
    with torch.no_grad():
        model.head.weight.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after it was copied"):
        opt.step()


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


def _popped(model, opt):
    # its params are no longer stepped (found from outside: they were); put back after
    # the refusal (torch's state_dict() cannot save the state of a param in no group)
    opt.popped = opt.param_groups.pop(1)


def _reloaded(model, opt):
    # a state saved before this backward (state_dict() between backward and step() is
    # itself refused with the state in RAM: test_state_dict_between_backward_and_step)
    settle(opt)
    opt.load_state_dict(opt.saved_before_backward)


CHANGES = {
    "scaled": (_scaled, "changed after it was copied"),
    "replaced": (_replaced, "changed after it was copied"),
    ".data edit": (_data_edit, "changed after it was copied"),
    "dropped": (_dropped, "was dropped"),
    "torch clip": (_torch_clip, "changed after it was copied"),
    "lr": (_lr, r"param group 1's hyperparameters changed after its step started \(lr 0.01 -> 0.005"),
    "group popped": (_popped, r"param group 1, param \d \(shape .*\) was taken out of "
                              "param_groups after its step began in backward"),
    # (in files, load_state_dict replaces the whole state: no param named)
    "load_state_dict": (_reloaded, r"state (of .* )?was replaced \(load_state_dict\??\) after its "
                                   "step started"),
}


def test_a_nan_lr_is_refused_at_step_and_the_step_taken_once_undone(path):
    """A diverged schedule's NaN lr, set before backward: step() refuses it as torch's
    constructor does (torch's step made every param NaN, and with state files committed
    them so), with and without step_in_backward, nothing stepped (in backward neither:
    its hooks start no step of a group step() refuses); the lr set back, step() takes
    the same backward's grads, and both runs are the same."""
    runs = []
    for early in (False, True):
        model, opt = make(early)
        backward(model, 0)
        opt.step()
        opt.zero_grad()
        lr = opt.param_groups[1]["lr"]
        opt.param_groups[1]["lr"] = float("nan")
        backward(model, 1)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"Invalid learning rate: nan \(param group 1, "
                                             r"at step\(\)\)"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.param_groups[1]["lr"] = lr
        opt.step()
        opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not any(bool(a.float().isnan().any()) for a in runs[1])


def _snapshot(opt, model):
    held = states(opt)
    return {p: held[p]["master_param"].clone() for p in model.parameters() if held.get(p)}


def _in_second_backward(**kw):
    """A step_in_backward run one step in, with the second backward done (its
    early steps queued); returns the masters from before it too."""
    model, opt = make(True, **kw)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _snapshot(opt, model)
    saved = opt.state_dict()
    opt.saved_before_backward = {**saved, "state": {k: {key: v.clone() for key, v in st.items()}
                                                    for k, st in saved["state"].items()}}
    backward(model, 1)
    return model, opt, before


def _check_left_state(opt, model, before, after_plain, message, files=False):
    """Each param: stepped as by a plain step, or not stepped; as many stepped
    as the message says; param == master rounded. With the state in files
    (`files`): none stepped, as the message says."""
    stepped = 0
    held = states(opt)
    for p in model.parameters():
        if not held.get(p):  # never stepped (the unused layer)
            assert p not in before
            continue
        master = held[p]["master_param"]
        assert torch.equal(p, master.to(BF16))
        if after_plain[p] is not None and torch.equal(master, after_plain[p]):
            stepped += 1
        else:
            assert torch.equal(master, before[p])
    if files:
        assert stepped == 0
        assert ("Nothing was stepped: the state files and the params are those of the "
                "last completed step") in message
        return
    if "was replaced" in message:   # (in RAM: the steps of the state replaced are dropped)
        assert stepped == 0
        assert "are dropped: the params are those of the last completed step" in message
        return
    assert stepped > 0
    assert f"The Adam step of {stepped} params already ran" in message
    assert "the other params are not (and step_count, the largest of their steps, counts " \
        "this one)" in message
    assert opt.step_count == 2   # (one step before the backward)


def _reference_after_plain_step(path, it):
    """The masters after step `it` of a plain run (default mode)."""
    with path.outside():
        model, opt = make(False)
    for i in range(it + 1):
        backward(model, i)
        opt.step()
        opt.zero_grad()
    held = states(opt)
    return [held[p]["master_param"].clone() if held.get(p) else None
            for p in model.parameters()]


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_backward_is_an_error(path, change):
    edit, pattern = CHANGES[change]
    model, opt, before = _in_second_backward()
    edit(model, opt)   # (perhaps while the early steps still run)
    with pytest.raises(RuntimeError, match="step_in_backward=True forbids") as err:
        opt.step()
    message = str(err.value)
    # steps had started in the second backward (the error counts those that ran;
    # in files none is committed)
    if not path.files and change != "load_state_dict":
        assert re.search(r"The Adam step of [1-9]\d* params already ran", message), message
    assert re.search(pattern, message), message
    if hasattr(opt, "popped"):
        opt.param_groups.insert(1, opt.popped)
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    _check_left_state(opt, model, before, after, message, path.files)
    # training goes on: the next iterations run (and start early again)
    opt.zero_grad()
    for it in (2, 3):
        steps = steps_of(opt, model)
        backward(model, it)
        assert early_steps(opt, model, steps)
        opt.step()
        opt.zero_grad()


def test_a_step_retried_after_the_error_is_refused(path):
    """The natural retry after the error (the lr put back, step() again) stepped every
    param with the same grads once more, those stepped in backward twice, without a
    word (found from outside): with the state in RAM it is refused until zero_grad()
    and the next backward, nothing stepped; in files nothing was stepped, and the retry
    is the step."""
    model, opt, before = _in_second_backward()
    _lr(model, opt)
    with pytest.raises(RuntimeError, match="step_in_backward=True forbids"):
        opt.step()
    opt.param_groups[1]["lr"] *= 2
    left = _snapshot(opt, model)
    if path.files:
        opt.step()   # (the pass at step(): every param stepped once)
        after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
        assert all(torch.equal(m, after[p]) for p, m in _snapshot(opt, model).items())
    else:
        for _ in range(2):   # (and again: still refused)
            with pytest.raises(RuntimeError, match=r"the last step\(\) raised after the Adam "
                                                   r"step of [1-9]\d* params had run during "
                                                   r"backward.*twice.*nothing was stepped"):
                opt.step()
        assert all(torch.equal(m, left[p]) for p, m in _snapshot(opt, model).items())
    opt.zero_grad()
    for it in (2, 3):   # training goes on
        backward(model, it)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("drop", ["p.grad = None", "model.zero_grad()"])
def test_a_freed_grad_dropped_after_backward_is_an_error(path, drop):
    """With free_grads_after_copy the grads are FreedGrads after backward: one set to
    None (by hand or by the model's zero_grad) is a grad dropped, as without the option
    (torch would not step its param; its step ran in backward), not a freed one."""
    model, opt, before = _in_second_backward(free_grads_after_copy=True)
    if drop == "p.grad = None":
        model.head.weight.grad = None
    else:
        model.zero_grad()
    with pytest.raises(RuntimeError, match="step_in_backward=True forbids") as err:
        opt.step()
    assert re.search("was dropped after it was copied", str(err.value)), err.value
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    _check_left_state(opt, model, before, after, str(err.value), path.files)


def test_clip_grad_norm_and_grad_scaler_are_errors(path):
    model, opt = make(True)
    # (in files nothing is committed before step(): nothing was stepped; in host RAM the
    # first backward steps what its guess completes)
    ran = "Nothing was stepped: the state files" if path.files else "params already ran"
    backward(model, 0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called.*" + ran):
        opt.clip_grad_norm_(1.0)
    if path.files:
        opt.step()   # (nothing was stepped: this is the step)
    else:   # (the steps that ran in backward would run again)
        with pytest.raises(RuntimeError, match="would step those params twice"):
            opt.step()
    opt.zero_grad()
    backward(model, 1)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ was called.*" + ran):
        opt.clip_grad_norm_(1.0)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss_of(model, 2)).backward()
    with pytest.raises(RuntimeError, match="GradScaler.step was used.*" + ran):
        scaler.step(opt)


def test_zero_grad_before_step_is_an_error(path):
    model, opt, before = _in_second_backward()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called") as err:
        opt.zero_grad()
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    _check_left_state(opt, model, before, after, str(err.value), path.files)
    opt.step()  # no grads: nothing happens
    _check_left_state(opt, model, before, after, str(err.value), path.files)


@pytest.mark.parametrize("then", ["zero_grad", "backward", "step"])
def test_a_backward_that_raised_after_steps_started(path, then):
    """A backward interrupted (an error, or Ctrl-C, in a hook) after the steps of some
    params started in it. step() steps the params that got their grad, as torch's would
    (the interrupted param got none); zero_grad() or the backward again cannot be what
    they are in torch (the steps ran): they raise naming the interrupted backward, not a
    zero_grad or an accumulation the user did not make, and say what was stepped."""
    model, opt = make(True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _snapshot(opt, model)

    def interrupt(grad):   # the embedding's grad comes last: the others' steps started
        raise Boom("interrupted")
    hook = model.embed.weight.register_hook(interrupt)
    with pytest.raises(Boom):
        backward(model, 1)
    hook.remove()
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    if then == "step":
        opt.step()
        held = states(opt)
        for name, p in model.named_parameters():
            if p in before:
                master = held[p]["master_param"]
                expected = after[p] if p.grad is not None else before[p]
                assert torch.equal(master, expected), name
                assert torch.equal(p, master.to(BF16)), name
        assert model.embed.weight.grad is None
        return
    said = "the backward in which the step of some params started raised"
    if then == "zero_grad":
        with pytest.raises(RuntimeError, match=said) as err:
            opt.zero_grad()
    else:
        with pytest.raises(RuntimeError, match=said):
            backward(model, 1)
        with pytest.raises(RuntimeError, match=said) as err:
            opt.step()
    _check_left_state(opt, model, before, after, str(err.value), path.files)




@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_steps_in_backward_as_the_default(path, reentrant):
    """Reentrant checkpointing recomputes each segment in a backward of its own (another
    graph task) inside the outer one. A grad there was taken for a sign that the outer
    backward had raised: step() refused, the params whose steps had run in backward
    stepped and the others not (found from outside). Whichever kind, the training is the
    default's bit for bit."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
            self.head = torch.nn.Linear(32, 64)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            return self.head(h)

    runs = []
    for early in (False, True):
        torch.manual_seed(0)
        model = Checkpointed().to(BF16)
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2, step_in_backward=early,
                                 bucket_mb=0.004)
        for it in range(3):
            x = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(it))
            model(x).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same(*runs)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("where", FILES_PATHS)
def test_a_first_backward_that_raised_then_redone_is_the_plain_training(where, footprint,
                                                                        kernels, tmp_path):
    """The state in files, the first backward interrupted after the steps of some params
    started (a Ctrl-C in a hook between layers), zero_grad() refused saying nothing was
    stepped, and the iteration redone. The pass in backward was abandoned, and the
    masters it had made from the params (their first step) in buckets never committed
    were taken as agreeing with the params: the redone step read them from the files,
    zeros, and those params went to ~0 (found from outside). A first step starts from
    the param; the training then is the plain one."""
    def model_and_opt(**options):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16)).to(BF16)
        return m, offload_adam.AdamW(m.parameters(), lr=1e-3, bucket_mb=0.001, **options)

    def backward(m, it):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(it)).to(BF16)
        m(x).float().pow(2).mean().backward()

    def interrupt(grad):   # after the last layer's grads: their steps started
        raise KeyboardInterrupt

    def on_output(module, inputs, output):
        output.register_hook(interrupt)

    with sim_path(where, tmp_path) as path:
        model, opt = model_and_opt(step_in_backward=True, state_footprint=footprint)
        hook = model[1].register_forward_hook(on_output)
        with pytest.raises(KeyboardInterrupt):
            backward(model, 0)
        hook.remove()
        with pytest.raises(RuntimeError, match="the backward in which the step of some params "
                                               "started raised.*Nothing was stepped"):
            opt.zero_grad()
        with path.outside():
            plain, plain_opt = model_and_opt()
        for m, o in ((model, opt), (plain, plain_opt)):
            for it in range(2):
                backward(m, it)
                o.step()
                o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name



def test_a_ctrl_c_while_a_grad_is_packed_leaves_no_empty_pack(sim, monkeypatch):
    """A KeyboardInterrupt inside a backward hook, between a packed piece's pack made and
    the piece put in it, left an empty pack, and zero_grad() then raised a bare
    IndexError before the grads were zeroed (found from outside, by SIGINT at random
    instants). The grads are zeroed (step_in_backward's error if steps had started), and
    training goes on."""
    from offload_adam.engine import layout
    model, opt = make(True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    of, calls = layout.Piece.of, []

    def interrupted_of(self, t):
        if self.packed and not calls:
            calls.append(self)
            raise KeyboardInterrupt
        return of(self, t)
    monkeypatch.setattr(layout.Piece, "of", interrupted_of)
    with pytest.raises(KeyboardInterrupt):
        backward(model, 1)
    monkeypatch.setattr(layout.Piece, "of", of)
    assert calls
    try:   # (raises when steps had started before the interrupt: saying so)
        opt.zero_grad()
    except RuntimeError as e:
        assert "the backward in which the step of some params started raised" in str(e)
    assert all(p.grad is None for p in model.parameters())
    for it in (2, 3):
        backward(model, it)
        opt.step()
        opt.zero_grad()

def test_state_dict_between_backward_and_step(path):
    """A checkpoint taken between backward and step(): in host RAM the steps started in
    backward already hold the next step's state (beside this step's weights): refused,
    and the iteration goes on; in files nothing is committed before step(), so the state
    dict is the last completed step's. Either way the run equals the default's."""
    model, opt, before = _in_second_backward()
    if path.files:
        saved = opt.state_dict()
        assert {float(st["step"]) for st in saved["state"].values()} == {1.0}
    else:
        with pytest.raises(RuntimeError, match=r"state_dict\(\) was called between backward "
                                               r"and step\(\) with step_in_backward=True"):
            opt.state_dict()
        # a copy or pickle of the optimizer likewise (it copied some params' state a
        # step ahead, one param's moments of the next step beside its count of this one:
        # found from outside)
        for copy_of in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
            with pytest.raises(RuntimeError, match=r"__getstate__ \(copy.deepcopy, pickle, "
                                                   r"torch.save of it\) was called between"):
                copy_of(opt)
    opt.step()
    after = _reference_after_plain_step(path, 1)
    held = states(opt)
    for p, expected in zip(model.parameters(), after):
        if expected is not None:
            assert torch.equal(held[p]["master_param"], expected)
    assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {1.0, 2.0}


def test_state_dict_across_a_backward_that_starts_steps_is_refused(path):
    """A checkpoint thread's state_dict() while the training thread's backward starts
    steps (the check before the read passed; the steps began during it) returned state of
    two steps (found from outside). Here the backward runs in a state dict pre-hook,
    between that check and the read: in host RAM refused; in files the dict is the last
    completed step's. The iteration goes on with step()."""
    model, opt = make(True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    handle = opt.register_state_dict_pre_hook(lambda o: backward(model, 1))
    if path.files:
        assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {1.0}
    else:
        with pytest.raises(RuntimeError, match=r"state_dict\(\) read the state while a backward "
                                               r"\(in another thread\) started the step"):
            opt.state_dict()
    handle.remove()
    opt.step()
    opt.zero_grad()
    assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {1.0, 2.0}


def test_accumulation_is_an_error(path):
    model, opt, before = _in_second_backward()
    with pytest.raises(RuntimeError, match="a grad arrived again.*accumulation"):
        backward(model, 11)
    with pytest.raises(RuntimeError, match="a grad arrived again") as err:
        opt.step()
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    _check_left_state(opt, model, before, after, str(err.value), path.files)


def test_a_load_after_a_step_that_never_came_says_how_to_go_on(path):
    """An exception between backward and step() (a Ctrl-C; HF Trainer's resume in the same
    process then loads a checkpoint and trains): the steps that started in backward were
    neither finished nor dropped, and the refusal (at the next backward in RAM, at step()
    with the files, whose load abandons the pass) named accumulation or a replaced state
    only (found from outside). It says what to call; calling it, training goes on."""
    model, opt, before = _in_second_backward()
    opt.load_state_dict(opt.saved_before_backward)
    with pytest.raises(RuntimeError, match=r"opt.step\(\) finishes that step and "
                                           r"opt.zero_grad\(\) drops it"):
        backward(model, 2)
        opt.step()
    model, opt, before = _in_second_backward()
    opt.step()   # what the message says: the step finished, then the checkpoint loaded
    opt.zero_grad()
    opt.load_state_dict(opt.saved_before_backward)
    backward(model, 2)
    opt.step()
    assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {2.0}


# ---- less travelled branches ------------------------------------------------------------
# bucket_mb this small puts every param of the MLP in a bucket of its own.


def test_dead_owner_starts_no_early_step(path):
    """The engine's hooks outlive the optimizer while someone holds the
    engine; with the owner gone (no groups, no state) they only copy the grads
    and start nothing. The engine still steps when driven directly. (Its owner
    here is a BareEngine: the engine's own API, the way the optimizer drives it.)"""
    model = make_mlp()
    opt = BareEngine(model.parameters(), step_in_backward=True, **MLP_OPTS)
    run(model, opt, 1, loss=mlp_loss)
    engine, groups, state = opt.engine, opt.param_groups, opt.state
    owner = weakref.ref(opt)
    del opt
    gc.collect()
    assert owner() is None
    mlp_loss(model, 1).backward()
    engine.drain()   # whatever was queued has run
    assert all(r.copy is not None for r in engine.recs) and not engine.early.stepped()
    engine.step(groups, state)
    assert [float(state[p]["step"]) for p in model.parameters()] == [2.0] * 4
    for p in model.parameters():
        assert torch.equal(p, state[p]["master_param"].to(BF16))


@pytest.mark.parametrize("when", ["from the start", "turned on after step 1"])
def test_amsgrad_early_start_is_bitwise_equal_to_the_default(path, when):
    """amsgrad with steps started in backward, also when amsgrad is switched on
    later (its max_exp_avg_sq buffers are then added by the early start; in
    files that is refused: _amsgrad_switched_on_in_files_is_refused)."""
    if path.files and when == "turned on after step 1":
        _amsgrad_switched_on_in_files_is_refused(path)
        return
    runs = []
    for early in (False, True):
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=early,
                                 amsgrad=when == "from the start", **MLP_OPTS)
        started = []
        for it in range(4):
            if it == 1:
                for g in opt.param_groups:
                    g["amsgrad"] = True
            before = steps_of(opt, model)
            mlp_loss(model, it).backward()
            started.append(early_steps(opt, model, before) if early else 0)
            opt.step()
            opt.zero_grad()
        # (the first backward's guess of the order is right: the last params first)
        assert started == ([4, 4, 4, 4] if early else [0, 0, 0, 0])
        runs.append((model, opt))
    assert_same(*runs)
    (m0, o0), (m, o) = runs
    held0, held = states(o0), states(o)
    for p, q in zip(m0.parameters(), m.parameters()):
        assert torch.equal(held0[p]["max_exp_avg_sq"], held[q]["max_exp_avg_sq"])
    # amsgrad really ran: max_exp_avg_sq is not exp_avg_sq
    assert any(not torch.equal(held[p]["max_exp_avg_sq"], held[p]["exp_avg_sq"])
               for p in m.parameters())


def _amsgrad_switched_on_in_files_is_refused(path):
    """state_dirs=: amsgrad cannot change after construction (options.py: the files
    are laid out with or without max_exp_avg_sq). The step after the switch raises,
    nothing stepped (the pass started in backward too), and training goes on once it
    is switched back, as if that iteration never ran."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **MLP_OPTS)
    run(model, opt, 1, loss=mlp_loss)
    for g in opt.param_groups:
        g["amsgrad"] = True
    mlp_loss(model, 1).backward()
    params = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="state_dtype and amsgrad cannot change with state_dirs="):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert steps_of(opt, model) == [1.0] * 4
    for g in opt.param_groups:
        g["amsgrad"] = False
    opt.zero_grad()
    run(model, opt, 2, start=2, loss=mlp_loss)
    with path.outside():
        ref = make_mlp()
        ropt = offload_adam.AdamW(ref.parameters(), **MLP_OPTS)
    run(ref, ropt, 1, loss=mlp_loss)
    run(ref, ropt, 2, start=2, loss=mlp_loss)
    assert_same((model, opt), (ref, ropt))


def test_grad_scale_after_early_steps_is_an_error(path):
    """The early steps used the grads unscaled: a step() that asks for a scale
    (clipping coefficient, 1/loss scale) cannot be honoured and says so."""
    model = make_mlp()
    # The optimizer asks for a scale only through clipping or GradScaler, which
    # refuse earlier: the engine's own step() is driven here (BareEngine).
    opt = BareEngine(model.parameters(), step_in_backward=True, **MLP_OPTS)
    run(model, opt, 1, loss=mlp_loss)
    mlp_loss(model, 1).backward()
    opt.engine.drain()
    assert opt.engine.early.stepped()   # started during backward
    with pytest.raises(RuntimeError, match=r"scales the grads by 0\.5 .*stepped unscaled"
                       r".*The Adam step of 4 params already ran"):
        opt.step(grad_scale=0.5)
    assert steps_of(opt, model) == [2.0] * 4
    assert_param_is_master_rounded(opt, model)


def test_failing_early_kernel_leaves_stepped_params_consistent(path, monkeypatch):
    """An early step whose kernel raises: step() re-raises that exception, the
    bucket stepped before it has its param written (param == master rounded),
    the failed and the skipped ones are not stepped, and training goes on. (In
    files none is stepped: nothing is committed before step().)"""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **MLP_OPTS)
    run(model, opt, 1, loss=mlp_loss)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def fail_second(args):
        calls.append(1)
        if len(calls) == 2:  # the first bucket runs, the second fails
            raise Boom("kernel failed")

    kernels_that(monkeypatch, fail_second)
    mlp_loss(model, 1).backward()
    with pytest.raises(Boom, match="kernel failed"):
        opt.step()
    monkeypatch.undo()
    steps = steps_of(opt, model)
    assert sorted(steps) == ([1.0] * 4 if path.files else [1.0, 1.0, 1.0, 2.0])
    assert_param_is_master_rounded(opt, model)
    for p, b, n in zip(model.parameters(), before, steps):
        assert torch.equal(p, b) == (n == 1.0)
    opt.zero_grad()
    run(model, opt, 2, start=2, loss=mlp_loss)
    assert sorted(steps_of(opt, model)) == ([3.0] * 4 if path.files else [3.0, 3.0, 3.0, 4.0])
    assert_param_is_master_rounded(opt, model)


def _wide_loss(model, seed):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(seed))
    return model(x.to(BF16)).float().pow(2).sum()


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
def test_a_kernel_failing_between_the_parts_of_a_param_is_not_stepped_on(sim, monkeypatch,
                                                                         early):
    """A 256x256 weight is cut in two pieces, each in a bucket of its own; the kernel of
    its second piece raises after the first one's ran. That param's state is part one
    step, part the next (its "step" says stepped): step(), a backward's early steps and
    state_dict() refuse it, naming the param, until a checkpoint is loaded; then training
    goes on as if the failure had never been."""
    def make_wide():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                   torch.nn.Linear(256, 8)).to(BF16)
    model = make_wide()
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=early, **MLP_OPTS)
    run(model, opt, 1, loss=_wide_loss)
    saved = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    calls = []

    def fail_fifth(args):   # (the buckets in hook order: 8-bias, 8x256, 256-bias, 256x256
        calls.append(1)     # in two pieces)
        if len(calls) == 5:
            raise Boom("kernel failed")
    kernels_that(monkeypatch, fail_fifth)
    _wide_loss(model, 1).backward()
    with pytest.raises(Boom, match="kernel failed"):
        opt.step()
    monkeypatch.undo()
    torn = (r"a step raised \(Boom: kernel failed\) after its kernels had stepped some of "
            r"the parts of param group 0, param 0 \(shape \(256, 256\)\).* load_state_dict")
    opt.zero_grad()
    _wide_loss(model, 2).backward()
    with pytest.raises(RuntimeError, match=torn):
        opt.step()
    assert steps_of(opt, model) == [2.0] * 4   # (nothing stepped in that backward either)
    with pytest.raises(RuntimeError, match=torn):
        opt.state_dict()
    opt.zero_grad()
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved[0]):
            p.copy_(v)
    opt.load_state_dict(saved[1])
    run(model, opt, 2, start=1, loss=_wide_loss)
    ref = make_wide()
    ref_opt = offload_adam.AdamW(ref.parameters(), step_in_backward=early, **MLP_OPTS)
    run(ref, ref_opt, 3, loss=_wide_loss)
    assert_same((model, opt), (ref, ref_opt))


def test_a_param_written_between_backward_and_step_is_said(path):
    """A model's load_state_dict between backward and step() after the params' steps
    began in backward from their values before: the params were written at step() from
    their masters, the load lost silently (found from outside). In RAM it is refused,
    saying the values written are replaced by the step's (a load of the same values,
    a whole checkpoint, then changes nothing). With the state in files nothing is
    committed before step(): nothing is stepped, and the values written are kept."""
    def load(model):
        zeros = torch.zeros_like(model.head.weight)
        model.load_state_dict({**model.state_dict(), "head.weight": zeros})

    model, opt, _ = _in_second_backward()
    # (the files' pass in backward may still be reading params to check their masters
    # on the worker, a read the load would race on a GPU: its result is abandoned with
    # the pass here, but the simulated device reports any race, so the load waits)
    settle(opt)
    load(model)
    if path.files:
        with pytest.raises(RuntimeError, match=r"was written \(a load_state_dict of the "
                                               r"model, an in-place edit\) after its step "
                                               r"began in backward from its values before; "
                                               r".*Nothing was stepped: .* and so are the "
                                               r"params but those written since backward"):
            opt.step()
        assert not model.head.weight.any()
        opt.zero_grad()
        backward(model, 2)
        opt.step()
        return
    with pytest.raises(RuntimeError, match=r"param group \d, param \d+ \(shape .*\) was "
                                           r"written \(a load_state_dict of the model, an "
                                           r"in-place edit\) after its step began in backward "
                                           r"from its values before: the values written are "
                                           r"replaced by the step's"):
        opt.step()
    after = dict(zip(model.parameters(), _reference_after_plain_step(path, 1)))
    assert torch.equal(states(opt)[model.head.weight]["master_param"], after[model.head.weight])
    assert_param_is_master_rounded(opt, model)
    opt.zero_grad()
    backward(model, 2)
    opt.step()


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="exception notes: Python 3.11")
def test_a_closure_that_raises_after_its_backward_says_steps_began(path):
    """step(closure) whose closure raised after its backward started steps passed the
    error on with nothing said; the next zero_grad() then spoke of a backward without
    a step() to follow (found from outside). The closure's error carries a note."""
    model, opt = make(True)

    def closure():
        backward(model, 0)
        raise ValueError("the data loader failed")
    with pytest.raises(ValueError, match="the data loader failed") as err:
        opt.step(closure)
    assert any("the closure raised after its backward had started the step of some params"
               in note for note in getattr(err.value, "__notes__", ())), err.value
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()


def test_a_close_from_another_thread_during_a_stepping_backward_waits_for_the_hook(kernels):
    """A watchdog's close() while the training thread's backward is inside the engine's
    hook (step_in_backward): close() tore the records down under the hook, and the
    backward raised an AttributeError from inside the engine (found from outside: 7 of 36
    runs). close() now waits for the hook running, then the hooks are gone: the backward
    ends, step() says the optimizer was closed, and its state stays readable, each param
    at its last step or the one begun in this backward (said by close()'s warning)."""
    import threading
    import warnings
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4)).to(BF16)
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, bucket_mb=0.002)
    x = torch.randn(8, 16).to(BF16)
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    engine, closed, calls, seen = opt._engine, threading.Event(), [], []
    real = engine._take

    def take(rec):   # the last hook of the backward: a watchdog closes meanwhile
        calls.append(rec)
        if len(calls) == 4:
            seen.append(threading.Thread(target=lambda: (opt.close(), closed.set())))
            seen[0].start()
            seen.append(closed.wait(0.5))   # (close() must wait for this hook)
        real(rec)
    engine._take = take
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(x).float().pow(2).mean().backward()
        seen[0].join(30)
    assert seen[1] is False and closed.is_set()
    with pytest.raises(RuntimeError, match="this optimizer was closed"):
        opt.step()
    steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    assert set(steps) <= {2.0, 3.0} and len(steps) == 4
    kept = [str(w.message) for w in said if "between backward and step()" in str(w.message)]
    assert len(kept) == (1 if 3.0 in steps else 0), (steps, kept)
