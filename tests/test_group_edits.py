"""Direct edits of optimizer.param_groups after construction, as torch.optim allows
them: each step follows param_groups as they are then (a param taken out is not
stepped and keeps its state; a group's hyperparameters are those of the group its
params are in now), on every path (in place, the engine's, the state in files), or,
where the offloaded state cannot follow (a param put into a group's list directly), a
clear error naming the param."""
import pytest
import torch

import offload_adam

from models import train_with_edit

N = 4


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=g) for _ in range(N)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=g) for _ in range(N)]


def _groups(ps):
    return [{"params": ps[:2], "lr": 0.1},
            {"params": ps[2:], "lr": 0.01, "weight_decay": 0.5, "betas": (0.8, 0.9)}]


def _train(make, edit, steps=3, backward=False):
    """`steps` steps over _groups, `edit(opt, params)` before the second."""
    return train_with_edit(make, edit, _params(), _grads, _groups, steps, 1, backward)


def _delete(opt, ps):
    del opt.param_groups[0]["params"][1]


def _reverse(opt, ps):
    opt.param_groups.reverse()


def _pop(opt, ps):
    opt.param_groups.pop()


def _pop_then_add(opt, ps):   # a new group under the index the popped one had
    opt.param_groups.pop()
    opt.add_param_group({"params": [ps[3]], "lr": 0.05})


def _replace_dict(opt, ps):   # a group dict of its own, same params
    opt.param_groups[1] = {**opt.param_groups[1], "lr": 0.2}


EDITS = {"delete": _delete, "reverse": _reverse, "pop": _pop,
         "pop_then_add": _pop_then_add, "replace_dict": _replace_dict}


@pytest.mark.parametrize("edit", EDITS)
def test_each_step_follows_the_param_groups_as_edited(path, edit):
    # torch.optim.AdamW steps what param_groups hold at each step, with each group's
    # hyperparameters; so does offload_adam, whichever path steps the params.
    if path.files and edit == "pop_then_add":
        pytest.skip("add_param_group cannot be used with state_dirs=")
    ref, _ = _train(torch.optim.AdamW, EDITS[edit])
    with path.outside():   # our in-place path: the bitwise reference
        ours, _ = _train(offload_adam.AdamW, EDITS[edit])
    out, opt = _train(lambda g: offload_adam.AdamW(g, bucket_mb=0.0001), EDITS[edit])
    for a, b, c in zip(out, ours, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    if edit == "delete":   # the param taken out kept its state of step 1
        before, _ = _train(offload_adam.AdamW, _delete, steps=1)
        assert torch.equal(out[1], before[1])


@pytest.mark.parametrize("edit", ["delete", "reverse"])
def test_step_in_backward_follows_the_param_groups_as_edited(sim, edit):
    # the engine's hooks copy (and step, in backward) only the params in a group now
    ref, _ = _train(torch.optim.AdamW, EDITS[edit], backward=True)
    out, _ = _train(lambda g: offload_adam.AdamW(g, bucket_mb=0.0001, step_in_backward=True),
                    EDITS[edit], backward=True)
    for a, c in zip(out, ref):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key,value,error,message", [
    ("lr", -0.01, ValueError, r"Invalid learning rate: -0.01 \(param group 1, at step\(\)\)"),
    ("lr", float("nan"), ValueError, r"Invalid learning rate: nan \(param group 1"),
    ("lr", "0.01", TypeError, r"lr must be a float or a 1-element tensor, not str '0.01' "
                              r"\(param group 1"),
    ("lr", torch.tensor([0.1, 0.2]), ValueError, r"Tensor lr must be 1-element \(param group 1"),
    ("eps", float("nan"), ValueError, r"Invalid epsilon value: nan \(param group 1"),
    ("betas", (0.9, 1.5), ValueError, r"Invalid beta parameter at index 1: 1.5 \(param group 1"),
    ("betas", (0.9,), ValueError, r"betas must be a pair \(beta1, beta2\), not \(0.9,\) "
                                  r"\(param group 1"),
    ("weight_decay", -0.1, ValueError, r"Invalid weight_decay value: -0.1 \(param group 1"),
    ("capturable", True, ValueError, r"does not support capturable=True \(param group 1, at "
                                     r"step\(\)\)"),
    ("differentiable", True, ValueError, r"does not support differentiable=True"),
], ids=["lr<0", "lr_nan", "lr_str", "lr_tensor2", "eps_nan", "beta2>1", "betas1",
        "wd<0", "capturable", "differentiable"])
def test_a_value_torch_refuses_set_later_is_refused_at_step(path, key, value, error, message):
    """What torch's constructor refuses, set in a group after it (a scheduler's NaN, a
    typo): torch's step takes most of them (NaN params, an ascent) or fails on its own
    arithmetic; step() refuses them on every path, naming the group and the value,
    before any param moves, and steps once the value is set right."""
    ps = [p.clone().requires_grad_() for p in _params()]
    opt = offload_adam.AdamW(_groups(ps), bucket_mb=0.0001)
    for p, g in zip(ps, _grads(0)):
        p.grad = g.clone()
    opt.step()
    good = opt.param_groups[1].get(key, False)
    opt.param_groups[1][key] = value
    before = [p.detach().clone() for p in ps]
    with pytest.raises(error, match=message):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    opt.param_groups[1][key] = good
    opt.step()
    assert opt.step_count == 2 and not any(torch.equal(p, b) for p, b in zip(ps, before))


def test_a_param_put_into_a_group_directly_is_refused_by_name(path):
    # The engine and the files lay out their memory for the params added through the
    # optimizer: one appended to a group's list is an error naming it, nothing stepped
    # (in place, in RAM, it is stepped as torch does).
    new = torch.randn(5, 2, requires_grad=True)

    def append(opt, ps):
        opt.param_groups[1]["params"].append(new)
        new.grad = torch.ones_like(new)

    if not path.engine and not path.files:
        _, opt = _train(offload_adam.AdamW, append, steps=2)
        assert float(opt.state[new]["step"]) == 1
        return
    ps = [p.clone().requires_grad_() for p in _params()]
    opt = offload_adam.AdamW(_groups(ps), bucket_mb=0.0001)
    for p, g in zip(ps, _grads(0)):
        p.grad = g.clone()
    opt.step()
    before = [p.detach().clone() for p in ps]
    append(opt, ps)
    with pytest.raises(RuntimeError, match=r"param group 1, param 2 \(shape \(5, 2\)\) was put "
                                           r"into param_groups\[1\]\['params'\].*add_param_group"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_a_param_put_into_a_named_group_is_named_by_its_place(path):
    """A group of named params (model.named_parameters()) has no name for a param
    appended to its list by hand: it is named by group and index (it was an IndexError
    from the label), stepped in place as torch does, refused by the engine and files."""
    a, b, new = (torch.randn(4, requires_grad=True) for _ in range(3))
    opt = offload_adam.AdamW([("a", a), ("b", b)], lr=0.1)
    opt.param_groups[0]["params"].append(new)
    for p in (a, b, new):
        p.grad = torch.ones_like(p)
    if not path.engine and not path.files:
        before = new.detach().clone()
        opt.step()
        torch.testing.assert_close(new.detach(), before - 0.1 * (1 + 0.01 * before))
        return
    with pytest.raises(RuntimeError, match=r"param group 0, param 2 \(shape \(4,\)\)"):
        opt.step()


@pytest.mark.parametrize("into", [0, 1])
def test_a_param_listed_twice_by_hand_is_refused_by_name(path, into):
    """A param appended again by hand to a group's list (its own or another's): torch
    steps it twice a step; in place it raised a bare TypeError from inside, and the
    engine and the files stepped it once, silently (found from outside). Refused on
    every path, naming both places, nothing stepped; taken out again, training goes on."""
    ps = [p.clone().requires_grad_() for p in _params()]
    opt = offload_adam.AdamW(_groups(ps), bucket_mb=0.0001)
    for step in range(2):
        for p, g in zip(ps, _grads(step)):
            p.grad = g.clone()
        opt.step()
        if step == 0:
            opt.param_groups[into]["params"].append(ps[1])
            before = [p.detach().clone() for p in ps]
            place = f"param group {into}, param {len(opt.param_groups[into]['params']) - 1}"
            with pytest.raises(ValueError, match=place + r" \(shape \(4, 3\)\) is the same "
                                                 r"tensor as param group 0, param 1 .*listed "
                                                 "twice in param_groups"):
                opt.step()
            assert all(torch.equal(p, b) for p, b in zip(ps, before))
            opt.param_groups[into]["params"].pop()
    assert [float(st["step"]) for st in opt.state_dict()["state"].values()] == [2.0] * N


def test_a_param_moved_to_another_group_is_refused_by_name(path):
    """A param of group 0 moved into group 1's list by hand: stepped with group 1's
    hyperparameters in place (as torch does); the engine and the files, which step a
    group's buckets with one group's, refuse it naming the param (with the state in
    files that was "Boolean value of Tensor with more than one value is ambiguous",
    from the error's own label: list.index compares tensors with ==)."""
    ps = [p.clone().requires_grad_() for p in _params()]
    opt = offload_adam.AdamW(_groups(ps), bucket_mb=0.0001)
    for step in range(2):
        for p, g in zip(ps, _grads(step)):
            p.grad = g.clone()
        if step == 1:
            opt.param_groups[0]["params"].pop(1)
            opt.param_groups[1]["params"].append(ps[1])
        if step == 0 or not (path.engine or path.files):
            opt.step()
            continue
        before = [p.detach().clone() for p in ps]
        # (named by its place when added, or now: param group 0, param 1 / 1, 2)
        with pytest.raises(RuntimeError, match=r"param group (0, param 1|1, param 2) \(shape "
                                               r"\(4, 3\)\) is now in param group 1"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
    if not (path.engine or path.files):
        assert opt.param_groups[1]["params"][-1] is ps[1]


def _swap(opt, ps):   # a param of each group traded by hand: the groups split
    g0, g1 = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
    g0[1], g1[0] = g1[0], g0[1]


def _bf16_state(opt, ps):   # one group's state_dtype changed after building
    opt.param_groups[1]["state_dtype"] = "bfloat16"


def _inf_lr(opt, ps):   # past the kernel's float32 step size
    opt.param_groups[1]["lr"] = float("inf")


def _beta_one(opt, ps):   # torch's constructor refuses it too
    opt.param_groups[0]["betas"] = (1.0, 0.999)


def _twice(opt, ps):   # a param appended again by hand
    opt.param_groups[1]["params"].append(ps[0])


@pytest.mark.parametrize("edit", [_swap, _bf16_state, _inf_lr, _beta_one, _twice],
                         ids=["split", "state_dtype", "lr", "betas", "twice"])
def test_an_edit_that_step_refuses_steps_nothing_in_backward(path, edit):
    """step_in_backward with an edit of the groups that step() refuses (a group split
    over two, one group's state_dtype changed, an lr or a beta step() refuses): backward
    steps none of the buckets, and raises nothing (an lr refused from the first grad hook
    stopped backward with one grad made, and step() after the edit was undone stepped that
    param alone, silently: found from outside), so
    the refusal leaves every param and its state at the last step; undone before step()
    is called again, the training is bit for bit the one never edited. (Found from
    outside: the other group's buckets stepped in backward, and step() then refused
    with the optimizer half a step ahead, the masters no longer the params', its
    state_dict() and zero_grad() refused.)"""
    if not path.engine:
        pytest.skip("step_in_backward runs on the engine")
    def undone(opt, ps):
        saved = [dict(g, params=list(g["params"])) for g in opt.param_groups]
        edit(opt, ps)
        sum((p * g).sum() for p, g in zip(ps, _grads(1))).backward()
        assert all(p.grad is not None for p in ps)
        before = [p.detach().clone() for p in ps]
        with pytest.raises((RuntimeError, ValueError),
                           match="is now in param group|state_dtype changed|lr=inf|cannot "
                                 "change with state_dirs=|listed twice|"
                                 r"Invalid beta parameter at index 0: 1\.0 \(param group 0"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
        steps = lambda: [float(st["step"]) for st in opt.state_dict()["state"].values()]
        assert steps() == [1.0] * N
        for g, was in zip(opt.param_groups, saved):
            g["params"][:] = was.pop("params")
            g.update(was)
        opt.step()   # the grads of the backward above, stepped now
        opt.zero_grad()
        assert steps() == [2.0] * N

    make = lambda groups: offload_adam.AdamW(groups, bucket_mb=0.0001, step_in_backward=True)
    ran = []
    for e in (undone, lambda opt, ps: None):
        ps = [p.clone().requires_grad_() for p in _params()]
        opt = make(_groups(ps))
        for s in range(4):
            if s == 1:
                e(opt, ps)
                if e is undone:
                    continue   # (its step is the one undone() made)
            sum((p * g).sum() for p, g in zip(ps, _grads(s))).backward()
            opt.step()
            opt.zero_grad()
        ran.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*ran))
