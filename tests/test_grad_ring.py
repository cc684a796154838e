"""The grad ring (engine/grad_ring.py): the bounded host buffer the grads wait in with
step_in_backward, the state in files or in host RAM. Its spans on their own, then on the
simulated device: training through it is bit for bit the plain step, in steady state it
never overflows however small it is next to the grads, and host_bytes() is what the issue
asked (<= 2.1 B per streamed param + the rings; in RAM the grads' bytes less)."""

import threading
import time

import pytest
import torch

import offload_adam
from offload_adam.engine.device import HostDevice
from offload_adam.engine.grad_ring import GradRing
from offload_adam.testing import AsyncSimDevice, simulated
from test_param_stream import Block, assert_same_training, make_llama, train
from test_param_stream import device  # noqa: F401 -- the simulated device, as a fixture


class _Rec:
    def __init__(self, numel):
        self.flat, self.dtype, self.shape = True, torch.bfloat16, (numel,)


class _Piece:
    def __init__(self, numel):
        self.numel, self.rec, self.grad, self.span = numel, _Rec(numel), None, None


def test_spans_go_around_the_ring_and_past_a_span_held_long():
    busy = []
    ring = GradRing(HostDevice(torch.device("cpu")), 1024, lambda: bool(busy))
    a, b, c = _Piece(128), _Piece(128), _Piece(128)   # 256 B each
    ring.take([a], 2)
    ring.take([b], 2)
    ring.take([c], 2)
    assert [p.grad.data_ptr() - ring.buf.data_ptr() for p in (a, b, c)] == [0, 256, 512]
    ring.done(a)           # b is held long; a's room is taken again once past the end
    d, e = _Piece(128), _Piece(128)
    ring.take([d], 2)
    ring.take([e], 2)
    assert d.grad.data_ptr() - ring.buf.data_ptr() == 768
    assert e.grad.data_ptr() - ring.buf.data_ptr() == 0
    assert ring.overflow_taken == 0
    # full, and nothing of the pass pending: a buffer of its own, freed when stepped
    f = _Piece(64)
    ring.take([f], 2)
    assert ring.overflow_taken == 1 and ring.overflow_bytes == 128
    assert ring.host_bytes() == 1024 + 128
    ring.done(f)
    assert ring.overflow_bytes == 0 and f.grad is None
    # a pack's pieces abut in one span
    for p in (b, c, d, e):
        ring.done(p)
    g, h = _Piece(10), _Piece(22)
    ring.take([g, h], 2)
    assert h.grad.data_ptr() == g.grad.data_ptr() + 20


def test_a_full_ring_waits_while_the_pass_has_work_and_only_then():
    busy = [True]
    ring = GradRing(HostDevice(torch.device("cpu")), 512, lambda: busy[0])
    held = [_Piece(128), _Piece(128)]
    for p in held:
        ring.take([p], 2)

    def the_pass():   # steps what it holds, a little later
        time.sleep(0.2)
        for p in held:
            ring.done(p)
        busy[0] = False
        ring.nudge()
    t = threading.Thread(target=the_pass)
    t.start()
    late = _Piece(128)
    ring.take([late], 2)   # waits for the room the pass frees
    t.join()
    assert ring.waits > 0 and ring.overflow_taken == 0
    assert late.grad.data_ptr() >= ring.buf.data_ptr()
    # nothing pending: a full ring does not wait (no one would free it)
    ring.take([_Piece(128)], 2)
    waits = ring.waits
    ring.take([_Piece(200)], 2)
    assert ring.waits == waits and ring.overflow_taken == 1


def _run(tmp_path, name, layers, early, streamed=True, steps=5, free=False, dim=64, hidden=128,
         bucket_mb=0.05, **options):
    """`steps` steps of a llama of `layers` blocks with the state in tmp_path / name (None:
    in host RAM); the ring's overflow count after each."""
    files = {}
    if tmp_path is not None:
        (tmp_path / name).mkdir()
        files = dict(state_dirs=str(tmp_path / name))
    model = make_llama(layers=layers, dim=dim, hidden=hidden)
    streamer = offload_adam.stream_params(model, Block, prefetch=2) if streamed else None
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, bucket_mb=bucket_mb,
                             step_in_backward=early, free_grads_after_copy=free, **files,
                             **options)
    overflows = []
    for step in range(steps):
        train(model, opt, 1, start=step)
        ring = opt._engine.ring
        overflows.append(ring.overflow_taken if ring is not None else None)
    return model, opt, streamer, overflows


@pytest.mark.parametrize("slow_pass", [False, True])
def test_training_through_a_ring_six_times_smaller_than_the_grads(device, tmp_path,
                                                                  monkeypatch, slow_pass):
    """16 blocks (one frozen), their grads ~1.3 MB, the ring ~0.2 MB: bitwise the plain
    step over the same files; after the first step (the order learned) no span overflows,
    also when the pass is slower than backward (the hooks then wait for its room)."""
    if slow_pass:
        from offload_adam.engine.core import OffloadEngine
        stepping = OffloadEngine.step_lent_early

        def slowly(self, *args):
            time.sleep(0.02)
            stepping(self, *args)
        monkeypatch.setattr(OffloadEngine, "step_lent_early", slowly)
    ring_run = _run(tmp_path, "ring", 16, early=True)
    plain = _run(tmp_path, "plain", 16, early=False)
    model, opt, streamer, overflows = ring_run
    ring = opt._engine.ring
    grads = 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ring is not None and plain[1]._engine.ring is None
    assert ring.nbytes * 5 < grads
    assert overflows[1] == overflows[-1], overflows   # steady: none
    assert ring.overflow_bytes == 0
    if slow_pass:
        assert ring.waits > 0
    assert_same_training(ring_run[:2], plain[:2])


def test_host_bytes_with_files_are_the_host_copies_and_the_rings(device, tmp_path):
    """The issue's bound: host_bytes() with state_dirs= <= 2.1 B per streamed param + the
    rings (the grad ring, the files' ring); here with the host copies counted in."""
    model, opt, streamer, _ = _run(tmp_path, "s", 8, early=True, steps=3)
    engine = opt._engine
    streamed = streamer.streamed_bytes // 2
    rings = engine.ring.host_bytes() + opt._store.host_bytes()
    resident_staging = sum(a.nbytes() for a in engine._transfer_arenas)
    host = opt.host_bytes() + streamer.streamed_bytes
    assert host - rings - resident_staging <= 2.1 * streamed
    assert resident_staging <= 2 * sum(p.numel() for n, p in model.named_parameters()
                                       if not n.startswith("layers."))


def test_a_norm_of_freed_grads_stepped_in_backward_is_refused_by_name(device, tmp_path):
    """Freed grads (free_grads_after_copy) give their norm from their host copies: once
    stepped in backward, their room in the ring holds other grads, so it is refused,
    naming why (clip_grad_norm_ is refused anyway with step_in_backward)."""
    model, opt, streamer, _ = _run(tmp_path, "s", 4, early=True, steps=2, free=True)
    from test_param_stream import llama_loss
    llama_loss(model, 7).backward()
    opt._engine.drain()
    with pytest.raises(RuntimeError, match="its room in the grad ring reused"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)


def test_the_first_backward_steps_in_the_guessed_order(device, tmp_path):
    """No order is known at the first backward: the pass guesses the files' buckets last
    first (backward meets the last registered params first), so for a model in sequence
    the first step runs in backward too and its grads keep to the ring."""
    from test_param_stream import llama_loss
    (tmp_path / "s").mkdir()
    model = make_llama(layers=8, dim=64, hidden=128, frozen=())
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())   # untied
    offload_adam.stream_params(model, Block, prefetch=2)
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.05,
                             step_in_backward=True, state_dirs=str(tmp_path / "s"))
    llama_loss(model, 0).backward()
    opt._engine.drain()
    files = opt._engine.early.files
    assert len(files.stepped) > len(list(model.parameters())) // 2
    assert opt._engine.ring.overflow_taken == 0
    opt.step()


def test_an_error_after_the_first_backward_names_the_params_it_stepped(device, tmp_path):
    """A first step that ran in backward has no earlier values to go back to (copying
    every param would cost what the ring saves): zero_grad() before step() says how
    many streamed params stay stepped, and how to start over."""
    from test_param_stream import llama_loss
    (tmp_path / "s").mkdir()
    model = make_llama(layers=8, dim=64, hidden=128, frozen=())
    offload_adam.stream_params(model, Block, prefetch=2)
    opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.05,
                             step_in_backward=True, state_dirs=str(tmp_path / "s"))
    llama_loss(model, 0).backward()
    opt._engine.drain()
    with pytest.raises(RuntimeError, match=r"but \d+ streamed params in their first step.*"
                                           "load the model's weights again"):
        opt.zero_grad()


# ---- the state in host RAM: step_in_backward's grads through the ring too --------------

@pytest.mark.parametrize("free, slow_kernel", [(False, False), (True, False), (False, True)],
                         ids=["kept", "freed", "kept-slow-kernels"])
def test_in_host_ram_the_grads_keep_to_a_ring_from_the_first_step(device, monkeypatch,
                                                                 slow_kernel, free):
    """step_in_backward with the state in host RAM: the grads wait in a ring of 4 buckets
    (~6x smaller than them here), no buffer per param: bitwise the plain step, no span
    overflowing from the first backward on (its guess of the order holds: the last
    params first), also when the kernels are slower than backward (the hooks then wait),
    and the host holds the grads' bytes less, but for the ring."""
    if slow_kernel:
        from offload_adam.engine.core import BucketJob
        kernel = BucketJob.kernel

        def slowly(self):
            time.sleep(0.05)
            kernel(self)
        monkeypatch.setattr(BucketJob, "kernel", slowly)
    early = _run(None, None, 16, True, steps=4, free=free)
    plain = _run(None, None, 16, False, steps=4, free=free)
    model, opt, _, overflows = early
    ring = opt._engine.ring
    grads = sum(2 * p.numel() for p in model.parameters() if p.requires_grad)
    assert ring is not None and plain[1]._engine.ring is None
    assert ring.nbytes * 5 < grads
    assert overflows == [0] * 4 and ring.overflow_bytes == 0
    if slow_kernel:   # the last step's profile counts its own waits, and their time
        profile = opt.last_step_profile
        assert ring.waits > profile["ring_waits"] > 0
        assert profile["ring_wait_s"] > 0 and ring.wait_s > profile["ring_wait_s"]
        # each wait also as an interval, for a timeline against the kernels' (what a
        # backward whose CPU idles while hooks wait is told by)
        waits = [w for w in profile["waits"] if w["what"] == "ring"]
        assert len(waits) <= profile["ring_waits"] and waits
        assert sum(w["end_s"] - w["start_s"] for w in waits) == pytest.approx(
            profile["ring_wait_s"]) == profile["wait_s"]["ring"]
        assert all(w["bucket"] == -1 and w["end_s"] > w["start_s"] for w in waits)
    assert_same_training(early[:2], plain[:2])
    saved = plain[1].host_bytes() - opt.host_bytes()
    assert saved >= grads - ring.nbytes, (saved, grads, ring.nbytes)


@pytest.mark.parametrize("state", ["ram", "files", "compact"])
def test_a_param_larger_than_the_ring_drains_through_it(device, tmp_path, state):
    """Each MLP weight's grad (512 KB, cut into 8 pieces of a 64 KB bucket each) is twice
    the ring in host RAM (4 buckets): its pieces' buckets start as each piece is sent, so
    the later pieces wait for room instead of taking buffers outside the ring (on CUDA,
    pageable memory copied synchronously: what made a 13B model's backward 4x slower on an
    H200). Bitwise the plain step; with the state in files too, and compact (a file bucket
    holding a part of the param starts, or is logged, once that part is sent)."""
    where = None if state == "ram" else tmp_path
    # (in host RAM not streamed: the ring would hold two blocks' grads, test_ring_sizes)
    shape = dict(steps=3, dim=256, hidden=1024, bucket_mb=0.0625, streamed=state != "ram")
    if state == "compact":   # one generation and a log of the grads (disk_log.py)
        shape["state_footprint"] = "compact"
    early = _run(where, "early", 4, True, **shape)
    plain = _run(where, "plain", 4, False, **shape)
    model, opt, _, overflows = early
    ring = opt._engine.ring
    largest = max(2 * p.numel() for p in model.parameters())
    assert max(len(r.pieces) for r in opt._engine.recs) == 8
    if state == "ram":
        assert largest == 2 * ring.nbytes
    # overflow_taken counts from the start: in files, the first step (its order guessed)
    # may overflow, none after it; in host RAM, none from the first backward on
    assert overflows[1:] == [overflows[0]] * 2 and ring.overflow_bytes == 0, overflows
    if state == "ram":
        assert overflows[0] == 0
    assert_same_training(early[:2], plain[:2])


def test_a_step_after_a_failed_early_start_in_host_ram(device):
    """clip_grad_norm_ after a backward that stepped buckets in host RAM is refused and
    names the params stepped; a step() then, which would step those twice, is refused
    until zero_grad() (the grads those kernels read are gone from the ring: nothing
    reads them), and the training after is the same with the ring and without."""
    from test_param_stream import llama_loss
    runs = []
    for ring in (True, False):
        model = make_llama(layers=8, dim=64, hidden=128)
        offload_adam.stream_params(model, Block, prefetch=2)
        opt = offload_adam.AdamW(model.parameters(), lr=3e-3, bucket_mb=0.05,
                                 step_in_backward=True)
        if not ring:   # the same steps with a buffer per grad: what the ring must equal
            engine = opt._engine
            engine.ring, engine._ring_arenas[:] = None, []
            engine._rebucket(list(dict.fromkeys(p.rec for b in engine.buckets
                                                for p in b.pieces)))
        train(model, opt, 2)
        llama_loss(model, 5).backward()
        with pytest.raises(RuntimeError, match=r"The Adam step of [1-9]\d* params already ran"):
            opt.clip_grad_norm_(1.0)
        with pytest.raises(RuntimeError, match="would step those params twice"):
            opt.step()
        opt.zero_grad()
        train(model, opt, 1, start=6)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_ring_sizes(kernels, tmp_path):
    """The ring's size (grad_ring.ring_bytes): with the state in RAM twice the trainable
    grads of the largest streamed block, 4 buckets at least, 4 buckets when nothing
    streams; grad_ring_mb= where given, raised to what the pass needs (4 buckets in RAM,
    twice the largest file bucket's grads in files)."""
    bucket = int(0.0625 * 2**20)
    sim = AsyncSimDevice(seed=0)

    def ring(streamed=True, frozen=(), files=False, **options):
        model = make_llama(layers=3, dim=256, hidden=1024, frozen=())
        model.layers[1].up.requires_grad_(False)   # a block with a frozen param
        for i in frozen:
            model.layers[i].requires_grad_(False)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1)
        if files:
            (tmp_path / files).mkdir()
            options["state_dirs"] = str(tmp_path / files)
        opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.0625, step_in_backward=True,
                                 **options)
        try:   # (with state_dirs= the files' pass makes its ring as the optimizer opens them)
            return opt._engine.ring.nbytes, model
        finally:
            opt.close()

    try:
        with simulated(sim):
            full = 2 * sum(p.numel() for p in Block(256, 1024).parameters())
            nbytes, model = ring()
            assert nbytes == 2 * full   # blocks 0 and 2; block 1's frozen `up` not counted
            nbytes, _ = ring(frozen=(0, 2))
            assert nbytes == 2 * (full - 2 * 256 * 1024)
            assert ring(streamed=False)[0] == 4 * bucket
            assert ring(grad_ring_mb=9)[0] == 9 * 2**20
            assert ring(grad_ring_mb=0.01)[0] == 4 * bucket
            in_files, _ = ring(files="a", grad_ring_mb=0.01)
            assert in_files >= 4 * bucket and in_files < 2 * full
            assert ring(files="b", grad_ring_mb=9)[0] == 9 * 2**20
        sim.check()
    finally:
        sim.close()


@pytest.mark.parametrize("value, match", [
    (0, "grad_ring_mb must be a positive number of MiB, got 0"),
    (-1.5, "grad_ring_mb must be a positive number of MiB"),
    (True, "grad_ring_mb must be a positive number of MiB, got True"),
    ("64", "grad_ring_mb must be a positive number of MiB, got '64'"),
])
def test_grad_ring_mb_is_checked(value, match):
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=match):
        offload_adam.AdamW([p], step_in_backward=True, grad_ring_mb=value)


def test_grad_ring_mb_needs_step_in_backward():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="grad_ring_mb= needs step_in_backward=True"):
        offload_adam.AdamW([p], grad_ring_mb=64)


def test_options_pickled_before_an_option_existed_take_its_default():
    import pickle
    from offload_adam.options import Options
    old = Options(bucket_mb=8)
    state = old.__getstate__()
    del state["grad_ring_mb"]   # as pickled before grad_ring_mb was added
    new = Options.__new__(Options)
    new.__setstate__(state)
    assert new.grad_ring_mb is None and new.bucket_mb == 8
    assert pickle.loads(pickle.dumps(new)) == new


def test_a_ring_for_few_trainable_params_and_grown_when_more_take_grads(device):
    """A model whose params mostly take no grad (LoRA's frozen base; the optimizer given
    all of them) gets a ring of twice the grads that can come, not 4 x bucket_mb of pinned
    memory (found from outside: 128 MiB for 24 KiB of adapter grads). A block unfrozen
    later overflows it in the next step (own buffers) and it is made again for the grads
    that come now: after that step no overflow, and bitwise the plain step throughout."""
    from offload_adam.engine.grad_ring import trainable_bytes

    def run(early):
        model = make_llama(layers=4, frozen=())
        model.requires_grad_(False)
        model.layers[2].down.requires_grad_(True)   # the only trainable param at first
        offload_adam.stream_params(model, Block, prefetch=1)
        opt = offload_adam.AdamW(model.parameters(), bucket_mb=0.0625, lr=1e-3,
                                 step_in_backward=early)
        sizes, overflows = [], []
        for step in range(5):
            if step == 2:
                model.layers[1].requires_grad_(True)
            train(model, opt, 1, start=step)
            ring = opt._engine.ring
            if ring is not None:
                sizes.append(ring.nbytes)
                overflows.append(ring.overflow_taken)
        return model, opt, sizes, overflows

    model, opt, sizes, overflows = run(True)
    first = 2 * trainable_bytes([model.layers[2].down.weight])
    assert sizes[0] == sizes[1] == first < 4 * int(0.0625 * 2**20)
    now = 2 * trainable_bytes(list(model.parameters()))
    assert first < sizes[2] <= now and sizes[2] == sizes[3] == sizes[4]
    assert overflows[0] == overflows[1] == 0 and overflows[3] == overflows[4] == 0
    plain = run(False)
    assert_same_training((model, opt), plain[:2])
