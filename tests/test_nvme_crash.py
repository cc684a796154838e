"""Nothing lost on a crash: a process stepping the state on disk is SIGKILLed at random
instants, again and again; every reopened state must be bitwise the state after some
completed step (never older than the last one seen), and the run continued from there must
end bitwise where an uninterrupted run in host RAM ends.

The workers (nvme_crash_worker.py) are forked from a forkserver that has loaded torch,
offload_adam and the kernels once, so a kill-and-restart costs milliseconds rather than an
interpreter start.
"""
import multiprocessing
import os
import random
import time

import pytest

from nvme_adam import host_state, host_step, same_bits
from nvme_crash_worker import SEED, spec_of, worker
from offload_adam.nvme import NvmeState

KILLS = {"fp32": 24, "8bit": 12}


def on_disk(folder, fmt):
    with NvmeState.open([folder], spec_of(fmt)) as state:
        return state.step, [{k: v.clone() for k, v in state.views(i).items()}
                            for i in range(len(state.spec.buckets))]


@pytest.fixture(scope="module")
def forkserver():
    """The forkserver context, its server preloading nvme_crash_worker (found through
    PYTHONPATH: Python 3.11's forkserver ignores the parent's sys.path when preloading)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + ([saved] if saved else []))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["nvme_crash_worker"])
    try:
        yield ctx
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def test_a_second_process_on_the_directory_is_refused(kernels, tmp_path, forkserver):
    receive, send = forkserver.Pipe(duplex=False)
    p = forkserver.Process(target=worker, args=(str(tmp_path), "fp32", 10_000, send))
    p.start()
    send.close()
    try:
        assert receive.poll(60)
        receive.recv()
        with pytest.raises(RuntimeError, match=f"is in use by another optimizer .* held by "
                                               f"pid {p.pid}"):
            NvmeState.open([tmp_path], spec_of("fp32"))
    finally:
        p.kill()
        p.join(60)
    NvmeState.open([tmp_path], spec_of("fp32")).close()   # SIGKILL dropped the lock


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_sigkill_at_random_instants_loses_no_completed_step(kernels, tmp_path, forkserver, fmt):
    rng = random.Random(1234)
    ram = host_state(spec_of(fmt), SEED)
    ram_step, last_seen, steps_seen = 0, 0, []

    step_time = [0.05]

    def run(until, kill=True):
        """A worker; killed (when `kill`) after 0-2 completed steps and a random part of
        one more step's time."""
        receive, send = forkserver.Pipe(duplex=False)
        p = forkserver.Process(target=worker, args=(str(tmp_path), fmt, until, send))
        p.start()
        send.close()
        assert receive.poll(60), "the worker did not start"
        receive.recv()
        if kill:
            for _ in range(rng.randint(0, 2)):
                t = time.perf_counter()
                receive.recv()
                step_time[0] = 0.5 * step_time[0] + 0.5 * (time.perf_counter() - t)
            time.sleep(rng.uniform(0.0, 1.2 * step_time[0]))
            p.kill()
        p.join(120)
        assert p.exitcode in (0, -9), p.exitcode
        return p.exitcode

    for _ in range(KILLS[fmt]):
        run(until=10_000)
        step, state = on_disk(tmp_path, fmt)
        assert step >= last_seen, "a committed step was lost"
        while ram_step < step:
            host_step(ram, SEED, ram_step)
            ram_step += 1
        if step > 0:   # at step 0 a kill may land before the first values are written
            assert same_bits(state, ram), f"the state on disk is not that of step {step}"
        last_seen = step
        steps_seen.append(step)
    assert len(set(steps_seen)) > KILLS[fmt] // 3, steps_seen   # the kills landed at many steps
    final = last_seen + 3
    assert run(until=final, kill=False) == 0
    while ram_step < final:
        host_step(ram, SEED, ram_step)
        ram_step += 1
    step, state = on_disk(tmp_path, fmt)
    assert step == final and same_bits(state, ram)
