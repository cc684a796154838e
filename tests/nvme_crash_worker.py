"""The training processes of tests/test_nvme_crash.py (the storage layer's, `worker`, and the
optimizer's, `optimizer_worker`), forked from a forkserver that imported
this module: torch, offload_adam and the compiled kernels are loaded once there (the kernels'
threads start at first use, so forking after the load is safe), and a worker starts in
milliseconds. Loading the kernels before the state is opened also keeps the build's
subprocesses (`c++ --version`, `ninja -n`) from running while the lock is held."""
import os

import torch

import offload_adam
from nvme_adam import adam_fn, fill_initial, make_spec
from nvme_model import groups, make_params, train
from offload_adam.kernel_step import kernels
from offload_adam.nvme import NvmeState, StepPipeline

SEED = 5
kernels()


def spec_of(fmt):
    # 4 buckets of ~1.2 MB (fp32): a step takes long enough that kills land in its writes
    return make_spec(fmt, buckets=4, numel=50_000)


def worker(folder, fmt, until, progress):
    """Opens the state (the first values when it is at step 0: idempotent), sends its step
    count, and steps it until `until` completed steps, sending each one."""
    spec = spec_of(fmt)
    with NvmeState.open([folder], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        if state.step == 0:
            pipe.load(fill_initial(SEED), step=0)
        progress.send(state.step)
        while state.step < until:
            pipe.step(adam_fn(SEED, state.step, threads=1))
            progress.send(state.step)
        pipe.close()


# The optimizer worker's model: fp32 and bf16 params in two groups, ~1.1 MB of fp32 state
# in ~70 KB buckets, so that a step has ~16 buckets, each read, stepped, written and the
# step committed: the kills land anywhere in it.
MODEL = dict(shapes=((130, 97), (9001,), (31, 7, 41), (12_000,), (77, 101), (5003,)),
             dtypes=(torch.float32, torch.bfloat16, torch.float32, torch.bfloat16,
                     torch.bfloat16, torch.float32))
BUCKET_MB = 0.07


def model_params():
    return make_params(**MODEL)


def optimizer(params, folder, fmt, **kw):
    """The optimizer of the optimizer worker: state in files under `folder` when given, in
    host RAM otherwise (the uninterrupted run the test compares with)."""
    extra = dict(state_dirs=folder, bucket_mb=BUCKET_MB, state_resume=True) if folder else {}
    return offload_adam.AdamW(groups(params, split=3), lr=0.01, state_dtype=fmt, **extra, **kw)


def committed_step(opt) -> int:
    """The completed steps of the state, read as a user can: the largest param step of the
    state dict (a param left without a grad has fewer; none at step 0)."""
    return int(max((float(s["step"]) for s in opt.state_dict()["state"].values()), default=0))


def optimizer_worker(state_dir, fmt, until, progress):
    """A training run on the optimizer's NVMe tier: resumes the state in `state_dir`
    (state_resume=True: the params too come back from the files, as of its last completed
    step; nothing else is saved), sends its step, then trains to `until` steps, sending
    each step count once its step() returned."""
    params = model_params()
    opt = optimizer(params, state_dir, fmt)
    step = committed_step(opt)
    progress.send(step)
    while step < until:
        train(opt, params, step, 1)
        step += 1
        progress.send(step)
