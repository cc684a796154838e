"""defer_blocks=: with step_in_backward and streamed params, the CPU steps of the first
blocks whose grads come in backward (the model's last blocks) are left running when
step() returns, and overlap the next forward. On the simulated asynchronous device, with
those steps made to start late: the training is bit for bit the one without deferral,
every reader waits for them, and without the streamer's wait the next forward reads the
blocks' old values."""
import copy
import re
import time

import pytest
import torch

import offload_adam
from offload_adam.engine.core import OffloadEngine
from offload_adam.param_stream import _Block
from offload_adam.testing import AsyncSimDevice, simulated
from test_param_stream import OPTS, Block, assert_same_training, llama_loss, make_llama
import test_param_stream

device = test_param_stream.device   # the fixture: the simulated devices, checked at the end

KW = dict(OPTS, step_in_backward=True, bucket_mb=0.008)   # ~3 buckets a block


class _Late:
    """A deferred step that starts 20 ms late (or fails): whatever reads its block
    without waiting for it reads the values of the step before."""

    def __init__(self, job, fail=False):
        self.job, self.pieces, self.fail = job, job.pieces, fail

    def kernel(self):
        time.sleep(0.02)
        if self.fail:
            raise RuntimeError("a deferred step failed (test)")
        self.job.kernel()


@pytest.fixture
def late(monkeypatch):
    """Deferred steps start late; `late.blocks[i]`: the block indices deferred at step i;
    `late.fail`: the next deferred step raises."""
    real = OffloadEngine.run_tail

    class Log:
        blocks: list = []
        fail = False

    def run_tail(self, jobs):
        Log.blocks.append(sorted({p.rec.home.block.index for j in jobs for p in j.pieces}))
        wrapped = [_Late(j, fail=Log.fail and k == 0) for k, j in enumerate(jobs)]
        Log.fail = False
        real(self, wrapped)
    monkeypatch.setattr(OffloadEngine, "run_tail", run_tail)
    Log.blocks = []
    return Log


@pytest.fixture
def held(monkeypatch):
    """Deferred steps start only once `held.release` is set (cleared at each use): what
    a reader in between does is certain to meet them running."""
    import threading
    real = OffloadEngine.run_tail

    class Held:
        release = threading.Event()

        def __init__(self, job):
            self.job, self.pieces = job, job.pieces

        def kernel(self):
            assert Held.release.wait(120)
            self.job.kernel()
    monkeypatch.setattr(OffloadEngine, "run_tail",
                        lambda self, jobs: real(self, [Held(j) for j in jobs]))
    yield Held
    Held.release.set()


def _run(defer, steps=4, streamed=True, layers=16, read=True, clip_inf=False, **kw):
    """Trains `steps` steps (one micro-batch each, as step_in_backward asks); after each
    step(), before anything waited, reads a deferred block's moments through opt.state
    and the model's values through its state_dict (both must wait). Returns the model,
    the optimizer, the reads, and whether deferred steps were pending each time."""
    model = make_llama(layers=layers, **kw)
    if streamed:
        offload_adam.stream_params(model, Block, prefetch=2)
    opt = offload_adam.AdamW(model.parameters(), **KW, defer_blocks=defer)
    last = model.layers[-1].up.weight
    reads, pending = [], []
    for it in range(steps):
        llama_loss(model, it).backward()
        if clip_inf:   # what HF Trainer does with max_grad_norm=0: a norm, grads times 1
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        pending.append(opt._engine.tail_pending)
        if read:
            reads.append((opt.state[last]["exp_avg"].clone(),
                          {k: v.clone() for k, v in model.state_dict().items()}))
        opt.zero_grad()
    return model, opt, reads, pending


def _same_reads(a, b):
    for (m1, v1), (m2, v2) in zip(a, b):
        assert torch.equal(m1, m2)
        assert v1.keys() == v2.keys()
        for k in v1:
            assert torch.equal(v1[k], v2[k]), k


@pytest.mark.parametrize("defer", [1, 3])
def test_deferred_blocks_train_bitwise_as_without(device, late, defer):
    """16 blocks (one frozen), tied embeddings: deferring the last 1 or 3 blocks' steps
    past step() trains bit for bit as no deferral and as the resident params, and
    opt.state and model.state_dict() read right after step() are the stepped values."""
    resident = _run(0, streamed=False)
    plain = _run(0)
    deferred = _run(defer)
    assert not any(plain[3]) and not any(resident[3])
    assert all(deferred[3][1:])   # left running from the second step on (at least)
    trainable = [i for i in range(16) if i != 3]
    # the last blocks (the first grads), as far as whole buckets go: a bucket that holds
    # a resident param, or reaches into one block more, is stepped by step()
    assert late.blocks[-1] and set(late.blocks[-1]) <= set(trainable[-defer:])
    assert all(set(b) <= set(trainable[-defer:]) for b in late.blocks)
    _same_reads(plain[2], deferred[2])
    _same_reads(resident[2], deferred[2])
    assert_same_training(plain[:2], deferred[:2])
    assert_same_training(resident[:2], deferred[:2])


@pytest.mark.parametrize("defer", [0, 3])
def test_grads_multiplied_by_one_after_backward_train_as_untouched(device, late, defer):
    """clip_grad_norm_ at max_norm inf between backward and step() (HF Trainer calls it
    every step with max_grad_norm=0) multiplies every grad by 1 in place: their versions
    move, their values do not, and step() accepts them. It then copied them to the host
    again, into the ring room the deferred steps read after step() (their blocks came out
    NaN on the simulated device, whose late copies read as poison; found from outside;
    without deferral the copy was only wasted): trained bit for bit as without the call."""
    untouched = _run(defer, steps=3)
    clipped = _run(defer, steps=3, clip_inf=True)
    _same_reads(untouched[2], clipped[2])
    assert_same_training(untouched[:2], clipped[:2])


def test_the_ring_holds_the_deferred_blocks_grads(device):
    """The grads of the deferred blocks wait in the grad ring: it grows by one block's
    grads per deferred block (grad_ring_mb= None)."""
    sizes = {}
    for defer in (0, 2):
        model = make_llama(layers=4, frozen=())
        offload_adam.stream_params(model, Block)
        opt = offload_adam.AdamW(model.parameters(), **KW, defer_blocks=defer)
        block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
        sizes[defer] = opt._engine.ring.nbytes
    assert sizes[0] >= 2 * block
    assert sizes[2] >= 4 * block and sizes[2] > sizes[0]


def test_an_error_in_a_deferred_step_is_raised_by_the_next_use(device, late):
    """A deferred step that raised is not lost: the next call that waits for it (here
    zero_grad() or the forward that fetches its block) raises it."""
    model = make_llama(layers=4, frozen=())
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **KW, defer_blocks=1)
    for it in range(2):
        late.fail = it == 1
        llama_loss(model, it).backward()
        opt.step()
    with pytest.raises(RuntimeError, match="a deferred step failed"):
        opt.zero_grad()
        llama_loss(model, 5).backward()


@pytest.mark.parametrize("options, match", [
    (dict(defer_blocks=2, step_in_backward=False), "needs step_in_backward=True"),
    (dict(defer_blocks=-1), "whole number of blocks"),
    (dict(defer_blocks=1.5), "whole number of blocks"),
    (dict(defer_blocks=True), "whole number of blocks"),
])
def test_bad_defer_blocks_is_refused(options, match):
    p = torch.nn.Parameter(torch.zeros(4))
    kw = {"step_in_backward": True, **options}
    with pytest.raises(ValueError, match=match):
        offload_adam.AdamW([p], **kw)


def test_defer_blocks_with_state_files_is_refused(tmp_path):
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="cannot be used with state_dirs="):
        offload_adam.AdamW([p], step_in_backward=True, defer_blocks=1, state_dirs=str(tmp_path))


def test_without_the_fetchs_wait_the_next_forward_reads_old_values(kernels, late, monkeypatch):
    """Mutation test: without the wait of a block's fetch for its deferred step, the
    next forward reads the step before's values (the simulated device reports it, or the
    training differs)."""
    plain = None
    sim = AsyncSimDevice(seed=0, latency="latest")
    try:
        with simulated(sim), sim.watch():
            plain = _run(0, steps=3, layers=4, frozen=(), read=False)
            monkeypatch.setattr(_Block, "wait_steps", lambda self, ahead=False: True)
            deferred = _run(2, steps=3, layers=4, frozen=(), read=False)
        try:
            sim.check()
            violations = False
        except AssertionError:
            violations = True
    finally:
        sim.close()
    differ = any(not torch.equal(a, b) for a, b in
                 zip(plain[0].state_dict().values(), deferred[0].state_dict().values()))
    assert violations or differ


def _streamed(defer, layers=6):
    """A streamed model of `layers` blocks and its optimizer deferring `defer` blocks."""
    model = make_llama(layers=layers)
    offload_adam.stream_params(model, Block)
    return model, offload_adam.AdamW(model.parameters(), **KW, defer_blocks=defer)


def test_checkpoints_saved_and_loaded_while_deferred_steps_run(device, late):
    """The optimizer's and the model's state dicts saved right after step() (deferred
    steps running), and loaded right after another step(), give the run without deferral,
    bit for bit: both wait for the deferred steps first."""
    runs = []
    for defer in (0, 2):
        model, opt = _streamed(defer)
        for it in range(5):
            llama_loss(model, it).backward()
            opt.step()
            if it == 1:
                saved = (copy.deepcopy(opt.state_dict()),
                         {k: v.clone() for k, v in model.state_dict().items()})
            if it == 2:
                assert opt._engine.tail_pending == bool(defer)
                opt.load_state_dict(saved[0])
                model.load_state_dict(saved[1])
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("read", ["optimizer", "model"])
def test_a_ctrl_c_in_the_wait_for_deferred_steps_leaves_them_waited_for(device, held,
                                                                        monkeypatch, read):
    """Ctrl-C while opt.state_dict() or model.state_dict() waits for the deferred steps,
    then the state_dict() retried (a save-on-Ctrl-C handler): the engine, or the block,
    had forgotten the steps before its wait, so the retry read them half done, without a
    word (found from outside). They are waited for again, and the dict is the one without
    deferral, bit for bit."""
    from offload_adam.engine.worker import Worker
    interrupts = [1]

    def interrupted(self):   # (called in each turn of a wait for a job not done)
        if interrupts:
            interrupts.pop()
            raise KeyboardInterrupt
    runs = []
    for defer in (0, 2):
        held.release.set()
        model, opt = _streamed(defer)
        test_param_stream.train(model, opt, 2)
        opt.state   # (waits for the steps deferred so far: the next ones are held)
        held.release.clear()
        test_param_stream.train(model, opt, 1, start=2)
        saved = (lambda: opt.state_dict()["state"]) if read == "optimizer" else model.state_dict
        if defer:
            assert opt._engine.tail_pending
            with monkeypatch.context() as m:
                m.setattr(Worker, "_refuse_in_child", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    saved()
            assert opt._engine.tail_pending and not interrupts
            held.release.set()
        runs.append(copy.deepcopy(saved()))
    (a, b) = runs
    assert a.keys() == b.keys()
    for i in a:
        for k, v in (a[i].items() if read == "optimizer" else [(None, a[i])]):
            w = b[i][k] if read == "optimizer" else b[i]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (i, k)


def test_a_child_forked_while_deferred_steps_run_is_refused(device, held):
    """A child forked right after step() while deferred steps still run on the parent's
    worker thread (a fork-based checkpoint): its opt.state_dict() and model.state_dict()
    waited for that thread, which the child lacks, for good (found from outside). They
    are refused naming both processes, as often as asked (what those steps write is half
    written in the child), the child's exit waits on nothing, and the parent's training
    is the run's without a fork, bit for bit."""
    from offload_adam.engine import worker
    from forked import in_child, refused_in_child
    runs = []
    for fork in (False, True):
        held.release.set()
        model, opt = _streamed(2)
        test_param_stream.train(model, opt, 2)
        opt.state   # (waits for the steps deferred so far: the next ones are held)
        held.release.clear()
        test_param_stream.train(model, opt, 1, start=2)
        if fork:
            assert opt._engine.tail_pending
            try:
                said = in_child([opt.state_dict, model.state_dict, opt.state_dict,
                                 worker._join_closed])
            finally:
                held.release.set()
            assert len(said) == 4 and said[3] == "ran", said
            for line in said[:3]:
                assert refused_in_child(line) and "never ends here" in line, line
        held.release.set()
        test_param_stream.train(model, opt, 1, start=3)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("defer", [1, 2])
@pytest.mark.parametrize("read", ["state_dict", "forward"])
def test_a_read_between_backward_and_step_sees_the_model_stepped(device, late, defer, read):
    """step_in_backward shows the stepped model between backward and step(): so it does
    with deferred blocks. Their held steps start when the read comes (a no-grad forward,
    model.state_dict()), even for a block whose other params a bucket reaching into the
    next block stepped in backward (~3 buckets a block: refused as "half stepped"
    before), and nothing is stepped twice: the training is the one without deferral."""
    runs = []
    for d in (0, defer):
        model = make_llama(layers=4, frozen=())
        offload_adam.stream_params(model, Block, prefetch=2)
        opt = offload_adam.AdamW(model.parameters(), **KW, defer_blocks=d)
        seen = []
        for it in range(4):
            llama_loss(model, it).backward()
            if it >= 1:
                if read == "forward":
                    with torch.no_grad():
                        seen.append(llama_loss(model, 50).detach())
                else:
                    seen.append({k: v.clone() for k, v in model.state_dict().items()})
            opt.step()
            opt.zero_grad()
        runs.append((model, opt, seen))
    if read == "forward":
        assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    else:
        _same_reads([(torch.zeros(1), s) for s in runs[0][2]],
                    [(torch.zeros(1), s) for s in runs[1][2]])
    assert_same_training(runs[0][:2], runs[1][:2])


def test_a_second_micro_batch_is_refused_as_accumulation(device):
    """Gradient accumulation is refused with step_in_backward: with deferred blocks by
    the same message (not as a block "half stepped" by the deferral)."""
    model = make_llama(layers=4, frozen=())
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **KW, defer_blocks=2)
    llama_loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        llama_loss(model, 1).backward()


class _FailAt:
    def __init__(self, job, fail):
        self.job, self.pieces, self.fail = job, job.pieces, fail

    @property
    def ran(self):
        return self.job.ran

    def kernel(self):
        if self.fail:
            raise RuntimeError("a deferred step failed (test)")
        self.job.kernel()


@pytest.mark.parametrize("at", [0, 2])
def test_an_error_in_a_deferred_step_says_what_stayed_behind(device, monkeypatch, at):
    """The worker skips the deferred steps after one that raised: its error says how
    many params stayed a step behind, and training can go on; when those include the
    second part of a param whose first part was stepped (job 2: the second piece of a
    param cut in two), its state is torn, and step() refuses it, naming the param."""
    real = OffloadEngine.run_tail
    state = {"step": 0}

    def run_tail(self, jobs):
        state["step"] += 1
        real(self, [_FailAt(j, state["step"] == 2 and k == at) for k, j in enumerate(jobs)])
    monkeypatch.setattr(OffloadEngine, "run_tail", run_tail)
    model = make_llama(layers=3, frozen=(), dim=64, hidden=1024)   # (1024, 64): two pieces
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), **dict(KW, bucket_mb=0.05), defer_blocks=1)
    llama_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    llama_loss(model, 1).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="a deferred step failed") as info:
        opt.zero_grad()   # (or the forward that fetches a deferred block)
        llama_loss(model, 5).backward()
    note = " ".join(getattr(info.value, "__notes__", []))
    assert re.search(r"\d+ of the \d+ params of its blocks were not stepped", note), note
    steps = [s["step"] for s in opt.state_dict()["state"].values()] if at == 0 else None
    if at == 0:   # nothing torn: a step behind for some, and training goes on
        assert set(steps) == {1.0, 2.0} or set(map(float, steps)) == {1.0, 2.0}
        opt.zero_grad()
        llama_loss(model, 6).backward()
        opt.step()
    else:
        opt.zero_grad()
        with pytest.raises(RuntimeError, match=r"some of the parts of param group 0, param \d+"):
            llama_loss(model, 6).backward()
            opt.step()


def test_defer_blocks_without_streamed_params_warns():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.warns(UserWarning, match="none of these params is streamed"):
        offload_adam.AdamW([p], step_in_backward=True, defer_blocks=1)


_EXIT_SCRIPT = r"""
import sys, time
sys.path.insert(0, {tests!r})
import torch, offload_adam
from offload_adam.engine.core import OffloadEngine
from offload_adam.testing import AsyncSimDevice, simulated
from test_param_stream import Block, make_llama, llama_loss

class Slow:   # a deferred step still running when the script ends
    def __init__(self, job):
        self.job, self.pieces = job, job.pieces
    def kernel(self):
        time.sleep(0.3)
        self.job.kernel()
        with open({marker!r}, "a") as f:
            f.write("ran\n")
real = OffloadEngine.run_tail
OffloadEngine.run_tail = lambda self, jobs: real(self, [Slow(j) for j in jobs])
sim = AsyncSimDevice(seed=0, latency="latest")
with simulated(sim), sim.watch():
    model = make_llama(layers=4, frozen=())
    offload_adam.stream_params(model, Block)
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, step_in_backward=True,
                             bucket_mb=0.008, defer_blocks=2)
    for it in range(2):
        llama_loss(model, it).backward()
        opt.step()
        opt.zero_grad()
    assert opt._engine.tail_pending
    if {close!r}:
        opt.close()
"""


@pytest.mark.parametrize("close", [False, True])
def test_a_script_that_ends_with_deferred_steps_running_exits_cleanly(kernels, tmp_path, close):
    """A script ending while deferred steps run (its optimizer alive, or closed): the
    exit lets them finish, and nothing of the worker runs on while the interpreter
    finalizes (a thread freeing a tensor or inside a kernel then was ended in C++ frames:
    "terminate called without an active exception", the process aborted)."""
    import os
    import subprocess
    import sys
    for run in range(3):
        marker = tmp_path / f"ran{run}"
        script = tmp_path / "exit.py"
        script.write_text(_EXIT_SCRIPT.format(tests=os.path.dirname(__file__),
                                              marker=str(marker), close=close))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
        # every deferred step of the last step ran (those of the first, before it)
        assert marker.read_text().count("ran") >= 2
