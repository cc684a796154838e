"""offload_adam.Adam/AdamW against the float64 reference and torch.optim.

Every kernel-level check: our fp32 result (the param, or the master of a bf16/fp16
param) is no further from the float64 reference than torch's fp32 AdamW is.
"""
import inspect
import math
import subprocess
import sys

import pytest
import torch

import offload_adam
from offload_adam import inplace, kernel_step
from reference import ReferenceAdam, assert_lp_matches_master, assert_no_worse_than_torch

CLASSES = {"Adam": (offload_adam.Adam, torch.optim.Adam),
           "AdamW": (offload_adam.AdamW, torch.optim.AdamW)}
SHAPES = [(17,), (8, 33), (1000,), (1,), (0,)]


def fp32_of(opt, p):
    """What our optimizer holds as p's exact value: p itself, or its fp32 master."""
    return opt.state[p].get("master_param", p) if p.dtype != torch.float32 else p


def run_three_ways(kind, dtype, steps=8, shapes=SHAPES, seed=0, grad_scale=1.0, **hyper):
    """Steps ours (params of `dtype`), torch fp32 and the reference on the same grads."""
    ours_cls, torch_cls = CLASSES[kind]
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ours = [x.clone().requires_grad_() for x in init]
    theirs = [x.float().requires_grad_() for x in init]
    opt = ours_cls(ours, **hyper)
    topt = torch_cls(theirs, **hyper)
    decoupled = kind == "AdamW" or hyper.get("decoupled_weight_decay", False)
    wd = hyper.get("weight_decay", 1e-2 if kind == "AdamW" else 0.0)
    refs = [ReferenceAdam(x, lr=hyper.get("lr", 1e-3), betas=hyper.get("betas", (0.9, 0.999)),
                          eps=hyper.get("eps", 1e-8), weight_decay=wd, decoupled=decoupled,
                          amsgrad=hyper.get("amsgrad", False),
                          maximize=hyper.get("maximize", False)) for x in init]
    for _ in range(steps):
        for p, q, r in zip(ours, theirs, refs):
            g = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
            p.grad = g
            q.grad = g.float()
            r.step(g)
        opt.step()
        topt.step()
    return opt, ours, theirs, refs


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_reference(kernels, kind, dtype, amsgrad, maximize, weight_decay):
    opt, ours, theirs, refs = run_three_ways(kind, dtype, lr=1e-2, amsgrad=amsgrad,
                                             maximize=maximize, weight_decay=weight_decay)
    masters = [fp32_of(opt, p) for p in ours]
    assert all(m.dtype == torch.float32 for m in masters)
    assert_no_worse_than_torch([m.detach() for m in masters], [q.detach() for q in theirs],
                               [r.p for r in refs], what=f"{kind} {dtype}")
    for p in ours:
        st = opt.state[p]
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
        assert st["step"].item() == 8
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert st[key].dtype == torch.float32 and st[key].shape == p.shape
        if dtype != torch.float32:
            assert_lp_matches_master(p.detach(), st["master_param"])
        else:
            assert "master_param" not in st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_with_nan_and_rounding_ties(kernels, dtype):
    # Values that sit exactly between two bf16/fp16 numbers, plus NaN grads.
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(257, generator=gen).to(dtype).requires_grad_()
    opt = offload_adam.AdamW([p], lr=1e-3, weight_decay=0.0)
    g = torch.randn(257, generator=gen).to(dtype)
    g[::7] = float("nan")
    p.grad = g
    opt.step()
    master = opt.state[p]["master_param"]
    assert torch.isnan(master[::7]).all()
    assert_lp_matches_master(p.detach(), master)
    # Force ties: set the master to halfway points and step with zero lr.
    lo = torch.randn(257, generator=gen).to(dtype)
    hi = torch.nextafter(lo.float(), torch.full_like(lo.float(), math.inf)).to(dtype)
    mid = (lo.double() + (hi.double() - lo.double()) * 0.5).float()
    master.copy_(mid)
    opt.param_groups[0]["lr"] = 0.0
    p.grad = torch.zeros(257, dtype=dtype)
    opt.step()
    assert_lp_matches_master(p.detach(), master)


def test_nan_and_inf_grads_match_torch(kernels):
    for kind in CLASSES:
        ours_cls, torch_cls = CLASSES[kind]
        p = torch.randn(64).requires_grad_()
        q = p.detach().clone().requires_grad_()
        opt, topt = ours_cls([p], lr=1e-2, weight_decay=0.1), torch_cls([q], lr=1e-2, weight_decay=0.1)
        for k in range(3):
            g = torch.randn(64)
            g[k::9] = float("nan")
            g[k + 3::11] = float("inf")
            g[k + 5::13] = -float("inf")
            p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            topt.step()
        assert torch.equal(torch.isnan(p), torch.isnan(q))
        fin = ~torch.isnan(q)
        torch.testing.assert_close(p.detach()[fin], q.detach()[fin])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_params(kernels, dtype):
    # A transposed weight steps exactly like its contiguous twin.
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(33, 17, generator=gen).to(dtype)
    p_t = base.t().detach().clone(memory_format=torch.preserve_format).requires_grad_()
    assert not p_t.is_contiguous()
    p_c = p_t.detach().contiguous().requires_grad_()
    opts = [offload_adam.AdamW([p], lr=1e-2, amsgrad=True) for p in (p_t, p_c)]
    for _ in range(3):
        g = torch.randn(17, 33, generator=gen).to(dtype)
        p_t.grad = g.t().contiguous().t()  # non-contiguous grad too
        p_c.grad = g.clone()
        for o in opts:
            o.step()
    assert not p_t.is_contiguous()
    assert torch.equal(p_t.detach(), p_c.detach())
    for key, value in opts[1].state[p_c].items():
        assert torch.equal(opts[0].state[p_t][key], value), key


def test_params_without_grad_are_skipped(kernels):
    a = torch.randn(10).requires_grad_()
    b = torch.randn(10).requires_grad_()
    b0 = b.detach().clone()
    opt = offload_adam.AdamW([a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.randn(10)
    opt.step()
    assert torch.equal(b.detach(), b0) and b not in opt.state
    b.grad = torch.randn(10)
    opt.step()
    a.grad = None
    a1 = a.detach().clone()
    opt.step()
    assert torch.equal(a.detach(), a1)
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 2


def test_zero_size_params(kernels):
    z = torch.zeros(0, 5).requires_grad_()
    w = torch.randn(5).requires_grad_()
    opt = offload_adam.AdamW([z, w, torch.zeros(0, dtype=torch.bfloat16).requires_grad_()])
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.state[z]["exp_avg"].shape == (0, 5) and opt.state[z]["step"].item() == 1


def make_twins(n=3, seed=3):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(7, 5, generator=gen).requires_grad_() for _ in range(n)]
    return ps, [p.detach().clone().requires_grad_() for p in ps]


def set_grads(seed, *param_lists):
    gen = torch.Generator().manual_seed(seed)
    for group in zip(*param_lists):
        g = torch.randn(group[0].shape, generator=gen)
        for p in group:
            p.grad = g.clone()


def assert_params_close(a, b, **kw):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), **kw)


def test_param_groups_and_add_param_group(kernels):
    ps, qs = make_twins(4)
    opt = offload_adam.AdamW([{"params": ps[:2]}, {"params": ps[2:3], "lr": 0.05, "amsgrad": True}], lr=0.01)
    topt = torch.optim.AdamW([{"params": qs[:2]}, {"params": qs[2:3], "lr": 0.05, "amsgrad": True}], lr=0.01)
    for k in range(5):
        if k == 2:
            opt.add_param_group({"params": [ps[3]], "weight_decay": 0.3})
            topt.add_param_group({"params": [qs[3]], "weight_decay": 0.3})
        set_grads(k, ps, qs)
        opt.step()
        topt.step()
    assert_params_close(ps, qs)
    # torch's keys, plus our state format
    assert [sorted(g) for g in opt.param_groups] == [sorted([*g, "state_dtype"])
                                                      for g in topt.param_groups]


def test_group_keys_and_defaults_match_torch():
    for kind, (ours_cls, torch_cls) in CLASSES.items():
        p = torch.zeros(3, requires_grad=True)
        ours, theirs = ours_cls([p]), torch_cls([p])
        # torch's defaults and group keys, plus the state format (state_format.py)
        assert ours.defaults == {**theirs.defaults, "state_dtype": "float32"}, kind
        assert ours.param_groups[0].keys() == theirs.param_groups[0].keys() | {"state_dtype"}
        sig_o = inspect.signature(ours_cls.__init__).parameters
        sig_t = inspect.signature(torch_cls.__init__).parameters
        # torch's arguments, in torch's order; then the offload engine's options,
        # keyword-only (overlap, bucket_mb, ...: see offload_adam.Adam)
        assert list(sig_o)[:len(sig_t)] == list(sig_t), kind
        for name in list(sig_o)[len(sig_t):]:
            assert sig_o[name].kind is inspect.Parameter.KEYWORD_ONLY, (kind, name)
        for name in sig_t:
            assert sig_o[name].default == sig_t[name].default, (kind, name)
            assert sig_o[name].kind == sig_t[name].kind, (kind, name)
    p = torch.zeros(3, requires_grad=True)
    adam_dec = offload_adam.Adam([p], decoupled_weight_decay=True, weight_decay=0.1)
    assert adam_dec.param_groups[0]["decoupled_weight_decay"] is True


def assert_same_steps(make_a, make_b, steps):
    """Two optimizers built on twin params and fed the same grads end with
    bitwise equal params."""
    ps, qs = make_twins()
    a, b = make_a(ps), make_b(qs)
    for k in range(steps):
        set_grads(k, ps, qs)
        a.step()
        b.step()
    for x, y in zip(ps, qs):
        assert torch.equal(x, y)


def test_adam_decoupled_weight_decay_equals_adamw(kernels):
    assert_same_steps(
        lambda ps: offload_adam.Adam(ps, lr=0.01, weight_decay=0.2, decoupled_weight_decay=True),
        lambda qs: offload_adam.AdamW(qs, lr=0.01, weight_decay=0.2), steps=3)


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
], ids=["StepLR", "LambdaLR"])
def test_lr_schedulers(kernels, make_sched):
    ps, qs = make_twins()
    opt, topt = offload_adam.AdamW(ps, lr=0.1), torch.optim.AdamW(qs, lr=0.1)
    s, ts = make_sched(opt), make_sched(topt)
    for k in range(6):
        set_grads(k, ps, qs)
        opt.step()
        topt.step()
        s.step()
        ts.step()
        assert s.get_last_lr() == ts.get_last_lr()
    assert_params_close(ps, qs)


def test_tensor_lr(kernels):
    ps, qs = make_twins()
    opt = offload_adam.AdamW(ps, lr=torch.tensor(0.01))
    topt = torch.optim.AdamW(qs, lr=torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=1, gamma=0.5)
    for k in range(3):
        set_grads(k, ps, qs)
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
    assert_params_close(ps, qs)


def test_named_parameters(kernels):
    model = torch.nn.Linear(4, 3)
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt = offload_adam.AdamW(model.named_parameters(), lr=0.1)
    topt = torch.optim.AdamW(twin.named_parameters(), lr=0.1)
    x = torch.randn(6, 4)
    for _ in range(3):
        for m, o in ((model, opt), (twin, topt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    assert opt.state_dict()["param_groups"] == [{**g, "state_dtype": "float32"}
                                                for g in topt.state_dict()["param_groups"]]
    assert_params_close(model.parameters(), twin.parameters())


def test_zero_grad_and_closure(kernels):
    model = torch.nn.Linear(4, 1)
    opt = offload_adam.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():  # step(closure) still computes grads
        first = opt.step(closure).item()
    for _ in range(20):
        last = opt.step(closure).item()
    assert last < first
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # nothing to do


def test_foreach_and_fused_are_ignored(kernels):
    assert_same_steps(lambda ps: offload_adam.AdamW(ps, lr=0.01, foreach=True, fused=True),
                      lambda qs: offload_adam.AdamW(qs, lr=0.01), steps=2)


class CountingKernels:
    """Wraps the module to record adam_step calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def adam_step(self, *args, **kwargs):
        self.calls.append(args)
        return self.inner.adam_step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_one_kernel_call_per_group_and_dtype(kernels, monkeypatch):
    counting = CountingKernels(kernels)
    monkeypatch.setattr(kernel_step, "kernels", lambda: counting)
    g0 = [torch.randn(3).requires_grad_() for _ in range(5)] + \
         [torch.randn(3, dtype=torch.bfloat16).requires_grad_() for _ in range(4)]
    g1 = [torch.randn(3).requires_grad_() for _ in range(3)]
    opt = offload_adam.AdamW([{"params": g0}, {"params": g1}])
    for p in g0 + g1:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(counting.calls) == 3
    assert sorted(len(c[0]) for c in counting.calls) == [3, 4, 5]
    assert all(c[-1] == torch.get_num_threads() for c in counting.calls)
    counting.calls.clear()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        opt.step()
        assert all(c[-1] == 1 for c in counting.calls)
    finally:
        torch.set_num_threads(old)


def test_the_argument_lists_are_built_once(kernels, monkeypatch):
    """Thousands of small params: a step is one kernel call whose argument lists
    are cached; only the grads are gathered anew while the same params have
    grads, and the lists are rebuilt when that changes."""
    ps = [torch.randn(4).requires_grad_() for _ in range(4000)]
    for p in ps:
        p.grad = torch.ones(4)
    opt = offload_adam.AdamW(ps)
    builds = []
    real = inplace.InPlace._build
    monkeypatch.setattr(inplace.InPlace, "_build",
                        lambda self, *a: builds.append(1) or real(self, *a))
    for _ in range(3):
        opt.step()
    assert builds == [1]
    ps[7].grad = None
    opt.step()
    assert builds == [1, 1] and float(opt.state[ps[7]]["step"]) == 3.0
    assert float(opt.state[ps[8]]["step"]) == 4.0


def test_options_are_checked_for_every_path():
    """The options record (offload_adam/options.py) is checked when the optimizer
    is built, for fp32 CPU params stepped in place as for the engine's."""
    p = torch.nn.Parameter(torch.zeros(2))
    for bad, match in (({"bucket_mb": 0}, "bucket_mb"), ({"num_threads": 0}, "num_threads"),
                       ({"max_grad_norm": 0.0}, "max_grad_norm"),
                       ({"overlap": False, "step_in_backward": True}, "needs overlap=True"),
                       ({"overlap": False, "free_grads_after_copy": True}, "needs overlap=True"),
                       ({"step_in_backward": True, "max_grad_norm": 1.0}, "cannot be used")):
        with pytest.raises(ValueError, match=match):
            offload_adam.AdamW([p], **bad)
    opt = offload_adam.AdamW([p], max_grad_norm=1.0)
    # in place (an engine would hold its host buffers from the start)
    assert opt.host_bytes() == 0 and opt.max_grad_norm == 1.0
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.max_grad_norm = -1.0
    assert opt.max_grad_norm == 1.0


def test_num_threads_holds_in_place(kernels, monkeypatch):
    counting = CountingKernels(kernels)
    monkeypatch.setattr(kernel_step, "kernels", lambda: counting)
    p = torch.randn(3).requires_grad_()
    opt = offload_adam.AdamW([p], num_threads=torch.get_num_threads() + 1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.last_step_profile is None   # in place: the engine profiles its steps
    assert [c[-1] for c in counting.calls] == [torch.get_num_threads() + 1]


def test_import_compiles_nothing():
    code = ("import sys, torch, offload_adam; "
            "opt = offload_adam.AdamW([torch.zeros(3, requires_grad=True)]); "
            "assert 'offload_adam._build' not in sys.modules, 'loader imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def _repo_root():
    from pathlib import Path
    return Path(__file__).resolve().parents[1]


def test_kernel_isa_exports(kernels):
    assert offload_adam.kernel_isa() == kernels.isa()
    assert offload_adam.supported_isas() == list(kernels.supported_isas())
    assert offload_adam.kernel_isa() in offload_adam.supported_isas()


def test_clipping_fp32_and_bf16_params_of_one_optimizer(kernels):
    """The norm over grads of two dtypes (one kernel call per dtype)."""
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(30, generator=gen).requires_grad_(),
          torch.randn(20, generator=gen).bfloat16().requires_grad_()]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    want = float(torch.cat([p.grad.double().reshape(-1) for p in ps]).norm())
    opt = offload_adam.AdamW(ps, lr=0.01, max_grad_norm=1.0)
    assert float(opt.clip_grad_norm_(1.0)) == pytest.approx(want, rel=1e-6)
    opt.step()
    assert all(opt.state[p]["step"].item() == 1 for p in ps)


@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale_and_clip"])
def test_grad_scaler_matches_torch_fused(kernels, clip):
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    opt = offload_adam.AdamW(model.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for k in range(8):
        for m, o, s in ((model, opt, scalers[0]), (twin, topt, scalers[1])):
            o.zero_grad()
            s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            if k == 3:  # an overflow: the step must be skipped and the scale halved
                m[0].weight.grad[0, 0] = float("inf")
            if clip:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.5)
            s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_params_close(model.parameters(), twin.parameters(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert opt.state[p]["step"].item() == topt.state[q]["step"].item() == 7
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_a_refused_grad_scaler_step_leaves_no_loss_scale_behind(kernels):
    """A step() that raised inside GradScaler.step (a refusal: the grads changed after
    opt.clip_grad_norm_) removes the grad_scale/found_inf GradScaler set, as GradScaler
    does after a step that returns: left on, the next GradScaler.step multiplied the old
    scale into the new one and the grads were divided by the scale squared, silently, and
    plain step()s were taken for a GradScaler's (found from outside). A loss scale that
    underflowed to 0 is refused by name (was a ZeroDivisionError)."""
    def run(refuse):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = offload_adam.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        g = torch.Generator().manual_seed(1)
        for it in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            loss = lambda: torch.nn.functional.mse_loss(model(x), y)   # noqa: E731
            scaler.scale(loss()).backward()
            if it == 1:
                if refuse:
                    opt.clip_grad_norm_(1e9)
                    scaler.scale(loss()).backward()   # grads changed after the clip
                    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
                        scaler.step(opt)
                    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
                else:
                    scaler.unscale_(opt)   # the same iteration dropped, nothing refused
                opt.zero_grad()
                scaler.update()
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model, opt
    refused, opt = run(True)
    dropped, _ = run(False)
    for p, q in zip(refused.parameters(), dropped.parameters()):
        assert torch.equal(p, q)
    p = next(refused.parameters())
    p.grad = torch.ones_like(p)
    opt.step()   # a plain step after: no GradScaler's attributes in the way
    assert opt.state[p]["step"].item() == 4
    opt.grad_scale, opt.found_inf = torch.tensor(0.0), torch.tensor(0.0)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"the loss scale .* is 0: halved"):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 4


def test_grad_scale_attribute_unscales(kernels):
    ps, qs = make_twins()
    opt, ref = offload_adam.AdamW(ps, lr=0.01), offload_adam.AdamW(qs, lr=0.01)
    set_grads(0, ps, qs)
    for p in ps:
        p.grad.mul_(1024.0)
    opt.grad_scale = torch.tensor(1024.0)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    ref.step()
    for x, y in zip(ps, qs):
        assert torch.equal(x, y)
    opt.found_inf = torch.tensor(1.0)
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    assert opt.state[ps[0]]["step"].item() == 1


def test_a_param_listed_twice_in_a_group_is_refused(kernels):
    """torch steps such a param twice a step (and warns that it will refuse it); the
    engine and the state files stepped it once, or wrongly: refused, naming both places,
    and add_param_group leaves the optimizer as it was."""
    import warnings
    w, v = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's own warning about duplicates
        with pytest.raises(ValueError, match=r"param group 0, param 2 \(shape \(3,\)\) is the "
                                             r"same tensor as param 0 of its group"):
            offload_adam.AdamW([w, v, w])
        opt = offload_adam.AdamW([v])
        with pytest.raises(ValueError, match="param group 1, param 1 .* same tensor as param 0"):
            opt.add_param_group({"params": [w, w]})
    assert len(opt.param_groups) == 1


_THREADS_REFUSED = """
import resource, warnings, torch, offload_adam
from offload_adam._build import load_kernels
load_kernels()
g = torch.Generator().manual_seed(0)
shapes = [(8,), (4_000_000,)]
ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
qs = [p.detach().clone().requires_grad_() for p in ps]
for p, q in zip(ps, qs):
    p.grad = torch.randn(p.shape, generator=g)
    q.grad = p.grad.clone()
ref = offload_adam.AdamW([{"params": [qs[0]]}, {"params": [qs[1]]}], lr=0.01, num_threads=1)
ref.step()
opt = offload_adam.AdamW([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.01, num_threads=4)
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
# (each thread's stack is the 1 GiB RLIMIT_STACK the parent set: none fits)
resource.setrlimit(resource.RLIMIT_AS, (vm + 300 * 2**20, resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
print([float(opt.state[p]["step"]) for p in ps], all(torch.equal(p, q) for p, q in zip(ps, qs)),
      [str(w.message)[:60] for w in caught])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="thread stacks and RLIMIT_AS as on Linux")
def test_a_step_whose_threads_the_system_refuses_runs_on_fewer(kernels):
    """A kernel thread the system refuses to start (1 GiB stacks under a limit on
    address space; a cgroup's pids.max) raised a bare 'Resource temporarily
    unavailable' from the step, one group stepped and the next not, and the next step
    went on from there (found from outside). The step runs on the threads there are,
    bitwise as with one, and says so once."""
    import resource
    out = subprocess.run([sys.executable, "-c", _THREADS_REFUSED], capture_output=True,
                         text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_STACK,
                                                               (2**30, resource.RLIM_INFINITY)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("[1.0, 1.0] True ['offload_adam: the system refused to start "
                                  "some of the CPU st']"), out.stdout
