"""State dicts move between offload_adam and torch.optim.Adam/AdamW both ways."""
import copy
import io
import traceback

import pytest
import torch

import offload_adam

LP = [torch.bfloat16, torch.float16]


def make_params(dtype=torch.float32, seed=0, shapes=((6, 5), (7,), (3, 4))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def clone_params(ps, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in ps]


def grads_for(ps, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(p.shape, generator=gen) for p in ps]


def run(opt, ps, first, count):
    for k in range(first, first + count):
        for p, g in zip(ps, grads_for(ps, k)):
            p.grad = g.to(p.dtype)
        opt.step()


def roundtrip(sd):
    """Through torch.save/torch.load, as a checkpoint would go."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_close_lists(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), **kw)


@pytest.mark.parametrize("kind,amsgrad", [("AdamW", False), ("AdamW", True), ("Adam", False)])
def test_state_dict_format_matches_torch(kernels, kind, amsgrad):
    ps, qs = make_params(), make_params()
    ours = getattr(offload_adam, kind)(ps, lr=0.01, amsgrad=amsgrad)
    theirs = getattr(torch.optim, kind)(qs, lr=0.01, amsgrad=amsgrad)
    run(ours, ps, 0, 2)
    run(theirs, qs, 0, 2)
    a, b = ours.state_dict(), theirs.state_dict()
    # torch's groups, plus our state format
    assert a["param_groups"] == [{**g, "state_dtype": "float32"} for g in b["param_groups"]]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for key, value in b["state"][i].items():
            mine = a["state"][i][key]
            assert (mine.dtype, mine.shape) == (value.dtype, value.shape), key
        assert a["state"][i]["step"].dtype == torch.float32 and a["state"][i]["step"].dim() == 0


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_ours_to_torch_and_back(kernels, kind):
    ps = make_params()
    ours = getattr(offload_adam, kind)(ps, lr=0.01, weight_decay=0.1, amsgrad=True)
    run(ours, ps, 0, 3)
    sd = roundtrip(ours.state_dict())

    # ours -> torch: torch continuing equals ours continuing.
    qs = clone_params(ps)
    theirs = getattr(torch.optim, kind)(qs, lr=0.5)  # hyperparameters come from the dict
    theirs.load_state_dict(copy.deepcopy(sd))
    assert theirs.param_groups[0]["lr"] == 0.01
    run(theirs, qs, 3, 4)
    run(ours, ps, 3, 4)
    assert_close_lists(ps, qs)

    # torch -> ours: a fresh ours loading torch's dict continues like torch.
    rs = clone_params(qs)
    again = getattr(offload_adam, kind)(rs)
    again.load_state_dict(roundtrip(theirs.state_dict()))
    run(again, rs, 7, 3)
    run(theirs, qs, 7, 3)
    assert_close_lists(rs, qs)
    assert again.state[rs[0]]["step"].item() == 10


@pytest.mark.parametrize("dtype", LP)
def test_low_precision_roundtrip_is_exact(kernels, dtype):
    ps = make_params(dtype)
    ours = offload_adam.AdamW(ps, lr=0.01, amsgrad=True)
    run(ours, ps, 0, 3)
    sd = roundtrip(ours.state_dict())
    assert sd["state"][0]["master_param"].dtype == torch.float32

    qs = clone_params(ps)
    resumed = offload_adam.AdamW(qs)
    resumed.load_state_dict(sd)
    for p, q in zip(ps, qs):
        for key, value in ours.state[p].items():
            assert resumed.state[q][key].dtype == torch.float32, key
            assert torch.equal(resumed.state[q][key], value), key
    run(ours, ps, 3, 3)
    run(resumed, qs, 3, 3)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]["master_param"], resumed.state[q]["master_param"])


@pytest.mark.parametrize("dtype", LP)
def test_torch_dict_for_low_precision_params(kernels, dtype):
    # torch keeps bf16/fp16 moments; ours upcasts them and starts the master from the params.
    qs = make_params(dtype)
    theirs = torch.optim.AdamW(qs, lr=0.01)
    run(theirs, qs, 0, 2)
    ps = clone_params(qs)
    ours = offload_adam.AdamW(ps)
    ours.load_state_dict(roundtrip(theirs.state_dict()))
    for p, q in zip(ps, qs):
        assert ours.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"].float())
        assert "master_param" not in ours.state[p]
    run(ours, ps, 2, 1)
    # The master started at the bf16 param and took one step from there.
    for p, q in zip(ps, qs):
        m = ours.state[p]["master_param"]
        assert m.dtype == torch.float32 and ours.state[p]["step"].item() == 3
        assert (m - q.detach().float()).abs().max() < 0.05
    # And back into torch: it loads (casting to the param dtype) and steps.
    theirs2 = torch.optim.AdamW(clone_params(ps))
    theirs2.load_state_dict(ours.state_dict())
    assert theirs2.state[theirs2.param_groups[0]["params"][0]]["exp_avg"].dtype == dtype


def test_fp32_params_drop_a_loaded_master(kernels):
    ps = make_params(torch.bfloat16)
    ours = offload_adam.AdamW(ps)
    run(ours, ps, 0, 1)
    fp32 = clone_params(ps, torch.float32)
    other = offload_adam.AdamW(fp32)
    other.load_state_dict(ours.state_dict())
    assert "master_param" not in other.state[fp32[0]]
    run(other, fp32, 1, 1)


@pytest.mark.parametrize("named", [False, True])
def test_shape_mismatch_names_the_param(kernels, named):
    ps = make_params()
    src = offload_adam.AdamW(ps)
    run(src, ps, 0, 1)
    sd = src.state_dict()
    wrong = make_params(shapes=((6, 5), (8,), (3, 4)))
    params = [("a", wrong[0]), ("b.weight", wrong[1]), ("c", wrong[2])] if named else wrong
    dst = offload_adam.AdamW(params)
    before = dst.state_dict()
    with pytest.raises(ValueError, match=r"b\.weight" if named else r"group 0, param 1") as e:
        dst.load_state_dict(sd)
    assert "(7,)" in str(e.value) and "(8,)" in str(e.value) and "exp_avg" in str(e.value)
    assert dst.state_dict() == before  # nothing was loaded


def test_load_keeps_decoupled_for_adamw_and_runs_user_hooks(kernels):
    ps = make_params()
    adam = torch.optim.Adam(clone_params(ps), lr=0.02)
    run(adam, adam.param_groups[0]["params"], 0, 1)
    ours = offload_adam.AdamW(ps)
    ours.register_load_state_dict_pre_hook(
        lambda opt, sd: {**sd, "param_groups": [{**g, "lr": 0.03} for g in sd["param_groups"]]})
    ours.load_state_dict(adam.state_dict())
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert ours.param_groups[0]["lr"] == 0.03
    run(ours, ps, 1, 1)



def test_a_loaded_capturable_or_differentiable_group_takes_this_optimizers_modes(kernels):
    """A torch dict from a capturable (or differentiable) run: its moments load, and the
    groups keep this optimizer's modes, which the constructor refuses True (they were
    taken from the dict, kept and saved again, found from outside)."""
    ps = make_params()
    torch_opt = torch.optim.AdamW(clone_params(ps), lr=0.02)
    run(torch_opt, torch_opt.param_groups[0]["params"], 0, 1)
    sd = torch_opt.state_dict()
    sd["param_groups"][0].update(capturable=True, differentiable=True)
    ours = offload_adam.AdamW(ps, lr=0.02)
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["capturable"] is False
    assert ours.param_groups[0]["differentiable"] is False
    saved = ours.state_dict()["param_groups"][0]
    assert saved["capturable"] is False and saved["differentiable"] is False
    assert float(ours.state[ps[0]]["step"]) == 1.0
    run(ours, ps, 1, 1)

def test_load_then_scheduler_and_pickle(kernels):
    ps = make_params(torch.bfloat16)
    ours = offload_adam.AdamW(ps, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(ours, 1, 0.5)
    run(ours, ps, 0, 1)
    sched.step()
    sd = ours.state_dict()
    assert sd["param_groups"][0]["lr"] == 0.05 and "initial_lr" in sd["param_groups"][0]
    clone = copy.deepcopy(ours)  # pickles through __getstate__/__setstate__
    qs = clone.param_groups[0]["params"]
    run(ours, ps, 1, 2)
    run(clone, qs, 1, 2)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("state_dtype", [torch.float32, "8bit"])
@pytest.mark.parametrize("fp32_moments", [False, True])
def test_entries_that_are_not_a_params_state_pass_through_as_in_torch(kernels, state_dtype,
                                                                      fp32_moments):
    # torch's own suite (test_state_dict_pre_hook, the load hooks' tests) puts
    # optimizer.state["test"] = 1 there: torch's state_dict keeps such an entry as it
    # is, its load_state_dict puts it back as it is.
    ps, qs = make_params(), make_params()
    ours = offload_adam.AdamW(ps, lr=0.01, state_dtype=state_dtype)
    theirs = torch.optim.AdamW(qs, lr=0.01)
    run(ours, ps, 0, 1)
    run(theirs, qs, 0, 1)
    for opt in (ours, theirs):
        opt.register_state_dict_pre_hook(lambda o: o.state.update(test=1, ran=True))
    sd = ours.state_dict(fp32_moments=fp32_moments)
    assert (sd["state"]["test"], sd["state"]["ran"]) == (1, True)
    assert theirs.state_dict()["state"]["test"] == 1
    codes = state_dtype == "8bit" and not fp32_moments
    assert ("exp_avg_codes" in sd["state"][0]) == codes   # the params' state as before

    again = offload_adam.AdamW(clone_params(ps), state_dtype=state_dtype)
    again.load_state_dict(roundtrip(sd))
    assert (again.state["test"], again.state["ran"]) == (1, True)
    # and the params' state loaded as from a dict without them: the run resumes
    rs = again.param_groups[0]["params"]
    assert [float(again.state[r]["step"]) for r in rs] == [1.0] * len(rs)
    run(again, rs, 1, 2)
    run(ours, ps, 1, 2)
    if state_dtype is torch.float32 or not fp32_moments:   # (else 8-bit codes re-encoded)
        assert all(torch.equal(p, r) for p, r in zip(ps, rs))


def test_post_hooks_see_the_dict_returned_and_the_state_loaded(path):
    """As torch's: a state_dict post hook gets the dict state_dict() returns (its state
    from the files, 8-bit codes under their keys) and what it returns is returned; a
    load_state_dict post hook runs once the state is loaded, and what it sets in
    optimizer.state is the state (in files: loaded at the next step)."""
    ps = make_params()
    opt = offload_adam.AdamW(ps, lr=0.01, bucket_mb=0.0001)
    run(opt, ps, 0, 1)
    seen = {}

    def given(o, sd):
        seen["keys"] = sorted(sd["state"][0])
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].to(torch.float16)

    handle = opt.register_state_dict_post_hook(given)
    sd = opt.state_dict()
    assert seen["keys"] == sorted(["exp_avg", "exp_avg_sq", "step"] + (
        ["master_param"] if path.sim else []))
    assert sorted(sd["state"][0]) == sorted(seen["keys"])
    assert sd["state"][0]["exp_avg"].dtype == torch.float16
    handle.remove()
    sd = opt.state_dict()

    def loaded(o):
        seen["loaded"] = sorted(o.state[ps[0]])
        o.state[ps[0]]["exp_avg"] = torch.zeros_like(ps[0])

    opt.register_load_state_dict_post_hook(loaded)
    opt.load_state_dict(sd)
    # (in files the entries are empty: the state is read from state_dict())
    assert seen["loaded"] == ([] if path.files else sorted(seen["keys"]))
    assert torch.count_nonzero(opt.state_dict()["state"][0]["exp_avg"]) == 0
    assert torch.count_nonzero(opt.state_dict()["state"][1]["exp_avg"]) > 0
    run(opt, ps, 1, 1)


def test_a_users_key_of_another_shape_loads(kernels):
    # (only the state's own keys are checked against the param's shape)
    ps = make_params()
    opt = offload_adam.AdamW(ps, lr=0.01)
    run(opt, ps, 0, 1)
    opt.state[ps[0]]["clip_count"] = torch.tensor(3.0)
    opt.load_state_dict(roundtrip(opt.state_dict()))
    assert float(opt.state[ps[0]]["clip_count"]) == 3.0


def test_state_dict_from_another_thread_waits_for_the_step_in_flight(path):
    """state_dict() and load_state_dict() called from another thread while step() runs
    (a checkpointing thread) read state half stepped (moments of the next step beside
    the count of the last; a compact state's bucket mid-move: found from outside): they
    wait for the step to end."""
    import threading
    import time
    ps = make_params()
    opt = offload_adam.AdamW(ps, lr=0.02)
    run(opt, ps, 0, 1)
    got, entered, release = [], threading.Event(), threading.Event()

    def stepping():   # holds the step's lock as step() does, until released
        with opt._busy():
            entered.set()
            release.wait(30)
    holder = threading.Thread(target=stepping)
    holder.start()
    entered.wait(30)
    reader = threading.Thread(target=lambda: got.append(opt.state_dict()))
    reader.start()
    time.sleep(0.3)
    assert not got   # (waiting)
    release.set()
    holder.join(30)
    reader.join(30)
    assert len(got) == 1 and {float(st["step"]) for st in got[0]["state"].values()} == {1.0}
    opt.load_state_dict(got[0])
    opt.close()


@pytest.mark.parametrize("what", ["state_dict", "load_state_dict", "close"])
def test_a_save_inside_the_step_on_its_thread_is_refused(path, monkeypatch, what):
    """A SIGTERM handler that saves a checkpoint runs on the thread in step(), which the
    step's lock lets in: state_dict() returned some params' state a step ahead of the
    others' (found from outside). Refused there, and close() too; the step that raised
    runs again after, as if nothing had happened."""
    from offload_adam import optimizer as optimizer_module
    ps, ref = make_params(), make_params()
    opt, ref_opt = offload_adam.AdamW(ps, lr=0.02), offload_adam.AdamW(ref, lr=0.02)
    run(opt, ps, 0, 1)
    run(ref_opt, ref, 0, 2)
    saved = opt.state_dict()
    real, calls = optimizer_module.step_on_cpu, []

    def handler_inside(*args, **kwargs):   # where a signal may land: the pass
        if not calls:
            calls.append(what)
            getattr(opt, what)(*([saved] if what == "load_state_dict" else []))
        return real(*args, **kwargs)
    monkeypatch.setattr(optimizer_module, "step_on_cpu", handler_inside)
    for p, g in zip(ps, grads_for(ps, 1)):
        p.grad = g.to(p.dtype)
    with pytest.raises(RuntimeError, match=rf"{what}\(\) was called inside step\(\), on the "
                                           "thread running it"):
        opt.step()
    monkeypatch.undo()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, ref))
    assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {2.0}
    opt.close()
    ref_opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_loads_torch_adamw_s_checkpoint(kernels, tmp_path, dtype):
    """A migration from torch: a torch.distributed.checkpoint of a model trained with
    torch.optim.AdamW loaded into offload_adam.AdamW, as the README says. dcp.load plans
    the keys from the optimizer it loads into, so the groups' state_dtype (this
    optimizer's, whatever a dict says; flatten_optimizer_state_dict needs it in both)
    and a bf16 model's fp32 masters are in no torch checkpoint: a strict load names the
    first missing; with allow_partial_load they keep this optimizer's value and start
    from the params. Training on follows torch's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 4)).to(dtype)

    def train(m, opt, first, count):
        for i in range(first, first + count):
            gen = torch.Generator().manual_seed(100 + i)
            x, y = (torch.randn(5, n, generator=gen).to(dtype) for n in (8, 4))
            ((m(x) - y) ** 2).float().mean().backward()
            opt.step()
            opt.zero_grad()

    ref = model(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, ref_opt, 0, 3)
    msd, osd = get_state_dict(ref, ref_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    m = model(1)
    opt = offload_adam.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    with pytest.raises(BaseException) as refused:   # (DCP's CheckpointException is one)
        dcp.load(sd, checkpoint_id=str(tmp_path))
    said = "".join(traceback.format_exception(refused.value))
    assert "Missing key in checkpoint state_dict: optim." in said
    dcp.load(sd, checkpoint_id=str(tmp_path),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert opt.param_groups[0]["state_dtype"] == "float32"
    train(ref, ref_opt, 3, 2)
    train(m, opt, 3, 2)
    for p, q in zip(ref.parameters(), m.parameters()):
        if dtype == torch.float32:
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        else:   # (torch steps the bf16 param itself: it and the master's rounding may part)
            torch.testing.assert_close(q.float(), p.float(), rtol=2e-2, atol=2e-2)
