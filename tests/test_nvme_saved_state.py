"""What the state in files must never do (issue 25): be overwritten unasked, load wrong
bytes silently, or resume a mix of two steps. Each test is one way a user gets there: the
directories in another order, a manifest deleted, a flipped bit, a construction refused,
a model or a state dict loaded after a resume. The optimizer as users build it, small
sizes under tmp_path (tests/nvme_model.py's model)."""
import gc
import os
import re
import warnings

import pytest
import torch

import offload_adam
from offload_adam.testing import state_files
from nvme_adam import flip_byte
from nvme_model import NVME, assert_same, bits, grad, groups, make_params, train
from offload_adam.nvme import NvmeError

FILES = ("offload_adam_state.bin", "offload_adam_state.manifest", "offload_adam_state.spec")


def build(params, dirs, **kw):
    return offload_adam.AdamW(groups(params), lr=0.01, state_dtype="bfloat16",
                              state_dirs=dirs, **NVME, **kw)


def ram_run(steps):
    """The uninterrupted run in host RAM after `steps` steps: (params, optimizer)."""
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="bfloat16")
    train(ram, ps, 0, steps)
    return ps, ram


def on_disk(dirs, steps):
    """A run with its state in `dirs`, `steps` steps trained, closed: its params."""
    qs = make_params()
    opt = build(qs, dirs)
    train(opt, qs, 0, steps)
    opt.close()
    return qs


def snapshot(*folders):
    """Every byte of every file of the state (the lock aside)."""
    return {os.path.join(f, n): open(os.path.join(f, n), "rb").read()
            for f in folders for n in sorted(os.listdir(f)) if not n.endswith(".lock")}


def resumed(dirs):
    return build(make_params(seed=7), dirs, state_resume=True)


def test_directories_in_another_order_are_refused_and_nothing_is_overwritten(kernels, tmp_path):
    """Item 1: [a, b] reopened as [b, a] or [b] (with or without state_resume) is refused,
    naming where the manifest is and the order to give; [a, b] still resumes bitwise."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    on_disk([a, b], 5)
    before = snapshot(a, b)
    for dirs in ([b, a], [b]):
        for resume in (True, False):
            with pytest.raises(ValueError, match=re.escape(f"['{a}', '{b}']")):
                build(make_params(seed=7), dirs, state_resume=resume)
            gc.collect()
    assert snapshot(a, b) == before
    ps, ram = ram_run(5)
    qs = make_params(seed=7)
    opt = build(qs, [a, b], state_resume=True)
    assert opt.step_count == 5
    assert_same(ps, qs, ram, opt)


def test_a_missing_manifest_is_refused_never_made_anew(kernels, tmp_path):
    """Item 2: data files and a spec without a manifest are a state that cannot be trusted:
    refused (resumed or not), the files left as they are."""
    on_disk(tmp_path, 5)
    (tmp_path / "offload_adam_state.manifest").unlink()
    before = snapshot(tmp_path)
    for resume in (True, False):
        with pytest.raises(ValueError, match=r"holds optimizer state files .* but no manifest "
                                             r".*never overwritten"):
            build(make_params(seed=7), tmp_path, state_resume=resume)
        gc.collect()
    assert snapshot(tmp_path) == before


def flip_master_byte(opt, folder, bucket, param_name, index):
    """Flips a bit of element `index` of a master in the committed slot of `bucket`."""
    st = state_files(opt)
    spec = st.spec.buckets[bucket]
    names = [t.name for t in spec.tensors]
    offset = spec.offsets()[names.index(f"{param_name}.master")] + 4 * index + 3
    # an exponent bit: -0.0996 becomes ~-3e37
    flip_byte(os.path.join(folder, "offload_adam_state.bin"),
              st.extents[bucket].at(st.slots[bucket]) + offset)


def test_a_flipped_bit_is_refused_at_resume_at_state_dict_and_at_the_step(kernels, tmp_path):
    """Item 3: each bucket slot is checksummed as written and verified as read: a resume,
    state_dict() and the step's read-ahead each refuse a damaged master, naming the bucket
    and the file; nothing is restored or stepped from it."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 3)
    flip_master_byte(opt, tmp_path, 0, "0:0", 7)
    data = tmp_path / "offload_adam_state.bin"
    with pytest.raises(NvmeError, match=f"bucket 0 of the optimizer state in {data} is damaged"):
        opt.state_dict()
    before = [q.detach().clone() for q in qs]
    with pytest.raises(NvmeError, match="bucket 0 .* is damaged"):
        train(opt, qs, 3, 1)
    assert all(torch.equal(bits(q), bits(b)) for q, b in zip(qs, before))
    assert opt.step_count == 3
    opt.close()
    fresh = make_params(seed=7)
    start = [r.detach().clone() for r in fresh]
    with pytest.raises(NvmeError, match="bucket 0 .* is damaged"):
        build(fresh, tmp_path, state_resume=True)
    assert all(torch.equal(bits(r), bits(s)) for r, s in zip(fresh, start))   # none restored


def test_a_refused_construction_leaves_the_directory_as_it_found_it(kernels, tmp_path):
    """Item 4: a budget too small for the buckets is refused before a file is made, so the
    fix the message suggests (smaller buckets) works; a state made and never committed is
    taken by another layout too."""
    with pytest.raises(ValueError, match="raise the budget or make the buckets smaller"):
        offload_adam.AdamW(make_params(), state_dirs=tmp_path, state_budget_mb=0.06,
                           bucket_mb=0.05)
    gc.collect()
    assert not any(os.path.exists(tmp_path / n) for n in FILES)
    opt = offload_adam.AdamW(make_params(), state_dirs=tmp_path, state_budget_mb=0.06,
                             bucket_mb=0.005)   # the fix it named
    opt.close()
    qs = make_params()
    opt = offload_adam.AdamW(qs, state_dirs=tmp_path, bucket_mb=0.001)   # never stepped
    train(opt, qs, 0, 1)
    assert opt.step_count == 1


def test_a_model_of_no_step_the_files_hold_loaded_after_a_resume_is_refused(kernels, tmp_path):
    """Item 5: state_resume=True set the params from the files; another model loaded after
    that, before the next step, would be stepped with the files' moments and step count:
    refused at that step (nothing stepped); state_dict() refuses too."""
    on_disk(tmp_path, 3)
    rs = make_params(seed=8)
    opt = build(rs, tmp_path, state_resume=True)
    with torch.no_grad():   # another checkpoint of the model, loaded now
        for r, o in zip(rs, make_params(seed=5)):
            r.copy_(o)
    before = [r.detach().clone() for r in rs]
    with pytest.raises(RuntimeError, match=r"4 params were changed after state_resume=True "
                                           r"set them to the state files' step 3 .* not the "
                                           r"params of any step the files hold \(step 3 or 2\)"
                                           r".*Nothing was stepped"):
        train(opt, rs, 3, 1)
    with pytest.raises(RuntimeError, match="were changed after state_resume=True"):
        opt.state_dict()
    assert all(torch.equal(bits(r), bits(b)) for r, b in zip(rs, before))
    assert opt.step_count == 3


def test_a_model_of_the_step_before_loaded_after_a_resume_sets_the_state_back(kernels,
                                                                              tmp_path):
    """Item 5, the usual way there: killed between step() (step 3 committed) and the save
    of the model, the run restarts from its last model checkpoint (step 2), loaded after the
    optimizer was built with state_resume=True. Those are the params of step 2, which the
    files hold too: the state goes back to step 2, with a warning, and training goes on
    bitwise as the uninterrupted run from step 2."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 2)
    checkpoint = [q.detach().clone() for q in qs]   # the model saved after step 2
    train(opt, qs, 2, 1)                              # step 3 committed, then killed
    opt.close()
    rs = make_params(seed=8)
    opt = build(rs, tmp_path, state_resume=True)
    assert opt.step_count == 3
    with torch.no_grad():
        for r, c in zip(rs, checkpoint):
            r.copy_(c)
    with pytest.warns(RuntimeWarning, match="they are the params of step 2, which the files "
                                            "hold too .* went back to step 2"):
        # (at once: a loop reads it to set its schedule and data position before any
        # step; it said 3 until the next step() or state_dict(), found from outside)
        assert opt.step_count == 2
    train(opt, rs, 2, 1)
    assert opt.step_count == 3
    train(opt, rs, 3, 2)
    ps, ram = ram_run(5)
    assert_same(ps, rs, ram, opt)


def test_a_model_of_the_step_before_loaded_before_a_resume_sets_the_state_back(kernels,
                                                                               tmp_path):
    """The other usual order: the model checkpoint of step 2 loaded first (killed between
    step 3 and its save), then the optimizer built with state_resume=True on files at
    step 3. Setting the params to step 3 dropped the checkpoint silently, and the loop,
    going on from the checkpoint's step, trained step 3 twice: those are the params of
    step 2, which the files hold too, so the state goes back to it, with a warning, and
    the training is bitwise the uninterrupted run. A fresh model is neither step's: the
    files' step is taken, as always."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 2)
    checkpoint = [q.detach().clone() for q in qs]
    train(opt, qs, 2, 1)
    opt.close()
    fresh = make_params(seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = build(fresh, tmp_path, state_resume=True)   # no warning: the files' step
    assert opt.step_count == 3
    opt.close()
    rs = [c.clone().requires_grad_() for c in checkpoint]
    with pytest.warns(RuntimeWarning, match=r"the params were those of step 2 when the "
                                            r"optimizer was built .* went back to step 2"):
        opt = build(rs, tmp_path, state_resume=True)
    assert opt.step_count == 2
    train(opt, rs, 2, 3)
    ps, ram = ram_run(5)
    assert_same(ps, rs, ram, opt)


def test_params_of_both_steps_the_files_hold_are_said_to_be_ambiguous(kernels, tmp_path):
    """A step that moved no param (lr 0: a warmup's first) leaves a model checkpoint
    unable to say which step it is: a resume whose params are both the files' steps
    keeps the last one and says so (a loop going on from the step before would take a
    batch twice in the moments)."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 2)
    for g in opt.param_groups:
        g["lr"] = 0.0
    train(opt, qs, 2, 1)   # step 3 moves no param
    checkpoint = [q.detach().clone() for q in qs]
    opt.close()
    rs = [c.clone().requires_grad_() for c in checkpoint]
    with pytest.warns(RuntimeWarning, match=r"the params are those of step 3 and of step 2 "
                                            r"alike .* the state is at step 3"):
        opt = build(rs, tmp_path, state_resume=True)
    assert opt.step_count == 3


def test_a_refusal_names_only_the_steps_the_files_still_hold(kernels, tmp_path):
    """A model of no step loaded after a resume is refused naming the steps the files
    hold: not the step before when its slots are no longer whole (a step cut short was
    overwriting them: here a damaged byte)."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 3)
    st = state_files(opt)
    spec = st.spec.buckets[0]
    opt.close()
    flip_byte(os.path.join(tmp_path, "offload_adam_state.bin"),
              st.extents[0].at(1 - st.slots[0]) + spec.offsets()[0] + 3)
    rs = make_params(seed=8)
    opt = build(rs, tmp_path, state_resume=True)
    with torch.no_grad():
        for r, o in zip(rs, make_params(seed=5)):
            r.copy_(o)
    with pytest.raises(RuntimeError, match=r"not the params of any step the files hold \(step 3 "
                                           r"only: the one before was being overwritten"):
        train(opt, rs, 3, 1)


def test_a_state_dict_of_another_step_after_a_resume_is_refused(kernels, tmp_path):
    """Item 6 in one process: a model checkpoint of step 2 loaded, then the optimizer built
    with state_resume=True on files at step 4 (which sets the params to step 4), then the
    checkpoint's optimizer state loaded: its moments would train step 4's weights. Refused
    with nothing loaded, naming the way that works: build without state_resume on a
    directory without state, then load; that run equals the uninterrupted one."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 2)
    ck_model = [q.detach().clone() for q in qs]
    ck_opt = {k: v for k, v in opt.state_dict().items()}
    ck_opt = {**ck_opt, "state": {i: {k: v.clone() for k, v in st.items()}
                                  for i, st in ck_opt["state"].items()}}
    train(opt, qs, 2, 2)
    opt.close()
    rs = [c.clone().requires_grad_() for c in ck_model]   # the model loaded first
    opt = build(rs, tmp_path, state_resume=True)
    at_four = [r.detach().clone() for r in rs]
    files = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"state_resume=True set the params to the state files' "
                                         r"step 4 .* saved with other params \(param 0:0: its step "
                                         r"2, 4 in the files\).*build the optimizer without state_resume "
                                         r"on directories without state.*Nothing was loaded"):
        opt.load_state_dict(ck_opt)
    assert snapshot(tmp_path) == files and opt.step_count == 4
    assert all(torch.equal(bits(r), bits(a)) for r, a in zip(rs, at_four))
    opt.close()
    # the way it names: a directory without state, the checkpoint's model and state
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    rs = [c.clone().requires_grad_() for c in ck_model]
    opt = build(rs, fresh)
    opt.load_state_dict(ck_opt)
    train(opt, rs, 2, 3)
    ps, ram = ram_run(5)
    assert_same(ps, rs, ram, opt)


def test_a_state_dict_of_the_files_step_after_a_resume_loads(kernels, tmp_path):
    """Not a mix: the state dict saved at the step the files are at (a checkpoint every
    step), or loaded after a model of its own step, is loaded as always."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 3)
    sd = opt.state_dict()
    sd = {**sd, "state": {i: {k: v.clone() for k, v in st.items()}
                          for i, st in sd["state"].items()}}
    opt.close()
    rs = make_params(seed=8)
    opt = build(rs, tmp_path, state_resume=True)
    opt.load_state_dict(sd)
    train(opt, rs, 3, 2)
    ps, ram = ram_run(5)
    assert_same(ps, rs, ram, opt)


def test_the_param_dtype_may_change_between_runs(kernels, tmp_path):
    """The files hold fp32 masters whatever the params' dtype: a bf16 model's state resumes
    for the model cast to fp32 (its params are then the masters themselves)."""
    qs = make_params()
    opt = build(qs, tmp_path)
    train(opt, qs, 0, 2)
    masters = {i: st["master_param"].clone() for i, st in opt.state_dict()["state"].items()
               if "master_param" in st}
    opt.close()
    rs = [p.detach().float().requires_grad_() for p in make_params(seed=8)]
    opt = build(rs, tmp_path, state_resume=True)
    assert all(torch.equal(rs[i].detach(), m) for i, m in masters.items())
    train(opt, rs, 2, 1)
    assert opt.step_count == 3


def test_step_count_is_the_completed_steps(kernels, tmp_path):
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01)
    assert ram.step_count == 0
    train(ram, ps, 0, 3)   # (param 1 has no grad at step 2: it counts 2)
    assert ram.step_count == 3
    qs = make_params()
    disk = build(qs, tmp_path)
    assert disk.step_count == 0
    train(disk, qs, 0, 3)
    assert disk.step_count == 3


def test_messages_that_name_what_to_do(kernels, tmp_path):
    """The smaller items: a path that is a file is not told to create a directory; a
    refused state names the way to resume from a checkpoint without advising state_resume
    for it; a damaged data file header is not reported as an order problem."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is not a directory$"):
        offload_adam.AdamW(make_params(), state_dirs=tmp_path / "file")
    d = tmp_path / "d"
    d.mkdir()
    on_disk(d, 2)
    with pytest.raises(ValueError, match=r"at step 2 .* To continue from it, pass "
                                         r"state_resume=True .* To start afresh, or from a "
                                         r"checkpoint of your own .* remove its files"):
        build(make_params(), d)
    gc.collect()
    with open(d / "offload_adam_state.bin", "r+b") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="its header is not an offload_adam state file's"):
        build(make_params(), d, state_resume=True)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("order", ["optimizer first", "model first"])
def test_a_load_then_a_kill_before_the_next_step_resumes_with_the_models_weights(
        kernels, tmp_path, footprint, order):
    """A checkpoint loaded into new directories, the optimizer's state dict in torch's form
    (no masters: the files take the params as they are at the load) and the model's
    weights, in either order, then the process dies before a step. The resume sets the
    params from the files, and says that their masters were the params at the load: loaded
    after the optimizer, the model's weights were not in them, and loading them again now is
    taken (not refused as another step's), each master following its param. Either way
    the run goes on bitwise as from the checkpoint loaded in RAM."""
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01)
    train(ram, ps, 0, 3)
    weights = [p.detach().clone() for p in ps]
    ckpt = ram.state_dict(fp32_moments=True)
    for st in ckpt["state"].values():
        st.pop("master_param", None)   # (as torch's AdamW saves it)
    ckpt = {**ckpt, "state": {k: {n: v.clone() for n, v in st.items()}
                              for k, st in ckpt["state"].items()}}
    # the reference: the same checkpoint loaded in RAM (a bf16 param's master starts
    # again from it: the dict has none)
    ps = [w.clone().requires_grad_() for w in weights]
    ram = offload_adam.AdamW(groups(ps), lr=0.01)
    ram.load_state_dict(ckpt)
    train(ram, ps, 3, 3)
    dirs = [str(tmp_path / "a")]
    os.makedirs(dirs[0])
    qs = make_params(seed=7)
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dirs=dirs, state_footprint=footprint,
                             **NVME)

    def load_model(params):
        with torch.no_grad():
            for q, w in zip(params, weights):
                q.copy_(w)

    if order == "model first":
        load_model(qs)
    opt.load_state_dict(ckpt)
    if order == "optimizer first":
        load_model(qs)
    opt.close()   # (killed here: no step since the load)
    rs = make_params(seed=7)
    with pytest.warns(RuntimeWarning, match=r"load_state_dict at step 3 and no step since.*"
                                            r"\(first: group 0's param 0; .*load them again now"):
        again = offload_adam.AdamW(groups(rs), lr=0.01, state_dirs=dirs, state_resume=True,
                                   state_footprint=footprint, **NVME)
    assert again.step_count == 3
    # the params as they were at the load: the weights when the model came first
    assert all(torch.equal(bits(r), bits(w)) for r, w in zip(rs, weights)) == (
        order == "model first")
    load_model(rs)   # as the warning says (a no-op when the model came first)
    train(again, rs, 3, 3)
    for p, r in zip(ps, rs):
        assert torch.equal(bits(p), bits(r))


FORKED = r"""
import gc, os, sys, warnings, torch, offload_adam
warnings.simplefilter("ignore", DeprecationWarning)   # (fork with threads: the point here)
p = torch.nn.Parameter(torch.randn(64))
opt = offload_adam.AdamW([p], state_dirs=[sys.argv[1]])
p.grad = torch.randn(64)
opt.step()
pid = os.fork()
if pid == 0:
    code = 0
    if sys.argv[2] == "step":
        try:
            p.grad = torch.randn(64)
            opt.step()
            code = 3
        except RuntimeError as e:
            code = 0 if "child it forked" in str(e) else 4
    del opt
    gc.collect()   # (the optimizer's finalizer runs in the child, as at its exit)
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
try:
    offload_adam.AdamW([torch.nn.Parameter(torch.randn(64))], state_dirs=[sys.argv[1]])
    print("second optimizer built")
except RuntimeError as e:
    print("refused:", "in use by another optimizer" in str(e))
p.grad = torch.randn(64)
opt.step()   # the parent's goes on
print("parent stepped", opt.step_count)
"""


@pytest.mark.parametrize("child", ["exits", "step"])
def test_a_forked_child_neither_unlocks_the_parents_files_nor_hangs(tmp_path, kernels, child):
    """A child forked from a process with a state in files inherits its descriptors: its
    exit must not unlock the parent's directory (an flock unlock through the child's copy
    unlocks the parent's: a second optimizer could then write the same files), and a step
    in it is an error that says why (the I/O threads are the parent's), not a hang."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path), child],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: True" in out.stdout and "parent stepped 2" in out.stdout, out.stdout


def test_load_state_dict_into_a_closed_optimizer_says_it_was_closed(tmp_path, kernels):
    p = torch.nn.Parameter(torch.randn(8))
    opt = offload_adam.AdamW([p], state_dirs=[tmp_path])
    p.grad = torch.randn(8)
    opt.step()
    sd = opt.state_dict()
    opt.close()
    with pytest.raises(RuntimeError, match="this optimizer was closed"):
        opt.load_state_dict(sd)


EXIT_AFTER_BACKWARD = r"""
import sys, torch, offload_adam
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]).to(torch.bfloat16)
opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.002, step_in_backward=True,
                         state_dirs=[sys.argv[1]], state_footprint=sys.argv[2])
for s in range(3):
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().square().mean().backward()
    if s < 2:
        opt.step()
        opt.zero_grad()
print("exiting at step", opt.step_count)
"""


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_script_ending_between_backward_and_step_exits_quietly(tmp_path, kernels, footprint):
    """The optimizer let go at the interpreter's exit with the files' pass of a backward
    under way: no traceback (the I/O threads take no more work then), and the files are
    at the last completed step."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", EXIT_AFTER_BACKWARD, str(tmp_path), footprint],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "exiting at step 2" in out.stdout, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    p = [torch.nn.Linear(32, 32).to(torch.bfloat16) for _ in range(4)]
    again = offload_adam.AdamW(torch.nn.Sequential(*p).parameters(), bucket_mb=0.002,
                               state_dirs=[tmp_path], state_resume=True,
                               state_footprint=footprint)
    assert again.step_count == 2
    again.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_close_from_another_thread_lets_the_step_in_flight_finish(tmp_path, kernels, footprint):
    """close() from another thread (a watchdog) while step() runs: the step ends, its
    files committed, then the optimizer closes (it pulled the files and buffers from
    under the pass: a TypeError or AttributeError from inside it)."""
    import threading
    import time
    ps = make_params()
    opt = build(ps, [tmp_path], state_footprint=footprint)
    train(opt, ps, 0, 1)
    for p in ps:
        p.grad = torch.randn_like(p)
    closer = threading.Thread(target=opt.close)

    def closure():   # (inside step(): the closer starts and reaches close() meanwhile)
        closer.start()
        time.sleep(0.3)
    opt.step(closure)
    closer.join(60)
    assert not closer.is_alive()
    with pytest.raises(RuntimeError, match="this optimizer was closed"):
        opt.step()
    again = build(make_params(), [tmp_path], state_footprint=footprint, state_resume=True)
    assert again.step_count == 2
    again.close()


@pytest.mark.parametrize("state_dtype", ["float32", "8bit"])
def test_another_runs_state_dict_of_the_same_step_after_a_resume_is_refused(
        kernels, tmp_path, state_dtype):
    """fp32 params are their own masters: a state dict holds none to tell whose params it
    was saved with, and its step count is the files'. Another run's (other grads, so
    other moments) loaded over the params the resume set is refused by its moments;
    the run's own, in its own form or torch's fp32 one, loads."""
    def run(scale, dirs=None):
        ps = [p.detach().float().requires_grad_() for p in make_params()]
        opt = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype=state_dtype,
                                 state_dirs=dirs, **NVME)
        for k in range(3):
            for p in ps:
                p.grad = grad(p, k, 0) * scale
            opt.step()
        sds = [opt.state_dict(fp32_moments=fp32) for fp32 in (False, True)]
        sds = [{**sd, "state": {i: {k: v.clone() for k, v in st.items()}
                                for i, st in sd["state"].items()}} for sd in sds]
        opt.close()
        return sds

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    own = [run(1.0, [d])[fp32] for fp32, d in enumerate(dirs)]
    other = run(3.0)
    for d, sd in zip(dirs, own):
        opt = offload_adam.AdamW(
            groups([p.detach().float().requires_grad_() for p in make_params(seed=8)]),
            lr=0.01, state_dtype=state_dtype, state_dirs=[d], state_resume=True, **NVME)
        files = snapshot(d)
        for theirs in other:
            with pytest.raises(ValueError, match=r"saved with other params \(param 0:0: step 3 "
                                                 r"as the files, but its moments are not the "
                                                 r"files'\)"):
                opt.load_state_dict(theirs)
        assert snapshot(d) == files
        opt.load_state_dict(sd)
        opt.close()


@pytest.mark.parametrize("resume", [False, True])
def test_a_sharded_runs_folders_are_not_resumed_by_one_process(kernels, tmp_path, resume):
    """Under FSDP2 each rank keeps its shard's state in a folder rank<R> of state_dirs.
    One process given those directories looked at the directory itself, found no state
    and (state_resume=True) started again at step 0 with a warning, beside the ranks'
    files: refused, naming the folder, with nothing made."""
    (tmp_path / "rank0").mkdir()
    ps = make_params()
    opt = build(ps, [tmp_path / "rank0"])   # (a rank's files: what a 2-rank run leaves)
    train(opt, ps, 0, 2)
    opt.close()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=r"holds a sharded run's \(FSDP2\) optimizer state in "
                                         r".*rank0'.*this run has 1 rank: resume it with the "
                                         r"number of ranks that made it"):
        build(make_params(), [tmp_path], state_resume=resume)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_state_dict_of_many_params_keeps_no_descriptor_per_tensor(kernels, tmp_path,
                                                                     footprint):
    # A dict of state in files maps its tensors from the files. Python's mmap kept a
    # descriptor per tensor: a model of many params (an MoE of a Linear per expert)
    # passed the open files' hard limit, and the kernel's 65,530 mappings a process at
    # 13,000 params of 5 tensors (8-bit moments).
    shapes, dtypes = ((24,),) * 120, (torch.bfloat16,) * 120
    ps, qs = make_params(0, shapes, dtypes), make_params(0, shapes, dtypes)
    ram = offload_adam.AdamW(ps, lr=0.01, state_dtype="bfloat16")
    opt = offload_adam.AdamW(qs, lr=0.01, state_dtype="bfloat16", state_dirs=[tmp_path],
                             state_footprint=footprint, **NVME)
    for k in range(2):
        for p, q in zip(ps, qs):
            p.grad = grad(p, k, 0)
            q.grad = grad(q, k, 0)
        ram.step()
        opt.step()
    fds = len(os.listdir("/proc/self/fd"))
    sd = opt.state_dict()
    assert len(os.listdir("/proc/self/fd")) - fds < 8   # (was 360: a descriptor a tensor)
    want = ram.state_dict()["state"]
    assert sd["state"].keys() == want.keys()
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():
                # a storage of its own each (torch.save writes just its bytes)
                assert v.untyped_storage().nbytes() == v.nbytes, (i, k)
        for k in want[i]:
            assert torch.equal(bits(st[k]), bits(want[i][k])), (i, k)
    st = sd["state"][0]
    st["exp_avg"].add_(1)   # copy-on-write: the files keep their bytes
    assert torch.equal(bits(opt.state_dict()["state"][0]["exp_avg"]),
                       bits(want[0]["exp_avg"]))
    del sd, st
    opt.close()
