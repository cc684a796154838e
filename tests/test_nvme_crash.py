"""Nothing lost on a crash: a process stepping the state on disk is SIGKILLed at random
instants, again and again; every reopened state must be bitwise the state after some
completed step (never older than the last one seen), and the run continued from there must
end bitwise where an uninterrupted run in host RAM ends. Proved twice: on the storage layer
(NvmeState + StepPipeline stepping a bucketed Adam state), and on the optimizer
(offload_adam.AdamW(state_dirs=..., state_resume=True) training a small model of fp32 and
bf16 params, with no checkpoint of its own: the resumed optimizer restores the params from
the files too).

The workers (nvme_crash_worker.py) are forked from a forkserver that has loaded torch,
offload_adam and the kernels once, so a kill-and-restart costs milliseconds rather than an
interpreter start.
"""
import gc
import multiprocessing
import os
import random
import time

import pytest

from nvme_adam import compact_step, flip_byte, host_state, host_step, same_bits
from nvme_crash_worker import (SEED, committed_step, compact_optimizer_worker, compact_worker,
                               engine_model,
                               engine_optimizer, open_compact,
                               engine_train, engine_values, engine_worker, model_params, optimizer,
                               optimizer_worker, spec_of, worker)
from nvme_model import assert_same, train
from offload_adam import nvme_tier
from offload_adam.nvme import NvmeState, StepPipeline, manifest
from offload_adam.testing import AsyncSimDevice, simulated

KILLS = {"fp32": 24, "8bit": 12}


def mid_step(folder) -> bool:
    """Whether the compact files in `folder` hold a step begun and not finished."""
    body = manifest.read(str(folder))
    return body is not None and body.get("intent") is not None


REDONE = []   # the kills after which a compact state had a step to finish from its log


def on_disk(folder, fmt, compact=False):
    """The step and state the files hold; compact: a step cut short finished first (from
    its redo log, as a resume does)."""
    with (open_compact([folder], spec_of(fmt, True)) if compact
          else NvmeState.open([folder], spec_of(fmt))) as state:
        if state.pending:
            REDONE.append(len(state.pending))
            pipe = StepPipeline(state, 3 * max(b.nbytes for b in state.spec.buckets))
            compact_step(state, pipe, SEED)
            pipe.close()
        return state.step, [{k: v.clone() for k, v in state.views(i).items()}
                            for i in range(len(state.spec.buckets))]


def kill_rounds(count, begun, compact):
    """`count` kills; with compact files up to 3 x `count` more while none has yet landed
    inside a step after its redo log (a random instant misses that window with some
    chance, more on a loaded machine, and the window is short: the pass reads the log
    without writing it again; the assertion after the loop then still holds)."""
    k = 0
    while k < count or (compact and not any(begun) and k < 4 * count):
        yield k
        k += 1


class Timing:
    """A running average of a worker's step time."""
    step = 0.05


def run_worker(forkserver, target, args, rng, timing, kill=True):
    """Runs target(*args, progress) in a worker forked from the forkserver; when `kill`,
    SIGKILLs it after 0-2 more progress messages and a random part of one more step's time.
    Returns its exit code and every message it sent."""
    receive, send = forkserver.Pipe(duplex=False)
    p = forkserver.Process(target=target, args=(*args, send))
    p.start()
    send.close()
    assert receive.poll(60), "the worker did not start"
    sent = [receive.recv()]
    if kill:
        for _ in range(rng.randint(0, 2)):
            t = time.perf_counter()
            sent.append(receive.recv())
            timing.step = 0.5 * timing.step + 0.5 * (time.perf_counter() - t)
        time.sleep(rng.uniform(0.0, 1.2 * timing.step))
        p.kill()
    p.join(120)
    assert p.exitcode in (0, -9), p.exitcode
    while receive.poll(10):   # what it sent before it died
        try:
            sent.append(receive.recv())
        except EOFError:
            break
    return p.exitcode, sent


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


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_sigkill_at_random_instants_loses_no_completed_step(kernels, tmp_path, forkserver, fmt,
                                                            compact):
    """`compact`: one copy and a redo log (nvme/redo.py): a kill inside a step leaves its
    log and the buckets already moved; finishing it from the log is the step."""
    rng = random.Random(1234)
    REDONE.clear()
    ram = host_state(spec_of(fmt, compact), SEED)
    ram_step, last_seen, steps_seen = 0, 0, []

    timing = Timing()

    def run(until, kill=True):
        return run_worker(forkserver, compact_worker if compact else worker,
                          (str(tmp_path), fmt, until), rng, timing, kill)[0]

    for _ in range(KILLS[fmt]):
        run(until=10_000)
        step, state = on_disk(tmp_path, fmt, compact)
        assert step >= last_seen, "a committed step was lost"
        while ram_step < step:
            host_step(ram, SEED, ram_step)
            ram_step += 1
        if step > 0:   # at step 0 a kill may land before the first values are written
            assert same_bits(state, ram), f"the state on disk is not that of step {step}"
        last_seen = step
        steps_seen.append(step)
    assert len(set(steps_seen)) > KILLS[fmt] // 3, steps_seen   # the kills landed at many steps
    if compact:   # and inside steps, after their log
        assert REDONE, "no kill landed inside a step"
        print(f"compact {fmt}: buckets finished from the log after {len(REDONE)} of "
              f"{KILLS[fmt]} kills: {REDONE}")
    final = last_seen + 3
    assert run(until=final, kill=False) == 0
    while ram_step < final:
        host_step(ram, SEED, ram_step)
        ram_step += 1
    step, state = on_disk(tmp_path, fmt, compact)
    assert step == final and same_bits(state, ram)


OPTIMIZER_KILLS = {"float32": 12, "8bit": 8}


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
@pytest.mark.parametrize("fmt", ["float32", "8bit"])
def test_the_optimizer_killed_at_random_instants_resumes_bitwise(kernels, tmp_path, forkserver,
                                                                 fmt, compact):
    """The same at the optimizer's level: offload_adam.AdamW(state_dirs=...,
    state_resume=True) trains fp32 and bf16 params in two groups, ~16 buckets a step, with
    no model checkpoint of its own; SIGKILLed at random instants. Each time, a new optimizer
    on freshly initialised params, resumed from the files, has the params and the whole state
    bitwise those of an uninterrupted run in host RAM after the step it names, no older than
    the last step the worker saw return (a kill after a step's commit and before step()
    returned loses nothing either); and the run resumed from there, killed again and again,
    ends bitwise where the uninterrupted one ends."""
    rng = random.Random(4321)
    state_dir = tmp_path / "state"
    begun = []   # compact: whether each kill left a step to finish from its log
    state_dir.mkdir()
    ps = model_params()
    ram = optimizer(ps, None, fmt)
    ram_step, last_done, steps_seen = 0, 0, []

    def reopened(until):
        """The state in the files, reopened on new params; ram stepped to its step and
        compared."""
        nonlocal ram_step
        qs = model_params()
        if compact:
            begun.append(mid_step(state_dir))
        opt = optimizer(qs, str(state_dir), fmt,
                        **(dict(state_footprint="compact") if compact else {}))
        step = committed_step(opt)
        assert last_done <= step <= last_done + 1, (last_done, step)
        assert step <= until
        train(ram, ps, ram_step, step - ram_step)
        ram_step = step
        assert_same(ps, qs, ram, opt)   # the params and the whole state, bitwise
        return step, opt, qs

    timing = Timing()
    for _ in kill_rounds(OPTIMIZER_KILLS[fmt], begun, compact):
        worker_fn = compact_optimizer_worker if compact else optimizer_worker
        code, sent = run_worker(forkserver, worker_fn,
                                (str(state_dir), fmt, 10_000), rng, timing)
        assert code == -9
        last_done = max(sent)   # the last opt.step() seen to return
        step, opt, qs = reopened(10_000)
        steps_seen.append(step)
        del opt   # closes the files, drops the lock
        gc.collect()
    assert len(set(steps_seen)) > OPTIMIZER_KILLS[fmt] // 3, steps_seen
    if compact:
        assert any(begun), "no kill landed inside a step, after its redo log"
    final = max(steps_seen) + 3
    code, sent = run_worker(forkserver, worker_fn, (str(state_dir), fmt, final), rng,
                            timing, kill=False)
    assert code == 0 and sent[-1] == final
    last_done = final
    step, opt, qs = reopened(final)
    assert step == final
    # and on from there in this process, the resumed optimizer against the RAM one
    train(opt, qs, final, 2)
    train(ram, ps, final, 2)
    assert_same(ps, qs, ram, opt)
    print(f"{fmt}: steps at the kills {steps_seen}")


ENGINE_KILLS = 10


@pytest.mark.parametrize("compact", [False, True], ids=["step_in_backward", "compact"])
@pytest.mark.parametrize("streamed", [False, True, "files", "heads"],
                         ids=["resident", "streamed", "param-files", "split-buckets"])
def test_step_in_backward_killed_at_random_instants_resumes_bitwise(kernels, tmp_path,
                                                                    forkserver, streamed,
                                                                    compact, monkeypatch):
    """The same for the engine with step_in_backward on the simulated device, where the
    files' pass writes its buckets during backward (engine/disk_early.py) and commits at
    step(): killed anywhere (forward, backward's pass, the commit), the files hold a
    completed step, the params restored from them included, bitwise the uninterrupted
    plain run in host RAM. `streamed`: the layers' params streamed per block (issue 27):
    the files restore their host copies, and the reference is the same model resident;
    "files": the host copies in param files (issue 28), a cache of 4 blocks of 8, the
    worker's files left as the kill left them and the resumed model's made anew;
    "heads": so, the state's buckets laid out with the params as their heads and split
    masters (nvme_tier.HEADS, the default)."""
    monkeypatch.setattr(nvme_tier, "HEADS", streamed == "heads")
    rng = random.Random(8642)
    state_dir = tmp_path / "state"
    begun = []
    state_dir.mkdir()
    sim = AsyncSimDevice(seed=3)
    try:
        with simulated(sim), sim.watch():
            ref = engine_model(seed=11, blocks=bool(streamed))
            ram = engine_optimizer(ref)
            ram_step, last_done, steps_seen = 0, 0, []

            def reopened():
                nonlocal ram_step
                param_dir = (str(tmp_path / f"params{len(steps_seen)}")
                             if streamed in ("files", "heads") else None)
                m = engine_model(seed=11, blocks=bool(streamed), streamed=bool(streamed),
                                 param_dir=param_dir)   # the state files restore it
                if compact:
                    begun.append(mid_step(state_dir))
                opt = engine_optimizer(m, str(state_dir), compact)
                assert any(e.split for b in opt._store.buckets for e in b) == (
                    streamed == "heads")
                step = committed_step(opt)
                assert last_done <= step <= last_done + 1, (last_done, step)
                engine_train(ref, ram, ram_step, step - ram_step)
                ram_step = step
                assert_same(engine_values(ref), engine_values(m), ram, opt)
                return step, opt, m

            timing = Timing()
            for _ in kill_rounds(ENGINE_KILLS, begun, compact):
                code, sent = run_worker(forkserver, engine_worker,
                                        (str(state_dir), 10_000, streamed, compact), rng, timing)
                assert code == -9
                last_done = max(sent)
                step, opt, _ = reopened()
                steps_seen.append(step)
                opt.close()
            assert len(set(steps_seen)) > ENGINE_KILLS // 3, steps_seen
            if compact:
                assert any(begun), "no kill landed inside a step, after its redo log"
            final = max(steps_seen) + 2
            code, sent = run_worker(forkserver, engine_worker,
                                    (str(state_dir), final, streamed, compact), rng, timing,
                                    kill=False)
            assert code == 0 and sent[-1] == final
            last_done = final
            step, opt, m = reopened()
            assert step == final
            engine_train(m, opt, final, 2)   # and on, early passes in this process
            engine_train(ref, ram, final, 2)
            assert_same(engine_values(ref), engine_values(m), ram, opt)
        sim.check()
    finally:
        sim.close()
    print(f"step_in_backward ({streamed or 'resident'}): steps at the kills "
          f"{steps_seen}")


def test_after_a_kill_a_misused_state_is_refused_and_still_resumes(kernels, tmp_path,
                                                                     forkserver):
    """Issue 25 items 1-3 with real processes and files: a run striped over [a, b],
    SIGKILLed at random instants. After each kill its directories given as [b, a] or [b],
    its manifest gone, or a bit flipped in a master of the committed step: each refused
    (resumed or not), no byte changed; given right again, the state resumes bitwise the
    uninterrupted run at its step."""
    from offload_adam.nvme import NvmeError, StateSpec, manifest
    from offload_adam.nvme.layout import place

    rng = random.Random(97)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ps = model_params()
    ram = optimizer(ps, None, "float32")
    ram_step, timing = 0, Timing()

    def contents():
        return {p: p.read_bytes() for d in (a, b) for p in sorted(d.iterdir())
                if not p.name.endswith(".lock")}

    def refused(dirs, error, match, resumes=(True, False)):
        for resume in resumes:
            with pytest.raises(error, match=match):
                optimizer(model_params(), [str(d) for d in dirs], "float32", resume)
            gc.collect()

    def master_byte():
        """The file and offset of a byte of bucket 0's first master, committed slot."""
        body = manifest.read(str(a))
        spec = StateSpec.from_json(manifest.read(str(a), manifest.SPEC))
        e = place(spec, 2)[0][0]
        return (a, b)[e.file] / "offload_adam_state.bin", e.at(body["slots"][0]) + 4 * 10 + 3

    for _ in range(3):
        code, _ = run_worker(forkserver, optimizer_worker, ([str(a), str(b)], "float32", 10_000),
                             rng, timing)
        assert code == -9
        if manifest.read(str(a)) is None or not manifest.read(str(a))["written"]:
            continue   # killed before the first commit: nothing to misuse yet
        before = contents()
        refused([b, a], ValueError, "in the order")
        refused([b], ValueError, "in the order")
        (a / "offload_adam_state.manifest").rename(tmp_path / "aside")
        refused([a, b], ValueError, "no manifest")
        (tmp_path / "aside").rename(a / "offload_adam_state.manifest")
        path, at = master_byte()
        flip_byte(path, at)
        refused([a, b], NvmeError, "bucket 0 .* is damaged", resumes=(True,))
        refused([a, b], ValueError, "already hold", resumes=(False,))   # (nothing read)
        flip_byte(path, at)
        assert contents() == before
        qs = model_params()
        opt = optimizer(qs, [str(a), str(b)], "float32")
        step = opt.step_count
        train(ram, ps, ram_step, step - ram_step)
        ram_step = step
        assert_same(ps, qs, ram, opt)
        opt.close()
