"""The training process of tests/test_nvme_crash.py, forked from a forkserver that imported
this module: torch, offload_adam and the compiled kernels are loaded once there (the kernels'
threads start at first use, so forking after the load is safe), and a worker starts in
milliseconds. Loading the kernels before the state is opened also keeps the build's
subprocesses (`c++ --version`, `ninja -n`) from running while the lock is held."""
from nvme_adam import adam_fn, fill_initial, make_spec
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
