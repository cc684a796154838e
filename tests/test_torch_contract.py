"""Contract holes found with real training code: each behaves as torch's
optimizer does, or is a clear error. Every test runs in place and on the
simulated device (the engine's path, as for CUDA params)."""
import collections
import contextlib
import copy
import gc
import os

import pytest
import torch

import offload_adam
from offload_adam.testing import in_files, state_files
from conftest import FILES_PATHS, sim_path
from engine_watch import hooked
from models import (BF16, assert_param_is_master_rounded, assert_same, make_mlp, mlp_loss, run,
                    state_of, states)

OPTS = dict(lr=3e-3, weight_decay=0.1, bucket_mb=0.0001)


def test_frozen_low_precision_params_are_accepted_and_skipped(path):
    # AdamW(model.parameters()) with frozen layers: torch accepts params with
    # requires_grad=False and skips them while they have no grad. The engine
    # registers no grad hook on them (torch refuses one); unfrozen, a param
    # gets its hook at the next step() and trains like the others.
    model, twin = make_mlp(), make_mlp()
    frozen = [model[0].weight, model[0].bias]
    for p, q in zip(frozen, [twin[0].weight, twin[0].bias]):
        p.requires_grad_(False)
        q.requires_grad_(False)
    before = [p.clone() for p in frozen]
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    with path.outside():   # the reference: only the trainable params, in place
        ref = offload_adam.AdamW([p for p in twin.parameters() if p.requires_grad], **OPTS)
    run(model, opt, 3, loss=mlp_loss)
    run(twin, ref, 3, loss=mlp_loss)
    assert all(torch.equal(p, b) for p, b in zip(frozen, before))
    assert all(not states(opt).get(p) for p in frozen)
    for p, q in zip(list(model.parameters())[2:], list(twin.parameters())[2:]):
        assert torch.equal(p, q)

    for p in frozen:   # unfrozen: from now on stepped like the rest
        p.requires_grad_(True)
    if path.files:   # (the files hold the params that trained when they were laid out)
        _refused_as_not_in_files(model, opt)
        return
    run(model, opt, 2, start=3, loss=mlp_loss)
    assert all(not torch.equal(p, b) for p, b in zip(frozen, before))
    assert [float(states(opt)[p]["step"]) for p in model.parameters()] == [2.0, 2.0, 5.0, 5.0]
    assert_param_is_master_rounded(opt, model)
    if path.engine:
        assert all(hooked(p) for p in model.parameters())   # the unfrozen ones too


def _refused_as_not_in_files(model, opt, clip=True):
    """A step of `model` (make_mlp's, its first layer frozen when `opt` was built with
    state_dirs=, unfrozen since) is refused with the param's name, nothing moved; so is
    clip_grad_norm_ (`clip`: not refused for its own reason, as with step_in_backward)."""
    mlp_loss(model, 9).backward()
    params, state = [p.clone() for p in model.parameters()], state_of(opt, model)
    for use in (opt.step, lambda: opt.clip_grad_norm_(1.0))[:2 if clip else 1]:
        with pytest.raises(RuntimeError, match=r"param group 0, param 0 \(shape \(16, 8\)\) "
                                               r"has a grad, but it was frozen"):
            use()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for now, then in zip(state_of(opt, model), state):
        assert (now is None) == (then is None)
        assert all(torch.equal(now[k], then[k]) for k in then or {})


def _file_bytes(opt):
    return sum(os.path.getsize(os.path.join(d, f)) for d in state_files(opt).folders
               for f in os.listdir(d))


def _freeze_first_layer(model):
    frozen = [model[0].weight, model[0].bias]
    for p in frozen:
        p.requires_grad_(False)
    return frozen


FROZEN_MODES = {"default": {}, "free_grads": {"free_grads_after_copy": True},
                "early": {"step_in_backward": True}, "no_overlap": {"overlap": False}}


def test_a_backward_under_inference_mode_is_refused_by_the_engine_by_name(path):
    """backward() of a graph built outside torch.inference_mode(), run inside it, makes
    inference tensors of the grads, which have no version counter: the engine (which
    tells a grad changed after its copy by it) failed with torch's "Inference tensors do
    not track version counter" (found from outside). Named; in place, stepped as torch
    does. Training goes on after."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    loss = mlp_loss(model, 0)
    if path.engine:
        with pytest.raises(RuntimeError, match=r"a grad is an inference tensor: backward ran "
                                               r"under torch.inference_mode\(\)"):
            with torch.inference_mode():
                loss.backward()
        opt.zero_grad()
    else:
        with torch.inference_mode():
            loss.backward()
        opt.step()
        opt.zero_grad()
    run(model, opt, 2, start=1, loss=mlp_loss)
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.parametrize("early", [False, True])
def test_a_step_under_inference_mode_is_the_step(path, early):
    """step() inside torch.inference_mode() (a loop that wraps its updates in it), as
    torch's runs: the engine's host state, made at the first step, became inference
    tensors that its worker thread could not write, and the step raised half done (found
    from outside). The same training as outside it."""
    runs = []
    for inference in (False, True):
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "step_in_backward": early})
        for it in range(3):
            mlp_loss(model, it).backward()
            with torch.inference_mode() if inference else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same(*runs)


@pytest.mark.parametrize("mode", FROZEN_MODES)
def test_frozen_params_hold_no_host_memory_until_they_have_a_grad(path, mode):
    # torch makes no state for a param until its first step with a grad: a LoRA model's
    # AdamW(model.parameters()) costs nothing for its frozen base weights. Neither does
    # the engine: it lays out host buffers for the params that train (with the state
    # in RAM; state_dirs= lays its files out for every param at construction), and a
    # param unfrozen later joins it at the next step, its buffers laid out then, its
    # grad counted by clip_grad_norm_ before that step. With state_dirs= the files hold
    # the trainable params only, and the engine's buffers are theirs alone too.
    opts = {**OPTS, **FROZEN_MODES[mode]}
    model, twin = make_mlp(), make_mlp()
    frozen = _freeze_first_layer(model)
    _freeze_first_layer(twin)
    opt = offload_adam.AdamW(model.parameters(), **opts)
    trainable = offload_adam.AdamW([p for p in twin.parameters() if p.requires_grad], **opts)
    assert opt.host_bytes() == trainable.host_bytes()
    if path.files:
        assert _file_bytes(opt) == _file_bytes(trainable)
    run(model, opt, 2, loss=mlp_loss)
    run(twin, trainable, 2, loss=mlp_loss)
    assert opt.host_bytes() == trainable.host_bytes()
    assert all(not states(opt).get(p) for p in frozen)
    del trainable
    if path.files:
        for p in frozen:
            p.requires_grad_(True)
        _refused_as_not_in_files(model, opt, clip=not opts.get("step_in_backward"))
        return
    with path.outside():   # the reference: in place, every param from the start
        ref_model = make_mlp()
        _freeze_first_layer(ref_model)
        ref = offload_adam.AdamW(ref_model.parameters(), **OPTS)
        run(ref_model, ref, 2, loss=mlp_loss)
    for p in frozen + [ref_model[0].weight, ref_model[0].bias]:
        p.requires_grad_(True)
    clip = not opts.get("step_in_backward")   # (clipping there is refused, grad_scaling.py)
    for it in (2, 3):
        for m, o in ((model, opt), (ref_model, ref)):
            mlp_loss(m, it).backward()
            if clip:
                norm = o.clip_grad_norm_(0.5)
            o.step()
            o.zero_grad()
    assert_same((model, opt), (ref_model, ref))
    assert [float(states(opt)[p]["step"]) for p in model.parameters()] == [2.0, 2.0, 4.0, 4.0]
    if not path.files:
        assert opt.host_bytes() > 0 and (not path.engine or opt._engine.has(frozen[0]))
    if clip:
        assert torch.isfinite(norm)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("mode", ["default", "early"])
@pytest.mark.parametrize("where", FILES_PATHS)
def test_files_of_every_param_resume_with_a_param_frozen_since(where, mode, footprint,
                                                                kernels, tmp_path):
    # Files made before the files held only the params that train held every float param
    # (made here with every param training). Resumed with a layer frozen since, they are
    # laid out as made: the engine, which takes the params that train, takes the frozen
    # ones too before the buckets are laid out over its records (a param larger than a
    # bucket is in parts there, as its engine pieces), and training goes on bitwise as
    # in RAM with the layer frozen from step 2 on.
    opts = {**OPTS, **FROZEN_MODES[mode], "state_footprint": footprint}
    with sim_path(where) as path:
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), state_dirs=tmp_path, **opts)
        run(model, opt, 2, loss=mlp_loss)
        spec = state_files(opt).spec
        opt.close()
        del opt
        gc.collect()
        resumed = make_mlp(seed=1)
        _freeze_first_layer(resumed)
        opt = offload_adam.AdamW(resumed.parameters(), state_dirs=tmp_path,
                                 state_resume=True, **opts)
        assert state_files(opt).spec == spec
        if path.engine:   # (the frozen layer's transfer buffers, as when the files were made)
            assert all(opt._engine.has(p) for p in resumed.parameters())
        run(resumed, opt, 2, start=2, loss=mlp_loss)
        with path.outside():
            ref_model = make_mlp()
            ref = offload_adam.AdamW(ref_model.parameters(), **OPTS)
            run(ref_model, ref, 2, loss=mlp_loss)
            _freeze_first_layer(ref_model)
            run(ref_model, ref, 2, start=2, loss=mlp_loss)
        assert_same((resumed, opt), (ref_model, ref))
        opt.close()


@pytest.mark.parametrize("how", ["clear", "replace", "moment"])
@pytest.mark.parametrize("where", ["in-place", "sim-latest"])
def test_a_state_cleared_or_set_anew_between_steps_is_the_one_stepped(where, how, kernels):
    # torch steps what optimizer.state holds at the step: a state cleared (or the whole
    # state replaced) starts again as at the params' first step (a reset of the moments),
    # a moment set anew is the one the step goes on from. (With state_dirs= the state is
    # in the files, not in optimizer.state.) The reference: a new optimizer given that
    # state by load_state_dict.
    with sim_path(where):
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        run(model, opt, 2, loss=mlp_loss)
        saved = copy.deepcopy(opt.state_dict())
        if how == "clear":
            opt.state.clear()
            saved["state"] = {}
        elif how == "replace":
            opt.state = collections.defaultdict(dict)
            saved["state"] = {}
        else:
            for p in model.parameters():
                opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
            for st in saved["state"].values():
                st["exp_avg"] = torch.zeros_like(st["exp_avg"])
        ref_model = make_mlp(seed=3)
        ref_model.load_state_dict(model.state_dict())
        ref = offload_adam.AdamW(ref_model.parameters(), **OPTS)
        ref.load_state_dict(saved)
        run(model, opt, 2, start=2, loss=mlp_loss)
        run(ref_model, ref, 2, start=2, loss=mlp_loss)
        assert_same((model, opt), (ref_model, ref))


def test_state_loaded_for_a_frozen_param_is_where_it_goes_on_when_unfrozen(path):
    # A checkpoint holds the state of a param that is frozen in the run that loads it
    # (its second phase freezes it, say): the state waits in optimizer.state, as with
    # torch, and is the one the param goes on from once it is unfrozen.
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2, loss=mlp_loss)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())

    def resumed(frozen_for):
        m = make_mlp(seed=1)
        m.load_state_dict(weights)
        frozen = _freeze_first_layer(m)
        o = offload_adam.AdamW(m.parameters(), **OPTS)
        if in_files(o):   # no state for it in the files: refused, nothing loaded
            with pytest.raises(ValueError, match=r"a state for param group 0, param 0 \(shape "
                                                 r"\(16, 8\)\), which was frozen"):
                o.load_state_dict(saved)
            assert not states(o)
            return None
        o.load_state_dict(saved)
        run(m, o, frozen_for, start=2, loss=mlp_loss)
        for p in frozen:
            p.requires_grad_(True)
        run(m, o, 2, start=2 + frozen_for, loss=mlp_loss)
        return m, o

    ours = resumed(1)
    if ours is None:
        return
    with path.outside():
        reference = resumed(1)
    assert_same(ours, reference)
    assert [float(states(ours[1])[p]["step"]) for p in ours[0].parameters()] == [4.0, 4.0,
                                                                                 5.0, 5.0]


def test_a_group_added_to_an_optimizer_without_engine_params_is_stepped(kernels):
    # An optimizer of fp32 CPU params (stepped in place: no engine) given a group of bf16
    # params that an option sends through the engine (free_grads_after_copy): the engine
    # started then is the one the step runs (it was once left out: the group never moved).
    def train(sends):
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(8))
        b = torch.nn.Parameter(torch.randn(8).to(BF16))
        opt = offload_adam.AdamW([a], lr=0.1, free_grads_after_copy=sends)
        opt.add_param_group({"params": [b], "lr": 0.05})
        b0 = b.detach().clone()
        for it in range(3):
            x = torch.randn(8, generator=torch.Generator().manual_seed(it))
            ((a * x).sum() + (b.float() * x).pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
        assert not torch.equal(b, b0)
        return a, b, opt

    a, b, opt = train(True)
    assert opt._engine is not None and opt._engine.has(b)
    ra, rb, _ = train(False)
    assert torch.equal(a, ra) and torch.equal(b, rb)


class _Packed(torch.nn.Module):
    """make_mlp's model beside integer params, as a quantized model holds its packed
    weights (uint8) and an index table (int64): params that can take no grad."""

    def __init__(self):
        super().__init__()
        self.mlp = make_mlp()
        self.packed = torch.nn.Parameter(torch.randint(0, 255, (4, 8), dtype=torch.uint8),
                                         requires_grad=False)
        self.index = torch.nn.Parameter(torch.arange(4), requires_grad=False)

    def forward(self, x):
        return self.mlp(x)[:, self.index]


def test_integer_params_are_accepted_and_never_stepped(path):
    # AdamW(model.parameters()) of a model with integer params (bitsandbytes' packed
    # weights, an index table): torch takes them and never steps them (they have no
    # grad), and so does offload_adam, whose training is bit for bit the one of the float
    # params alone; a grad set on one by hand is refused at step() and clip_grad_norm_()
    # with its name, nothing stepped (torch's step fails part way). (The state files,
    # state_dirs=, hold the params that train.)
    model = _Packed()
    loss = lambda m, seed: mlp_loss(m.mlp, seed) + m(torch.ones(2, 8).to(BF16)).float().sum()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    with path.outside():
        twin = _Packed()
        ref = offload_adam.AdamW(twin.mlp.parameters(), **OPTS)
    packed = model.packed.clone()
    run(model, opt, 2, loss=loss)
    run(twin, ref, 2, loss=loss)
    assert_same((model.mlp, opt), (twin.mlp, ref))
    assert torch.equal(model.packed, packed) and not states(opt).get(model.packed)
    assert len(opt.state_dict()["param_groups"][0]["params"]) == 6
    loss(model, 5).backward()
    model.index.grad = torch.zeros_like(model.index)
    params = [p.clone() for p in model.parameters()]
    for use in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(TypeError, match=r"group 0, param 1 \(shape \(4,\)\) is torch.int64 "
                                            r"and has a grad \(torch.int64\)"):
            use()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    model.index.grad = None
    opt.step()
    assert not torch.equal(model.mlp[0].weight, params[2])


def _compiling_where(where):
    """In place, or through the engine on its synchronous host stand-in: the
    simulated device's watch (a TorchDispatchMode) makes dynamo compile nothing."""
    from offload_adam.engine.device import HostDevice
    from offload_adam.testing import simulated
    return simulated(HostDevice(torch.device("cpu"))) if where == "engine" else contextlib.nullcontext()


def _counting_backend(calls):
    """aot_eager (the same graphs, no code generated), counting the graphs compiled."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, inputs):
        calls.append(len(gm.graph.nodes))
        return aot_eager(gm, inputs)
    return backend


def _mlp_loss_of(m, seed):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)).to(BF16)
    return m(x).float().pow(2).sum()


@pytest.mark.parametrize("where", ["in-place", "engine"])
@pytest.mark.parametrize("mode", ["default", "free_grads", "early"])
def test_a_compiled_model_trains_as_the_eager_one(kernels, where, mode):
    # torch.compile(model): autograd still accumulates the grads into .grad and runs the
    # post-accumulate hooks the engine copies them from, so the training is the eager
    # model's, bit for bit; graphs were compiled (under the simulated device's watch
    # none are, so the engine runs on its host stand-in here)
    opts = {**OPTS, **FROZEN_MODES[mode]}
    runs, calls = [], []
    torch._dynamo.reset()
    for compiled in (False, True):
        with _compiling_where(where):
            model = make_mlp()
            opt = offload_adam.AdamW(model.parameters(), **opts)
            f = torch.compile(model, backend=_counting_backend(calls)) if compiled else model
            run(f, opt, 3, loss=_mlp_loss_of)
            runs.append((model, opt))
    assert calls   # (compiled: not the eager model run twice)
    assert_same(*runs)
    assert [float(states(runs[1][1])[p]["step"]) for p in runs[1][0].parameters()] == [3.0] * 4


@pytest.mark.parametrize("what", ["opt.step", "a training-step function"])
@pytest.mark.parametrize("where", ["in-place", "engine"])
@pytest.mark.parametrize("mode", ["default", "free_grads", "early"])
def test_a_compiled_step_is_the_step(kernels, where, mode, what, monkeypatch):
    """torch.compile(opt.step) runs the step as it is (nothing in it to trace: the C++
    kernel and host threads); through the engine it raised dynamo's "Guard failed on the
    same frame it was created" (found from outside). torch.compile of a function doing
    forward, backward, step() and zero_grad() runs backward eagerly with dynamo's frame
    callback still set: dynamo traced the engine's grad hooks from there and failed
    inside ("sources must not be empty for symbol" with inductor on a cold cache, found
    from outside). The hooks are not traced (what they call sees no compiling)."""
    from offload_adam.engine.core import OffloadEngine
    on_grad, traced = OffloadEngine._on_grad, []

    def seen(self, rec):
        traced.append(torch.compiler.is_compiling())
        return on_grad(self, rec)
    monkeypatch.setattr(OffloadEngine, "_on_grad", seen)
    opts = {**OPTS, **FROZEN_MODES[mode]}
    runs = []
    torch._dynamo.reset()
    for compiled in (False, True):
        with _compiling_where(where):
            model = make_mlp()
            opt = offload_adam.AdamW(model.parameters(), **opts)
            step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step

            def train_step(x):
                model(x).float().pow(2).sum().backward()
                step()
                opt.zero_grad()
            if what != "opt.step" and compiled:
                train_step = torch.compile(train_step, backend="aot_eager")
            for it in range(3):
                train_step(torch.randn(5, 8, generator=torch.Generator().manual_seed(it)).to(BF16))
            runs.append((model, opt))
    assert_same(*runs)
    assert [float(states(runs[1][1])[p]["step"]) for p in runs[1][0].parameters()] == [3.0] * 4
    assert not any(traced) and (where == "in-place" or traced)


def test_compiled_autograd_is_refused_by_the_engine_and_training_goes_on(kernels):
    """Compiled autograd traces the grad hooks, and the engine's cannot be traced: it
    failed inside dynamo part way (queue_callback under it), and the param whose hook
    raised was stepped twice a step after (found from outside). Refused naming it,
    nothing copied; training without it then is the plain one, bit for bit."""
    from torch._dynamo import compiled_autograd
    runs = []
    torch._dynamo.reset()
    for refused in (False, True):
        with _compiling_where("engine"):
            model = make_mlp()
            opt = offload_adam.AdamW(model.parameters(), **OPTS)
            if refused:
                loss = _mlp_loss_of(model, 99)
                with pytest.raises(RuntimeError, match="backward runs under compiled autograd"):
                    with compiled_autograd._enable(torch.compile(backend="eager")):
                        loss.backward()
                opt.zero_grad()
            for it in range(3):
                _mlp_loss_of(model, it).backward()
                opt.step()
                opt.zero_grad()
            runs.append((model, opt))
    assert_same(*runs)


@pytest.mark.parametrize("cast", ["float", "half", "bfloat16"])
def test_cast_after_building_is_followed_or_refused_before_any_change(path, cast):
    # model.float()/.half()/.to(bf16) after building the optimizer: in place, the
    # optimizer follows the params (its fp32 state goes on; an fp32 param is its
    # own master); the engine, whose host buffers are sized for the old dtype,
    # refuses with a clear error, before it has changed anything; so do the state
    # files (state_dirs=), laid out for the old dtype (nvme_tier.py).
    model = make_mlp()
    if cast == "bfloat16":
        model.float()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2, loss=mlp_loss)
    getattr(model, cast)()
    dtype = model[0].weight.dtype
    model(torch.randn(5, 8).to(dtype)).float().pow(2).sum().backward()
    state, params = state_of(opt, model), [p.clone() for p in model.parameters()]
    if path.engine or path.files:
        refusal = (rf"is now {dtype}.*Build the optimizer after" if path.engine else
                   rf"is {dtype}; its state files were laid out for .*build the optimizer after")
        with pytest.raises(RuntimeError, match=refusal):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        for now, then in zip(state_of(opt, model), state):
            assert all(torch.equal(now[k], then[k]) for k in then)
        return
    opt.step()
    assert [float(states(opt)[p]["step"]) for p in model.parameters()] == [3.0] * 4
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), params))
    if dtype is torch.float32:
        assert all("master_param" not in states(opt)[p] for p in model.parameters())
    else:
        assert_param_is_master_rounded(opt, model)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_state_dict_through_torch_adamw_and_back_does_not_move_the_params_back(path, dtype):
    # offload_adam -> torch AdamW -> offload_adam: torch keeps "master_param" as
    # an unknown key (cast to bf16) and never updates it, while its steps move
    # the params. Loaded back, that master no longer rounds to its param: it is
    # dropped and the master starts from the param, exactly as from a torch
    # state dict that never had one. (fp32 params in the engine have a host
    # master too; in place, an fp32 param is its own.)
    model = make_mlp().to(dtype)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2, loss=mlp_loss)
    sd = copy.deepcopy(opt.state_dict())
    tmodel = copy.deepcopy(model)
    with path.outside():
        topt = torch.optim.AdamW(tmodel.parameters(), **{k: OPTS[k] for k in ("lr", "weight_decay")})
    topt.load_state_dict(copy.deepcopy(sd))   # torch steps the loaded "step" tensors in place
    run(tmodel, topt, 2, start=2, loss=mlp_loss)   # torch moves the params
    stale = copy.deepcopy(topt.state_dict())
    has_master = dtype is BF16 or path.engine
    assert all(("master_param" in st) == has_master for st in stale["state"].values())

    back, clean = copy.deepcopy(tmodel), copy.deepcopy(tmodel)
    opt_back = offload_adam.AdamW(back.parameters(), **OPTS)
    opt_back.load_state_dict(stale)
    opt_clean = offload_adam.AdamW(clean.parameters(), **OPTS)
    without = copy.deepcopy(stale)
    for st in without["state"].values():
        st.pop("master_param", None)
    opt_clean.load_state_dict(without)
    run(back, opt_back, 2, start=4, loss=mlp_loss)
    run(clean, opt_clean, 2, start=4, loss=mlp_loss)
    for p, q, t in zip(back.parameters(), clean.parameters(), tmodel.parameters()):
        assert torch.equal(p, q)
        assert (p.float() - t.float()).abs().max() < 0.05   # went on from torch's params
    assert_param_is_master_rounded(opt_back, back)

    # Our own round trip keeps the exact fp32 master (it rounds to the param).
    model2 = copy.deepcopy(model)
    opt2 = offload_adam.AdamW(model2.parameters(), **OPTS)
    opt2.load_state_dict(sd)
    run(model2, opt2, 1, start=2, loss=mlp_loss)
    run(model, opt, 1, start=2, loss=mlp_loss)
    assert_same((model, opt), (model2, opt2))


def test_a_loaded_master_is_checked_whatever_the_loading_order(path):
    # Loading the optimizer before the model is fine: the check waits for the
    # next step, when both are loaded.
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2, loss=mlp_loss)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fresh = make_mlp(seed=5)
    fopt = offload_adam.AdamW(fresh.parameters(), **OPTS)
    fopt.load_state_dict(osd)   # before the model: the masters do not match yet
    fresh.load_state_dict(msd)
    run(model, opt, 2, start=2, loss=mlp_loss)
    run(fresh, fopt, 2, start=2, loss=mlp_loss)
    assert_same((model, opt), (fresh, fopt))


def _edited_and_reloaded(dtype, edit, opts=OPTS):
    """Two twin runs of 2 steps, then `edit(param)` applied to every param of both:
    (model, its optimizer, twin, an optimizer built over the twin at the edit from its
    optimizer's state dict without "master_param": every master starts from its param)."""
    model, twin = make_mlp().to(dtype), make_mlp().to(dtype)
    opt = offload_adam.AdamW(model.parameters(), **opts)
    ref = offload_adam.AdamW(twin.parameters(), **opts)
    run(model, opt, 2, loss=mlp_loss)
    run(twin, ref, 2, loss=mlp_loss)
    for m in (model, twin):
        with torch.no_grad():
            for p in m.parameters():
                edit(p)
    sd = ref.state_dict()
    sd["state"] = {k: {key: v for key, v in st.items() if key != "master_param"}
                   for k, st in sd["state"].items()}
    reloaded = offload_adam.AdamW(twin.parameters(), **opts)
    reloaded.load_state_dict(sd)
    return model, opt, twin, reloaded


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "step_in_backward"])
@pytest.mark.parametrize("where", ["in-place", "in-place+files", "sim-seed1", "sim-latest",
                                   "sim-latest+files"])
@pytest.mark.parametrize("edit", ["clamp", "copy", "normal"])
def test_an_edit_through_p_data_is_stepped_from(where, early, edit, kernels, tmp_path):
    # p.data.clamp_() (WGAN's clip), p.data.copy_(ema), p.data.normal_(): `.data` is a
    # tensor with a version counter of its own, so the param's stays as the optimizer
    # left it. In host memory the bytes' checksum in the param's mark (master_rule.py)
    # shows the edit; on the (simulated) device, the sums of the params' bits compared
    # on the device (engine/param_check.py). The next step goes on from the edit:
    # bitwise an optimizer whose masters were dropped at the edit; the CPU params
    # stepped in place or by the engine (step_in_backward), the device's at step() or
    # in backward.
    def gen(p):   # (the same values for the twin's param)
        return torch.Generator().manual_seed(p.numel())
    edits = {"clamp": lambda p: p.data.clamp_(-0.05, 0.05),
             "copy": lambda p: p.data.copy_(torch.randn(p.shape, generator=gen(p)) * 0.1),
             "normal": lambda p: p.data.normal_(0, 0.1, generator=gen(p))}
    opts = {**OPTS, "step_in_backward": early}
    with sim_path(where, tmp_path):
        for dtype in (BF16, torch.float16):
            model, opt, twin, ref = _edited_and_reloaded(dtype, edits[edit], opts)
            edited = [p.detach().clone() for p in model.parameters()]
            run(model, opt, 1, start=2, loss=mlp_loss)
            for p, e in zip(model.parameters(), edited):   # one step on from the edit
                assert (p.float() - e.float()).abs().max() < 0.05
            run(model, opt, 1, start=3, loss=mlp_loss)
            run(twin, ref, 2, start=2, loss=mlp_loss)
            assert_same((model, opt), (twin, ref))
            opt.close()
            ref.close()


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_a_param_changed_between_steps_is_stepped_from_its_new_value(path, dtype):
    # The master follows the param (master_rule.py), as torch's AdamW, which keeps no
    # master, steps whatever the param is: params written between two steps (an edit
    # in place, a model checkpoint of another step loaded) go on from their new values,
    # and a param without a grad in the next step has its master follow it all the
    # same. Bitwise the run of an optimizer whose masters were dropped at the edit.
    model, opt, twin, ref = _edited_and_reloaded(dtype, lambda p: p.mul_(-0.5).add_(0.25))
    edited = [p.clone() for p in model.parameters()]

    def no_grad_for_the_last_bias(m, o):
        m[2].bias.grad = None

    run(model, opt, 1, start=2, loss=mlp_loss, edit=no_grad_for_the_last_bias)
    run(twin, ref, 1, start=2, loss=mlp_loss, edit=no_grad_for_the_last_bias)
    assert torch.equal(model[2].bias, edited[-1])   # not stepped
    assert torch.equal(states(opt)[model[2].bias]["master_param"].to(dtype), edited[-1])
    for p, e in zip(list(model.parameters())[:-1], edited):   # one step on from the edit
        assert (p.float() - e.float()).abs().max() < 0.05
    run(model, opt, 2, start=3, loss=mlp_loss)
    run(twin, ref, 2, start=3, loss=mlp_loss)
    assert_same((model, opt), (twin, ref))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_param_data_replaced_between_steps_is_stepped_from_its_new_values(path, dtype):
    # p.data = new tensor between steps (weights swapped in, load_state_dict(assign=True)):
    # the next step steps the new data from its values, as torch's AdamW does (in place,
    # the kernel kept writing the old tensor: the param did not move). Bitwise an
    # optimizer loaded at the swap without masters.
    def swap(p):
        p.data = (p.detach() * -0.5 + 0.25).clone()
    model, opt, twin, ref = _edited_and_reloaded(dtype, swap)
    swapped = [p.detach().clone() for p in model.parameters()]
    run(model, opt, 2, start=2, loss=mlp_loss)
    run(twin, ref, 2, start=2, loss=mlp_loss)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), swapped))
    assert_same((model, opt), (twin, ref))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_step_between_forward_and_backward_is_seen_by_autograd(path, dtype):
    # torch's step changes the params in place and bumps their version counters,
    # so a backward whose forward ran before the step raises; so does ours.
    model = make_mlp().to(dtype)
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    x = torch.randn(5, 8).to(dtype)
    model(x).float().pow(2).sum().backward()
    loss = model(x).float().pow(2).sum()   # forward with the params before the step
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("state_dtype", [torch.float32, "8bit"])
@pytest.mark.parametrize("dropped", ["step", "exp_avg", "exp_avg_sq"])
def test_a_state_missing_step_or_a_moment_is_refused_before_any_change(path, state_dtype, dropped):
    # torch's step raises a KeyError for such a state; taken as it was, the missing
    # key started again from zero (a fresh step count, a zeroed moment) and the param
    # was stepped with wrong values, without a word. A state missing all of them (a
    # param never stepped) and one missing only max_exp_avg_sq (amsgrad turned on
    # later) load as before.
    model, other = make_mlp(), make_mlp(seed=1)
    opt = offload_adam.AdamW(model.parameters(), state_dtype=state_dtype, **OPTS)
    run(model, opt, 2, loss=mlp_loss)
    sd = opt.state_dict()
    if not path.files and state_dtype != "8bit":   # amsgrad on: max_exp_avg_sq from zeros
        ams = offload_adam.AdamW(make_mlp(seed=2).parameters(), amsgrad=True,
                                 state_dtype=state_dtype, **OPTS)
        ams.load_state_dict(copy.deepcopy(sd))
    held = sd["state"][1]
    held.pop(next(k for k in (dropped, dropped + "_codes") if k in held))
    dst = offload_adam.AdamW(other.parameters(), state_dtype=state_dtype, **OPTS)
    run(other, dst, 1, loss=mlp_loss)
    before = state_of(dst, other)
    with pytest.raises(ValueError, match=rf"group 0, param 1 .*not '{dropped}'"):
        dst.load_state_dict(sd)
    for now, then in zip(state_of(dst, other), before):
        assert now.keys() == then.keys() and all(torch.equal(now[k], then[k]) for k in then)

    sd["state"].pop(1)   # no state at all for that param: it starts afresh, as in torch
    dst.load_state_dict(sd)
    assert 1 not in dst.state_dict()["state"]
    run(other, dst, 1, start=2, loss=mlp_loss)
    assert float(states(dst)[list(other.parameters())[1]]["step"]) == 1.0


def test_saving_a_param_or_a_hidden_state_warns_of_no_hook_of_ours(kernels):
    """torch.save of a plain-tensor param the engine steps (its tensor hook), or of a
    streamed block's input saved from forward (the streamer's hook on it: a hidden state
    kept, output_hidden_states), warned "backward hook ... will not be serialized" of a
    hook the user never registered (found from outside); torch's optimizer gives none."""
    import io
    import warnings
    from offload_adam.testing import AsyncSimDevice, simulated
    from test_param_stream import Block, llama_loss, make_llama
    w = torch.randn(4, 3, dtype=BF16, requires_grad=True)
    opt = offload_adam.AdamW([w], step_in_backward=True)   # (the engine, on the CPU)
    (w.float() ** 2).sum().backward()
    opt.step()
    hidden = []
    sim = AsyncSimDevice(seed=0)
    with simulated(sim), sim.watch():
        model = make_llama(layers=2, frozen=())
        offload_adam.stream_params(model, Block)
        model.layers[1].register_forward_pre_hook(lambda m, args: hidden.append(args[0]))
        loss = llama_loss(model, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for obj in (w, opt, hidden[0]):
                torch.save(obj, io.BytesIO())
        loss.backward()
    sim.check()
    sim.close()
    opt.close()
