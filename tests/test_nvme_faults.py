"""Fault injection on the state in files as a whole (issue 25): for every file the tier
writes (data, manifest, spec, lock) and every way it can go wrong outside offload_adam
(deleted, truncated, a byte flipped, swapped with another run's, a stale copy from an
earlier step), a resume either continues bitwise from a completed step or refuses with an
error of offload_adam's naming the problem; and no new state is ever made over the files:
an optimizer built without state_resume refuses, every byte left as it was.

The run under test trains 4 steps (copies of its files taken after steps 2 and 3 are the
stale ones); "another run's" files are those of the same model from another init, so that
its spec is the same file and its manifest and data look right but for their identity."""
import errno
import gc
import os
import shutil

import pytest
import torch

import offload_adam
from offload_adam.testing import state_files
from conftest import sim_path
from models import BF16, Sometimes, decay_groups, fp32_head, loss_of
from nvme_adam import fails_at, flip_byte
from nvme_model import NVME, assert_same, bits, cut_short, groups, make_params, train

NAMES = {"data": "offload_adam_state.bin", "manifest": "offload_adam_state.manifest",
         "spec": "offload_adam_state.spec", "lock": "offload_adam_state.lock"}
STEPS = 4


def build(params, folder, **kw):
    return offload_adam.AdamW(groups(params), lr=0.01, state_dtype="8bit", state_dirs=folder,
                              **NVME, **kw)


def ram_at(step):
    ps = make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit")
    train(ram, ps, 0, step)
    return ps, ram


@pytest.fixture(scope="module")
def runs(kernels, tmp_path_factory):
    """{"run": its folder, "stale2"/"stale3": its files after steps 2/3, "other": another
    run's folder, "slot": (offset, size) of bucket 0's committed slot in the data file}."""
    root = tmp_path_factory.mktemp("faults")
    out = {k: root / k for k in ("run", "stale2", "stale3", "other")}
    for d in out.values():
        d.mkdir()
    qs = make_params()
    opt = build(qs, out["run"])
    for k in range(STEPS):
        train(opt, qs, k, 1)
        if k + 1 in (2, 3):
            for name in NAMES.values():
                shutil.copy(out["run"] / name, out[f"stale{k + 1}"] / name)
    st = state_files(opt)
    out["slot"] = (st.extents[0].at(st.slots[0]), st.extents[0].nbytes)
    opt.close()
    ps = make_params(seed=3)
    other = build(ps, out["other"])
    train(other, ps, 0, 3)
    other.close()
    return out


def inject(folder, runs, which, fault):
    path = folder / NAMES[which]
    size = path.stat().st_size
    if fault == "delete":
        path.unlink()
    elif fault == "truncate":
        os.truncate(path, size // 2)
    elif fault == "flip":
        at, nbytes = runs["slot"] if which == "data" else (0, size)
        flip_byte(path, at + nbytes // 3)
    elif fault == "flip-header":
        flip_byte(path, 40)
    elif fault == "swap":
        shutil.copy(runs["other"] / NAMES[which], path)
    else:   # "stale2", "stale3": the file as it was after that step
        shutil.copy(runs[fault] / NAMES[which], path)


def contents(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))
            if n != NAMES["lock"]}


# What each fault must give: "refused", or the completed step resumed from.
EXPECTED = {
    ("data", "delete"): "refused", ("data", "truncate"): "refused",
    ("data", "flip"): "refused", ("data", "flip-header"): "refused",
    ("data", "swap"): "refused", ("data", "stale2"): "refused", ("data", "stale3"): "refused",
    ("manifest", "delete"): "refused", ("manifest", "truncate"): "refused",
    ("manifest", "flip"): "refused", ("manifest", "swap"): "refused",
    ("manifest", "stale2"): "refused",
    ("manifest", "stale3"): 3,   # the slots it names still hold step 3, whole
    ("spec", "delete"): "refused", ("spec", "truncate"): "refused",
    ("spec", "flip"): "refused",
    ("spec", "swap"): STEPS, ("spec", "stale2"): STEPS,   # the same bytes: nothing changed
    **{("lock", f): STEPS for f in ("delete", "truncate", "flip", "swap", "stale2")},
}


@pytest.mark.parametrize("which,fault", sorted(EXPECTED), ids=[f"{w}-{f}" for w, f in sorted(EXPECTED)])
def test_a_damaged_state_resumes_a_completed_step_or_is_refused(runs, tmp_path, which, fault):
    folder = tmp_path / "state"
    shutil.copytree(runs["run"], folder)
    inject(folder, runs, which, fault)
    before = contents(folder)
    with pytest.raises((ValueError, RuntimeError, OSError), match="offload_adam"):
        build(make_params(seed=7), folder)   # never a new state over it
    assert contents(folder) == before
    expected = EXPECTED[(which, fault)]
    qs = make_params(seed=7)
    if expected == "refused":
        with pytest.raises((ValueError, RuntimeError, OSError), match="offload_adam") as e:
            build(qs, folder, state_resume=True)
        assert contents(folder) == before, e.value
        assert all(torch.equal(q, p) for q, p in zip(qs, make_params(seed=7)))   # untouched
        return
    opt = build(qs, folder, state_resume=True)
    assert opt.step_count == expected
    ps, ram = ram_at(expected)
    assert_same(ps, qs, ram, opt)
    train(opt, qs, expected, 1)   # and on
    train(ram, ps, expected, 1)
    assert_same(ps, qs, ram, opt)
    opt.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_byte_flipped_anywhere_in_the_data_file(runs, tmp_path, seed):
    """A byte flipped at a random place: in what the state reads (a header, a committed
    slot) it is refused; elsewhere (the other slots, padding) the state resumes at its
    step bitwise, and the next step overwrites the damage."""
    folder = tmp_path / "state"
    shutil.copytree(runs["run"], folder)
    path = folder / NAMES["data"]
    at = torch.randint(0, path.stat().st_size, (1,),
                       generator=torch.Generator().manual_seed(seed)).item()
    flip_byte(path, at)
    qs = make_params(seed=7)
    try:
        opt = build(qs, folder, state_resume=True)
    except (ValueError, OSError) as e:
        assert "offload_adam" in str(e)
        return
    assert opt.step_count == STEPS
    ps, ram = ram_at(STEPS)
    assert_same(ps, qs, ram, opt)
    opt.close()


# ---- the compact layout's redo log (state_footprint="compact") -----------------------------

def compact_run(folder, mid_step):
    """A compact run of STEPS steps; `mid_step`: the next step cut short after its redo
    log (its third kernel call fails), the files holding step STEPS and the log of the
    next."""
    qs = make_params()
    opt = build(qs, folder, state_footprint="compact")
    train(opt, qs, 0, STEPS)
    if mid_step:
        cut_short(opt, qs, STEPS)
    opt.close()


REDO = "offload_adam_state.redo"


@pytest.mark.parametrize("mid_step", [False, True], ids=["whole", "mid-step"])
@pytest.mark.parametrize("fault", ["delete", "truncate", "flip"])
def test_a_damaged_redo_log_is_refused_where_it_is_needed(kernels, tmp_path, fault, mid_step):
    """The redo log deleted, cut or flipped: a missing log is refused; one cut or flipped
    is refused when a step cut short needs it (nothing changed on disk, the params
    untouched), and unused otherwise (the files' step resumes bitwise and trains on)."""
    folder = tmp_path / "state"
    folder.mkdir()
    compact_run(folder, mid_step)
    path = folder / REDO
    if fault == "delete":
        path.unlink()
    elif fault == "truncate":
        os.truncate(path, 100)
    else:
        flip_byte(path, 200)
    before = contents(folder)
    qs = make_params(seed=7)
    if fault == "delete" or mid_step:
        with pytest.raises((ValueError, RuntimeError, OSError), match="offload_adam.*redo"):
            build(qs, folder, state_resume=True, state_footprint="compact")
        assert contents(folder) == before
        assert all(torch.equal(q, p) for q, p in zip(qs, make_params(seed=7)))
        return
    opt = build(qs, folder, state_resume=True, state_footprint="compact")
    assert opt.step_count == STEPS
    ps, ram = ram_at(STEPS)
    assert_same(ps, qs, ram, opt)
    train(opt, qs, STEPS, 1)
    train(ram, ps, STEPS, 1)
    assert_same(ps, qs, ram, opt)
    opt.close()


def test_a_stale_compact_manifest_is_refused_or_a_completed_step(kernels, tmp_path):
    """The manifest of an earlier step put back over a compact state: the ring has since
    rewritten some of the copies it names, so it is refused by their checksums, or, where
    they are intact, it is that step, whole and bitwise."""
    folder = tmp_path / "state"
    folder.mkdir()
    qs = make_params()
    opt = build(qs, folder, state_footprint="compact")
    train(opt, qs, 0, 2)
    stale = (folder / NAMES["manifest"]).read_bytes()
    train(opt, qs, 2, 2)
    opt.close()
    (folder / NAMES["manifest"]).write_bytes(stale)
    qs = make_params(seed=7)
    try:
        opt = build(qs, folder, state_resume=True, state_footprint="compact")
    except (ValueError, OSError) as e:
        assert "offload_adam" in str(e) and "damaged" in str(e), e
        return
    assert opt.step_count == 2
    ps, ram = ram_at(2)
    assert_same(ps, qs, ram, opt)
    opt.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_state_files_removed_or_replaced_while_open_stop_the_steps(kernels, tmp_path,
                                                                   footprint, how):
    """The directory removed and made again between steps (a cleanup script), or its data
    file replaced by another: the steps went on into the files still open, unlinked, and
    each was reported committed, the manifest alone written beside whatever was there.
    The next step is refused, naming the file; nothing is committed after it."""
    folder = tmp_path / "state"
    folder.mkdir()
    ps = make_params()
    opt = build(ps, folder, state_footprint=footprint)
    train(opt, ps, 0, 2)
    if how == "removed":
        shutil.rmtree(folder)
        folder.mkdir()
    else:
        data = folder / NAMES["data"]
        shutil.copy(data, tmp_path / "copy")
        os.replace(tmp_path / "copy", data)
    before = sorted(os.listdir(folder))
    with pytest.raises(OSError, match=rf"{folder / NAMES['data']} is no longer the state file "
                                      r"this optimizer opened .* step 3 was not committed"):
        train(opt, ps, 2, 1)
    with pytest.raises(RuntimeError, match="is no longer the state file .* Build the "
                                           "optimizer again"):
        train(opt, ps, 3, 1)
    assert opt.step_count == 2 and sorted(os.listdir(folder)) == before
    opt.close()


# ---- an error in a new state's first step ------------------------------------------------

@pytest.mark.parametrize("how", ["eio", "ctrl-c"])
@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_error_in_the_first_step_refuses_the_next(kernels, tmp_path, monkeypatch,
                                                     footprint, how):
    """The first step of a new state fails after some buckets were stepped (EIO writing the
    third bucket; Ctrl-C in the third kernel call): their params moved, and a compact
    state's first pass (no redo log yet) wrote them in place, so its files hold no whole
    step. The error does not call that state intact; the next step is refused, changing
    nothing (a retry stepped the buckets written twice, their step counts 2); an optimizer
    built anew over the directories, the params set again, trains as in RAM."""
    from offload_adam.nvme import NvmeError, direct_io
    ps = make_params()
    opt = build(ps, tmp_path, state_footprint=footprint)
    if how == "eio":
        monkeypatch.setattr(direct_io, "_write", fails_at(3, direct_io._write, errno.EIO))
        with pytest.raises(NvmeError) as raised:
            train(opt, ps, 0, 1)
        monkeypatch.undo()
        if footprint == "compact":
            assert "intact" not in str(raised.value)
            assert "first step of the new compact state files" in str(raised.value)
            assert "hold no whole state" in str(raised.value)
    else:
        cut_short(opt, ps, 0)
    moved = [p.detach().clone() for p in ps]
    assert any(not torch.equal(bits(p), bits(q)) for p, q in zip(moved, make_params()))
    with pytest.raises(RuntimeError, match="No step was completed: set the params again"):
        train(opt, ps, 0, 1)
    assert opt.step_count == 0
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(ps, moved))
    opt.close()
    del opt
    gc.collect()
    qs = make_params()
    opt = build(qs, tmp_path, state_footprint=footprint)
    train(opt, qs, 0, 2)
    rs, ram = ram_at(2)
    assert_same(rs, qs, ram, opt)
    opt.close()


@pytest.mark.parametrize("at", [0, 3], ids=["first-step", "step-3"])
@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_interrupt_between_two_kernel_calls_of_a_bucket_refuses_the_next(
        kernels, tmp_path, footprint, at):
    """A bucket of an fp32 and a bf16 param is stepped by two kernel calls; Ctrl-C in
    the second has moved the first param. The bucket counted as stepped only once its
    calls were all done, so the next step was let run (but compact files once committed,
    whose redo log is there) and stepped that param twice, silently (found from outside).
    It is refused, changing nothing."""
    ps = make_params()
    opt = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit", state_dirs=tmp_path,
                             state_footprint=footprint, bucket_mb=1)
    train(opt, ps, 0, at)
    before = [p.detach().clone() for p in ps]
    cut_short(opt, ps, at, call=2)
    moved = [p.detach().clone() for p in ps]
    assert not torch.equal(bits(moved[0]), bits(before[0]))
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(moved[1:], before[1:]))
    why = ("No step was completed: set the params again" if at == 0 else
           "cut short by an error" if footprint == "compact" else
           "state_resume=True to continue from step 3")
    with pytest.raises(RuntimeError, match=why):
        train(opt, ps, at, 1)
    assert opt.step_count == at
    assert all(torch.equal(bits(p), bits(q)) for p, q in zip(ps, moved))
    opt.close()


def early_model():
    """test_nvme_early's: bf16 with an fp32 head, a layer that gets a grad every other
    step and one that never does (its file bucket never completes in backward)."""
    torch.manual_seed(0)
    return fp32_head(Sometimes().to(BF16))


def early_params(m):
    return [p for g in decay_groups(m) for p in g["params"]]


def early_backward(m, it):
    m.odd = it % 2 == 1
    loss_of(m, it).float().backward()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_error_in_the_first_step_in_backward_refuses_the_next(kernels, tmp_path,
                                                                 monkeypatch, footprint):
    """step_in_backward through the engine (simulated device), EIO writing the third file
    bucket of the first step. Two generations: the first backward's pass stops at a bucket
    whose grads have not all come (its order a guess), and step() lends the rest, writing
    their params as it steps them; compact: the first pass writes its buckets in place.
    Either way some params moved and the files hold no step: the next step is refused
    (it went on, the params and state off a run that skipped that iteration), changing
    nothing, and a model loaded again trains as in RAM over the directories built anew."""
    from offload_adam.nvme import NvmeError, direct_io
    opts = dict(lr=3e-3, bucket_mb=0.01, state_dtype="bfloat16")
    with sim_path("sim-seed1"):
        m = early_model()
        before = [p.detach().clone() for p in early_params(m)]
        opt = offload_adam.AdamW(decay_groups(m), state_dirs=tmp_path, state_budget_mb=0.2,
                                 state_footprint=footprint, step_in_backward=True, **opts)
        monkeypatch.setattr(direct_io, "_write", fails_at(3, direct_io._write, errno.EIO))
        early_backward(m, 0)
        with pytest.raises(NvmeError) as raised:
            opt.step()
        monkeypatch.undo()
        assert "intact" not in str(raised.value) or footprint == "two_generations"
        moved = [p.detach().clone() for p in early_params(m)]
        assert any(not torch.equal(p, q) for p, q in zip(moved, before))
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="No step was completed: set the params again"):
            early_backward(m, 1)
            opt.step()
        assert opt.step_count == 0
        assert all(torch.equal(p, q) for p, q in zip(early_params(m), moved))
        opt.close()
        del opt
        gc.collect()
        a, b = early_model(), early_model()
        ram = offload_adam.AdamW(decay_groups(a), **opts)
        opt = offload_adam.AdamW(decay_groups(b), state_dirs=tmp_path, state_budget_mb=0.2,
                                 state_footprint=footprint, step_in_backward=True, **opts)
        for it in range(3):
            for model, o in ((a, ram), (b, opt)):
                early_backward(model, it)
                o.step()
                o.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(early_params(a), early_params(b)))
        sa, sb = ram.state_dict()["state"], opt.state_dict()["state"]
        assert sa.keys() == sb.keys() and all(
            torch.equal(bits(sa[i][k]), bits(sb[i][k])) for i in sa for k in sa[i])
        opt.close()


@pytest.mark.parametrize("early", [False, True])
def test_no_room_for_the_second_generation_is_said_as_the_second_step_starts(
        kernels, tmp_path, monkeypatch, early):
    """A new two-generation state reserves on disk only the slots its first step writes,
    the rest (what the second step writes) once that step committed: by then the heads
    gave back the param files' room (nvme_heads.given_back). No room then: the first step
    stays committed, and the second is refused as it starts, nothing of it run (the params
    and the files at step 1); once there is room it runs as if it was never refused."""
    from offload_adam.nvme.direct_io import allocated_bytes
    from offload_adam.nvme import NvmeError
    from conftest import holes_supported
    opts = dict(lr=3e-3, bucket_mb=0.01, state_dtype="bfloat16", step_in_backward=early)
    real = os.posix_fallocate

    def full(fd, at, n):   # (the state's creation reserved what it needs first, for real)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def run(model, opt, it):
        early_backward(model, it)
        opt.step()
        opt.zero_grad()

    with sim_path("sim-seed1"):
        a, b = early_model(), early_model()
        ram = offload_adam.AdamW(decay_groups(a), **opts)
        opt = offload_adam.AdamW(decay_groups(b), state_dirs=tmp_path, **opts)
        path = tmp_path / NAMES["data"]
        holes = holes_supported(tmp_path)
        size = path.stat().st_size
        if holes:   # (the header and one slot of each bucket)
            assert allocated_bytes(str(path)) < size // 2 + 8192
        run(a, ram, 0)
        monkeypatch.setattr(os, "posix_fallocate", full)
        run(b, opt, 0)
        assert opt.step_count == 1
        stepped = [p.detach().clone() for p in early_params(b)]
        with pytest.raises(NvmeError, match=r"reserving the second generation of the "
                           r"optimizer state file .* \(the disk is full\)\. The state of step 1 "
                           r"\(the last completed one\) is intact on disk, and nothing of the "
                           r"next step was written: make room and step again"):
            run(b, opt, 1)
        assert opt.step_count == 1
        assert all(torch.equal(p, q) for p, q in zip(early_params(b), stepped))
        monkeypatch.setattr(os, "posix_fallocate", real)
        opt.zero_grad()
        for it in (1, 2):
            run(a, ram, it)
            run(b, opt, it)
        if holes:
            assert allocated_bytes(str(path)) >= size
        assert all(torch.equal(p, q) for p, q in zip(early_params(a), early_params(b)))
        sa, sb = ram.state_dict()["state"], opt.state_dict()["state"]
        assert sa.keys() == sb.keys() and all(
            torch.equal(bits(sa[i][k]), bits(sb[i][k])) for i in sa for k in sa[i])
        opt.close()
