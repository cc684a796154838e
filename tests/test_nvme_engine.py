"""The offload engine with its state in files (state_dirs=, offload_adam/engine/core.py's EngineStep.lent),
on the asynchronous simulated device (the GPU's path: copies land late and read their source
when they run, so a missing wait before the pipeline reuses a ring buffer fails here): bitwise
the engine with its state in host RAM, through real backward passes with hooks, clipping,
accumulation, GradScaler's protocol and freed grads; checkpoints across the tiers both ways,
and a resume from the files."""
import gc
import io

import pytest
import torch

import offload_adam
from offload_adam.testing import ring_buffers, state_files
from conftest import sim_path
from models import decay_groups, fp32_head, loss_of, make_pair
from nvme_model import assert_same, assert_stepped_from, kernel_interrupted

FORMATS = ["float32", "bfloat16", "8bit"]
SIMS = ["sim-seed0", "sim-seed1", "sim-latest"]
OPTS = dict(lr=3e-3, bucket_mb=0.01)


def model():
    """TinyTransformer in bf16 with an fp32 head: both kinds of engine param (an fp32
    param's master is the param; the files keep it too, the GPU holds the param)."""
    return fp32_head(make_pair()[0])


groups = decay_groups


def train(m, opt, first, count, accumulate=1, clip=None, scaler=False):
    for k in range(first, first + count):
        for micro in range(accumulate):
            (loss_of(m, 10 * k + micro) / accumulate).backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        elif clip == "opt":
            opt.clip_grad_norm_(0.5)
        if scaler:   # GradScaler's protocol: 1/scale in the kernel, an inf skips the step
            opt.grad_scale = torch.tensor(1.0)
            opt.found_inf = torch.tensor(1.0 if k == first + 1 else 0.0)
        opt.step()
        opt.zero_grad()


def params_of(m):
    return [p for g in groups(m) for p in g["params"]]


CASES = [dict(), dict(accumulate=2), dict(clip="opt"), dict(max_grad_norm=0.3),
         dict(scaler=True), dict(amsgrad=True)]


# Every case in every format, each on one of the simulated device's latencies in turn (the
# plain case on all of them): OFFLOAD_ADAM_SIM_SEEDS soaks test_engine*.py, not these.
RUNS = [(fmt, case, where) for i, (fmt, case) in enumerate(
            (f, c) for c in CASES for f in FORMATS)
        for where in (SIMS if not case else [SIMS[i % len(SIMS)]])]


@pytest.mark.parametrize("fmt,case,where", RUNS, ids=lambda v: v if isinstance(v, str) else (
    "-".join(f"{k}={x}" for k, x in v.items()) or "plain"))
def test_the_engine_on_disk_steps_bitwise_as_in_ram(kernels, tmp_path, where, fmt, case):
    case = dict(case)
    if case.get("amsgrad") and fmt == "8bit":
        pytest.skip("8-bit moments have no amsgrad")
    run = {k: case.pop(k) for k in ("accumulate", "clip", "scaler") if k in case}
    a, b = model(), model()
    with sim_path(where):
        ram = offload_adam.AdamW(groups(a), state_dtype=fmt, **OPTS, **case)
        disk = offload_adam.AdamW(groups(b), state_dtype=fmt, state_dirs=tmp_path, **OPTS,
                                  **case)
        assert len(state_files(disk).spec.buckets) >= 6
        # no state arenas: the engine holds its transfer buffers, the tier its ring
        assert disk.host_bytes() - sum(b.nbytes for b in ring_buffers(disk)) < ram.host_bytes()
        train(a, ram, 0, 4, **run)
        train(b, disk, 0, 4, **run)
        assert disk.last_step_profile is not None   # the engine stepped them
        assert_same(params_of(a), params_of(b), ram, disk)
    assert disk.step_count == (3 if run.get("scaler") else 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_moves_between_the_tiers_both_ways(kernels, tmp_path, fmt):
    """RAM -> disk and disk -> RAM through torch.save, each continuing bitwise as the run
    that never moved."""
    ms = [model() for _ in range(3)]
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
    with sim_path("sim-seed0"):
        ref = offload_adam.AdamW(groups(ms[0]), state_dtype=fmt, **OPTS)
        first = offload_adam.AdamW(groups(ms[1]), state_dtype=fmt, **OPTS)
        other = offload_adam.AdamW(groups(ms[2]), state_dtype=fmt, state_dirs=tmp_path / "x",
                                   **OPTS)
        for m, opt in zip(ms, (ref, first, other)):
            train(m, opt, 0, 2)
        # RAM (first) -> disk; disk (other) -> RAM
        saved = {}
        for name, opt in (("ram", first), ("disk", other)):
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            saved[name] = buf.getvalue()
        del first, other, opt
        gc.collect()
        to_disk = offload_adam.AdamW(groups(ms[1]), state_dtype=fmt, state_dirs=tmp_path / "y",
                                     **OPTS)
        to_ram = offload_adam.AdamW(groups(ms[2]), state_dtype=fmt, **OPTS)
        to_disk.load_state_dict(torch.load(io.BytesIO(saved["ram"]), weights_only=True))
        to_ram.load_state_dict(torch.load(io.BytesIO(saved["disk"]), weights_only=True))
        for m, opt in zip(ms, (ref, to_disk, to_ram)):
            train(m, opt, 2, 2)
        assert_same(params_of(ms[0]), params_of(ms[1]), ref, to_disk)
        assert_same(params_of(ms[0]), params_of(ms[2]), ref, to_ram)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_loaded_master_that_no_longer_rounds_to_its_param_starts_from_the_param(
        kernels, tmp_path, fmt):
    """The engine's side of the tier (engine.state.follow_masters): masters loaded into a model
    whose params moved since they were saved (another checkpoint of it loaded: here every
    param 0.25 up) are started from the params at the next step (the bf16 params' after a
    check against a copy of the param, the fp32 head's at once, its master being the
    param), bitwise as in RAM."""
    src, a, b = model(), model(), model()
    with torch.no_grad():
        for p in params_of(a) + params_of(b):
            p.add_(0.25)
    with sim_path("sim-seed0"):
        saved = offload_adam.AdamW(groups(src), state_dtype=fmt, **OPTS)
        train(src, saved, 0, 3)
        sd = saved.state_dict()
        ram = offload_adam.AdamW(groups(a), state_dtype=fmt, **OPTS)
        disk = offload_adam.AdamW(groups(b), state_dtype=fmt, state_dirs=tmp_path, **OPTS)
        ram.load_state_dict(sd)
        disk.load_state_dict(sd)
        before = [p.detach().clone() for p in params_of(b)]
        train(a, ram, 3, 1)
        train(b, disk, 3, 1)
        assert_stepped_from(params_of(b), before, params_of(src))   # no jump to `src`
        train(a, ram, 4, 2)
        train(b, disk, 4, 2)
        assert_same(params_of(a), params_of(b), ram, disk)


def test_a_new_optimizer_resumes_from_the_files(kernels, tmp_path):
    """close() lets the files go at once (a step after it raises); state_resume=True on a
    freshly initialised model restores its params from the files (the engine's masters, fp32
    params' too) and continues bitwise."""
    a, b, c = model(), model(), model()
    with sim_path("sim-seed1"):
        ref = offload_adam.AdamW(groups(a), state_dtype="bfloat16", **OPTS)
        opt = offload_adam.AdamW(groups(b), state_dtype="bfloat16", state_dirs=tmp_path, **OPTS)
        train(a, ref, 0, 3)
        train(b, opt, 0, 3)
        opt.close()   # now, not when collected: its files and their lock
        assert opt.pinned() and opt.host_bytes() == 0
        with pytest.raises(RuntimeError, match="this optimizer was closed"):
            opt.step()
        with pytest.raises(ValueError, match="state_resume=True"):
            offload_adam.AdamW(groups(c), state_dtype="bfloat16", state_dirs=tmp_path, **OPTS)
        assert not all(torch.equal(p, q) for p, q in zip(params_of(b), params_of(c)))
        opt = offload_adam.AdamW(groups(c), state_dtype="bfloat16", state_dirs=tmp_path,
                                 state_resume=True, **OPTS)
        assert all(torch.equal(p, q) for p, q in zip(params_of(b), params_of(c)))
        train(a, ref, 3, 2)
        train(c, opt, 3, 2)
        assert_same(params_of(a), params_of(c), ref, opt)
        assert opt.step_count == 5


def test_freed_grads_on_cpu_params_and_torch_clipping(kernels, tmp_path):
    """bf16 CPU params with free_grads_after_copy go through the engine on the host (no
    simulated device): the grads are freed in backward, clip_grad_norm_ sees their host
    copies, and the disk run is the RAM run bit for bit."""
    a, b = model(), model()
    kw = dict(free_grads_after_copy=True, state_dtype="8bit", **OPTS)
    ram = offload_adam.AdamW(groups(a), **kw)
    disk = offload_adam.AdamW(groups(b), state_dirs=tmp_path, **kw)
    train(a, ram, 0, 3, clip="torch")
    train(b, disk, 0, 3, clip="torch")
    assert disk.last_step_profile is not None   # the engine stepped them, on the host
    assert_same(params_of(a), params_of(b), ram, disk)


def test_a_step_of_freed_grads_clipped_by_torch_cut_short_is_redone_bitwise(kernels, tmp_path):
    """Compact files: a step of freed grads clipped by torch.nn.utils.clip_grad_norm_, cut
    short after its redo log, is finished from the log when the files are opened again. The
    log holds the host copies as they came (unclipped) and the coefficient beside them, so
    the redone kernels round the clipped grads as the step's own would have: bitwise the run
    in RAM."""
    a, b, c = model(), model(), model()
    kw = dict(free_grads_after_copy=True, **OPTS)
    ram = offload_adam.AdamW(groups(a), **kw)
    train(a, ram, 0, 3, clip="torch")
    disk = offload_adam.AdamW(groups(b), state_dirs=tmp_path, state_footprint="compact", **kw)
    train(b, disk, 0, 2, clip="torch")
    with kernel_interrupted(3):
        train(b, disk, 2, 1, clip="torch")
    disk.close()
    resumed = offload_adam.AdamW(groups(c), state_dirs=tmp_path, state_footprint="compact",
                                 state_resume=True, **kw)
    assert resumed.step_count == 3
    assert_same(params_of(a), params_of(c), ram, resumed)
