"""Bad input fails early, with torch's messages where torch has one and with the
param's name (or group and index) and shape where we add a check."""
import pytest
import torch

import offload_adam

BAD_HYPER = [
    {"lr": -1e-3},
    {"lr": torch.tensor([1e-3, 1e-3])},
    {"eps": -1.0},
    {"betas": (1.0, 0.999)},
    {"betas": (-0.1, 0.999)},
    {"betas": (0.9, 1.0)},
    {"betas": (0, 0.999)},
    {"weight_decay": -0.1},
]


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
@pytest.mark.parametrize("kwargs", BAD_HYPER, ids=lambda kw: repr(kw)[:40])
def test_invalid_hyperparameters_raise_like_torch(kind, kwargs):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        getattr(torch.optim, kind)([p], **kwargs)
    with pytest.raises(ValueError) as ours:
        getattr(offload_adam, kind)([p], **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("lr", [1e38, 1e300])
def test_an_lr_whose_step_overflows_float32_raises_as_torch_does(kernels, lr):
    """lr / (1 - beta1), the first step's size, past float32's range: torch's AdamW raises
    at the step, and so do we (the kernel's float32 step size made every param inf), naming
    lr; nothing is stepped (torch's has applied the weight decay by then). Set later (a
    scheduler), it is refused at that step."""
    for ours, make in ((False, lambda ps: torch.optim.AdamW(ps, lr=lr)),
                       (True, lambda ps: offload_adam.AdamW(ps, lr=lr)),
                       (True, lambda ps: _lr_set_later(offload_adam.AdamW(ps), lr))):
        p = torch.nn.Parameter(torch.ones(3))
        opt = make([p])
        p.grad = torch.ones(3)
        with pytest.raises((RuntimeError, ValueError), match="overflow"):
            opt.step()
        assert torch.equal(p.detach(), torch.ones(3)) or not ours


def _lr_set_later(opt, lr):
    opt.param_groups[0]["lr"] = lr
    return opt


@pytest.mark.parametrize("mode", ["capturable", "differentiable"])
def test_unsupported_modes(mode):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=mode):
        offload_adam.AdamW([p], **{mode: True})
    opt = offload_adam.AdamW([p])
    with pytest.raises(ValueError, match=mode):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], mode: True})
    assert len(opt.param_groups) == 1


def sparse_grad_model():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    return emb


def test_sparse_grad_names_the_param(kernels):
    emb = sparse_grad_model()
    opt = offload_adam.AdamW(emb.named_parameters())
    with pytest.raises(RuntimeError, match=r"sparse.*'weight' \(shape \(10, 4\)\)"):
        opt.step()
    emb2 = sparse_grad_model()
    opt2 = offload_adam.AdamW([torch.zeros(2, requires_grad=True), *emb2.parameters()])
    opt2.param_groups[0]["params"][0].grad = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"group 0, param 1 \(shape \(10, 4\)\)"):
        opt2.step()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_unsupported_dtype_at_construction(dtype):
    # (an integer param is taken and never stepped, as by torch: test_torch_contract)
    good = torch.zeros(3, requires_grad=True)
    bad = torch.zeros(2, 2, dtype=dtype)
    with pytest.raises(TypeError, match=rf"group 0, param 1 \(shape \(2, 2\)\).*{dtype}"):
        offload_adam.AdamW([good, bad])
    with pytest.raises(TypeError, match=rf"'layer.w'.*{dtype}"):
        offload_adam.AdamW([("x", good), ("layer.w", bad)])
    opt = offload_adam.AdamW([good])
    with pytest.raises(TypeError, match=str(dtype)):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1  # the failed group was not added


def test_non_cpu_params_are_rejected():
    # No GPU here: a meta tensor stands in for any non-CPU device.
    p = torch.zeros(3, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"group 0, param 0.*meta"):
        offload_adam.AdamW([p])


def test_bad_params_argument_like_torch():
    with pytest.raises(TypeError):
        offload_adam.AdamW(torch.zeros(3, requires_grad=True))
    with pytest.raises(ValueError, match="empty parameter list"):
        offload_adam.AdamW([])


@pytest.mark.parametrize("option", ["overlap", "free_grads_after_copy", "verify_grads",
                                    "step_in_backward"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_bool_options_refuse_what_is_not_a_bool(option, value):
    # "no" would be taken as True: a TypeError naming the option and the value
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError, match=f"{option} must be True or False, got {value!r}"):
        offload_adam.AdamW([p], **{option: value})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.0, True])
def test_bucket_mb_must_be_positive_and_finite(value):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="bucket_mb must be a positive, finite number"):
        offload_adam.AdamW([p], bucket_mb=value)


@pytest.mark.parametrize("step", [2.5, 0.5, float("inf"), float("nan"), -1.0])
def test_a_loaded_step_count_must_be_whole(step):
    """The kernels count whole steps (the bias corrections, the rounding bits): a loaded
    2.5 was taken as 2 without a word (torch's step uses the float), inf said 'step counts
    start at 1'. Refused naming the param and the value; a whole float or int loads."""
    p = torch.nn.Parameter(torch.randn(8))
    opt = offload_adam.AdamW([p])
    p.grad = torch.randn(8)
    opt.step()
    sd = opt.state_dict()
    for value in (torch.tensor(step), step):
        sd["state"][0]["step"] = value
        with pytest.raises(ValueError, match=r"loaded optimizer state 'step' for param group 0, "
                                             r"param 0 \(shape \(8,\)\) is .*: a step count is a "
                                             r"whole number >= 0"):
            opt.load_state_dict(sd)
    for whole in (torch.tensor(3.0), 3):
        sd["state"][0]["step"] = whole
        opt.load_state_dict(sd)
        assert float(opt.state[p]["step"]) == 3.0



@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "8bit"])
def test_a_step_count_past_float32s_integers_is_refused(state_dtype):
    """torch's float32 step stops counting at 2^24 (+1 rounds back to it); the stochastic
    rounding of bf16/8-bit moments keys its bits on the count, so past it every step
    rounded alike and the moments went biased without a word (found from outside). The
    step is refused, nothing stepped; fp32 moments step on as torch's do."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = offload_adam.AdamW([p], state_dtype=state_dtype)
    p.grad = torch.randn(300)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(2.0 ** 24)
    opt.load_state_dict(sd)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"steps\[0\] is 16777216: a float32 step count .* "
                                         r"stops counting at 2\^24"):
        opt.step()
    assert torch.equal(p.detach(), before) and float(opt.state[p]["step"]) == 2.0 ** 24
    sd["state"][0]["step"] = torch.tensor(2.0 ** 24 - 1)   # (its last count: steps)
    opt.load_state_dict(sd)
    opt.step()
    assert float(opt.state[p]["step"]) == 2.0 ** 24
    q = torch.nn.Parameter(torch.randn(300))
    fp32 = offload_adam.AdamW([q])
    q.grad = torch.randn(300)
    fp32.step()
    sd = fp32.state_dict()
    sd["state"][0]["step"] = torch.tensor(2.0 ** 24)
    fp32.load_state_dict(sd)
    fp32.step()

def test_a_refused_load_state_dict_changes_nothing(path):
    # amsgrad=True cannot be kept by an 8-bit optimizer: refused before any of the
    # state or the groups is replaced, and training goes on as if never tried
    def train(opt, ps, steps, start=0):
        for s in range(start, start + steps):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()

    def make():
        ps = [torch.randn(64, 8, generator=torch.Generator().manual_seed(i)).to(
            torch.bfloat16).requires_grad_() for i in range(2)]
        return ps, offload_adam.AdamW(ps, lr=0.1, state_dtype="8bit", bucket_mb=0.001)

    with path.outside():
        src_ps = [torch.randn(64, 8).requires_grad_() for _ in range(2)]
        src = offload_adam.AdamW(src_ps, amsgrad=True)
        train(src, src_ps, 1)
        saved = src.state_dict()
    ps, opt = make()
    twin_ps, twin = make()
    train(opt, ps, 2)
    train(twin, twin_ps, 2)
    before = opt.state_dict()
    before = {**before, "state": {k: {key: v.clone() for key, v in st.items()}
                                  for k, st in before["state"].items()}}
    with pytest.raises(ValueError, match=r"amsgrad=True cannot be used with "
                                         r"state_dtype=\"8bit\" \(loaded param group 0\)"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for k, st in before["state"].items():
        assert after["state"][k].keys() == st.keys()
        assert all(torch.equal(after["state"][k][key], v) for key, v in st.items())
    train(opt, ps, 2, start=2)
    train(twin, twin_ps, 2, start=2)
    assert all(torch.equal(p, q) for p, q in zip(ps, twin_ps))


@pytest.mark.parametrize("early", [False, True])
def test_backward_into_a_freed_grad_after_close_says_the_optimizer_was_closed(sim, early):
    # free_grads_after_copy: a grad freed before close() has its host copy no more; the
    # next backward accumulating into it says so (zero_grad() first: it trains no more,
    # but backward works)
    m = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = offload_adam.AdamW(m.parameters(), free_grads_after_copy=True, step_in_backward=early)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    m(x).sum().backward()
    if early:   # (closed between backward and step(): the steps that ran are said)
        with pytest.warns(RuntimeWarning, match="closed .* between backward and step"):
            opt.close()
    else:
        opt.close()
    with pytest.raises(RuntimeError, match=r"was closed \(close\(\)\).*zero_grad\(\)"):
        m(x).sum().backward()
    opt.zero_grad()
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_a_grad_of_another_dtype_names_the_param_and_both_dtypes(path):
    # torch 2.13's p.grad_dtype lets a bf16 param hold an fp32 grad: no kernel steps that
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    q = torch.nn.Parameter(torch.randn(8).bfloat16())
    opt = offload_adam.AdamW([{"params": [q]}, {"params": [p]}])
    before = p.detach().clone()
    p.grad_dtype = torch.float32
    p.grad = torch.randn(8)
    with pytest.raises(TypeError, match=r"group 1, param 0 \(shape \(8,\)\) is "
                                        r"torch.bfloat16 and its grad torch.float32; .* "
                                        r"\(p.grad_dtype is torch.float32: set it back"):
        opt.step()
    assert torch.equal(p.detach(), before)
    p.grad_dtype = None   # (any dtype)
    p.grad = torch.randn(8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"its grad torch.float64; .* \(p.grad_dtype is None"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_a_grad_left_at_the_old_shape_names_the_param(path):
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(16))
    opt = offload_adam.AdamW([p, q])
    q.grad = torch.randn(16)
    q.data = torch.randn(32)
    with pytest.raises(RuntimeError, match=r"param 1 \(shape \(32,\)\) has shape \(32,\) "
                                           r"and its grad \(16,\)"):
        opt.step()


def test_a_param_reshaped_after_its_files_were_laid_out_is_refused_by_name(tmp_path, kernels):
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = offload_adam.AdamW([p], state_dirs=[tmp_path])
    p.grad = torch.randn(6, 4)
    opt.step()
    p.data, p.grad = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=r"param 0 \(shape \(4, 6\)\).*laid out for "
                                           r"\(6, 4\).*nothing was stepped"):
        opt.step()


def test_state_dirs_over_params_none_of_which_trains_says_so(tmp_path, kernels):
    m = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="none of the optimizer's params trains"):
        offload_adam.AdamW(m.parameters(), state_dirs=[tmp_path])
    assert not any(tmp_path.iterdir())   # no file made


def test_a_step_after_close_raises_on_every_path(path):
    p = torch.nn.Parameter(torch.randn(4))
    opt = offload_adam.AdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    opt.close()
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="this optimizer was closed"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("kwargs, error", [
    ({"num_threads": 1.5}, TypeError), ({"num_threads": True}, TypeError),
    ({"num_threads": "2"}, TypeError), ({"num_threads": 0}, ValueError),
    ({"max_grad_norm": "1"}, TypeError), ({"max_grad_norm": True}, TypeError),
    ({"max_grad_norm": 0.0}, ValueError), ({"process_group": 3}, TypeError),
    ({"process_group": "world"}, TypeError)], ids=repr)
def test_options_of_the_wrong_type_or_value_are_named(kwargs, error):
    """Not turned into something else (1.5 threads into 1, True into 1) nor left to fail
    at the first step (a process group that is an int)."""
    (name,) = kwargs
    with pytest.raises(error, match=name):
        offload_adam.AdamW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_params_that_share_memory_are_refused_by_name(kernels):
    """torch steps overlapping views one after the other; with a master each, one update
    would be lost where they overlap: refused, in the constructor and add_param_group
    (which then leaves the optimizer as it was). Views that do not overlap are fine,
    interleaved ones too."""
    base = torch.zeros(16)
    with pytest.raises(ValueError, match=r"param 0 \(shape \(6,\)\) and .*param 1 "
                                         r"\(shape \(6,\)\) share memory"):
        offload_adam.AdamW([base[:6].requires_grad_(), base[4:10].requires_grad_()])
    m = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="share memory"):   # rows 0, 2 and column 0
        offload_adam.AdamW([{"params": [m[0::2].requires_grad_()]},
                            {"params": [m[:, 0].requires_grad_()]}])
    opt = offload_adam.AdamW([base[:8].requires_grad_()])
    with pytest.raises(ValueError, match=r"group 0, param 0 .* and group 1, param 0"):
        opt.add_param_group({"params": [base[7:9].requires_grad_()]})
    assert len(opt.param_groups) == 1
    ps = [base[0::2].requires_grad_(), base[1::2].requires_grad_()]   # interleaved
    opt = offload_adam.AdamW(ps, lr=0.1)
    for p, g in zip(ps, (1.0, -1.0)):
        p.grad = torch.full_like(p, g)
    opt.step()
    assert base[0::2].eq(-0.1).all() and base[1::2].eq(0.1).all()


@pytest.mark.parametrize("where", ["in_place", "engine", "files"])
def test_a_param_whose_elements_share_memory_is_refused_when_built(kernels, tmp_path, where):
    """An expand()ed param (stride 0): torch's own step refuses it at the first step, and
    the engine's copy back to it raised on its copy stream after step() had returned (on
    the simulated device, a thread died and the exit hung). Refused by name when built."""
    import contextlib
    from offload_adam.testing import AsyncSimDevice, simulated
    sim = AsyncSimDevice(seed=0) if where == "engine" else None
    kw = dict(state_dirs=[tmp_path]) if where == "files" else {}
    with (simulated(sim) if sim else contextlib.nullcontext()):
        ok = torch.nn.Parameter(torch.randn(4, 8))
        p = torch.nn.Parameter(torch.randn(1, 8).expand(4, 8))
        with pytest.raises(ValueError, match=r"group 0, param 1 \(shape \(4, 8\)\) \(strides "
                                             r"\[0, 1\]\) has elements that share memory"):
            offload_adam.AdamW([ok, p], lr=1e-2, **kw)
    if sim is not None:
        sim.check()
        sim.close()


def test_a_group_added_is_checked_against_the_params_on_its_storages_only(kernels,
                                                                           monkeypatch):
    """Building with many groups (torch's __init__ adds them one by one) looked at the
    memory of every param of every group at each add: O(groups x params), 12x torch's
    construction at 2,000 groups. Each param's memory is read a bounded number of times;
    an overlap with a param of an earlier group on the same storage is still refused."""
    from offload_adam import params as params_module
    real, calls = params_module._memory, [0]

    def counted(p):
        calls[0] += 1
        return real(p)
    monkeypatch.setattr(params_module, "_memory", counted)
    groups = [{"params": [torch.zeros(4, requires_grad=True)], "lr": 1e-3 * (i + 1)}
              for i in range(300)]
    offload_adam.AdamW(groups)
    assert calls[0] <= 4 * 300
    base = torch.zeros(64)
    opt = offload_adam.AdamW([{"params": [torch.zeros(3, requires_grad=True)]},
                              {"params": [base[:8].requires_grad_()]}])
    with pytest.raises(ValueError, match=r"group 1, param 0 .* and group 2, param 0"):
        opt.add_param_group({"params": [base[7:9].requires_grad_()]})
    opt.add_param_group({"params": [base[8:9].requires_grad_()]})   # next to it: fine


@pytest.mark.parametrize("where", ["in_place", "engine", "engine_in_backward"])
def test_params_tied_after_the_optimizer_was_built_are_refused(kernels, where):
    """`b.data = a.data` after the optimizer was built puts two params on one memory,
    which the constructor refuses: each would be stepped from its own master and one
    update lost (bf16: a tenth of the weight off torch's after 3 steps). Refused at the
    next step() (or, with step_in_backward, at the backward's first grad), naming both,
    nothing stepped; a param given new memory of its own steps on."""
    import contextlib
    from offload_adam.testing import AsyncSimDevice, simulated
    sim = AsyncSimDevice(seed=0) if where != "in_place" else None
    with (simulated(sim) if sim else contextlib.nullcontext()), \
            (sim.watch() if sim else contextlib.nullcontext()):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
        opt = offload_adam.AdamW(m.parameters(), lr=1e-2,
                                 step_in_backward=where == "engine_in_backward")
        x = torch.randn(4, 8).to(torch.bfloat16)
        m[0].weight.data = m[0].weight.data.clone()   # moved, shared with none: fine
        m(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        m[1].weight.data = m[0].weight.data
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(RuntimeError, match=r"group 0, param 0 \(shape \(8, 8\)\) and "
                                               r"group 0, param 2 .* share memory.*changed "
                                               r"after the optimizer was built"):
            m(x).float().sum().backward()
            opt.step()
        assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    if sim is not None:
        sim.check()
        sim.close()


def test_groups_without_params_are_allowed_like_torch(kernels):
    opt = offload_adam.AdamW([{"params": []}])
    opt.step()
    p = torch.zeros(3, requires_grad=True)
    opt.add_param_group({"params": [p], "lr": 0.5})
    p.grad = torch.ones(3)
    opt.step()
    assert p.eq(-0.5).all()


@pytest.mark.parametrize("state_dirs", [False, True], ids=["ram", "files"])
def test_an_lr_that_overflows_in_a_later_group_moves_no_group(kernels, tmp_path, state_dirs):
    """Two groups, the second's lr set past float32's step size: the step is refused
    before the first group steps."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = offload_adam.AdamW([{"params": [a]}, {"params": [b]}],
                             state_dirs=str(tmp_path) if state_dirs else None)
    opt.param_groups[1]["lr"] = 1e38
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match="lr=1e\\+38 .* overflows float32"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3)) and torch.equal(b.detach(), torch.ones(3))
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    assert opt.step_count == 1
    opt.close()
