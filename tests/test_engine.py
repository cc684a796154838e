"""The offload engine's contract (offload_adam/engine/), on every path.

Each test runs in place (CPU params, the kernel reads p.grad) and through the
engine on the asynchronous simulated device (conftest.path): the same training
must give the same bits, whatever the user does between backward and step(),
and the device must see no ordering violation. References: torch.optim.AdamW
on fp32 twins (a tolerance: another order of float operations) and our own
in-place path built outside the simulation (bit for bit).
"""
import _thread
import contextlib
import copy
import math
import gc
import time
import unittest.mock
import weakref

import pytest
import torch

import offload_adam
from offload_adam.engine import OffloadEngine
from offload_adam.freed_grad import is_freed
from offload_adam.testing import settle
from bare_engine import BareEngine
from conftest import PATHS
from engine_watch import Born, buckets_of, hooked
from models import (BF16, MLP_OPTS, OPTS, Boom, Sometimes, assert_param_is_master_rounded, assert_same,
                    copy_grads, early_steps, halve_grad, kernels_that, loss_of, make_mlp, make_pair, mlp_loss,
                    run, state_of, states, steps_of, train_shadow)


def in_place_run(path, steps, edit=None, micro=1, **options):
    """The same training, in place (the reference the engine must equal)."""
    with path.outside():
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), **{**OPTS, **options})
    run(model, opt, steps, edit=edit, micro=micro)
    return model, opt


@pytest.mark.parametrize("overlap", [True, False])
def test_transformer_matches_torch_adamw(path, overlap):
    model, ref = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for it in range(4):
        loss_of(model, it).backward()
        copy_grads(model, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    if path.engine:
        assert len(buckets_of(opt.last_step_profile)) > 3
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in rheld:
            torch.testing.assert_close(held[p]["master_param"], q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(held[p]["exp_avg_sq"], rheld[q]["exp_avg_sq"])
        else:
            assert not held.get(p)  # unused: no state, as torch
            assert torch.equal(p.float(), q)
    assert_param_is_master_rounded(opt, model)


@pytest.mark.parametrize("overlap", [True, False])
def test_bitwise_equal_to_fp32_params_fed_the_same_grads(path, overlap):
    """The bf16 model == fp32 params stepped by the same kernel with the bf16
    model's grads (the master is exactly an fp32 param), bit for bit."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    run(model, opt, 3)
    shadow, ref = make_pair()
    with path.outside():
        ropt = offload_adam.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    train_shadow(shadow, ref, ropt, steps=3)
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q.to(BF16))
        if held.get(p):
            assert torch.equal(held[p]["master_param"], q)
            assert torch.equal(held[p]["exp_avg_sq"], rheld[q]["exp_avg_sq"])
        else:
            assert not rheld.get(q)


def _clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _scale(model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def _edit_one(model, opt):
    model.head.weight.grad[0].fill_(0.25)


def _edit_data(model, opt):
    model.head.weight.grad.data.mul_(-3)  # .data: a new version counter, no bump


def _unscale_in_place(model, opt):
    # GradScaler.unscale_'s op: changes the grads and bumps no version counter
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._amp_foreach_non_finite_check_and_unscale_(
        grads, torch.zeros(1), torch.full((1,), 0.25))


def _drop_one(model, opt):
    model.head.bias.grad = None


def _replace_one(model, opt):
    model.embed.weight.grad = model.embed.weight.grad * 3


EDITS = [_clip, _scale, _edit_one, _edit_data, _unscale_in_place, _drop_one, _replace_one]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("edit", EDITS)
def test_changes_between_backward_and_step_are_seen(path, edit, overlap):
    """Whatever happens to p.grad after backward, the step uses what is there
    at step(): the in-place path reads it there. (eps is large so that scaling
    a grad changes Adam's update.)"""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS, eps=1e-2)
    run(model, opt, 2, edit=edit)
    assert_same((model, opt), in_place_run(path, 2, edit=edit, eps=1e-2))


@pytest.mark.parametrize("edit", [_edit_data, _unscale_in_place])
def test_hidden_edits_are_caught_by_the_fingerprint(path, edit):
    """Without verify_grads a copied grad changed behind its version counter is
    missed (the test above would fail): the fingerprint is what sees it. The
    in-place path reads the live grad and needs no check."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), verify_grads=False, **OPTS, eps=1e-2)
    run(model, opt, 2, edit=edit)
    ref, _ = in_place_run(path, 2, edit=edit, eps=1e-2)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert same == (not path.engine)


def _clip_foreach(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)


def test_foreach_clip_is_seen_by_its_version_counters(path):
    """clip_grad_norm_'s foreach path (_foreach_mul_) bumps the grads' version counters
    on a GPU, so a copied grad clipped so is copied again without verify_grads too; on
    the simulated device as well (its watch, a TorchDispatchMode, under which torch
    bumps none, bumps them itself)."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), verify_grads=False, **OPTS, eps=1e-2)
    run(model, opt, 2, edit=_clip_foreach)
    assert_same((model, opt), in_place_run(path, 2, edit=_clip_foreach, eps=1e-2))


@pytest.mark.parametrize("overlap", [True, False])
def test_grad_accumulation_over_micro_batches(path, overlap):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    run(model, opt, 2, micro=3)
    assert_same((model, opt), in_place_run(path, 2, micro=3))
    # and the accumulated grads summed by hand, stepped by torch
    shadow, ref = make_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    train_shadow(shadow, ref, ropt, steps=2, micro=3)
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in rheld:
            torch.testing.assert_close(held[p]["master_param"], q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropped", [1, 2], ids=["one-micro-batch", "two-accumulated"])
def test_freed_grads_dropped_by_the_model_start_again(path, dropped):
    """free_grads_after_copy: model.zero_grad() (p.grad = None) drops micro-batches whose
    grads the engine freed (after one that raised, say; accelerate's optimizer.zero_grad
    does nothing inside accumulate()): the next backward's grads are the whole grads, as
    with torch: the same training as if the dropped ones never ran (the next backward was
    refused as "a grad arrived twice", found from outside)."""
    runs = []
    for drop in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=True, **OPTS)
        for it in range(3):
            if drop and it == 1:
                for m in range(dropped):
                    loss_of(model, 100 + m).backward()
                model.zero_grad()
            for m in range(2):
                loss_of(model, 10 * it + m).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same(*runs)


def ref_from_masters(opt, model, ref):
    """The fp32 reference restarted from opt's masters (each step compared, not drifts)."""
    with torch.no_grad():
        held = states(opt)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(held[p]["master_param"] if held.get(p) else p.float())


@pytest.mark.parametrize("overlap", [True, False])
def test_clip_grad_norm_inside_the_kernel_matches_torch(path, overlap):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, **OPTS)
    model2, _ = make_pair()
    opt2 = offload_adam.AdamW(model2.parameters(), overlap=overlap, max_grad_norm=0.05, **OPTS)
    _, ref = make_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for it in range(3):
        loss_of(model, it).backward()
        loss_of(model2, it).backward()
        copy_grads(model, ref)
        before = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
        norm = opt.clip_grad_norm_(0.05)
        for p, g in before.items():
            assert torch.equal(p.grad, g)  # p.grad is left alone: the kernel clips
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        opt.step(), opt2.step(), ropt.step()
        opt.zero_grad(), opt2.zero_grad(), ropt.zero_grad()
        ref_from_masters(opt, model, ref)
    held, held2 = states(opt), states(opt2)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        if held.get(p):
            torch.testing.assert_close(held[p]["master_param"],
                                       held2[p2]["master_param"], rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_twice_compounds_as_torch(path):
    """torch's second clip sees the grads the first one scaled: the step uses both
    coefficients, and the second call returns the clipped norm."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    _, ref = make_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for it in range(2):
        loss_of(model, it).backward()
        copy_grads(model, ref)
        norms = [opt.clip_grad_norm_(0.05), opt.clip_grad_norm_(0.01)]
        rnorms = [torch.nn.utils.clip_grad_norm_(ref.parameters(), m) for m in (0.05, 0.01)]
        for n, r in zip(norms, rnorms):
            torch.testing.assert_close(n.float(), r, rtol=1e-5, atol=0)
        assert float(norms[1]) < 0.051   # the first clip's norm, not the grads' own
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
        ref_from_masters(opt, model, ref)
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in rheld:
            torch.testing.assert_close(held[p]["exp_avg"].float(), rheld[q]["exp_avg"],
                                       rtol=1e-4, atol=1e-9)


def test_clip_grad_norm_of_grads_changed_since_is_refused(path):
    """A clip applies to the grads it saw: grads added to (a backward after the clip),
    or zeroed and made again (model.zero_grad()), are refused at step() by name, with
    nothing stepped; opt.zero_grad() drops the clip; grads all gone take it with them."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    twin, _ = make_pair()
    topt = offload_adam.AdamW(twin.parameters(), **OPTS)
    for m in (model, twin):
        loss_of(m, 0).backward()
    opt.clip_grad_norm_(1e-3)
    loss_of(model, 1).backward()   # accumulates onto what torch would have clipped
    with pytest.raises(RuntimeError, match=r"changed after opt.clip_grad_norm_"):
        opt.step()
    opt.zero_grad()
    model.zero_grad()
    opt.clip_grad_norm_(1e-3)
    model.zero_grad()   # (the model's: the optimizer does not see it)
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"changed after opt.clip_grad_norm_"):
        opt.step()
    opt.zero_grad()   # drops it: the step is the unclipped one
    loss_of(model, 0).backward()
    opt.step(), topt.step()
    for m, o in ((model, opt), (twin, topt)):
        o.clip_grad_norm_(1e-3)
        m.zero_grad()   # every grad gone: the clip with them
        o.step()
        loss_of(m, 1).backward()
        o.step()
    held, theld = states(opt), states(topt)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        if held.get(p):
            assert torch.equal(held[p]["master_param"], theld[q]["master_param"])


def test_state_dict_resume_is_bitwise(path):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    for st in sd["state"].values():
        assert st["master_param"].dtype == torch.float32
        assert st["exp_avg"].device.type == "cpu" and st["step"].dim() == 0
    run(model, opt, 2, start=2)

    model2, _ = make_pair(seed=5)
    model2.load_state_dict(msd)
    opt2 = offload_adam.AdamW(model2.parameters(), **OPTS)
    opt2.load_state_dict(sd)
    run(model2, opt2, 2, start=2)
    assert_same((model, opt), (model2, opt2))


def test_load_state_dict_between_steps(path):
    """A state dict loaded into a running optimizer takes effect at the next
    step (the engine copies it in once the last step's copies are done)."""
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 1)
    sd, msd = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    run(model, opt, 2, start=1)
    model.load_state_dict(msd)
    opt.load_state_dict(sd)
    run(model, opt, 2, start=1)
    reference, ropt = make_pair()[0], None
    with path.outside():
        ropt = offload_adam.AdamW(reference.parameters(), **OPTS)
    run(reference, ropt, 3)
    assert_same((model, opt), (reference, ropt))


def test_scheduler_groups_and_step_without_backward(path):
    model, _ = make_pair()
    groups = [{"params": list(model.body.parameters()), "weight_decay": 0.0},
              {"params": list(model.embed.parameters()) + list(model.head.parameters())
               + list(model.unused.parameters()), "lr": 1e-2}]
    opt = offload_adam.AdamW(groups, lr=3e-3, bucket_mb=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt.step()  # no backward yet: nothing happens
    assert not states(opt)
    _, ref = make_pair()
    rgroups = [{"params": list(ref.body.parameters()), "weight_decay": 0.0},
               {"params": list(ref.embed.parameters()) + list(ref.head.parameters())
                + list(ref.unused.parameters()), "lr": 1e-2}]
    ropt = torch.optim.AdamW(rgroups, lr=3e-3)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, 1, gamma=0.5)
    for it in range(3):
        loss_of(model, it).backward()
        copy_grads(model, ref)
        opt.step(), ropt.step(), sched.step(), rsched.step()
        opt.zero_grad(), ropt.zero_grad()
        with torch.no_grad():  # keep the reference on the bf16 trajectory
            held = states(opt)
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(held[p]["master_param"] if held.get(p) else p.float())
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in rheld:
            torch.testing.assert_close(held[p]["exp_avg"], rheld[q]["exp_avg"])
    assert not held.get(model.unused.weight)


def test_add_param_group_while_training(path):
    # With the state in files the groups are fixed at construction (options.py):
    # add_param_group is refused, the optimizer left as it was, and it trains on
    # as the reference that adds nothing.
    def train(adds, refused=False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(list(model.body.parameters()), **OPTS)
        run(model, opt, 1)
        group = {"params": list(model.embed.parameters()) + list(model.head.parameters()),
                 "lr": 1e-2}
        _add_group(opt, group, adds, refused)
        run(model, opt, 2, start=1)
        return model, opt

    ours = train(adds=not path.files, refused=path.files)
    with path.outside():
        reference = train(adds=not path.files)
    assert_same(ours, reference)


def test_several_optimizers_and_fp32_params(path):
    model, _ = make_pair()
    extra = torch.nn.Linear(4, 4)  # fp32 params beside the bf16 ones
    opt1 = offload_adam.AdamW(list(model.body.parameters()) + list(extra.parameters()), **OPTS)
    opt2 = offload_adam.Adam(list(model.embed.parameters()) + list(model.head.parameters()),
                             lr=1e-3, bucket_mb=0.01)
    for it in range(2):
        (loss_of(model, it) + extra(torch.ones(4)).sum()).backward()
        opt1.step(), opt2.step()
        opt1.zero_grad(), opt2.zero_grad()
    assert ("master_param" in states(opt1)[extra.weight]) == path.engine
    assert_param_is_master_rounded(opt1, model)
    assert_param_is_master_rounded(opt2, model)


def test_free_grads_after_copy(path):
    """Freed grads, two micro-batches per step (the second added to the host copy, not
    on the device): the same training as the grads kept and accumulated on the device."""
    out = []
    for free in (True, False):
        model, _ = make_pair()
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free, **OPTS)
        for it in range(3):
            for micro in range(2):
                loss_of(model, 10 * it + micro).backward()
                if free:   # freed, or never given one (the unused layer)
                    assert [is_freed(p.grad) for p in model.parameters()] == [
                        not name.startswith("unused") for name, _ in model.named_parameters()]
            opt.clip_grad_norm_(0.1)
            opt.step()
            opt.zero_grad()
        out.append((model, opt))
    for p, q in zip(*(m.parameters() for m, _ in out)):
        assert torch.equal(p, q)
    (m1, o1), (m2, o2) = out
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    for i in s1:
        for k in s1[i]:
            assert torch.equal(torch.as_tensor(s1[i][k]), torch.as_tensor(s2[i][k])), (i, k)


def _torch_clipped_run(model, opt, loss, max_norm, steps=3, foreach=None) -> list:
    """`steps` steps, each clipped by torch.nn.utils.clip_grad_norm_ (as Trainer
    and Accelerate do); the norms it returned."""
    norms = []
    for it in range(steps):
        loss(model, it).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                          foreach=foreach)))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("foreach", [None, True], ids=["", "foreach"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clipped", "unclipped"])
def test_torch_clipping_of_freed_grads(path, dtype, max_norm, foreach):
    """torch.nn.utils.clip_grad_norm_ (what Trainer and Accelerate clip and log
    the norm with) after free_grads_after_copy freed the grads: the norm comes
    from the host copies and the coefficient is applied inside the step, not a
    norm of 0 and no clipping. The bound of options.py against torch's clip of
    the kept grads: the norms as close as torch's fp32 sum is to the double one
    on the host (here within a unit in the last place: fp32's third unclipped
    norm); with the same norms, or none clipped, the same training bit for bit (the
    kernel rounds each clipped bf16 grad to bf16 as torch's multiplication does;
    kept in fp32, the masters differ from the first step and params by a bf16
    ulp from the second). Anything else done to a freed grad is a clear error. The
    foreach path (foreach=True; torch's default for FSDP2's DTensor grads) too."""
    runs = []
    for free in (True, False):
        model = make_mlp().to(dtype)
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free, **MLP_OPTS)
        runs.append((model, opt, _torch_clipped_run(model, opt, mlp_loss, max_norm,
                                                    foreach=foreach)))
    (freed, o1, n1), (kept, o2, n2) = runs
    assert [n > max_norm for n in n2] == [max_norm < 1] * 3   # every step clipped, or none
    assert n1 == pytest.approx(n2, rel=torch.finfo(dtype).eps, abs=0)
    if dtype == BF16:
        assert n1 == n2   # (this model's bf16 norms round alike)
    if n1 == n2 or max_norm > 1:   # the same coefficients (1 when unclipped)
        assert_same(runs[0][:2], runs[1][:2])
    if dtype != BF16 or max_norm > 1:
        return
    mlp_loss(freed, 9).backward()
    with pytest.raises(RuntimeError, match=r"shape \(16, 8\).*freed in backward.*cannot use it"
                                           r".*their grads\)$"):
        freed[0].weight.grad.sum()
    from offload_adam import distributed   # as under DDP, the optimizer built before its group
    with unittest.mock.patch.object(distributed, "replicated", lambda *a, **k: True):
        with pytest.raises(RuntimeError, match=r"cannot use it.* Under DistributedDataParallel"
                                               r".*built before torch.distributed's process "):
            freed[0].weight.grad.sum()
    mlp_loss(freed, 10).backward()   # another micro-batch: added to the host copies
    torch.nn.utils.clip_grad_norm_(freed.parameters(), 0.1)
    with pytest.raises(RuntimeError, match=r"multiplied \(clipped or unscaled\) and then "
                                           r"another micro-batch was accumulated"):
        mlp_loss(freed, 11).backward()


def test_torch_clipping_of_freed_grads_beside_kept_zero_grads(path):
    """zero_grad(set_to_none=False) leaves zeros for the freed grads; a param that then
    gets no grad in a backward keeps them, not freed, and torch's clip multiplies them
    too (still zeros): the step applies the freed grads' coefficient, as before, and
    trains as with the grads kept, bit for bit (it was refused, "different factors").
    A grad set by hand, not zero, beside freed ones would be multiplied twice: refused,
    naming it."""
    runs = []
    for free in (True, False):
        model = make_mlp()
        extra = torch.nn.Linear(4, 4).to(BF16)   # used at the first step only
        params = list(model.parameters()) + list(extra.parameters())
        opt = offload_adam.AdamW(params, free_grads_after_copy=free, **MLP_OPTS)
        for it in range(3):
            out = model(torch.randn(5, 8, generator=torch.Generator().manual_seed(it)).to(BF16))
            if it == 0:
                out = extra(out)
            out.float().pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(params, 0.05)
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append((model, opt))
        if free:
            mlp_loss(model, 7).backward()
            extra.weight.grad = torch.ones_like(extra.weight)
            torch.nn.utils.clip_grad_norm_(params, 0.05)
            if path.engine:
                with pytest.raises(RuntimeError, match=r"shape \(4, 4\).*not zero: it would "
                                                       r"be multiplied twice"):
                    opt.step()
    assert_same(*runs)


def test_grad_scaler_skips_inf_steps_with_freed_grads(path):
    """GradScaler.step checks the grads for inf before stepping: freed grads
    answer from their host copies, so an overflowing step is skipped and the
    scale lowered exactly as when the grads are kept."""
    runs = []
    for free in (True, False):
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free, **MLP_OPTS)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        scales = []
        for it in range(4):
            overflow = 1e38 if it == 1 else 1.0   # inf grads in the second step
            scaler.scale(mlp_loss(model, it) * overflow).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs.append((model, opt, scales))
    assert runs[0][2] == runs[1][2] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
    assert steps_of(runs[0][1], runs[0][0]) == [3.0] * 4   # the overflowing step skipped
    assert_same(runs[0][:2], runs[1][:2])


def _scaler_run(overlap, unscale, clip=None, max_grad_norm=None, opt_clip=None):
    model = make_mlp()
    # eps large enough that a grad left scaled changes the update (Adam is
    # otherwise nearly invariant to the grads' scale)
    opt = offload_adam.AdamW(model.parameters(), overlap=overlap, eps=1e-2,
                             max_grad_norm=max_grad_norm, **OPTS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it in range(3):
        scaler.scale(mlp_loss(model, it)).backward()
        if unscale:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if opt_clip:
            opt.clip_grad_norm_(opt_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return opt, list(model.parameters())


@pytest.mark.parametrize("overlap", [True, False])
def test_opt_clip_after_unscale(path, overlap):
    """opt.clip_grad_norm_ after GradScaler.unscale_ sees the unscaled grads
    (fingerprints, or live grads) and equals clipping inside the kernel with
    the grads still scaled (the scale is a power of two: bitwise)."""
    o1, a = _scaler_run(True, unscale=False, max_grad_norm=0.5)
    o2, b = _scaler_run(overlap, unscale=True, opt_clip=0.5)
    held1, held2 = states(o1), states(o2)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(held1[p]["master_param"], held2[q]["master_param"])


def test_grad_scaler(path):
    """bf16 params under torch.amp.GradScaler. unscale_ changes grads without
    bumping version counters: the engine copies them again. The scale is a
    power of two, so unscaling in the kernel or before is the same."""
    _, a = _scaler_run(True, unscale=True)
    _, b = _scaler_run(False, unscale=True)
    _, c = _scaler_run(True, unscale=False)
    for p, q, r in zip(a, b, c):
        assert torch.equal(p, q) and torch.equal(p, r)
    # in-kernel clipping (grads still scaled) vs unscale_ + torch's clip, which
    # rounds the clipped grads to bf16 (the kernel keeps them fp32): equal up to
    # that rounding, moved by Adam's normalisation at most ~lr.
    o1, d = _scaler_run(True, unscale=False, max_grad_norm=0.5)
    o2, e = _scaler_run(False, unscale=True, clip=0.5)
    held1, held2 = states(o1), states(o2)
    for p, q in zip(d, e):
        torch.testing.assert_close(held1[p]["master_param"], held2[q]["master_param"],
                                   rtol=0, atol=3e-4)


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(4096, 32), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 32)).to(BF16)


def _wide_loss(model, seed):
    tokens = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(seed))
    return model(tokens).float().pow(2).mean()


def test_large_params_in_pieces_and_small_ones_packed(path):
    """An embedding of 4 x 32768 elements and 0.1 MB buckets: it is cut into 4
    pieces in 4 buckets; the norm, the bias and the small weight travel packed.
    Same bits as in place."""
    model = _wide_model()
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.1)
    run(model, opt, 3, loss=_wide_loss)
    if path.engine:
        # The layout, read from an engine driven alike (the optimizer's is not
        # public), and the optimizer's last step went through as many buckets.
        twin = _wide_model()
        bare = BareEngine(twin.parameters(), lr=3e-3, bucket_mb=0.1)
        run(twin, bare, 3, loss=_wide_loss)
        engine = bare.engine
        embed = next(r for r in engine.recs if r.param is twin[0].weight)
        assert [p.numel for p in embed.pieces] == [32768] * 4
        assert len({p.bucket.index for p in embed.pieces}) == 4
        packed = [p.rec.param for b in engine.buckets for p in b.pieces if p.packed]
        assert len(packed) == 4 and all(p is not twin[0].weight for p in packed)
        assert buckets_of(opt.last_step_profile) == set(range(len(engine.buckets)))
        assert_same((model, opt), (twin, bare))
    with path.outside():
        ref = _wide_model()
        ropt = offload_adam.AdamW(ref.parameters(), lr=3e-3, bucket_mb=0.1)
    run(ref, ropt, 3, loss=_wide_loss)
    assert_same((model, opt), (ref, ropt))


def _encoder_and_head(dtype):
    """Issue 25's model: with the default bucket_mb, one bucket holds the norms'
    and biases' packed grads between large weights', in the order backward
    makes them."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(256, 4, dropout=0.0, batch_first=True),
        torch.nn.Linear(256, 37)).to(dtype)


def _encoder_loss(model, seed):
    x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(seed))
    return model(x.to(model[1].weight.dtype)).float().pow(2).mean()


@pytest.mark.parametrize("free", [False, True], ids=["kept", "freed"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_packs_among_large_grads_move_only_their_bytes(sim, dtype, free):
    """Issue 25: a pack's copy (through a temporary, as on a GPU) wrote the
    whole span from its lowest to its highest byte, over the host grads of
    three weights; freed grads' norms came out NaN, and the H2D read and
    moved the span. Same bits and norms as in place."""
    runs = []
    for build in (sim.outside, contextlib.nullcontext):
        with build():
            model = _encoder_and_head(dtype)
            opt = offload_adam.AdamW(model.parameters(), lr=1e-3, free_grads_after_copy=free)
        runs.append((model, opt, _torch_clipped_run(model, opt, _encoder_loss, 1e9)))
    (ref, ropt, ref_norms), (model, opt, norms) = runs
    assert all(map(math.isfinite, norms)) and norms == pytest.approx(ref_norms, rel=1e-5)
    held, rheld = states(opt), states(ropt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        for key, value in rheld[q].items():   # in place, fp32 has no master_param
            assert torch.equal(held[p][key], value), key


def _column_major_grads(model):
    """Every 2-D param's grad arrives non-contiguous (column-major), as from a
    hook of the user's registered before the optimizer's."""
    for p in model.parameters():
        if p.dim() == 2:
            p.register_post_accumulate_grad_hook(
                lambda p: setattr(p, "grad", p.grad.t().contiguous().t()))


NON_CONTIGUOUS_CASES = {   # name: (model, its loss, edit between backward and step, options)
    "data_edit": (lambda: make_pair()[0], loss_of, _edit_data, {}),
    "unscale": (lambda: make_pair()[0], loss_of, _unscale_in_place, {}),
    "free_grads": (lambda: make_pair()[0], loss_of, None, {"free_grads_after_copy": True}),
    "pieces_and_packs": (_wide_model, _wide_loss, _unscale_in_place, {"bucket_mb": 0.1}),
}


@pytest.mark.parametrize("case", NON_CONTIGUOUS_CASES)
def test_non_contiguous_grads(path, case):
    """Non-contiguous grads go to the host through one contiguous copy made on
    the D2H stream, in order with the copies that read it, also when a grad
    changed behind its version counter is copied again by a bucket job on the
    worker's thread (which has a stream of its own on CUDA: a copy made on it
    is unordered with the D2H stream). Same bits as in place."""
    build, loss, edit, extra = NON_CONTIGUOUS_CASES[case]

    def train():
        model = build()
        _column_major_grads(model)
        opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "eps": 1e-2, **extra})
        run(model, opt, 3, edit=edit, loss=loss)
        return model, opt

    result = train()
    with path.outside():
        reference = train()
    assert_same(result, reference)


def test_hook_that_finds_no_grad_does_nothing(path):
    """A post-accumulate-grad hook registered before the optimizer's may take the
    grad (an optimizer-in-backward pattern): that param is left alone."""
    model = make_mlp()
    dropped = model[2].weight
    before = dropped.detach().clone()
    dropped.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    mlp_loss(model, 0).backward()
    assert dropped.grad is None
    opt.step()
    assert not states(opt).get(dropped)
    assert torch.equal(dropped, before)
    assert steps_of(opt, model) == [1.0, 1.0, 0.0, 1.0]


def test_cast_after_building_is_followed_or_refused(path):
    """model.to(dtype) after the optimizer was built: in place, the optimizer
    follows the params (as torch's does); the engine, whose host buffers were
    sized for the old dtype, refuses with a message saying what to do; so do
    the state files, laid out for the old dtype (nvme_tier.py)."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    run(model, opt, 1, loss=mlp_loss)
    model.to(torch.float16)
    x = torch.randn(5, 8).to(torch.float16)
    model(x).float().sum().backward()
    if path.engine:
        with pytest.raises(RuntimeError, match=r"is now torch.float16.*Build the optimizer after"):
            opt.step()
    elif path.files:
        with pytest.raises(RuntimeError, match=r"is torch.float16; its state files were laid out "
                                               r"for torch.bfloat16.*build the optimizer after"):
            opt.step()
        assert steps_of(opt, model) == [1.0] * 4
    else:
        opt.step()
        assert steps_of(opt, model) == [2.0] * 4
        assert_param_is_master_rounded(opt, model)


# ---- when things go wrong ---------------------------------------------------------------
def test_a_kernel_error_surfaces_with_the_original_exception(path, monkeypatch):
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    mlp_loss(model, 0).backward()
    armed = [True]

    def fail_once(args):
        if armed.pop() if armed else False:
            raise Boom("kernel failed")

    kernels_that(monkeypatch, fail_once)
    with pytest.raises(Boom, match="kernel failed"):
        opt.step()
    opt.zero_grad()  # usable afterwards
    mlp_loss(model, 1).backward()
    opt.step()
    assert_param_is_master_rounded(opt, model)


def _interrupts_in_kernel(count, at):
    """A kernel wrapper that, in kernel call `at` only, sends `count`
    SIGINTs to the main thread and gives each time to be handled (the sleep is
    sliced so that the main thread, when it is the one waiting here, runs its
    handler between slices). Sent from inside the step, not from timers, so
    that a slow machine cannot move them before or after it."""
    calls = []

    def before_step(args):
        calls.append(1)
        if len(calls) != at:
            return
        for _ in range(count):
            _thread.interrupt_main()
            for _ in range(30):
                time.sleep(0.01)
        time.sleep(0.3)
    return before_step


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("interrupts", [1, 2])
@pytest.mark.parametrize("last", [False, True])
def test_keyboard_interrupt_in_step_then_training_goes_on(path, monkeypatch, capfd, interrupts, last):
    """One ^C in step(): every bucket is still stepped, then KeyboardInterrupt
    (the step is all or nothing). A second ^C gives up on the buckets not
    started; each param is then stepped or not, never half. With the state in
    files a second ^C is held too (a bucket stepped would be ahead of the files
    until the pass commits), and a line on stderr says why and how to stop at
    once. Either way the next iteration runs. The ^Cs come in the first kernel
    call of the second step, or in its `last` (the buckets before it are done)."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    calls = []
    kernels_that(monkeypatch, calls.append)
    mlp_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    kernels_that(monkeypatch, _interrupts_in_kernel(interrupts, len(calls) if last else 1))
    mlp_loss(model, 1).backward()
    before = [p.clone() for p in model.parameters()]
    capfd.readouterr()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    steps = steps_of(opt, model)
    held = "the state files are being written" in capfd.readouterr().err
    if interrupts == 1 or path.files or (path.engine and last):
        assert steps == [2.0] * len(steps)
    elif path.engine:  # the bucket running finishes, those queued are dropped
        assert 1 < sum(steps) / len(steps) < 2 and set(steps) <= {1.0, 2.0}
    else:  # in place, one kernel call: the second ^C came before it started
        assert steps == [1.0] * len(steps)
    # a param not stepped is as it was
    assert all(torch.equal(p, b) for p, b, n in zip(model.parameters(), before, steps) if n == 1)
    assert_param_is_master_rounded(opt, model)
    assert held == (interrupts == 2 and path.files)
    monkeypatch.undo()
    opt.zero_grad()
    mlp_loss(model, 1).backward()
    opt.step()  # returns: nothing left waiting


class FailHalfway(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("backward failed")


def test_backward_that_raises_halfway(path):
    """Hooks fired for the last layer only; the next iteration is exact."""
    results = []
    for broken in (True, False):
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
        if broken:
            x = torch.randn(5, 8).to(BF16)
            h = FailHalfway.apply(model[1](model[0](x)))
            with pytest.raises(Boom):
                model[2](h).float().sum().backward()
            assert model[2].weight.grad is not None and model[0].weight.grad is None
            opt.zero_grad()
        run(model, opt, 2, loss=mlp_loss)
        results.append((model, opt))
    assert_same(*results)


@pytest.mark.parametrize("then", ["backward", "zero_grad_keep"])
def test_grads_of_a_backward_that_raised_are_written_after_their_copies(path, then):
    """The copies a raised backward started are published by no end of backward: the
    next write of those grads (the next backward adding into them, zero_grad with
    set_to_none=False zeroing them) is ordered after them (the simulated device reports
    a write racing a copy), and the training is the one in place, bit for bit."""
    def train():
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
        run(model, opt, 1, loss=mlp_loss)
        h = FailHalfway.apply(model[1](model[0](torch.randn(5, 8).to(BF16))))
        with pytest.raises(Boom):
            model[2](h).float().sum().backward()
        if then == "zero_grad_keep":
            opt.zero_grad(set_to_none=False)
        mlp_loss(model, 3).backward()
        opt.step()
        opt.zero_grad()
        run(model, opt, 1, start=4, loss=mlp_loss)
        return model, opt

    ours = train()
    with path.outside():
        ref = train()
    assert_same(ours, ref)


@pytest.mark.parametrize("early", [False, True])
def test_zero_grad_keeping_grads_leaves_zeros_where_grads_were_freed(path, early):
    """free_grads_after_copy with zero_grad(set_to_none=False): zero grads, as torch
    leaves, so that a param without a grad in the next backward is stepped with zeros
    (weight decay, momentum) as without the option: bit for bit. The model's
    zero_grad(set_to_none=False) cannot zero a freed grad in place: refused by name."""
    runs = []
    for free in (False, True):
        torch.manual_seed(0)
        model = Sometimes().to(BF16)
        opt = offload_adam.AdamW(model.parameters(), free_grads_after_copy=free,
                                 step_in_backward=early, **OPTS)
        for it in range(4):
            model.odd = it == 1   # `sometimes` gets a grad in step 2 only
            loss_of(model, it).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append((model, opt))
        assert all(p.grad is not None and not is_freed(p.grad) and not p.grad.any()
                   for p in model.sometimes.parameters())
    assert float(states(runs[1][1])[runs[1][0].sometimes.weight]["step"]) == 3
    assert_same(*runs)
    model, opt = runs[1]
    loss_of(model, 5).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"no memory to zero in place.*optimizer's "
                                           r"zero_grad\(set_to_none=False\)"):
        model.zero_grad(set_to_none=False)
    model.zero_grad()


class WithEmpty(torch.nn.Module):
    """A weight and an empty param (a rank-0 adapter): every empty storage is at address
    0, which the simulated device once took for one memory shared by them all."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 37).to(BF16))
        self.e = torch.nn.Parameter(torch.zeros(0, 3).to(BF16))
        self.embed = torch.nn.Embedding(37, 8).to(BF16)

    def forward(self, tokens):
        return self.embed(tokens) @ self.w + self.e.sum()


def test_an_empty_param_beside_others_in_backward(path):
    def train():
        torch.manual_seed(0)
        model = WithEmpty()
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=True, **OPTS)
        run(model, opt, 3)
        return model, opt

    ours = train()
    with path.outside():
        ref = train()
    assert_same(ours, ref)


def _add_group(opt, group, adds, refused):
    """opt.add_param_group(group) when `adds`; `refused` (the state in files): it raises
    NotImplementedError and leaves the optimizer with its one group."""
    if refused:
        with pytest.raises(NotImplementedError, match="add_param_group cannot be used "
                                                      "with state_dirs="):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1
    if adds:
        opt.add_param_group(group)


@pytest.mark.parametrize("trained_before", [False, True])
@pytest.mark.parametrize("path,then", [
    (p, then) for p in PATHS for then in ["step", "backward", "zero_grad"]],
    indirect=["path"])
def test_add_param_group_after_a_backward_that_raised(path, trained_before, then):
    """A backward that raised left grads hooked halfway (the last layer's, in a
    bucket's pack that waits for the rest); a group added then re-buckets
    everything. The copies of the failed backward are discarded and the grads
    copied again at step() (`then`: at once, after another backward, or after
    zero_grad and another backward): the same bits as in place. (With the state
    in files add_param_group is refused, options.py: the optimizer trains on as
    the reference that adds nothing.)"""
    def train(adds, refused=False):
        torch.manual_seed(0)
        model = make_mlp()
        extra = torch.nn.Linear(4, 3).to(BF16)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)   # one bucket, packed
        if trained_before:
            run(model, opt, 1, loss=mlp_loss)
        h = FailHalfway.apply(model[1](model[0](torch.randn(5, 8).to(BF16))))
        with pytest.raises(Boom):
            model[2](h).float().sum().backward()
        assert model[2].weight.grad is not None and model[0].weight.grad is None
        if then == "zero_grad":
            opt.zero_grad()
        group = {"params": list(extra.parameters()), "lr": 1e-2}
        _add_group(opt, group, adds, refused)
        if then != "step":
            (mlp_loss(model, 1) + extra(torch.ones(2, 4).to(BF16)).float().pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
        run(model, opt, 1, start=2, loss=mlp_loss)
        return torch.nn.ModuleList([model, extra]), opt

    ours = train(adds=not path.files, refused=path.files)
    with path.outside():
        reference = train(adds=not path.files)
    assert_same(ours, reference)


@pytest.mark.parametrize("overlap", [True, False])
def test_sparse_grad_is_a_clear_error(path, overlap):
    """A bf16 sparse embedding: refused, naming the param, from the hook
    (overlap) or from step()."""
    emb = torch.nn.Embedding(10, 4, sparse=True).to(BF16)
    opt = offload_adam.AdamW(emb.parameters(), overlap=overlap)
    match = r"sparse gradients \(param group 0, param 0 \(shape \(10, 4\)\)"   # both paths
    if overlap and path.engine:
        with pytest.raises(RuntimeError, match=match):
            emb(torch.tensor([1, 2])).float().sum().backward()
    else:
        emb(torch.tensor([1, 2])).float().sum().backward()
        with pytest.raises(RuntimeError, match=match):
            opt.step()
    assert not states(opt).get(emb.weight)


def test_param_made_non_contiguous(path):
    """p.data replaced by a non-contiguous tensor after the optimizer was
    built: stepped through a copy in place; refused by the engine (its pieces
    are ranges of a contiguous param), naming the shape."""
    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    w = model[0].weight
    w.data = w.detach().t().contiguous().t()
    original = w.detach().clone()
    mlp_loss(model, 0).backward()
    if path.engine:
        with pytest.raises(RuntimeError, match=r"shape \(16, 8\).*became non-contiguous"):
            opt.step()
        assert torch.equal(w, original)
    else:
        opt.step()
        assert not torch.equal(w, original)
        assert_param_is_master_rounded(opt, model)


def test_close_and_del_let_everything_go(sim):
    """close() does what dropping the optimizer does: no hook fires afterwards,
    the worker exits, host memory is released once no copy uses it, and a
    step() after it is an error, not a hang. (close() is the engine's own: the
    first half drives an engine directly; the second drops an optimizer and
    watches from outside.)"""
    model = make_mlp()
    born = Born()
    bare = BareEngine(model.parameters(), **MLP_OPTS)
    engine, (thread,) = bare.engine, born.threads()
    run(model, bare, 1, loss=mlp_loss)
    engine.close()
    assert all(r.hook is None for r in engine.recs)
    assert not any(hooked(p) for p in model.parameters())
    thread.join(timeout=10)
    assert not thread.is_alive()
    mlp_loss(model, 1).backward()  # the hooks are gone: nothing is copied
    assert all(r.copy is None or r.copy.grad() is not p.grad
               for r, p in zip(engine.recs, model.parameters()))
    with pytest.raises(RuntimeError, match="engine was closed"):
        bare.step()
    engine.close()  # a second close is a no-op
    closed = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    run(model, closed, 1, loss=mlp_loss)
    closed.close()
    closed.zero_grad()   # as torch's: the grads cleared (a closed engine has no part in it)
    assert all(p.grad is None for p in model.parameters())

    model = make_mlp()
    pinned, born = sim.sim.pinned(), Born()
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    run(model, opt, 1, loss=mlp_loss)
    engines, (thread,) = born.engines(), born.threads()
    assert len(engines) == 1 and len(sim.sim.pinned()) > len(pinned)
    del opt
    gc.collect()
    assert engines[0]() is None
    assert sim.sim.pinned() == pinned  # unpinned (unpin() checks: after their copies)
    thread.join(timeout=5)
    assert not thread.is_alive()
    mlp_loss(model, 0).backward()  # hooks are gone or harmless


DROP_OPTIONS = {"default": {}, "free_grads": {"free_grads_after_copy": True},
                "early": {"step_in_backward": True}, "no_overlap": {"overlap": False},
                "clip": {"max_grad_norm": 1.0}}


@pytest.mark.parametrize("options", DROP_OPTIONS)
def test_a_dropped_optimizer_is_freed_at_once(path, options):
    """As torch's: an optimizer is freed the moment it is dropped, with no
    cyclic garbage collection (it is disabled here), and takes its hooks,
    worker and pinned memory with it; a new optimizer over the same params
    then trains them alone (what torch's own state-dict tests do), exactly as
    if the first had been collected before it was built."""
    options = {**MLP_OPTS, **DROP_OPTIONS[options]}
    results = []
    # The collected run first: it also does the imports torch makes on the first
    # state_dict()/add_param_group() of a process, whose frames outlive them.
    for collect in (True, False):
        model = make_mlp()
        gc.collect()
        gc.disable()
        try:
            pinned = path.sim.pinned() if path.engine else None
            opt = offload_adam.AdamW(model.parameters(), **options)
            run(model, opt, 2, loss=mlp_loss)
            state = opt.state_dict()
            dropped = weakref.ref(opt)
            del opt
            if collect:
                gc.collect()
            assert dropped() is None
            assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
            if path.engine:
                assert path.sim.pinned() == pinned
            opt = offload_adam.AdamW(model.parameters(), **options)
            opt.load_state_dict(state)
            run(model, opt, 2, start=2, loss=mlp_loss)
        finally:
            gc.enable()
        results.append((model, opt))
    assert_same(*results)


@pytest.mark.parametrize("options", DROP_OPTIONS)
def test_a_new_optimizer_takes_the_params_over_from_a_live_one(path, options):
    """`opt = AdamW(params)` run again while the old optimizer is still bound to
    `opt` (an LR sweep, a notebook cell run twice, torch's own optimizer tests):
    as with torch, the new one trains the params, bit for bit as if the old one had
    been dropped first. The old one's hooks (they would split the grads between
    the two), worker and pinned memory go at once; its step(), zero_grad() or
    clip_grad_norm_() afterwards is a clear error that touches nothing."""
    options = {**MLP_OPTS, **DROP_OPTIONS[options]}
    engine = path.engine or any(options.get(k) for k in ("free_grads_after_copy",
                                                         "step_in_backward"))
    results, pinned = [], []
    for keep in (True, False):
        model = make_mlp()
        before = len(path.sim.pinned()) if path.engine else 0
        born = Born()
        old = offload_adam.AdamW(model.parameters(), **options)
        run(model, old, 2, loss=mlp_loss)
        state, threads = old.state_dict(), born.threads()
        if not keep:
            del old
        new = offload_adam.AdamW(model.parameters(), **options)
        new.load_state_dict(state)
        pinned.append(len(path.sim.pinned()) - before if path.engine else 0)
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        run(model, new, 1, start=2, loss=mlp_loss)
        mlp_loss(model, 3).backward()
        if keep and engine:
            settle(new)   # (step_in_backward: its steps started in backward have run)
            grads, params = [p.grad for p in model.parameters()], state_of(new, model)
            for use in (old.step, old.zero_grad, lambda: old.clip_grad_norm_(1.0)):
                with pytest.raises(RuntimeError, match=r"params \(param group 0, param 0 "
                                   r"\(shape \(16, 8\)\) and 3 other params, of its 4\) were "
                                   "taken over by a newer offload_adam optimizer"):
                    use()
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))
            for now, then in zip(state_of(new, model), params):
                assert all(torch.equal(now[k], then[k]) for k in then)
        new.step()
        new.zero_grad()
        run(model, new, 1, start=4, loss=mlp_loss)
        hooks = engine and options.get("overlap", True)   # one, the new one's
        assert all(len(p._post_accumulate_grad_hooks or ()) == hooks for p in model.parameters())
        results.append((model, new))
    assert_same(*results)
    assert pinned[0] == pinned[1]


@pytest.mark.parametrize("old_options", [{"step_in_backward": True},
                                         {"free_grads_after_copy": True}])
def test_a_newer_optimizer_stepping_in_place_takes_the_params_over(old_options):
    """A notebook cell run again with other options: the old optimizer (the engine's,
    bf16 CPU params) still referenced, the new one steps them in place. The old one's
    hooks stayed on, stepped in backward or freed the grads, and the new one could not
    train (found from outside). It lets go as for a newer engine, and the new one trains
    as if the old one had been dropped."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4)).to(torch.bfloat16)

    def loss(m, it):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(it))
        return m(x.to(torch.bfloat16)).float().pow(2).sum()

    runs = []
    for keep in (True, False):
        m = make()
        old = offload_adam.AdamW(m.parameters(), lr=1e-2, **old_options)
        loss(m, 0).backward()
        old.step()
        old.zero_grad()
        if not keep:
            old.close()
        new = offload_adam.AdamW(m.parameters(), lr=1e-2)
        for it in range(1, 4):
            loss(m, it).backward()
            new.step()
            new.zero_grad()
        runs.append([p.detach().clone() for p in m.parameters()])
        if keep:
            with pytest.raises(RuntimeError, match="taken over by a newer offload_adam"):
                old.step()
            assert all(not p._post_accumulate_grad_hooks for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
def test_a_refused_constructor_takes_nothing_over(sim, tmp_path, early):
    """A notebook cell building the optimizer again over the same state_dirs= while the
    old one lives: the new one is refused (the files are locked by the old one, and the
    message says to close it to resume them), and the old one, untouched, trains on bit
    for bit as if nothing had been tried: the refused one's hooks are gone at once."""
    options = {**MLP_OPTS, "step_in_backward": early}
    results = []
    for tried in (True, False):
        model = make_mlp()
        (tmp_path / f"s{tried}").mkdir()
        opt = offload_adam.AdamW(model.parameters(), state_dirs=tmp_path / f"s{tried}",
                                 **options)
        run(model, opt, 2, loss=mlp_loss)
        if tried:
            with pytest.raises(RuntimeError, match=r"is in use by another optimizer .*close "
                                                   r"that optimizer first \(opt.close\(\)"):
                offload_adam.AdamW(model.parameters(), state_dirs=tmp_path / f"s{tried}",
                                   state_resume=True, **options)
        assert all(len(p._post_accumulate_grad_hooks or ()) == 1 for p in model.parameters())
        run(model, opt, 2, start=2, loss=mlp_loss)
        results.append((model, opt))
    assert_same(*results)
    for _, opt in results:
        opt.close()


def test_an_optimizer_taken_over_in_part_says_what_it_left(sim):
    """A newer optimizer given some of an older live one's params (add_param_group): a
    param's grads go to one engine, so the older one lets go of all of them, and says
    how many of its params were taken and that the rest are stepped by none now."""
    model = make_mlp()
    params = list(model.parameters())
    old = offload_adam.AdamW(params[:3], **MLP_OPTS)
    new = offload_adam.AdamW(params[3:], **MLP_OPTS)
    run(model, old, 1, loss=mlp_loss)
    new.add_param_group({"params": [params[0]]})
    with pytest.raises(RuntimeError, match=r"\(param group 0, param 0 \(shape \(16, 8\)\), of "
                       r"its 3\) were taken over by a newer offload_adam optimizer \(built over "
                       r"them, given them by add_param_group, or a copy.copy or an unpickled "
                       r"copy of this one over the same params\).* Its 2 other params are "
                       r"stepped by no optimizer now"):
        old.step()


def _halve_data(p):
    p.grad.data.mul_(0.5)   # no version bump


def _halve_replaced(p):
    p.grad = p.grad * 0.5


def _dropped(p):
    p.grad = None


HOOK_EDITS = {"in place": halve_grad, ".data": _halve_data, "replaced": _halve_replaced,
              "dropped": _dropped}
HOOK_OPTIONS = {"default": {}, "free_grads": {"free_grads_after_copy": True},
                "early": {"step_in_backward": True},
                "early, free_grads": {"step_in_backward": True, "free_grads_after_copy": True}}


@pytest.mark.parametrize("edit", HOOK_EDITS)
@pytest.mark.parametrize("options", HOOK_OPTIONS)
def test_a_hook_registered_after_the_optimizer_edits_the_grad_it_steps(path, options, edit):
    """A user's post-accumulate-grad hook registered after the optimizer runs after
    the engine's and edits the grad. The engine copies such a grad only once
    autograd is past that hook (a copy queued before it would race its write on
    the device, and step_in_backward would step the grad as it was), so every mode
    steps the edited grad (or none, if the hook dropped it), bit for bit as in
    place, and steps still start during backward."""
    options = {**MLP_OPTS, **HOOK_OPTIONS[options]}

    def train(model, opt):
        for p in list(model.parameters())[::2]:   # some params, not the others
            p.register_post_accumulate_grad_hook(HOOK_EDITS[edit])
        started = []
        for it in range(4):
            before = steps_of(opt, model)
            mlp_loss(model, it).backward()
            started.append(early_steps(opt, model, before))
            opt.step()
            opt.zero_grad()
        return started

    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **options)
    started = train(model, opt)
    with path.outside():
        ref_model = make_mlp()
        ref = offload_adam.AdamW(ref_model.parameters(), **MLP_OPTS)   # in place
    train(ref_model, ref)
    assert_same((model, opt), (ref_model, ref))
    with_grads = 2 if edit == "dropped" else 4   # (the hooked params' grads are gone)
    # the first backward guesses the order (the last params first; in host RAM the
    # buckets as first laid out, in files the file buckets): right but where the hook
    # dropped grads (a bucket is then left incomplete until step())
    if options.get("step_in_backward"):
        assert started[1:] == [with_grads] * 3
        if edit != "dropped":
            assert started[0] == with_grads
        else:
            assert started[0] <= with_grads
    else:
        assert started == [0] * 4


@pytest.mark.parametrize("options", ["default", "early"])
def test_a_backward_that_raises_after_a_hooked_grad(path, options):
    """A backward that raises after the engine's hook of a param whose copy waits
    for a user's hook: that copy is never taken from the failed backward (step()
    copies and steps the grads there are), and the next backward into the grads
    left (no zero_grad: they accumulate, as torch allows) steps exactly as in place."""
    def train(model, opt):
        model[2].weight.register_post_accumulate_grad_hook(halve_grad)
        run(model, opt, 2, loss=mlp_loss)
        h = FailHalfway.apply(model[1](model[0](torch.randn(5, 8).to(BF16))))
        with pytest.raises(Boom):
            model[2](h).float().sum().backward()
        opt.step()
        mlp_loss(model, 5).backward()
        opt.step()
        opt.zero_grad()
        run(model, opt, 2, start=6, loss=mlp_loss)

    model = make_mlp()
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS, **HOOK_OPTIONS[options])
    train(model, opt)
    with path.outside():
        ref_model = make_mlp()
        ref = offload_adam.AdamW(ref_model.parameters(), **MLP_OPTS)   # in place
    train(ref_model, ref)
    assert_same((model, opt), (ref_model, ref))


@pytest.mark.parametrize("early", [False, True])
def test_profile_and_host_bytes(path, early):
    model, _ = make_pair()
    opt = offload_adam.AdamW(model.parameters(), **OPTS, step_in_backward=early)
    engine = path.engine or early
    assert opt.last_step_profile is None
    n = sum(p.numel() for p in model.parameters())
    # the engine: master + 2 moments (fp32) + grad copy and staging (bf16), plus
    # alignment; in place, the state is the optimizer's own tensors. With the state
    # in files the engine keeps grad copy and staging, and the files' state is on the
    # host only in a ring of 4 buffers of the largest file bucket (options.py,
    # state_budget_mb=None): here one param's fp32 master + 2 moments, aligned
    per_param = (4 if path.files else 16) if engine else 0
    ring = 4 * 12 * max(p.numel() for p in model.parameters()) if path.files else 0
    assert (per_param * n + ring <= opt.host_bytes()
            <= per_param * n + ring + 3 * 64 * 14 + 5 * 8192)
    run(model, opt, 1)
    prof = opt.last_step_profile
    if not engine:
        assert prof is None
        return
    assert set(prof) == {"d2h_s", "cpu_step_s", "h2d_s", "exposed_s", "ring_waits", "ring_wait_s",
                         "timeline", "waits", "wait_s"}
    assert prof["ring_waits"] == 0 and prof["ring_wait_s"] == 0.0   # (no ring: not in backward)
    assert prof["wait_s"]["ring"] == 0.0
    # each bucket stepped in host RAM waited for its grads' copies (the files' pass at
    # step() steps through its own path)
    grads = [w for w in prof["waits"] if w["what"] == "grads"]
    stepped = {r["bucket"] for r in prof["timeline"] if r["phase"] == "cpu_step"}
    assert {w["bucket"] for w in grads} <= stepped
    assert path.files or {w["bucket"] for w in grads} == stepped
    for w in prof["waits"]:
        assert w["end_s"] >= w["start_s"] and w["what"] in ("grads", "home")
    assert prof["wait_s"]["grads"] == pytest.approx(sum(w["end_s"] - w["start_s"] for w in grads))
    assert {r["phase"] for r in prof["timeline"]} == {"d2h", "cpu_step", "h2d"}
    for r in prof["timeline"]:
        assert r["end_s"] >= r["start_s"] and isinstance(r["bucket"], int)
    assert prof["cpu_step_s"] > 0 and prof["exposed_s"] > 0
    if not early:
        # every bucket stepped inside step(); in backward, some may step before it
        assert prof["exposed_s"] >= prof["cpu_step_s"]


def test_num_threads_reaches_every_kernel_call(path, monkeypatch):
    """num_threads is what the engine's step and norm kernels get; the result
    does not depend on it."""
    option = torch.get_num_threads() + 1  # differs from the default anywhere
    runs = []
    for threads in (option, None):
        seen = []
        kernels_that(monkeypatch, lambda args: seen.append(args[-1]))
        model = make_mlp()
        opt = offload_adam.AdamW(model.parameters(), num_threads=threads, **MLP_OPTS)
        for it in range(2):
            mlp_loss(model, it).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        monkeypatch.undo()
        expected = threads or torch.get_num_threads()  # num_threads holds for every path
        assert seen and set(seen) == {expected}
        runs.append((model, opt))
    assert_same(*runs)


def test_too_little_host_memory_and_failed_pinning(sim, monkeypatch):
    model = make_mlp()
    with pytest.raises(MemoryError, match="available"):
        OffloadEngine([list(model.parameters())], [False], available_host_bytes=100)

    def refuse(t):
        raise RuntimeError("cudaHostRegister failed with error 2")

    monkeypatch.setattr(sim.sim, "pin", refuse)
    with pytest.warns(RuntimeWarning, match="could not pin .*pageable"):
        engine = OffloadEngine([list(model.parameters())], [False])
    assert not engine.pinned()
    del engine
    with pytest.warns(RuntimeWarning, match="could not pin .*pageable"):
        opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
        run(model, opt, 1, loss=mlp_loss)
    assert_param_is_master_rounded(opt, model)


def test_bad_engine_options():
    p = torch.nn.Parameter(torch.zeros(2, dtype=BF16))
    with pytest.raises(ValueError, match="bucket_mb"):
        offload_adam.AdamW([p], bucket_mb=0, free_grads_after_copy=True)
    with pytest.raises(ValueError, match="num_threads"):
        offload_adam.AdamW([p], num_threads=0, free_grads_after_copy=True)
    with pytest.raises(ValueError, match="overlap=True"):
        offload_adam.AdamW([p], overlap=False, free_grads_after_copy=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        offload_adam.AdamW([p], max_grad_norm=-1.0)
    with pytest.raises(NotImplementedError, match="2-norm"):
        offload_adam.AdamW([p]).clip_grad_norm_(1.0, norm_type=1.0)


def test_only_the_masters_that_copies_use_are_pinned(sim):
    """Page-locked memory is scarce (it cannot be swapped, and pinning is slow): a bf16
    param's master and every moment only the CPU kernel reads, so only an fp32 param's
    master (its copies' source and target) is pinned, also in a model mixing both."""
    model = make_mlp()
    model[2].float()   # an fp32 head after a bf16 layer
    model[2].register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    opt = offload_adam.AdamW(model.parameters(), **MLP_OPTS)
    run(model, opt, 2, loss=mlp_loss)
    pinned = sim.sim.is_pinned
    kinds = set()
    for p in model.parameters():
        st = opt.state[p]
        kinds.add(p.dtype)
        assert not pinned(st["exp_avg"]) and not pinned(st["exp_avg_sq"])
        assert pinned(st["master_param"]) == (p.dtype is torch.float32), p.dtype
    assert kinds == {BF16, torch.float32}
