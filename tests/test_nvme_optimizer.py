"""The optimizer with its state in files (state_dirs=, offload_adam/nvme_tier.py): bitwise
the optimizer with its state in host RAM, checkpoints across the two tiers both ways, and the
errors of bad input. Small sizes under tmp_path; bucket_mb is tiny so that every run has
several buckets and the pipeline reads ahead."""
import copy
import gc
import io
import os
import warnings

import pytest
import torch

import offload_adam
from offload_adam.testing import ring_buffers, state_files
from nvme_adam import fails_at
from nvme_model import (NVME, assert_same, assert_stepped_from, bits, grad, groups, make_params,
                        train)

FORMATS = ["float32", "bfloat16", "8bit"]


CASES = [dict(amsgrad=False), dict(amsgrad=True), dict(max_grad_norm=0.3),
         dict(clip=True), dict(accumulate=2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_state_on_disk_steps_bitwise_as_in_ram(kernels, tmp_path, fmt, case):
    case = dict(case)
    if case.get("amsgrad") and fmt == "8bit":
        pytest.skip("8-bit moments have no amsgrad")
    clip, accumulate = case.pop("clip", False), case.pop("accumulate", 1)
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype=fmt, **case)
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype=fmt, state_dirs=tmp_path,
                              **NVME, **case)
    assert len(state_files(disk).spec.buckets) >= 3
    for opt, params in ((ram, ps), (disk, qs)):
        train(opt, params, 0, 4, clip, accumulate)
    assert_same(ps, qs, ram, disk)
    assert disk.step_count == 4


def test_adam_with_l2_and_two_striped_directories(kernels, tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    ps, qs = make_params(), make_params()
    ram = offload_adam.Adam(groups(ps), lr=0.01, state_dtype=torch.bfloat16)
    disk = offload_adam.Adam(groups(qs), lr=0.01, state_dtype=torch.bfloat16,
                             state_dirs=[str(d) for d in dirs], state_budget_mb=0.05, **NVME)
    assert 3 * 4096 <= disk.host_bytes() <= 0.05 * 2 ** 20   # the budget bounds the ring
    for opt, params in ((ram, ps), (disk, qs)):
        train(opt, params, 0, 3)
    assert_same(ps, qs, ram, disk)
    assert all(os.path.getsize(d / "offload_adam_state.bin") > 4096 for d in dirs)


def test_state_dict_is_backed_by_the_files(kernels, tmp_path):
    qs = make_params()
    disk = offload_adam.AdamW(groups(qs), state_dtype="8bit", state_dirs=tmp_path, **NVME)
    train(disk, qs, 0, 1)
    st = disk.state_dict()["state"]
    assert set(st[1]) == {"step", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes",
                          "exp_avg_sq_scale", "master_param", "q8_format"}
    assert "master_param" not in st[0]   # an fp32 param is its own master, as in RAM
    # nothing in RAM: optimizer.state holds an empty entry per stepped param, and the state
    # dict's tensors are not in the pipeline's buffers but mappings of the files (copy on
    # write)
    assert len(disk.state) == 4 and not any(disk.state.values())
    assert disk.host_bytes() == sum(b.nbytes for b in ring_buffers(disk))   # the ring, nothing else
    ring = [(b.tensor.data_ptr(), b.tensor.data_ptr() + b.nbytes)
            for b in ring_buffers(disk)]
    for t in st[1].values():
        assert not any(lo <= t.data_ptr() < hi for lo, hi in ring)
    fp32 = disk.state_dict(fp32_moments=True)["state"][1]   # torch's format, decoded
    assert fp32["exp_avg"].dtype is torch.float32 and "exp_avg_scale" not in fp32
    before = st[1]["master_param"].clone()
    st[1]["master_param"].add_(1)
    assert torch.equal(disk.state_dict()["state"][1]["master_param"], before)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("first,then", [("ram", "disk"), ("disk", "ram"), ("disk", "disk")])
def test_a_checkpoint_resumes_bitwise_across_tiers(kernels, tmp_path, fmt, first, then):
    def build(params, tier, where):
        extra = {}
        if tier == "disk":
            os.makedirs(where)
            extra = dict(state_dirs=where, **NVME)
        return offload_adam.AdamW(groups(params), lr=0.01, state_dtype=fmt, **extra)

    ps = make_params()
    whole = build(ps, "ram", None)
    train(whole, ps, 0, 6)

    qs = make_params()
    a = build(qs, first, tmp_path / "a")
    train(a, qs, 0, 3)
    torch.save({"model": [q.detach() for q in qs], "opt": a.state_dict()}, tmp_path / "ck.pt")
    del a
    ck = torch.load(tmp_path / "ck.pt", weights_only=True, mmap=True)
    rs = [t.clone().requires_grad_() for t in ck["model"]]
    b = build(rs, then, tmp_path / "b")
    b.load_state_dict(ck["opt"])
    train(b, rs, 3, 3)
    assert_same(ps, rs, whole, b)


def test_a_directory_with_this_state_resumes_it_when_asked(kernels, tmp_path):
    ps = make_params()
    whole = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="bfloat16")
    train(whole, ps, 0, 4)
    qs = make_params()
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                             **NVME)
    train(opt, qs, 0, 2)
    del opt
    gc.collect()   # closes the files and drops the lock
    # A fresh run must not silently start from an old run's moments: resuming is asked for.
    with pytest.raises(ValueError, match=r"already hold this optimizer's state at step 2.*"
                                         r"state_resume=True"):
        offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path, **NVME)
    gc.collect()
    # Resumed on params initialised afresh (as after a crash, with no checkpoint of the
    # model): they come back from the files as of step 2, then train on bitwise.
    rs = make_params(seed=7)
    opt = offload_adam.AdamW(groups(rs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                             state_resume=True, **NVME)
    assert all(torch.equal(bits(r), bits(q)) for r, q in zip(rs, qs))
    train(opt, rs, 2, 2)
    assert_same(ps, rs, whole, opt)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_param_never_stepped_resumes_as_it_was(kernels, tmp_path, footprint):
    """A param that got no grad before the kill (an MoE expert no token was routed to
    yet) comes back from the files too, as the last step had it, here weights loaded
    after the optimizer was built: the model built again holds another init (or NaN,
    built on the meta device), and with it training on was another run (found from
    outside: only params stepped at least once were restored)."""
    def run(opt, ps, first, count, idle):
        for k in range(first, first + count):
            for j, p in enumerate(ps):
                p.grad = None if j == idle and k < 2 else grad(p, k, 0)
            opt.step()

    runs = []
    for resumed in (False, True):
        d = tmp_path / f"r{resumed}"
        d.mkdir()
        ps = make_params()
        opt = offload_adam.AdamW(groups(ps), lr=0.01, state_dirs=d, state_footprint=footprint,
                                 **NVME)
        with torch.no_grad():   # (weights loaded after building: the files follow them)
            for p, q in zip(ps, make_params(seed=5)):
                p.copy_(q)
        run(opt, ps, 0, 2, idle=3)
        if resumed:
            del opt
            gc.collect()
            want = [bits(p).clone() for p in ps]
            ps = make_params(seed=7)
            ps[3].detach().fill_(float("nan"))   # (as built on the meta device)
            opt = offload_adam.AdamW(groups(ps), lr=0.01, state_dirs=d, state_resume=True,
                                     state_footprint=footprint, **NVME)
            assert opt.step_count == 2
            assert all(torch.equal(bits(p), w) for p, w in zip(ps, want))
        run(opt, ps, 2, 2, idle=3)
        runs.append((ps, opt))
    assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_state_resume_with_no_state_there_says_it_starts_afresh(kernels, tmp_path, footprint):
    """state_resume=True over directories without a completed step (a first run, or a
    mistyped path) starts at step 0, and says so rather than silently."""
    qs = make_params()
    with pytest.warns(RuntimeWarning, match=r"state_resume=True, but state_dirs=.* hold no "
                                            r"completed step of this state: starting at step 0"):
        opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dirs=tmp_path, state_resume=True,
                                 state_footprint=footprint, **NVME)
    assert opt.step_count == 0
    train(opt, qs, 0, 1)
    del opt
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a state to resume: no warning of it
        opt = offload_adam.AdamW(groups(make_params(seed=3)), lr=0.01, state_dirs=tmp_path,
                                 state_resume=True, state_footprint=footprint, **NVME)
    assert opt.step_count == 1


def test_a_loaded_state_is_the_files_step_at_once(kernels, tmp_path):
    """load_state_dict commits the loaded step count (the largest param's) with the
    loaded state: a crash before the next step resumes it, params included, and a
    fresh optimizer on the directory is refused, as after any completed step."""
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="bfloat16")
    train(ram, ps, 0, 3)
    qs = make_params(seed=7)
    with torch.no_grad():   # the model's checkpoint loaded too
        for q, p in zip(qs, ps):
            q.copy_(p)
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                             **NVME)
    opt.load_state_dict(ram.state_dict())
    assert opt.step_count == 3
    opt.close()
    with pytest.raises(ValueError, match=r"already hold this optimizer's state at step 3"):
        offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                           **NVME)
    gc.collect()
    rs = make_params(seed=8)
    opt = offload_adam.AdamW(groups(rs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                             state_resume=True, **NVME)
    assert all(torch.equal(bits(r), bits(p)) for r, p in zip(rs, ps))   # from the files
    train(ram, ps, 3, 2)
    train(opt, rs, 3, 2)
    assert_same(ps, rs, ram, opt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_loaded_master_that_no_longer_rounds_to_its_param_starts_from_the_param(
        kernels, tmp_path, fmt):
    """As in RAM (test_torch_contract.py): a state dict whose masters the params no longer
    round to (here: saved from a model that trained on, loaded into one that did not) starts
    each such master from its param at the next step, instead of moving the param back to
    it; the tier then steps bitwise as RAM does."""
    src = make_params(seed=3)
    saved = offload_adam.AdamW(groups(src), lr=0.01, state_dtype=fmt)
    train(saved, src, 0, 3)
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype=fmt)
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype=fmt, state_dirs=tmp_path, **NVME)
    ram.load_state_dict(saved.state_dict())
    disk.load_state_dict(saved.state_dict())
    before = [q.detach().clone() for q in qs]
    train(ram, ps, 3, 1)
    train(disk, qs, 3, 1)
    assert_stepped_from(qs, before, src)   # from the param, not a jump to `src`
    train(ram, ps, 4, 2)
    train(disk, qs, 4, 2)
    assert_same(ps, qs, ram, disk)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_param_changed_between_steps_is_followed_by_its_master_as_in_ram(
        kernels, tmp_path, fmt):
    """The one master rule (master_rule.py) in the files as in RAM: params written by the
    user after step 1 go on from their new values at step 2, where param 1 has no grad
    (its master follows it all the same) and at step 3. Bitwise: RAM, files, and a RAM
    optimizer loaded at the edit from a state dict without masters (each starts from
    its param)."""
    ps, qs, rs = make_params(), make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype=fmt)
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype=fmt, state_dirs=tmp_path, **NVME)
    ref = offload_adam.AdamW(groups(rs), lr=0.01, state_dtype=fmt)
    for opt, params in ((ram, ps), (disk, qs), (ref, rs)):
        train(opt, params, 0, 2)
        with torch.no_grad():
            for p in params:
                p.mul_(-0.5).add_(0.25)
    sd = ref.state_dict()
    sd["state"] = {k: {key: v for key, v in st.items() if key != "master_param"}
                   for k, st in sd["state"].items()}
    ref = offload_adam.AdamW(groups(rs), lr=0.01, state_dtype=fmt)
    ref.load_state_dict(sd)
    edited = qs[1].detach().clone()
    for opt, params in ((ram, ps), (disk, qs), (ref, rs)):
        train(opt, params, 2, 1)
    assert torch.equal(qs[1], edited)
    assert torch.equal(disk.state_dict()["state"][1]["master_param"].to(qs[1].dtype), edited)
    for opt, params in ((ram, ps), (disk, qs), (ref, rs)):
        train(opt, params, 3, 1)
    assert_same(ps, qs, ram, disk)
    assert_same(ps, rs, ram, ref)


def test_a_param_made_non_contiguous_is_stepped_through_a_copy(kernels, tmp_path):
    """p.data replaced by a non-contiguous tensor after the optimizer was built: stepped
    through a contiguous copy and written back, bitwise as in RAM (test_engine.py has the
    RAM side)."""
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="bfloat16")
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="bfloat16", state_dirs=tmp_path,
                              **NVME)
    for x in (ps[0], qs[0]):
        x.data = x.detach().t().contiguous().t()
        assert not x.is_contiguous()
    start = qs[0].detach().clone()
    for opt, params in ((ram, ps), (disk, qs)):
        train(opt, params, 0, 3)
    assert not torch.equal(qs[0], start)
    assert_same(ps, qs, ram, disk)


# ---- bad input ---------------------------------------------------------------------------

def test_state_dirs_and_budget_are_checked_at_construction(tmp_path):
    ps = make_params()
    with pytest.raises(ValueError, match=r"state_dirs: '.*/nope' does not exist"):
        offload_adam.AdamW(ps, state_dirs=tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="state_dirs: .* is not a directory"):
        offload_adam.AdamW(ps, state_dirs=[tmp_path, tmp_path / "file"])
    with pytest.raises(ValueError, match="state_dirs names a directory twice"):
        offload_adam.AdamW(ps, state_dirs=[tmp_path, str(tmp_path)])
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ValueError, match="state_dirs names a directory twice"):
        offload_adam.AdamW(ps, state_dirs=[tmp_path, tmp_path / "link"])   # (once: "in use")
    assert sorted(os.listdir(tmp_path)) == ["file", "link"]   # nothing made
    with pytest.raises(ValueError, match=r"state_resume=True needs state_dirs="):
        offload_adam.AdamW(ps, state_resume=True)
    with pytest.raises(ValueError, match="state_resume must be True or False"):
        offload_adam.AdamW(ps, state_dirs=tmp_path, state_resume="yes")
    with pytest.raises(ValueError, match="state_dirs must be a directory or a non-empty list"):
        offload_adam.AdamW(ps, state_dirs=[])
    with pytest.raises(TypeError, match="state_dirs must be ordered .* got a set"):
        offload_adam.AdamW(ps, state_dirs={str(tmp_path)})   # (striped: file k in dirs[k])
    if os.geteuid() != 0:   # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ValueError, match="state_dirs: .* is not writable"):
            offload_adam.AdamW(ps, state_dirs=tmp_path / "ro")
    for bad in (0, -1, "8", True):
        with pytest.raises(ValueError, match="state_budget_mb must be a positive number"):
            offload_adam.AdamW(ps, state_dirs=tmp_path, state_budget_mb=bad)
    with pytest.raises(ValueError, match="state_budget_mb= needs state_dirs="):
        offload_adam.AdamW(ps, state_budget_mb=64)


def test_a_budget_below_three_buckets_names_the_option(kernels, tmp_path):
    with pytest.raises(ValueError, match=r"state_budget_mb=0.01: .*the pipeline needs 3"):
        offload_adam.AdamW(make_params(), state_dirs=tmp_path, state_budget_mb=0.01, **NVME)
    # nothing left locked: the directory can be used
    offload_adam.AdamW(make_params(), state_dirs=tmp_path, **NVME)


def test_a_resume_with_params_named_otherwise_or_added_says_which(kernels, tmp_path):
    """A state made with named params, resumed with the same params unnamed, was "the
    optimizer state of another model" (remove its files, said the message), and a param
    added or left out was "bucket 1: 4 tensors in the files, 8 here" or a question about
    bucket_mb (found from outside): each is said as it is; nothing is changed, and the
    resume as made goes on."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = offload_adam.AdamW(model.named_parameters(), state_dirs=tmp_path, **NVME)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()
    with pytest.raises(ValueError, match=r"holds the optimizer state of the same params in "
                                         r"number, shape and order under other names: 0.weight "
                                         r"\(group 0\) in the files, group 0's param 0 here\. "
                                         r"The state was made with params named, and these are "
                                         r"unnamed"):
        offload_adam.AdamW(model.parameters(), state_dirs=tmp_path, state_resume=True, **NVME)
    named = list(model.named_parameters())
    extra = ("2.weight", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"another model or optimizer: params here, not in the "
                                         r"files: 2.weight \(group 0\)\. Point"):
        offload_adam.AdamW(named + [extra], state_dirs=tmp_path, state_resume=True, **NVME)
    with pytest.raises(ValueError, match=r"params in the files, not here: 1.bias \(group 0\)\. "):
        offload_adam.AdamW(named[:3], state_dirs=tmp_path, state_resume=True, **NVME)
    opt = offload_adam.AdamW(named, state_dirs=tmp_path, state_resume=True, **NVME)
    assert opt.step_count == 1
    opt.close()


def test_the_state_of_another_model_is_refused(kernels, tmp_path):
    ps = make_params()
    opt = offload_adam.AdamW(ps, state_dirs=tmp_path, **NVME)
    train(opt, ps, 0, 1)
    del opt
    gc.collect()
    other = [torch.zeros(41, 33, requires_grad=True)] + make_params()[1:]
    with pytest.raises(ValueError, match=r"holds the optimizer state of another model or "
                                         r"optimizer: bucket 0: 0:0.master float32 \[40, 33\]"
                                         r" in the files, 0:0.master float32 \[41, 33\] here"):
        offload_adam.AdamW(other, state_dirs=tmp_path, **NVME)
    with pytest.raises(ValueError, match="state format 'float32' in the files, 'bfloat16' here"):
        offload_adam.AdamW(ps, state_dirs=tmp_path, state_dtype=torch.bfloat16, **NVME)
    with pytest.raises(ValueError, match=r"buckets in the files, .* bucket_mb=0.05 here; resume "
                                         "with the one they were made with"):
        offload_adam.AdamW(ps, state_dirs=tmp_path, bucket_mb=0.05)
    # (two groups resumed as one was "amsgrad = [False, False] in the files, [False] here":
    # found from outside)
    with pytest.raises(ValueError, match=r"another model or optimizer: 1 param groups in the "
                                         r"files, 2 here \(one amsgrad each: amsgrad = \[False\] "
                                         r"in the files, \[False, False\] here\)"):
        offload_adam.AdamW([{"params": ps[:1]}, {"params": ps[1:]}], state_dirs=tmp_path,
                           **NVME)


def test_a_stripe_put_back_alone_names_the_first_directory_too(kernels, tmp_path):
    """Striped over two directories, the first (its manifest, which holds every file's
    checksums) put back from an earlier step and the second left as it is: the resume
    refused, naming the second directory's intact file as damaged and no more (found from
    outside). It names the first directory as the other possibility."""
    import shutil
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ps = make_params()
    opt = offload_adam.AdamW(ps, state_dirs=[str(a), str(b)], **NVME)
    train(opt, ps, 0, 2)
    shutil.copytree(a, tmp_path / "a_then")
    train(opt, ps, 2, 2)
    opt.close()
    shutil.rmtree(a)
    shutil.copytree(tmp_path / "a_then", a)
    with pytest.raises(OSError, match=rf"in {b}.* is damaged.* or the first directory "
                                      rf"\({a}\), whose manifest holds the checksums, was put "
                                      "back from another step"):
        offload_adam.AdamW(make_params(), state_dirs=[str(a), str(b)], state_resume=True,
                           **NVME)


def test_named_params_identify_the_files_by_name(kernels, tmp_path):
    """Given named params (torch's named form), the files know each by name: a resume that
    lists two of one shape in another order is refused (unnamed, the order is all there is)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = offload_adam.AdamW(model.named_parameters(), state_dirs=tmp_path, **NVME)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()
    del opt
    gc.collect()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"another model or optimizer: bucket 0: "
                                         r"0:0.weight.master .* 0:1.weight.master"):
        offload_adam.AdamW(named[2:] + named[:2], state_dirs=tmp_path, state_resume=True, **NVME)
    opt = offload_adam.AdamW(named, state_dirs=tmp_path, state_resume=True, **NVME)
    assert opt.step_count == 1


@pytest.mark.parametrize("first", ["compiled", "eager"])
def test_a_state_resumes_across_torch_compile(kernels, tmp_path, monkeypatch, first):
    """torch.compile(model).named_parameters() names each param under `_orig_mod.`: a
    state made through it resumes on the model uncompiled, and the other way round,
    bitwise the run never stopped (found from outside: refused as another model's, with
    the advice to remove the files). Files made with the prefix in their names (before)
    still resume compiled."""
    from offload_adam import nvme_tier

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))

    def steps(model, opt, start, n):
        for i in range(start, start + n):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    def named(model, compiled):
        return (torch.compile(model, backend="eager") if compiled else model).named_parameters()

    whole = mlp()
    opt = offload_adam.AdamW(whole.named_parameters(), lr=1e-2)
    steps(whole, opt, 0, 3)
    for raw in (False, True):
        d = tmp_path / f"raw{raw}"
        d.mkdir()
        model = mlp()
        with monkeypatch.context() as m:
            if raw:   # (the names the files had before)
                m.setattr(nvme_tier, "_spec_name", lambda name, raw: name)
            opt = offload_adam.AdamW(named(model, first == "compiled" or raw), lr=1e-2,
                                     state_dirs=d, **NVME)
            steps(model, opt, 0, 2)
            opt.close()
        again = offload_adam.AdamW(named(model, first == "eager" or raw), lr=1e-2,
                                   state_dirs=d, state_resume=True, **NVME)
        assert again.step_count == 2
        steps(model, again, 2, 1)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
        again.close()


def test_two_optimizers_on_one_directory(kernels, tmp_path):
    first = offload_adam.AdamW(make_params(), state_dirs=tmp_path, **NVME)
    with pytest.raises(RuntimeError, match="is in use by another optimizer"):
        offload_adam.AdamW(make_params(), state_dirs=tmp_path, **NVME)
    del first


def test_add_param_group_is_refused(kernels, tmp_path):
    opt = offload_adam.AdamW(make_params(), state_dirs=tmp_path, **NVME)
    with pytest.raises(NotImplementedError, match="add_param_group cannot be used with "
                                                  "state_dirs="):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    assert len(opt.param_groups) == 1


def test_casting_the_model_after_building_is_refused_before_any_change(kernels, tmp_path):
    ps = make_params()
    opt = offload_adam.AdamW(ps, state_dirs=tmp_path, **NVME)
    train(opt, ps, 0, 1)
    before = [p.detach().clone() for p in ps]
    ps[1].data = ps[1].data.float()
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"param group 0, param 1 .* is torch.float32; its "
                                           r"state files were laid out for torch.bfloat16"):
        opt.step()
    assert all(torch.equal(p.detach().to(b.dtype), b) for p, b in zip(ps, before))
    assert opt.step_count == 1


def test_a_full_disk_mid_step_raises_and_keeps_the_last_completed_state(kernels, tmp_path,
                                                                        monkeypatch):
    import errno

    from offload_adam.nvme import NvmeError, direct_io
    ps = make_params()
    opt = offload_adam.AdamW(groups(ps), state_dtype="bfloat16", state_dirs=tmp_path, **NVME)
    train(opt, ps, 0, 2)
    before = opt.state_dict()
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in before["state"].items()}
    monkeypatch.setattr(direct_io, "_write", fails_at(3, direct_io._write, errno.ENOSPC))
    with pytest.raises(NvmeError, match=r"the disk is full\)\. The state of step 2 \(the last "
                                        r"completed one\) is intact"):
        train(opt, ps, 2, 1)
    after = opt.state_dict()["state"]
    assert opt.step_count == 2 and after.keys() == before.keys()
    assert all(torch.equal(bits(after[i][k]), bits(v))
               for i in before for k, v in before[i].items())
    monkeypatch.undo()
    # the buckets stepped before the error moved their params (an fp32 param stepped in
    # place is its own master): no step runs on them, a resume sets them from the files
    moved = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match=r"failed \(NvmeError: .*the disk is full.*\) after it "
                                           r"had stepped some params, which are now ahead of the files \(they hold step 2\)\. "
                                           r"Build the optimizer again with state_resume=True"):
        train(opt, ps, 3, 1)
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(ps, moved))
    opt.close()
    del opt
    gc.collect()
    qs = make_params(seed=5)
    opt = offload_adam.AdamW(groups(qs), state_dtype="bfloat16", state_dirs=tmp_path,
                             state_resume=True, **NVME)
    train(opt, qs, 3, 1)   # the disk has room again: the optimizer goes on from step 2
    assert opt.step_count == 3
    rs = make_params()
    ram = offload_adam.AdamW(groups(rs), state_dtype="bfloat16")
    for k in (0, 1, 3):   # (the step that failed never happened)
        train(ram, rs, k, 1)
    assert all(torch.equal(bits(r), bits(q)) for r, q in zip(rs, qs))


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_step_or_a_load_refused_before_it_starts_leaves_the_files_to_go_on(kernels, tmp_path,
                                                                            footprint):
    """A step refused by a check (state_dtype or amsgrad changed) and a load_state_dict of a
    state refused (8-bit codes of an unknown format) write nothing that lasts: a compact
    step's redo log (written first) is not left named by an intent, which a resume would
    finish as a step that never ran; a compact load is not left marked as cut short (the
    files then refused). Training goes on bitwise as if neither was tried, and a resume
    finds the step that completed."""
    opts = dict(lr=0.01, state_dtype="8bit", state_dirs=tmp_path, state_footprint=footprint,
                **NVME)
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit")
    opt = offload_adam.AdamW(groups(qs), **opts)
    train(ram, ps, 0, 2)
    train(opt, qs, 0, 2)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="state_dtype and amsgrad cannot change"):
        train(opt, qs, 2, 1)
    assert state_files(opt).intent_step is None   # (no step named for a resume to finish)
    opt.param_groups[0]["amsgrad"] = False
    saved = opt.state_dict()
    saved = {"param_groups": saved["param_groups"],
             "state": {k: dict(st) for k, st in saved["state"].items()}}
    saved["state"][max(saved["state"])]["q8_format"] = torch.tensor(99)
    with pytest.raises(ValueError, match="format 99"):
        opt.load_state_dict(saved)
    train(ram, ps, 2, 1)
    train(opt, qs, 2, 1)
    assert_same(ps, qs, ram, opt)
    opt.close()
    del opt
    gc.collect()
    rs = make_params(seed=9)
    opt = offload_adam.AdamW(groups(rs), state_resume=True, **opts)
    assert opt.step_count == 3
    assert all(torch.equal(bits(p), bits(r)) for p, r in zip(ps, rs))


def test_grad_scaler_protocol_and_a_skipped_step(kernels, tmp_path):
    """GradScaler hands grad_scale/found_inf to the optimizer: 1/scale in the kernel, and a
    step with an inf skipped whole (nothing read or written)."""
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit")
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="8bit", state_dirs=tmp_path,
                              **NVME)
    for k, found_inf in enumerate([0.0, 1.0, 0.0]):
        for opt, params in ((ram, ps), (disk, qs)):
            for p in params:
                p.grad = grad(p, k, 0) * 1024
            opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(found_inf)
            opt.step()
    assert_same(ps, qs, ram, disk)
    assert disk.step_count == 2


def test_dcp_get_state_dict_does_not_step_the_files(kernels, tmp_path):
    """torch.distributed.checkpoint's get_state_dict "initialises" an optimizer whose
    optimizer.state is empty with a step of zero grads (lr 0): the files' moments would
    decay and their step count grow. optimizer.state has an (empty) entry for each param
    the files hold a state for, so it sees a state and leaves it alone."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = offload_adam.AdamW(model.parameters(), state_dirs=tmp_path, **NVME)
    assert not opt.state
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert len(opt.state) == 4 and all(st == {} for st in opt.state.values())
    before = {i: {k: v.clone() for k, v in st.items()}
              for i, st in opt.state_dict()["state"].items()}
    _, osd = get_state_dict(model, opt)
    assert opt.step_count == 1
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i in before for k, v in before[i].items())
    assert len(osd["state"]) == 4


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_state_dict_of_another_amsgrad_is_refused_at_load(kernels, tmp_path, amsgrad):
    """The files are laid out for the groups' amsgrad: a dict of the other (torch's
    AdamW's default) was loaded, the group taking its amsgrad, and every step after was
    refused. Refused at the load now, with nothing loaded; the optimizer trains on."""
    ps = [p.detach().float().requires_grad_() for p in make_params()]
    torch_opt = torch.optim.AdamW(ps, lr=0.01, amsgrad=not amsgrad)
    for p in ps:
        p.grad = grad(p, 0, 0)
    torch_opt.step()
    qs = [p.detach().clone().requires_grad_() for p in make_params()]
    opt = offload_adam.AdamW(qs, lr=0.01, amsgrad=amsgrad, state_dirs=tmp_path, **NVME)
    with pytest.raises(ValueError, match=f"loaded param group 0 has amsgrad={not amsgrad}, "
                                         "and this optimizer's state files are laid out for "
                                         f"amsgrad={amsgrad}.*Nothing was loaded"):
        opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["amsgrad"] is amsgrad
    for p in qs:
        p.grad = grad(p, 0, 0)
    opt.step()
    assert opt.step_count == 1


@pytest.mark.parametrize("layout", ["fp32", "8bit", "files"])
def test_dcp_flattened_state_dicts_load_or_are_refused(kernels, tmp_path, layout):
    """torch.distributed.checkpoint's flatten_optimizer_state_dict=True rebuilds each
    param's state from the keys optimizer.state holds. fp32 moments in RAM: those are the
    state dict's, and it resumes bitwise. 8-bit codes are kept under other keys than the
    state dict's (its moments come back as empty dicts) and the files' entries are empty
    (every param's state comes back empty): both refused, naming the option, where they
    were loaded as moments of zero (a step count kept) or no state at all."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def build(seed, folder):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        kw = ({"state_dtype": "8bit"} if layout == "8bit" else
              {"state_dirs": folder, **NVME} if layout == "files" else {})
        return model, offload_adam.AdamW(model.parameters(), lr=0.01, **kw)

    def train(model, opt, first, count):
        for k in range(first, first + count):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(k))
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    model, opt = build(0, tmp_path / "a")
    train(model, opt, 0, 2)
    saved = get_optimizer_state_dict(model, opt, options=flat)
    other, other_opt = build(1, tmp_path / "b")
    other.load_state_dict(model.state_dict())
    if layout == "fp32":
        set_optimizer_state_dict(other, other_opt, saved, options=flat)
        train(model, opt, 2, 2)
        train(other, other_opt, 2, 2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
        return
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict=True"):
        set_optimizer_state_dict(other, other_opt, saved, options=flat)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_the_files_hold_the_params_that_train_and_older_files_of_every_param_resume(
        kernels, tmp_path, footprint):
    """A param frozen when the optimizer is built has no state in the files (it would cost
    its state's bytes on disk and in every step's pass; torch makes none for it). Files made
    before that held every param: those resume as they are (made here with every param
    training, resumed with one frozen), and train on bitwise as in RAM."""
    def steps(opt, ps, first, count):
        for k in range(first, first + count):
            for p in ps:
                p.grad = grad(p, k, 0) if p.requires_grad else None
            opt.step()

    def state_bytes(opt):
        return sum(t.nbytes for b in state_files(opt).spec.buckets for t in b.tensors)

    opts = dict(lr=0.01, state_footprint=footprint, **NVME)
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01)
    steps(ram, ps, 0, 2)
    ps[0].requires_grad_(False)
    steps(ram, ps, 2, 2)

    every, fresh_dir = tmp_path / "every", tmp_path / "fresh"
    every.mkdir()
    fresh_dir.mkdir()
    qs = make_params()
    opt = offload_adam.AdamW(groups(qs), state_dirs=every, **opts)
    steps(opt, qs, 0, 2)
    spec = state_files(opt).spec
    del opt
    gc.collect()
    rs = make_params(seed=7)
    rs[0].requires_grad_(False)
    opt = offload_adam.AdamW(groups(rs), state_dirs=every, state_resume=True, **opts)
    assert state_files(opt).spec == spec   # every param's, as made
    steps(opt, rs, 2, 2)
    assert all(torch.equal(bits(p), bits(r)) for p, r in zip(ps, rs))
    assert opt.step_count == 4

    fresh = make_params()
    fresh[0].requires_grad_(False)
    smaller = offload_adam.AdamW(groups(fresh), state_dirs=fresh_dir, **opts)
    # (its master and two fp32 moments; fp32 params stepped in place keep no master)
    assert state_bytes(smaller) <= state_bytes(opt) - ps[0].numel() * 8
    steps(smaller, fresh, 0, 1)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_step_that_rewrites_a_held_state_dict_warns(kernels, tmp_path, footprint):
    """state_dict()'s tensors are mapped from the files: two generations keep them through
    the next step, compact's buckets move at the next one. The step that rewrites their
    place while some are still held warns; one after they were dropped does not."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    opt = offload_adam.AdamW(params, state_dirs=[tmp_path], state_footprint=footprint,
                             bucket_mb=0.02)

    def step(quiet=True):
        for p in params:
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("error")
            opt.step()

    def saved(sd):
        buf = io.BytesIO()
        torch.save(sd, buf)
        return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["state"]

    step()
    sd = opt.state_dict()
    then = saved(sd)
    if footprint == "two_generations":
        step()   # quiet: the held tensors keep their values through it
        now = saved(sd)
        assert all(torch.equal(then[i][k], now[i][k]) for i in then for k in then[i])
    with pytest.warns(RuntimeWarning, match=r"tensors of a state_dict\(\) taken at step \d+ "
                                            r"are still held") as said:
        step(quiet=False)
    assert said[0].filename == __file__   # (the user's line, not torch's no_grad wrapper)
    saved(opt.state_dict())   # taken, saved and dropped at once: no warning after
    step()
    step()
    for _ in range(3):   # a loop that keeps the last state dict: said once, not each step
        sd = opt.state_dict()
        step()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("then", ["load", "step"])
def test_a_load_state_dict_that_rewrites_a_held_state_dict_warns(kernels, tmp_path,
                                                                 footprint, then):
    """A load_state_dict writes the files as a step does: a state dict held across a load
    and a second load or a step showed the other state's values, and its step count, without
    a word (found from outside: the warning counted steps, which a load sets back). Two
    generations: the held values stay through the load, and the write after warns; compact:
    the load warns."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    opt = offload_adam.AdamW(params, state_dirs=[tmp_path], state_footprint=footprint,
                             bucket_mb=0.02)
    other = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params])
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in other.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    other.step()
    sd = opt.state_dict()
    then_values = copy.deepcopy(sd["state"])
    loads = 0
    if footprint == "two_generations":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.load_state_dict(other.state_dict())   # quiet: into the other slots
        loads = 1
        assert all(torch.equal(then_values[i][k], sd["state"][i][k])
                   for i in then_values for k in then_values[i])
    writer = "step" if loads and then == "step" else "load_state_dict"
    with pytest.warns(RuntimeWarning, match=r"tensors of a state_dict\(\) taken at step 3 "
                                            f"are still held, and this {writer}"):
        if then == "load" or not loads:
            opt.load_state_dict(other.state_dict())
        if then == "step":   # (compact: after the load that warned, said once)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    assert sd["state"]


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_held_state_dict_of_a_closed_optimizer_warns_at_the_next_ones_rewrite(
        kernels, tmp_path, footprint):
    """state_dict() taken, the optimizer closed, another one built over the same files
    (state_resume=True): its steps rewrite the held tensors' place as the first one's
    would have (the dict showed the new optimizer's moments and step counts without a
    word): the same warning, at the same step."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    kw = dict(state_dirs=[tmp_path], state_footprint=footprint, bucket_mb=0.02)
    opt = offload_adam.AdamW(params, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    opt.close()
    again = offload_adam.AdamW(params, state_resume=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if footprint == "two_generations":
            again.step()   # quiet: the held tensors keep their values through it
    with pytest.warns(RuntimeWarning, match=r"tensors of a state_dict\(\) taken at step 1 "
                                            r"are still held"):
        again.step()
    assert sd["state"]
    again.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("fmt", ["bfloat16", "8bit"])
def test_loading_its_own_untouched_state_dict_writes_nothing(kernels, tmp_path, footprint, fmt):
    """Accelerate's AcceleratedOptimizer loads the optimizer's own state_dict() when it
    wraps it, at every start (found from outside: after state_resume=True that warned
    that the dict's tensors were still held, the user holding none, and rewrote the whole
    state). That dict, untouched, writes nothing, says nothing and trains on as without
    the load; a copy of it is loaded, and so is the dict edited in place (its tensors are
    copy-on-write maps of the files: the edit is the state loaded)."""
    from offload_adam.nvme.manifest import MANIFEST
    from offload_adam.nvme.store import DATA_FILE
    key = "exp_avg_codes" if fmt == "8bit" else "exp_avg"

    def run(how, resume=False):
        folder = tmp_path / f"{how}{resume}"
        folder.mkdir()
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 64, generator=gen).bfloat16())
                  for _ in range(3)]
        kw = dict(state_dirs=[folder], state_footprint=footprint, state_dtype=fmt,
                  bucket_mb=0.02)
        opt = offload_adam.AdamW(params, **kw)

        def step():
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        step()
        step()
        if resume:   # (the Trainer's resume under Accelerate)
            opt.close()
            opt = offload_adam.AdamW(params, state_resume=True, **kw)
        files = [os.stat(folder / name) for name in (MANIFEST, DATA_FILE)]
        sd = opt.state_dict()
        if how in ("copy", "edited copy"):   # (the mapped dict dropped: not held)
            sd = copy.deepcopy(sd)
            gc.collect()
        if how in ("edit", "edited copy"):
            sd["state"][1][key].zero_()
        with warnings.catch_warnings():
            # (an edited dict is loaded from its maps: compact warns that they are held)
            warnings.simplefilter("ignore" if how == "edit" else "error")
            opt.load_state_dict(sd)
        now = [os.stat(folder / name) for name in (MANIFEST, DATA_FILE)]
        written = [(a.st_ino, a.st_mtime_ns) != (b.st_ino, b.st_mtime_ns)
                   for a, b in zip(files, now)]
        del sd
        step()
        step()
        opt.close()
        return written, [p.detach().clone() for p in params]

    _, plain = run("none")
    for resume in (False, True):
        written, got = run("own", resume)
        assert written == [False, False]
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
    written, got = run("copy")
    assert written == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    written, edited = run("edit")
    assert written == [True, True]
    _, wanted = run("edited copy")
    assert all(torch.equal(a, b) for a, b in zip(edited, wanted))
    assert not torch.equal(edited[1], plain[1]) and torch.equal(edited[0], plain[0])


# (the limits set by the parent before exec: the child imports no `resource` of its own,
# which offload_adam must have imported before it runs out of descriptors)
_MANY_TENSORS = """
import sys, torch, offload_adam
params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(200)]   # 600 state tensors
opt = offload_adam.AdamW(params, state_dirs=[sys.argv[1]])
for p in params:
    p.grad = torch.ones_like(p)
opt.step()
try:
    sd = opt.state_dict()
    soft = [line.split()[3] for line in open("/proc/self/limits") if "open files" in line][0]
    print("ok", len(sd["state"]), soft)
except OSError as e:
    print("refused", e.errno, e)
opt.close()
"""


def test_a_state_dict_of_many_tensors_passes_a_low_open_files_limit(kernels, tmp_path):
    """state_dict() maps the state from the files without a descriptor per tensor (Python's
    mmap kept one each): 600 tensors under a limit of 256 open files, soft and hard, with
    the limit left as it was (before, the soft limit was raised to the hard one, and at
    the hard one the dict was refused)."""
    import resource
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _MANY_TENSORS, str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)),
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (256, 256)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "200", "256"], out.stdout


_MANY_DIRS = """
import os, resource, sys, torch, offload_adam
dirs = [os.path.join(sys.argv[1], f"d{i}") for i in range(int(sys.argv[2]))]
for d in dirs:
    os.makedirs(d)
params = [torch.nn.Parameter(torch.randn(64)) for _ in range(40)]
try:
    opt = offload_adam.AdamW(params, state_dirs=dirs, bucket_mb=0.0002)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    print("ok", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except OSError as e:
    print("refused", e.errno, e)
"""


@pytest.mark.parametrize("soft,hard", [(48, 48), (48, 4096)])
def test_state_dirs_past_the_open_files_limit_raise_it_or_say_so(kernels, tmp_path, soft, hard):
    """24 state directories (3 descriptors each) under a soft limit of 48 open files:
    below a higher hard limit the soft one is raised to it and the step runs; at the hard
    limit the error names the limit (was a bare "Too many open files" naming whichever file
    came next: found from outside)."""
    import resource
    import subprocess
    import sys
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this process's hard limit of open files is under {hard}")
    out = subprocess.run([sys.executable, "-c", _MANY_DIRS, str(tmp_path), "24"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)),
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (soft, hard)))
    assert out.returncode == 0, out.stderr
    if hard > soft:
        assert out.stdout.split() == ["ok", str(hard)], out.stdout
    else:
        assert out.stdout.startswith("refused 24 [Errno 24] offload_adam: too many open files (48 at "
                                     "most, hard limit 48): opening "), out.stdout
        assert "keeps open (3, or 4 compact, in each state directory)" in out.stdout


def test_an_optimizer_dropped_as_garbage_lets_the_next_one_have_its_files(kernels, tmp_path):
    """An optimizer over state files dropped without close() but not yet collected (in a
    reference cycle) holds the directory's lock: the next optimizer over it collects the
    garbage and takes it, instead of calling it another optimizer's."""
    gc.disable()
    try:
        params = [torch.nn.Parameter(torch.randn(8, 8))]
        dropped = offload_adam.AdamW(params, state_dirs=[tmp_path])
        cycle = [dropped]
        cycle.append(cycle)
        del dropped, cycle
        offload_adam.AdamW(params, state_dirs=[tmp_path]).close()
    finally:
        gc.enable()


_AT_EXIT = """
import atexit, sys, threading, torch, offload_adam
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(4)]
opt = offload_adam.AdamW(params, state_dirs=[sys.argv[1]], state_footprint=sys.argv[2],
                         bucket_mb=0.02)

def step(n):
    for _ in range(n):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    print("stepped", opt.step_count, flush=True)

step(1)
atexit.register(step, 1)   # (a last step, or checkpoint, at exit)
threading.Thread(target=step, args=(3,)).start()   # (outlives the main thread)
"""


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_the_files_step_after_the_interpreter_stopped_its_thread_pools(kernels, tmp_path,
                                                                      footprint):
    """Python stops every thread pool before it joins the threads still running and
    before the atexit handlers: a step there raised concurrent.futures' "cannot schedule
    new futures after shutdown" (found from outside). The files' I/O runs on the calling
    thread then, and both steps complete."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _AT_EXIT, str(tmp_path), footprint],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.split("\n")[-2] == "stepped 5", out.stdout
    params = [torch.nn.Parameter(torch.zeros(64, 64)) for _ in range(4)]
    resumed = offload_adam.AdamW(params, state_dirs=[tmp_path], state_footprint=footprint,
                                 bucket_mb=0.02, state_resume=True)
    assert resumed.step_count == 5
    resumed.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_unpickled_optimizer_goes_on_only_from_its_own_step(kernels, tmp_path, footprint):
    """torch.save of the optimizer object (and its params) pickles no state held in files:
    unpickled, it reopens them. At the pickled step it goes on bitwise as the RAM run;
    once the files moved on (training went on after the pickle), it is refused, saying
    so, and the files are as they were: it used to step the pickled params with the
    files' later moments and step count, silently."""
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01)
    train(ram, ps, 0, 5)
    disk = offload_adam.AdamW(groups(qs), lr=0.01, state_dirs=tmp_path,
                              state_footprint=footprint, **NVME)
    train(disk, qs, 0, 3)
    old = io.BytesIO()
    torch.save({"params": qs, "opt": disk}, old)
    train(disk, qs, 3, 2)
    now = io.BytesIO()
    torch.save({"params": qs, "opt": disk}, now)
    disk.close()
    old.seek(0)
    with pytest.raises(ValueError, match=r"pickled .* at step 3; they are at step 5: "
                                         r"training went on"):
        torch.load(old, weights_only=False)
    gc.collect()   # (what the refused one made: its lock let go)
    now.seek(0)
    back = torch.load(now, weights_only=False)
    assert back["opt"].step_count == 5
    assert_same(ps, back["params"], ram, back["opt"])
    train(ram, ps, 5, 2)
    train(back["opt"], back["params"], 5, 2)
    assert_same(ps, back["params"], ram, back["opt"])
    back["opt"].close()


def test_without_a_pagemap_its_own_state_dict_is_loaded_as_any(kernels, tmp_path, monkeypatch):
    """Where the pages of the maps cannot be told (no /proc/self/pagemap: not Linux), the
    dict is not recognized (no state_dict() reads the whole state to checksum it): its
    load rewrites the files, as before the recognition."""
    from offload_adam import nvme_tier
    from offload_adam.nvme.manifest import MANIFEST
    monkeypatch.setattr(nvme_tier, "written_pages", lambda address, nbytes: None)
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(2)]
    opt = offload_adam.AdamW(params, state_dirs=[tmp_path], bucket_mb=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = os.stat(tmp_path / MANIFEST).st_ino
    opt.load_state_dict(opt.state_dict())
    assert os.stat(tmp_path / MANIFEST).st_ino != before
    opt.close()
