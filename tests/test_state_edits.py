"""Direct edits of optimizer.state between steps, as torch.optim allows them: an entry
removed (`opt.state.clear()`, `del opt.state[p]`, a new `opt.state`, an entry replaced
or cleared) leaves the param without state, so its next step starts afresh; a tensor
set in an entry is that part of the param's state. Every path follows them as torch's
optimizers do, the state in files too (whose entries in optimizer.state are empty: the
edits are loaded into the files at the next step), and state_dict() shows them."""
import collections
import io

import pytest
import torch

import offload_adam
from offload_adam.testing import AsyncSimDevice, simulated, state_in_files

from models import train_with_edit

N = 3


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 4, generator=g) for _ in range(N)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(5, 4, generator=g) for _ in range(N)]


def _groups(ps):
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]


def _train(make, edit, steps=4, backward=False):
    """`steps` steps over _groups, `edit(opt, params)` before the third."""
    return train_with_edit(make, edit, _params(), _grads, _groups, steps, 2, backward)


def _clear(opt, ps):
    opt.state.clear()


def _delete(opt, ps):
    del opt.state[ps[1]]


def _new_state(opt, ps):
    opt.state = collections.defaultdict(dict)


def _replace_entry(opt, ps):
    opt.state[ps[0]] = {}


def _clear_entry(opt, ps):
    opt.state[ps[2]].clear()


def _set_moment(opt, ps):
    opt.state[ps[0]]["exp_avg"] = torch.full((5, 4), 0.25)


def _set_step(opt, ps):
    opt.state[ps[2]]["step"] = torch.tensor(10.0)


EDITS = {"clear": _clear, "delete": _delete, "new_state": _new_state,
         "replace_entry": _replace_entry, "clear_entry": _clear_entry,
         "set_moment": _set_moment, "set_step": _set_step}


@pytest.mark.parametrize("edit", EDITS)
def test_each_step_follows_optimizer_state_as_edited(path, edit):
    ref, _ = _train(lambda g: torch.optim.AdamW(g, lr=0.01), EDITS[edit])
    with path.outside():   # our in-place path, the state in RAM: the bitwise reference
        ours, _ = _train(lambda g: offload_adam.AdamW(g, lr=0.01), EDITS[edit])
        unedited, _ = _train(lambda g: offload_adam.AdamW(g, lr=0.01), lambda o, p: None)
    out, opt = _train(lambda g: offload_adam.AdamW(g, lr=0.01, bucket_mb=0.0001), EDITS[edit])
    for a, b, c in zip(out, ours, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(out, unedited))   # (the edit counts)
    if path.files:   # the entries are empty again: the state is in the files
        assert all(len(opt.state[p]) == 0 for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("edit", ["clear", "set_moment"])
def test_state_dict_shows_an_edit_before_the_step_loads_it(tmp_path, kernels, edit):
    ps = [p.clone().requires_grad_() for p in _params()]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = offload_adam.AdamW(ps, lr=0.01, state_dirs=[tmp_path])
    torch_opt = torch.optim.AdamW(ref, lr=0.01)
    for p, r, g in zip(ps, ref, _grads(0)):
        p.grad, r.grad = g.clone(), g.clone()
    opt.step()
    torch_opt.step()
    EDITS[edit](opt, ps)
    EDITS[edit](torch_opt, ref)
    got, want = opt.state_dict()["state"], torch_opt.state_dict()["state"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert sorted(got[k]) == sorted(want[k])
        for key in want[k]:
            torch.testing.assert_close(got[k][key], want[k][key], rtol=1e-6, atol=0)


def test_reading_a_key_of_a_file_entry_says_where_the_state_is(tmp_path, kernels):
    p = torch.nn.Parameter(torch.randn(4))
    opt = offload_adam.AdamW([p], state_dirs=[tmp_path])
    p.grad = torch.randn(4)
    opt.step()
    with pytest.raises(KeyError, match=r"state_dirs= files.*state_dict\(\)\['state'\]"):
        opt.state[p]["exp_avg"].zero_()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("edit", ["clear", "set_moment"])
def test_step_in_backward_with_files_follows_an_edit_made_before_backward(
        tmp_path, kernels, footprint, edit):
    # the backward after the edit does none of the files' work (its first grad sees the
    # edit); step() loads the edit, then steps every bucket
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim), sim.watch():
            out, _ = _train(lambda g: offload_adam.AdamW(
                g, lr=0.01, bucket_mb=0.0001, step_in_backward=True,
                state_dirs=[tmp_path], state_footprint=footprint),
                EDITS[edit], steps=5, backward=True)
        sim.check()
    finally:
        sim.close()
    with simulated(None), state_in_files(None):
        ours, _ = _train(lambda g: offload_adam.AdamW(g, lr=0.01), EDITS[edit], steps=5)
    for a, b in zip(out, ours):
        assert torch.equal(a, b)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_edit_between_backward_and_step_in_backward_is_refused_then_used(
        tmp_path, kernels, footprint):
    # the files' work began in backward from the state before the edit: that step() raises
    # naming the param, steps nothing, and the next iteration runs from the edited state
    def run(make, sim_on):
        ps = [p.clone().requires_grad_() for p in _params()]
        opt = make(ps)
        for s in range(4):
            sum((p * g).sum() for p, g in zip(ps, _grads(s))).backward()
            if s == 2:
                opt.state.clear()
                if sim_on:
                    with pytest.raises(RuntimeError, match="optimizer.state was changed"):
                        opt.step()
                    opt.zero_grad()
                    sum((p * g).sum() for p, g in zip(ps, _grads(s))).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in ps]

    with simulated(None), state_in_files(None):
        ours = run(lambda ps: offload_adam.AdamW(ps, lr=0.01), False)
    sim = AsyncSimDevice(seed=0)
    try:
        with simulated(sim), sim.watch():
            out = run(lambda ps: offload_adam.AdamW(
                ps, lr=0.01, bucket_mb=0.0001, step_in_backward=True,
                state_dirs=[tmp_path], state_footprint=footprint), True)
        sim.check()
    finally:
        sim.close()
    for a, b in zip(out, ours):
        assert torch.equal(a, b)


def _own_key(opt, ps):
    opt.state[ps[1]]["clip_count"] = torch.tensor(3.0)   # a library's count, say


def test_a_key_of_the_users_own_stays_and_changes_nothing(path):
    """torch's optimizers keep an entry of the user's own in a param's state through
    steps and a state_dict() / load_state_dict round trip (a shape-() tensor too); so
    does every path, the state in files too (the entry stays in RAM beside the files),
    and the training is as without it."""
    with path.outside():
        ref, _ = _train(lambda g: offload_adam.AdamW(g, lr=0.01), lambda o, p: None, steps=5)
    out, opt = _train(lambda g: offload_adam.AdamW(g, lr=0.01, bucket_mb=0.0001), _own_key)
    ps = [p for g in opt.param_groups for p in g["params"]]
    assert float(opt.state[ps[1]]["clip_count"]) == 3.0   # after two steps
    sd = opt.state_dict()
    assert float(sd["state"][1]["clip_count"]) == 3.0 and "exp_avg" in sd["state"][1]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    assert float(opt.state[ps[1]]["clip_count"]) == 3.0
    for p, g in zip(ps, _grads(4)):
        p.grad = g.clone()
    opt.step()
    assert float(opt.state_dict()["state"][1]["clip_count"]) == 3.0
    for a, b in zip(ps, ref):
        assert torch.equal(a.detach(), b)
